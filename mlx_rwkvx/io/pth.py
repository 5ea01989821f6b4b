"""Read PyTorch ``.pth`` checkpoints without torch, and without running code from the file.

A ``torch.save`` file is a zip: ``<name>/data.pkl`` (a pickle of the state dict whose tensors
are persistent references) and ``<name>/data/<key>`` (the raw bytes of each storage). The
unpickler below resolves only the globals needed to rebuild tensors and plain containers; any
other global in the pickle is refused, so no code from the file can run.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from dataclasses import dataclass

import numpy as np

# storage class name -> (numpy dtype of its bytes, whether the bytes are bfloat16)
_STORAGES = {
    "FloatStorage": (np.float32, False),
    "DoubleStorage": (np.float64, False),
    "HalfStorage": (np.float16, False),
    "BFloat16Storage": (np.uint16, True),
    "LongStorage": (np.int64, False),
    "IntStorage": (np.int32, False),
    "ShortStorage": (np.int16, False),
    "CharStorage": (np.int8, False),
    "ByteStorage": (np.uint8, False),
    "BoolStorage": (np.bool_, False),
}


class PthError(ValueError):
    """A .pth file that is not a plain tensor checkpoint, or is damaged."""


@dataclass
class _StorageType:
    name: str


@dataclass
class Tensor:
    """A tensor read from a .pth: ``array`` holds raw uint16 bits when ``bfloat16`` is set."""

    array: np.ndarray
    bfloat16: bool


def _rebuild_tensor(storage, offset, size, stride, *_):
    data, bf16 = storage
    itemsize = data.itemsize
    size, stride = tuple(size), tuple(stride)
    # as_strided does no bounds check: refuse any view reaching outside the storage
    if offset < 0 or len(size) != len(stride) or any(s < 0 for s in (*size, *stride)):
        raise PthError(f"tensor with offset {offset}, size {size}, stride {stride} is malformed")
    if all(size) and offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) >= len(
        data
    ):
        raise PthError(f"tensor of size {size} reaches past its storage (truncated file?)")
    view = np.lib.stride_tricks.as_strided(
        data[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
    )
    return Tensor(np.array(view), bf16)  # a copy: the storage buffer may be shared


def _rebuild_parameter(tensor, *_):
    return tensor


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, path: str):
        super().__init__(file)
        self.archive, self.prefix, self.path = archive, prefix, path
        self.storages: dict[str, tuple[np.ndarray, bool]] = {}

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise PthError(
            f"{self.path}: refuses to load {module}.{name} from the pickle: only plain tensor "
            "checkpoints are read (no code from the file is run)"
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise PthError(f"{self.path}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, _numel = pid
        if not isinstance(storage_type, _StorageType):
            raise PthError(f"{self.path}: unsupported storage type {storage_type!r}")
        if key not in self.storages:
            dtype, bf16 = _STORAGES[storage_type.name]
            try:
                raw = self.archive.read(f"{self.prefix}/data/{key}")
            except KeyError as e:
                raise PthError(f"{self.path}: storage {key} is missing (truncated file?)") from e
            self.storages[key] = (np.frombuffer(raw, dtype=dtype), bf16)
        return self.storages[key]


def read_pth(path: str) -> dict[str, Tensor]:
    """The state dict of a ``torch.save`` file: name -> Tensor. Raises PthError naming the
    problem (not a zip, truncated, not a tensor dict, a forbidden global)."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise PthError(f"{path}: not a readable PyTorch zip checkpoint ({e})") from e
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise PthError(f"{path}: expected one */data.pkl in the archive, found {pickles}")
        prefix = pickles[0][: -len("/data.pkl")]
        with archive.open(pickles[0]) as f:
            try:
                state = _Unpickler(f, archive, prefix, path).load()
            except PthError:
                raise
            except Exception as e:  # a damaged pickle can fail in many ways
                raise PthError(f"{path}: damaged checkpoint pickle ({e})") from e
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise PthError(f"{path}: expected a dict of tensors (a state dict)")
    return dict(state)
