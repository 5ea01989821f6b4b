"""Hostile ``.pth`` files: what the reader may allocate is bounded by what the file holds."""

import io
import pickle
import struct
import zipfile

import mlx_rwkvx
from mlx_rwkvx.io.formats import CheckpointError
from mlx_rwkvx.io.pth import PthError, read_pth, read_pth_lazily

import numpy as np
import pytest

MiB_FLOATS = 1 << 20  # a storage of 1M float32 elements: 4 MiB


def _write_pth(path, views: dict, storages: dict, compress=zipfile.ZIP_STORED) -> None:
    """A ``torch.save`` zip, by hand: ``views`` maps a name to (storage key, offset, size,
    stride), ``storages`` a key to (declared element count, float32 array stored)."""
    body = io.BytesIO()
    op = body.write

    def text(s: str) -> None:
        op(pickle.BINUNICODE + struct.pack("<I", len(s)) + s.encode())

    def integer(n: int) -> None:
        op(pickle.BININT + struct.pack("<i", n))

    def ints(values) -> None:
        op(pickle.MARK)
        for n in values:
            integer(n)
        op(pickle.TUPLE)

    op(pickle.PROTO + b"\x02" + pickle.GLOBAL + b"collections\nOrderedDict\n")
    op(pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.MARK)
    for name, (key, offset, size, stride) in views.items():
        text(name)
        op(pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.MARK + pickle.MARK)
        text("storage")
        op(pickle.GLOBAL + b"torch\nFloatStorage\n")
        text(key)
        text("cpu")
        integer(storages[key][0])
        op(pickle.TUPLE + pickle.BINPERSID)
        integer(offset)
        ints(size)
        ints(stride)
        op(pickle.NEWFALSE + pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE)
        op(pickle.REDUCE + pickle.TUPLE + pickle.REDUCE)
    op(pickle.SETITEMS + pickle.STOP)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a/data.pkl", body.getvalue())
        for key, (_, data) in storages.items():
            z.writestr(f"a/data/{key}", data.astype(np.float32).tobytes(), compress_type=compress)


@pytest.fixture
def opened(monkeypatch):
    """The names of the zip entries opened for reading (ZipFile.read opens through it too)."""
    names = []
    real_open = zipfile.ZipFile.open

    def recording_open(self, name, mode="r", *args, **kwargs):
        if mode == "r":
            names.append(name if isinstance(name, str) else name.filename)
        return real_open(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", recording_open)
    return names


def test_a_compressed_storage_is_refused_before_it_is_inflated(tmp_path, opened):
    # torch never compresses: a deflated storage of zeros is a zip bomb (16 MB of them
    # inflate to 16 GB), so its record is refused from the zip's directory, never read
    path = tmp_path / "bomb.pth"
    zeros = np.zeros(4 * MiB_FLOATS, np.float32)
    _write_pth(
        path,
        {"w": ("0", 0, (zeros.size,), (1,))},
        {"0": (zeros.size, zeros)},
        compress=zipfile.ZIP_DEFLATED,
    )
    assert path.stat().st_size < zeros.nbytes // 100
    with pytest.raises(PthError, match=r"bomb.pth: entry a/data/0 is compressed"):
        read_pth(str(path))
    assert not [n for n in opened if "/data/" in n]
    with pytest.raises(CheckpointError, match="a/data/0 is compressed"):
        mlx_rwkvx.load(str(path))


def test_a_storage_whose_size_is_not_its_declared_count_is_refused_unread(tmp_path, opened):
    path = tmp_path / "liar.pth"
    held = np.zeros(MiB_FLOATS, np.float32)
    _write_pth(path, {"w": ("0", 0, (4,), (1,))}, {"0": (10**9, held)})
    with pytest.raises(
        PthError,
        match=r"liar.pth: storage a/data/0 holds 4,194,304 bytes, "
        r"its declared 1,000,000,000 elements",
    ):
        read_pth(str(path))
    assert not [n for n in opened if "/data/" in n]


def test_many_views_of_one_storage_are_refused_together(tmp_path):
    # each view alone fits its storage; 50 of them would copy it 50 times (200 MB from 4)
    path = tmp_path / "views.pth"
    views = {f"w{i}": ("0", i, (MiB_FLOATS - i,), (1,)) for i in range(50)}
    _write_pth(path, views, {"0": (MiB_FLOATS, np.zeros(MiB_FLOATS, np.float32))})
    with pytest.raises(
        PthError, match="views.pth: its distinct tensors hold more than its storages"
    ):
        read_pth(str(path))


def test_tied_weights_are_copied_once_and_split_views_load(tmp_path):
    path = tmp_path / "tied.pth"
    storage = np.arange(24, dtype=np.float32)
    views = {
        "emb.weight": ("0", 0, (3, 4), (4, 1)),
        "head.weight": ("0", 0, (3, 4), (4, 1)),  # the same view: tied
        "a": ("0", 12, (6,), (1,)),  # the rest of the storage, split in two
        "b": ("0", 18, (2, 3), (1, 2)),
    }
    _write_pth(path, views, {"0": (24, storage)})
    state = read_pth(str(path))
    assert state["emb.weight"].array is state["head.weight"].array
    np.testing.assert_array_equal(state["head.weight"].array, storage[:12].reshape(3, 4))
    np.testing.assert_array_equal(state["a"].array, storage[12:18])
    np.testing.assert_array_equal(state["b"].array, storage[18:].reshape(3, 2).T)


def test_read_lazily_the_same_tensors_and_the_same_refusals(tmp_path, opened):
    path = tmp_path / "tied.pth"
    storage = np.arange(24, dtype=np.float32)
    views = {
        "emb.weight": ("0", 0, (3, 4), (4, 1)),
        "head.weight": ("0", 0, (3, 4), (4, 1)),
        "a": ("0", 12, (6,), (1,)),
        "b": ("0", 18, (2, 3), (1, 2)),  # strided: its copy is row-major
    }
    _write_pth(path, views, {"0": (24, storage)})
    eager = read_pth(str(path))
    opened.clear()
    lazy = read_pth_lazily(str(path))
    assert not [n for n in opened if "/data/" in n]  # no storage read yet
    assert list(lazy) == list(eager)
    assert all(t.shape == eager[name].array.shape for name, t in lazy.items())
    for name, t in lazy.items():
        np.testing.assert_array_equal(t.take(), eager[name].array)
    hostile = {
        "views": ({f"w{i}": ("0", i, (64 - i,), (1,)) for i in range(50)}, 64, 64, None),
        "liar": ({"w": ("0", 0, (4,), (1,))}, 10**9, 64, None),
        "past": ({"w": ("0", 60, (8,), (1,))}, 64, 64, None),
        "bomb": ({"w": ("0", 0, (64,), (1,))}, 64, 64, zipfile.ZIP_DEFLATED),
    }
    for name, (views, declared, held, compress) in hostile.items():
        bad = tmp_path / f"{name}.pth"
        data = np.zeros(held, np.float32)
        _write_pth(bad, views, {"0": (declared, data)}, compress=compress or zipfile.ZIP_STORED)
        with pytest.raises(PthError) as eager_error:
            read_pth(str(bad))
        with pytest.raises(PthError) as lazy_error:
            read_pth_lazily(str(bad))
        assert str(lazy_error.value) == str(eager_error.value), name
