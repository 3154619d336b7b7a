"""Atomic writes and the checkpoint container: round trips, corruption, crash safety."""

from __future__ import annotations

import os

import numpy as np
import pytest

from helios.errors import CheckpointError, DTypeError
from helios.fileio import atomic_open, atomic_write_bytes, load_checkpoint, save_checkpoint


def _leftovers(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp-" in n)


# ----------------------------------------------------------------------------- atomic writes


def test_atomic_write_bytes_creates_and_replaces(tmp_path):
    p = tmp_path / "f.bin"
    atomic_write_bytes(p, b"one")
    assert p.read_bytes() == b"one"
    atomic_write_bytes(p, b"\0two\xff")
    assert p.read_bytes() == b"\0two\xff"
    assert _leftovers(tmp_path) == []


def test_atomic_open_text_mode(tmp_path):
    p = tmp_path / "t.txt"
    with atomic_open(p, "w") as f:
        f.write("héllo\n")
    assert p.read_text(encoding="utf-8") == "héllo\n"


def test_atomic_open_keeps_old_file_when_writer_raises(tmp_path):
    p = tmp_path / "keep.bin"
    p.write_bytes(b"old content")
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_open(p, "wb") as f:
            f.write(b"new half")
            f.flush()
            # The temp file exists next to the target while writing.
            assert len(_leftovers(tmp_path)) == 1
            raise RuntimeError("writer failed midway")
    assert p.read_bytes() == b"old content"
    assert _leftovers(tmp_path) == []


def test_atomic_open_failure_leaves_no_target_when_absent(tmp_path):
    p = tmp_path / "absent.bin"
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(p) as f:
            f.write(b"x")
            raise KeyboardInterrupt
    assert not p.exists()
    assert _leftovers(tmp_path) == []


def test_atomic_open_rejects_bad_mode_and_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "x", "ab"):
            pass
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write_bytes(tmp_path / "nodir" / "x", b"")


def test_save_checkpoint_failure_keeps_old_checkpoint(tmp_path):
    p = tmp_path / "c.ckpt"
    save_checkpoint(p, {"a": np.arange(3)}, {"step": 1})
    before = p.read_bytes()
    with pytest.raises(DTypeError):
        save_checkpoint(p, {"a": np.arange(3), "bad": np.array([object()])}, {})
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(p, {"a": np.arange(3)}, {"x": object()})
    assert p.read_bytes() == before
    assert _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- checkpoints


def _sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    big = rng.standard_normal((7, 9)).astype(np.float32)
    return {
        "w": big,
        "w.T": big.T,  # non-contiguous
        "strided": np.arange(40, dtype=np.int64)[::3],
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 4), dtype=np.float16),
        "bool": rng.random(13) > 0.5,
        "be": np.arange(5, dtype=">i4"),  # big-endian input
        "c": (rng.standard_normal(3) + 1j).astype(np.complex64),
        "u8": np.arange(3, dtype=np.uint8),
    }


def test_checkpoint_round_trip(tmp_path):
    p = tmp_path / "c.ckpt"
    arrays = _sample_arrays()
    meta = {"step": np.int64(12), "lr": 3e-4, "nested": {"a": [1, 2, "x"]}, "loader": {"state": 2**127 + 5}}
    save_checkpoint(p, arrays, meta)
    got, got_meta = load_checkpoint(p)
    assert list(got) == list(arrays)
    for k, v in arrays.items():
        assert got[k].shape == v.shape, k
        assert got[k].dtype == v.dtype.newbyteorder("=") or got[k].dtype == v.dtype, k
        np.testing.assert_array_equal(got[k], v)
        assert got[k].flags.c_contiguous and got[k].flags.writeable
    assert got_meta == {"step": 12, "lr": 3e-4, "nested": {"a": [1, 2, "x"]}, "loader": {"state": 2**127 + 5}}
    assert got["be"].dtype.byteorder in "=<|"


def test_checkpoint_logical_dtypes(tmp_path):
    p = tmp_path / "bf.ckpt"
    f32 = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
    bf16_bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    save_checkpoint(p, {"w": bf16_bits, "b": f32}, {}, dtypes={"w": "bfloat16"})
    arrays, meta, dtypes = load_checkpoint(p, return_dtypes=True)
    assert dtypes == {"w": "bfloat16", "b": "float32"}
    back = (arrays["w"].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(back, f32)
    with pytest.raises(DTypeError, match="uint16"):
        save_checkpoint(tmp_path / "x", {"w": f32}, {}, dtypes={"w": "bfloat16"})
    with pytest.raises(DTypeError, match="unknown logical dtype"):
        save_checkpoint(tmp_path / "x", {"w": bf16_bits}, {}, dtypes={"w": "float13"})


def test_checkpoint_empty(tmp_path):
    p = tmp_path / "e.ckpt"
    save_checkpoint(p, {}, {})
    assert load_checkpoint(p) == ({}, {})


@pytest.fixture
def ckpt(tmp_path):
    p = tmp_path / "model.ckpt"
    save_checkpoint(p, _sample_arrays(), {"step": 3})
    return p


def _assert_rejected(p, match: str, original: bytes) -> None:
    with pytest.raises(CheckpointError, match=match) as ei:
        load_checkpoint(p)
    assert str(p) in str(ei.value)
    assert p.read_bytes() == original  # a load never modifies the file


@pytest.mark.parametrize("where", ["prefix_digest", "header", "array", "last_byte"])
def test_checkpoint_flipped_byte_detected(ckpt, where):
    raw = bytearray(ckpt.read_bytes())
    pos = {"prefix_digest": 40, "header": 70, "array": len(raw) // 2, "last_byte": len(raw) - 1}[where]
    raw[pos] ^= 0x01
    ckpt.write_bytes(bytes(raw))
    _assert_rejected(ckpt, r"SHA-256 mismatch|index|JSON|padding|bytes", bytes(raw))


def test_checkpoint_every_single_byte_flip_is_detected(tmp_path):
    p = tmp_path / "small.ckpt"
    save_checkpoint(p, {"a": np.arange(4, dtype=np.int16), "s": np.array(1.0)}, {"k": "v"})
    good = p.read_bytes()
    for pos in range(len(good)):
        raw = bytearray(good)
        raw[pos] ^= 0x80
        p.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError):
            load_checkpoint(p)


def test_checkpoint_truncated(ckpt):
    raw = ckpt.read_bytes()
    for cut in (len(raw) - 1, len(raw) // 2, 70, 30, 5, 0):
        ckpt.write_bytes(raw[:cut])
        _assert_rejected(ckpt, r"truncated|not a Helios checkpoint", raw[:cut])


def test_checkpoint_trailing_bytes(ckpt):
    raw = ckpt.read_bytes() + b"junk"
    ckpt.write_bytes(raw)
    _assert_rejected(ckpt, "trailing bytes", raw)


def test_checkpoint_wrong_magic_and_version(ckpt):
    raw = bytearray(ckpt.read_bytes())
    bad = b"PK\x03\x04" + bytes(raw[4:])
    ckpt.write_bytes(bad)
    _assert_rejected(ckpt, "not a Helios checkpoint", bad)
    raw[8] = 99  # version field
    ckpt.write_bytes(bytes(raw))
    _assert_rejected(ckpt, "format version 99", bytes(raw))


def test_checkpoint_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nope.ckpt")


def test_read_checkpoint_meta_reads_the_index_alone(tmp_path):
    from helios.errors import CheckpointError
    from helios.fileio import read_checkpoint_meta, save_checkpoint

    path = tmp_path / "c.helios"
    save_checkpoint(path, {"a": np.arange(1000, dtype=np.float32)}, {"step": 3, "tensors": {"a": [0, 1000]}})
    assert read_checkpoint_meta(path) == {"step": 3, "tensors": {"a": [0, 1000]}}
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint_meta(path)
    with pytest.raises(CheckpointError, match="no such file"):
        read_checkpoint_meta(tmp_path / "missing.helios")
