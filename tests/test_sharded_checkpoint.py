"""Sharded checkpoints: layout, resharding to other world sizes, completeness, retention,
asynchronous snapshots, and a SIGKILL halfway through a write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

from helios.errors import CheckpointError
from helios.schedule import checkpoint as C

SHAPES = {"a": (5, 7), "b": (13,), "c": (2, 3, 4), "one": (1,)}


def _coords(k: int, shape) -> np.ndarray:
    """Element i of tensor k holds k * 1e6 + i: any misplaced element shows."""
    return (k * 1_000_000 + np.arange(int(np.prod(shape)))).astype(np.float64)


def _save_world(run_dir, step: int, world: int, uneven: bool = False, meta=None, keep: int = 2) -> None:
    for r in range(world):
        shards = {}
        for k, (name, shape) in enumerate(SHAPES.items()):
            n = int(np.prod(shape))
            lo, hi = C.even_range(n, r, world)
            if uneven and world == 2:  # rank 0 holds a little, rank 1 the rest
                lo, hi = (0, min(2, n)) if r == 0 else (min(2, n), n)
            shards[name] = C.ShardedArray(shape, "float64", lo, hi, _coords(k, shape)[lo:hi])
        C.save(str(run_dir), step, shards, r, world, meta or {"step": step}, keep=keep)


@pytest.mark.parametrize("load_world", [1, 2, 3, 4])
def test_saved_at_two_ranks_loads_at_any_world_size(tmp_path, load_world):
    _save_world(tmp_path, 10, 2, uneven=True, meta={"loader": {"pos": 3}})
    step, d = C.latest_complete(str(tmp_path))
    assert step == 10 and os.path.basename(d) == "step-00000010"
    assert sorted(os.listdir(d)) == ["metadata.json", "shard-00000-of-00002.helios", "shard-00001-of-00002.helios"]
    shapes = C.global_shapes(d)
    assert shapes["a"] == ((5, 7), "float64")
    for r in range(load_world):
        wanted = {n: C.even_range(int(np.prod(s)), r, load_world) for n, s in SHAPES.items()}
        got, meta = C.load(d, wanted)
        assert meta == {"loader": {"pos": 3}}
        for k, (name, shape) in enumerate(SHAPES.items()):
            lo, hi = wanted[name]
            np.testing.assert_array_equal(got[name], _coords(k, shape)[lo:hi])


def test_bfloat16_round_trip_and_replicated_tensor(tmp_path):
    bits = np.arange(10, dtype=np.uint16) + 16256
    for r in range(2):
        lo, hi = C.even_range(10, r, 2)
        C.save(str(tmp_path), 1, {"w": C.ShardedArray((2, 5), "bfloat16", lo, hi, bits[lo:hi])}, r, 2)
    _, d = C.latest_complete(str(tmp_path))
    got, _ = C.load(d, {"w": (0, 10)})
    assert got["w"].dtype == np.uint16 and np.array_equal(got["w"], bits)


def test_an_incomplete_or_corrupt_newer_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    _save_world(tmp_path, 1, 2, keep=5)
    for case in ("missing shard", "corrupt shard", "no metadata"):
        _save_world(tmp_path, 2, 2, keep=5)
        d = C.step_dir(str(tmp_path), 2)
        C._VERIFIED.clear()
        if case == "missing shard":
            os.unlink(os.path.join(d, C.shard_name(1, 2)))
        elif case == "corrupt shard":
            p = os.path.join(d, C.shard_name(0, 2))
            data = bytearray(open(p, "rb").read())
            data[-3] ^= 0x10
            open(p, "wb").write(bytes(data))
        else:
            os.unlink(os.path.join(d, C.METADATA))
        with pytest.warns(UserWarning, match="step-00000002"):
            step, _ = C.latest_complete(str(tmp_path))
        assert step == 1, case


def test_ranges_that_do_not_partition_a_tensor_are_refused(tmp_path):
    C.save(str(tmp_path), 1, {"x": C.ShardedArray((10,), "float64", 0, 4, np.zeros(4))}, 0, 2)
    C.save(str(tmp_path), 1, {"x": C.ShardedArray((10,), "float64", 5, 10, np.zeros(5))}, 1, 2)
    with pytest.warns(UserWarning, match="gap at element 4"):
        assert C.latest_complete(str(tmp_path)) is None
    with pytest.raises(CheckpointError, match="gap"):
        C.global_shapes(C.step_dir(str(tmp_path), 1))


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _save_world(tmp_path, step, 2, keep=2)
    # An incomplete newer one (rank 1 never wrote): it does not count towards `keep`.
    C.save(str(tmp_path), 5, {"a": C.ShardedArray((5, 7), "float64", 0, 17, np.zeros(17))}, 0, 2, keep=2)
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["step-00000003", "step-00000004", "step-00000005"]


def test_async_save_returns_before_the_write_and_writes_the_snapshot(tmp_path, monkeypatch):
    real_save = C.save
    started = []

    def slow_save(*a, **k):
        started.append(time.monotonic())
        time.sleep(0.5)
        return real_save(*a, **k)

    monkeypatch.setattr(C, "save", slow_save)
    ck = C.AsyncCheckpointer(str(tmp_path), 0, 1)
    data = np.arange(100, dtype=np.float32)
    t0 = time.monotonic()
    ck.save(7, {"x": C.ShardedArray((100,), "float32", 0, 100, data)}, {"k": 1})
    returned = time.monotonic() - t0
    data[:] = -1  # the caller changes its buffer at once
    assert returned < 0.3 and ck.pending()
    ck.wait()
    got, meta = C.load(C.step_dir(str(tmp_path), 7), {"x": (0, 100)})
    assert np.array_equal(got["x"], np.arange(100, dtype=np.float32)) and meta == {"k": 1}


def test_an_error_in_the_background_write_is_raised_by_wait(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(C, "save", broken)
    ck = C.AsyncCheckpointer(str(tmp_path), 0, 1)
    ck.save(1, {"x": C.ShardedArray((1,), "float32", 0, 1, np.zeros(1, np.float32))})
    with pytest.raises(OSError, match="disk full"):
        ck.wait()


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    _save_world(tmp_path, 1, 1)
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from helios.schedule import checkpoint as C
        big = np.random.default_rng(0).random(30_000_000)
        ck = C.AsyncCheckpointer({str(tmp_path)!r}, 0, 1)
        ck.save(2, {{"big": C.ShardedArray(big.shape, "float64", 0, big.size, big)}})
        print("writing", flush=True)
        ck.wait()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    C._VERIFIED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step, d = C.latest_complete(str(tmp_path))
    assert step == 1
    got, _ = C.load(d, {"b": (0, 13)})
    np.testing.assert_array_equal(got["b"], _coords(1, (13,)))
    # The killed write left no shard under its final name (only, at most, a temporary file).
    d2 = C.step_dir(str(tmp_path), 2)
    assert not os.path.isdir(d2) or all(not f.endswith(".helios") for f in os.listdir(d2))
