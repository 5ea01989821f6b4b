"""PyTorch ``.pth`` checkpoints read and written without torch, and without running code
from the file.

A ``torch.save`` file is a zip: ``<name>/data.pkl`` (a pickle of the state dict whose tensors
are persistent references) and ``<name>/data/<key>`` (the raw bytes of each storage). The
unpickler below resolves only the globals needed to rebuild tensors and plain containers; any
other global in the pickle is refused, so no code from the file can run. The writer emits the
same layout, opcode by opcode (pickling torch's globals would need torch itself).
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import zipfile
from collections.abc import Callable
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


class StoredTensor:
    """A tensor for ``write_pth`` whose bytes are made only when its record is written, and
    dropped once written: ``read()`` returns a little-endian array of ``shape`` and ``dtype``
    (bfloat16 as its uint16 bits). A model's tensors pass one at a time."""

    def __init__(self, shape: tuple, dtype: np.dtype, bfloat16: bool, read: Callable):
        self.shape, self.dtype, self.bfloat16 = tuple(shape), np.dtype(dtype), bfloat16
        self._read = read

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def take(self) -> np.ndarray:
        """The tensor's array, read once: the reference to it is dropped here."""
        read, self._read = self._read, None
        return read()


def _stored(t) -> StoredTensor:
    if isinstance(t, StoredTensor):
        return t
    return StoredTensor(t.array.shape, t.array.dtype, t.bfloat16, lambda: t.array)


def _contiguous_strides(shape: tuple, size: int) -> tuple:
    """Row-major strides in elements, as numpy gives a contiguous array (all 0 when empty)."""
    if not size:
        return (0,) * len(shape)
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _view(storage, offset, size, stride) -> np.ndarray:
    """The strided view a tensor takes of its storage, refused unless it lies inside it and
    holds no more elements than the storage does (nothing is copied yet)."""
    data = storage[0]
    size, stride = _check_view(len(data), offset, size, stride)
    return np.lib.stride_tricks.as_strided(
        data[offset:], shape=size, strides=tuple(s * data.itemsize for s in stride)
    )


def _check_view(length: int, offset, size, stride) -> tuple[tuple, tuple]:
    """(size, stride) of a view of a storage of ``length`` elements, refused (PthError) unless
    it lies inside the storage and holds no more elements than it does."""
    size, stride = tuple(size), tuple(stride)
    # as_strided does no bounds check: refuse any view reaching outside the storage
    if offset < 0 or len(size) != len(stride) or any(s < 0 for s in (*size, *stride)):
        raise PthError(f"tensor with offset {offset}, size {size}, stride {stride} is malformed")
    last = offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
    if all(size) and last >= length:
        raise PthError(f"tensor of size {size} reaches past its storage (truncated file?)")
    # a stride-0 or overlapping view passes that check with any shape, and its copy
    # would take shape-many elements: no view may hold more than its storage does
    if math.prod(size) > length - offset:
        raise PthError(
            f"tensor of size {size} and stride {stride} holds {math.prod(size):,} "
            f"elements, its storage {length - offset:,} from offset {offset} (a "
            "stride-0 or overlapping view: not a checkpoint's tensor)"
        )
    return size, stride


@dataclass
class _UnreadStorage:
    """A storage known from the pickle and its zip record, its bytes not read yet."""

    entry: str
    numel: int
    dtype: np.dtype


def _read_view(path: str, storage: _UnreadStorage, bf16, offset, size, stride) -> np.ndarray:
    """A tensor's view of its storage, its storage read from the zip now (then dropped)."""
    try:
        with zipfile.ZipFile(path) as archive:
            raw = archive.read(storage.entry)
    except (zipfile.BadZipFile, OSError, KeyError) as e:
        raise PthError(f"{path}: cannot read {storage.entry} ({e})") from e
    data = np.frombuffer(raw, dtype=storage.dtype)
    if len(data) != storage.numel:
        raise PthError(f"{path}: {storage.entry} changed while it was read")
    return np.ascontiguousarray(_view((data, bf16), offset, size, stride))  # its own bytes


def _rebuild_tensor(storage, offset, size, stride, *_):
    if storage[0] is None:  # names only: no bytes were read
        return Tensor(np.zeros(0, np.uint8), storage[1])
    # a copy: the storage buffer may be shared
    return Tensor(np.array(_view(storage, offset, size, stride)), storage[1])


def _rebuild_parameter(tensor, *_):
    return tensor


_REBUILD_TENSOR = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")}
_ALLOWED = {
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, path: str):
        super().__init__(file)
        self.archive, self.prefix, self.path = archive, prefix, path
        self.storages: dict[str, tuple[np.ndarray, bool]] = {}
        self.views: dict[tuple, Tensor] = {}
        self.stored_bytes = 0  # of the storages read so far
        self.copied_bytes = 0  # of the distinct views copied so far
        self.names_only = False
        self.lazy = False  # tensors as StoredTensor: no storage's bytes read

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if (module, name) in _REBUILD_TENSOR:
            return self.rebuild_tensor
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise PthError(
            f"{self.path}: refuses to load {module}.{name} from the pickle: only plain tensor "
            "checkpoints are read (no code from the file is run)"
        )

    def rebuild_tensor(self, storage, offset, size, stride, *_):
        """Each distinct view copied once (tied weights share that copy), and all of them
        together no larger than the storages: pickle memo references can point many tensors
        at one storage, and each bound alone would let them copy it many times over."""
        if self.names_only:
            return _rebuild_tensor(storage, offset, size, stride)
        # id(): the storage tuple lives in self.storages for the whole load
        key = (id(storage), offset, tuple(size), tuple(stride))
        if self.lazy:
            unread, bf16 = storage
            size, stride = _check_view(unread.numel, offset, size, stride)
            if key not in self.views:
                self.views[key] = None
                self.copied_bytes += math.prod(size) * unread.dtype.itemsize
                self._check_copied()
            return StoredTensor(
                size,
                unread.dtype,
                bf16,
                lambda: _read_view(self.path, unread, bf16, offset, size, stride),
            )
        if key not in self.views:
            view = _view(storage, offset, size, stride)
            self.copied_bytes += view.nbytes
            self._check_copied()
            self.views[key] = Tensor(np.array(view), storage[1])  # a copy: storages are shared
        return self.views[key]

    def _check_copied(self) -> None:
        if self.copied_bytes > self.stored_bytes:
            raise PthError(
                f"{self.path}: its distinct tensors hold more than its storages (at least "
                f"{self.copied_bytes:,} bytes of {self.stored_bytes:,}): views that overlap "
                "or repeat a storage, not a checkpoint's tensors"
            )

    def persistent_load(self, pid):
        if self.names_only:
            return None, False
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise PthError(f"{self.path}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise PthError(f"{self.path}: unsupported storage type {storage_type!r}")
        if key not in self.storages:
            dtype, bf16 = _STORAGES[storage_type.name]
            entry = f"{self.prefix}/data/{key}"
            self._check_storage(entry, numel, np.dtype(dtype))
            self.stored_bytes += numel * np.dtype(dtype).itemsize
            if self.lazy:
                self.storages[key] = (_UnreadStorage(entry, numel, np.dtype(dtype)), bf16)
            else:
                raw = self.archive.read(entry)
                self.storages[key] = (np.frombuffer(raw, dtype=dtype), bf16)
        return self.storages[key]

    def _check_storage(self, name: str, numel, dtype: np.dtype) -> None:
        """A storage entry's zip record must hold exactly the ``numel`` elements the pickle
        declares, uncompressed (checked before its bytes are read)."""
        try:
            info = self.archive.getinfo(name)
        except KeyError as e:
            raise PthError(f"{self.path}: storage {name} is missing (truncated file?)") from e
        _refuse_compressed(self.path, info)
        if not isinstance(numel, int) or numel < 0:
            raise PthError(f"{self.path}: storage {name} declares {numel!r} elements")
        if info.file_size != numel * dtype.itemsize:
            raise PthError(
                f"{self.path}: storage {name} holds {info.file_size:,} bytes, its declared "
                f"{numel:,} elements of {dtype} take {numel * dtype.itemsize:,}"
            )


def _refuse_compressed(path: str, info: zipfile.ZipInfo) -> None:
    """torch.save stores every record uncompressed; a compressed one can inflate to any
    size (a few MB of deflated zeros are GBs), so it is refused before it is read."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise PthError(
            f"{path}: entry {info.filename} is compressed (zip method {info.compress_type}); "
            "torch.save never compresses, so this is not a checkpoint it wrote"
        )


def read_pth(path: str) -> dict[str, Tensor]:
    """The state dict of a ``torch.save`` file: name -> Tensor. Raises PthError naming the
    problem (not a zip, truncated, not a tensor dict, a forbidden global)."""
    return _load(path, names_only=False)


def read_pth_lazily(path: str) -> dict[str, StoredTensor]:
    """The state dict of a ``torch.save`` file as ``StoredTensor``: names, shapes and dtypes
    from the pickle, checked as ``read_pth`` checks them, each tensor's storage read from the
    zip only when it is taken (so a model passes one tensor at a time). Raises PthError."""
    return _load(path, names_only=False, lazy=True)


def pth_names(path: str) -> list[str]:
    """The tensor names of a ``torch.save`` file, without reading any tensor's bytes."""
    return list(_load(path, names_only=True))


def _load(path: str, names_only: bool, lazy: bool = False) -> dict:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise PthError(f"{path}: not a readable PyTorch zip checkpoint ({e})") from e
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise PthError(f"{path}: expected one */data.pkl in the archive, found {pickles}")
        prefix = pickles[0][: -len("/data.pkl")]
        _refuse_compressed(path, archive.getinfo(pickles[0]))  # a compressed pickle inflates too
        with archive.open(pickles[0]) as f:
            try:
                unpickler = _Unpickler(f, archive, prefix, path)
                unpickler.names_only, unpickler.lazy = names_only, lazy
                state = unpickler.load()
            except PthError:
                raise
            except Exception as e:  # a damaged pickle can fail in many ways
                raise PthError(f"{path}: damaged checkpoint pickle ({e})") from e
    kind = StoredTensor if lazy else Tensor
    if not isinstance(state, dict) or not all(isinstance(v, kind) for v in state.values()):
        if names_only and isinstance(state, dict):
            return state
        raise PthError(f"{path}: expected a dict of tensors (a state dict)")
    return dict(state)


# numpy dtype -> torch's storage class, for writing
_STORAGE_OF = {np.dtype(d): name for name, (d, bf16) in _STORAGES.items() if not bf16}


def write_pth(file, tensors: dict, archive_name: str = "archive") -> None:
    """``tensors`` (``Tensor``: little-endian arrays, bfloat16 as their uint16 bits; or
    ``StoredTensor``, read when its record is written) as ``torch.save`` writes a state dict:
    a zip of ``data.pkl`` and one storage per tensor, records aligned to 64 bytes as torch
    aligns them. ``file``: a path or a binary file."""
    body = io.BytesIO()
    op = body.write
    op(pickle.PROTO + b"\x02")

    def global_(module: str, name: str) -> None:
        op(pickle.GLOBAL + f"{module}\n{name}\n".encode())

    def string(s: str) -> None:
        data = s.encode()
        op(pickle.BINUNICODE + struct.pack("<I", len(data)) + data)

    def integer(n: int) -> None:
        op(pickle.BININT + struct.pack("<i", n) if n < 2**31 else pickle.LONG1 + _long(n))

    def int_tuple(values) -> None:
        op(pickle.MARK)
        for n in values:
            integer(n)
        op(pickle.TUPLE)

    global_("collections", "OrderedDict")
    op(pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.MARK)
    storages = []
    for key, (name, given) in enumerate(tensors.items()):
        t = _stored(given)
        if t.dtype.byteorder == ">" or (not t.bfloat16 and t.dtype not in _STORAGE_OF):
            raise PthError(f"{name}: cannot store dtype {t.dtype} in a .pth")
        storage = "BFloat16Storage" if t.bfloat16 else _STORAGE_OF[t.dtype]
        string(name)
        global_("torch._utils", "_rebuild_tensor_v2")
        op(pickle.MARK)
        op(pickle.MARK)
        string("storage")
        global_("torch", storage)
        string(str(key))
        string("cpu")
        integer(t.size)
        op(pickle.TUPLE + pickle.BINPERSID)
        integer(0)
        int_tuple(t.shape)
        int_tuple(_contiguous_strides(t.shape, t.size))
        op(pickle.NEWFALSE)
        global_("collections", "OrderedDict")
        op(pickle.EMPTY_TUPLE + pickle.REDUCE)
        op(pickle.TUPLE + pickle.REDUCE)
        storages.append(t)
    op(pickle.SETITEMS + pickle.STOP)
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        _write_aligned(z, f"{archive_name}/data.pkl", body.getvalue())
        _write_aligned(z, f"{archive_name}/byteorder", b"little")
        for key in range(len(storages)):
            t, storages[key] = storages[key], None
            data = np.ascontiguousarray(t.take())
            if data.shape != t.shape or data.dtype != t.dtype:
                raise PthError(f"storage {key}: read as {data.dtype} {data.shape}, not {t.dtype}")
            _write_aligned(z, f"{archive_name}/data/{key}", memoryview(data).cast("B"))
            del t, data
        _write_aligned(z, f"{archive_name}/version", b"3\n")


def _long(n: int) -> bytes:
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return bytes([len(data)]) + data


def _write_aligned(z: zipfile.ZipFile, name: str, data: bytes) -> None:
    """A stored record whose data starts at a multiple of 64 bytes (padding in the local
    header's extra field, as torch writes it, so readers may map the storages)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    offset = z.fp.tell() + 30 + len(name.encode())
    pad = (-(offset + 4)) % 64
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch's "FB" padding record
    z.writestr(info, data)
