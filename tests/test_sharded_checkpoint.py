"""Sharded checkpoints: layout, resharding to other world sizes, dtypes, replicated tensors,
completeness, retention, asynchronous snapshots, and a SIGKILL halfway through a write.

Ranks are simulated by calling ``save`` with rank=r for every r into the same folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from helios.errors import CheckpointError, DTypeError
from helios.fileio import load_checkpoint
from helios.schedule import checkpoint as C

# Odd sizes, a 0-d tensor, a one-element tensor and an empty one.
SHAPES = {"a": (5, 7), "b": (13,), "c": (2, 3, 4), "one": (1,), "scalar": (), "empty": (0, 3)}


def _n(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _coords(k: int, shape) -> np.ndarray:
    """Element i of tensor k holds k * 1e6 + i: any misplaced element shows."""
    return (k * 1_000_000 + np.arange(_n(shape))).astype(np.float64)


def _uneven(n: int, r: int, world: int) -> tuple[int, int]:
    """Rank 0 holds at most 2 elements, the last rank the rest; ranks between hold nothing."""
    cut = min(2, n)
    return (0, cut) if r == 0 else ((cut, n) if r == world - 1 else (cut, cut))


def _shards(r: int, world: int, split=C.even_range) -> dict[str, C.ShardedArray]:
    out = {}
    for k, (name, shape) in enumerate(SHAPES.items()):
        lo, hi = split(_n(shape), r, world)
        out[name] = C.ShardedArray(shape, "float64", lo, hi, _coords(k, shape)[lo:hi])
    return out


def _save_world(run_dir, step: int, world: int, split=C.even_range, meta=None, keep=2, order=None) -> None:
    for r in order or range(world):
        C.save(str(run_dir), step, _shards(r, world, split), r, world, meta or {"at": step}, keep=keep)


def _check_all(d: str, world: int) -> None:
    for r in range(world):
        wanted = {n: C.even_range(_n(s), r, world) for n, s in SHAPES.items()}
        got, _ = C.load(d, wanted)
        for k, (name, shape) in enumerate(SHAPES.items()):
            lo, hi = wanted[name]
            np.testing.assert_array_equal(got[name], _coords(k, shape)[lo:hi], err_msg=f"{name} rank {r}/{world}")


def test_round_trip_layout_and_metadata(tmp_path):
    meta = {"config": {"d": 64}, "loader": {"pos": 3}, "rng": {"seed": np.int64(7)}, "zero": 2}
    _save_world(tmp_path, 100, 2, meta=meta)
    step, d = C.latest_complete(str(tmp_path))
    assert step == 100 and d == C.step_dir(str(tmp_path), 100) and d.endswith(os.path.join("ckpt", "step-00000100"))
    assert sorted(os.listdir(d)) == ["metadata.json", "shard-00000-of-00002.helios", "shard-00001-of-00002.helios"]
    md = json.loads(open(os.path.join(d, "metadata.json")).read())
    assert md == {"format": 1, "step": 100, "world": 2,
                  "shards": ["shard-00000-of-00002.helios", "shard-00001-of-00002.helios"],
                  "meta": {"config": {"d": 64}, "loader": {"pos": 3}, "rng": {"seed": 7}, "zero": 2}}
    _, smeta = load_checkpoint(os.path.join(d, "shard-00001-of-00002.helios"))
    assert smeta["tensors"]["a"] == {"shape": [5, 7], "dtype": "float64", "start": 17, "stop": 35}
    assert (smeta["rank"], smeta["world"], smeta["step"]) == (1, 2, 100)
    assert C.global_shapes(d) == {n: (s, "float64") for n, s in SHAPES.items()}
    _check_all(d, 2)
    _, got_meta = C.load(d, {})
    assert got_meta == md["meta"]


@pytest.mark.parametrize("load_world", [1, 3, 4])
def test_saved_at_two_uneven_ranks_loads_at_other_world_sizes(tmp_path, load_world):
    _save_world(tmp_path, 10, 2, split=_uneven)
    _, d = C.latest_complete(str(tmp_path))
    _check_all(d, load_world)
    # And back: saved unevenly at 4 ranks (two of them empty), loaded evenly.
    _save_world(tmp_path, 20, 4, split=_uneven)
    _check_all(C.step_dir(str(tmp_path), 20), load_world)


def test_load_reads_only_the_shards_it_needs(tmp_path, monkeypatch):
    _save_world(tmp_path, 1, 3)
    d = C.step_dir(str(tmp_path), 1)
    read = []
    real = C.load_checkpoint
    monkeypatch.setattr(C, "load_checkpoint", lambda p, **k: (read.append(os.path.basename(p)), real(p, **k))[1])
    got, _ = C.load(d, {"b": (5, 8), "a": (12, 23)})  # b: ranks 1 and 2 hold [4, 8) and [8, 13); a: rank 1
    assert sorted(read) == ["shard-00001-of-00003.helios"]
    np.testing.assert_array_equal(got["b"], _coords(1, (13,))[5:8])
    np.testing.assert_array_equal(got["a"], _coords(0, (5, 7))[12:23])


def test_bfloat16_and_float8_round_trip(tmp_path):
    bits = (np.arange(21, dtype=np.uint16) * 997) ^ 0x3F80  # arbitrary bit patterns, NaN payloads included
    f8 = np.arange(21, dtype=np.uint8) * 11
    for r in range(2):
        lo, hi = _uneven(21, r, 2)
        C.save(str(tmp_path), 1, {"w": C.ShardedArray((3, 7), "bfloat16", lo, hi, bits[lo:hi]),
                                  "q": C.ShardedArray((21,), "float8_e4m3", lo, hi, f8[lo:hi])}, r, 2)
    _, d = C.latest_complete(str(tmp_path))
    assert C.global_shapes(d) == {"w": ((3, 7), "bfloat16"), "q": ((21,), "float8_e4m3")}
    for world in (1, 3):
        for r in range(world):
            lo, hi = C.even_range(21, r, world)
            got, _ = C.load(d, {"w": (lo, hi), "q": (lo, hi)})
            assert got["w"].dtype == np.uint16 and np.array_equal(got["w"], bits[lo:hi])
            assert got["q"].dtype == np.uint8 and np.array_equal(got["q"], f8[lo:hi])


def test_replicated_tensors_are_written_by_rank_zero_only(tmp_path):
    full = np.arange(24, dtype=np.float32).reshape(4, 6) * 3 + 1
    world = 3
    for r in range(world):
        rng = (0, 24) if r == 0 else (0, 0)
        data = full.reshape(-1)[rng[0]:rng[1]]
        lo, hi = C.even_range(10, r, world)  # and one sharded tensor next to it
        C.save(str(tmp_path), 5, {"emb": C.ShardedArray((4, 6), "float32", *rng, data),
                                  "s": C.ShardedArray((10,), "int64", lo, hi, np.arange(lo, hi))}, r, world)
    _, d = C.latest_complete(str(tmp_path))
    _, smeta = load_checkpoint(os.path.join(d, C.shard_name(2, 3)))
    assert smeta["tensors"]["emb"]["stop"] == 0
    for lw in (1, 2, 4):
        for r in range(lw):
            lo, hi = C.even_range(24, r, lw)
            got, _ = C.load(d, {"emb": (lo, hi), "s": (0, 10)})
            np.testing.assert_array_equal(got["emb"], full.reshape(-1)[lo:hi])
            np.testing.assert_array_equal(got["s"], np.arange(10))


def test_ranges_that_do_not_partition_a_tensor_are_refused_naming_it(tmp_path):
    def two(step, r0, r1):
        for r, (lo, hi) in enumerate((r0, r1)):
            C.save(str(tmp_path), step, {"ok": C.ShardedArray((4,), "float32", *C.even_range(4, r, 2),
                                                              np.zeros(2, np.float32)),
                                         "x": C.ShardedArray((10,), "float64", lo, hi, np.zeros(hi - lo))}, r, 2,
                   keep=None)

    two(1, (0, 4), (5, 10))
    with pytest.warns(UserWarning, match=r"step-00000001.*'x' has a gap.*\[4, 5\)"):
        assert C.latest_complete(str(tmp_path)) is None
    with pytest.raises(CheckpointError, match=r"'x' has a gap"):
        C.global_shapes(C.step_dir(str(tmp_path), 1))
    two(2, (0, 6), (4, 10))
    with pytest.raises(CheckpointError, match=r"'x' has an overlap: elements \[4, 6\) are in both shard-00000"):
        C.load(C.step_dir(str(tmp_path), 2), {"ok": (0, 4)})
    two(3, (0, 4), (4, 9))
    with pytest.raises(CheckpointError, match=r"'x' has a gap: no shard holds its elements \[9, 10\)"):
        C.load(C.step_dir(str(tmp_path), 3), {"x": (0, 4)})


def _flip_byte(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("case", ["missing shard", "corrupt shard", "corrupt index", "no metadata", "torn metadata",
                                  "metadata not an object", "shard of another world"])
def test_an_incomplete_or_corrupt_newer_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path, case):
    _save_world(tmp_path, 1, 2, keep=5)
    _save_world(tmp_path, 2, 2, keep=5)
    d = C.step_dir(str(tmp_path), 2)
    assert C.latest_complete(str(tmp_path))[0] == 2  # the cache of verified files must not hide what follows
    shard1 = os.path.join(d, C.shard_name(1, 2))
    md = os.path.join(d, C.METADATA)
    expect = {"missing shard": "shard-00001-of-00002.helios: missing", "corrupt shard": "SHA-256 mismatch",
              "corrupt index": "shard-00001-of-00002.helios", "no metadata": "metadata.json: missing",
              "torn metadata": "metadata.json: unreadable", "metadata not an object": "not an object",
              "shard of another world": "expected rank 1 of 2"}[case]
    if case == "missing shard":
        os.unlink(shard1)
    elif case == "corrupt shard":
        _flip_byte(shard1, os.path.getsize(shard1) - 3)
    elif case == "corrupt index":
        _flip_byte(shard1, 70)
    elif case == "no metadata":
        os.unlink(md)
    elif case == "torn metadata":
        raw = open(md, "rb").read()
        open(md, "wb").write(raw[: len(raw) // 2])
    elif case == "metadata not an object":
        open(md, "w").write("[1, 2]")
    else:
        C.save(str(tmp_path), 2, _shards(1, 4), 1, 4, keep=None)  # a stray rank of a 4-rank run
        os.replace(os.path.join(d, C.shard_name(1, 4)), shard1)
    with pytest.warns(UserWarning, match="step-00000002") as rec:
        found = C.latest_complete(str(tmp_path))
    assert found == (1, C.step_dir(str(tmp_path), 1)), case
    msg = str(rec[0].message)
    assert expect in msg and "\n" not in msg, msg
    _check_all(found[1], 3)


def test_no_complete_checkpoint_at_all(tmp_path):
    assert C.latest_complete(str(tmp_path)) is None
    C.save(str(tmp_path), 3, _shards(1, 2), 1, 2)  # rank 0 never wrote
    with pytest.warns(UserWarning, match="metadata.json: missing"):
        assert C.latest_complete(str(tmp_path)) is None


def _steps(run_dir) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(run_dir / "ckpt"))


def test_retention_keeps_the_newest_complete_checkpoints_and_never_the_last_complete(tmp_path):
    # Rank 0 finishing last: it sees each new checkpoint complete, so exactly `keep` remain.
    for step in (1, 2, 3, 4):
        _save_world(tmp_path, step, 2, keep=2, order=[1, 0])
    assert _steps(tmp_path) == [3, 4]
    # Rank 0 finishing first: the new one is not complete yet (it may be in progress), so it
    # does not count and the two complete ones before it stay.
    _save_world(tmp_path, 5, 2, keep=2)
    assert _steps(tmp_path) == [3, 4, 5]
    # A string of newer checkpoints that never complete (rank 1 dead): the last complete stays.
    for step in (6, 7, 8, 9):
        C.save(str(tmp_path), step, _shards(0, 2), 0, 2, keep=1)
    assert _steps(tmp_path) == [5, 6, 7, 8, 9]
    with pytest.warns(UserWarning):
        assert C.latest_complete(str(tmp_path))[0] == 5
    # The newest complete one corrupt: it does not count, the one before it is kept too.
    _save_world(tmp_path, 10, 2, keep=5, order=[1, 0])
    _save_world(tmp_path, 11, 2, keep=5, order=[1, 0])
    p = os.path.join(C.step_dir(str(tmp_path), 11), C.shard_name(0, 2))
    _flip_byte(p, os.path.getsize(p) - 1)
    C._VERIFIED.clear()  # this process verified it before the flip, within the same mtime tick
    C.save(str(tmp_path), 12, _shards(0, 2), 0, 2, keep=1)
    # 10 is the newest complete one: everything older goes (complete or dead); 11 (corrupt) and 12 are newer.
    assert _steps(tmp_path) == [10, 11, 12]
    with pytest.raises(ValueError, match="keep"):
        C.save(str(tmp_path), 13, _shards(0, 2), 0, 2, keep=0)


def test_discard_newer_removes_a_dead_attempts_folders(tmp_path):
    _save_world(tmp_path, 1, 2)
    C.save(str(tmp_path), 2, _shards(1, 2), 1, 2)
    C.save(str(tmp_path), 3, _shards(0, 2), 0, 2)
    gone = C.discard_newer(str(tmp_path), 1)
    assert sorted(os.path.basename(g) for g in gone) == ["step-00000002", "step-00000003"]
    assert _steps(tmp_path) == [1]


def test_load_errors_name_the_file_and_the_problem(tmp_path):
    _save_world(tmp_path, 1, 2)
    d = C.step_dir(str(tmp_path), 1)
    with pytest.raises(CheckpointError, match=r"step-00000001: the checkpoint has no tensor 'nope'"):
        C.load(d, {"nope": (0, 1)})
    with pytest.raises(CheckpointError, match=r"elements \[0, 14\) of 'b', which has 13"):
        C.load(d, {"b": (0, 14)})
    with pytest.raises(CheckpointError, match=r"another model: tensor 'a' is float64 \(5, 7\) there and shape "
                                              r"\(7, 5\) here \(1 more tensors differ\)"):
        C.load(d, {"a": (0, 1)}, expect={"b": ((13,), "float64"), "a": ((7, 5), None), "c": ((2, 3, 4), "float32")})
    with pytest.raises(CheckpointError, match=r"tensor 'c' is float64 \(2, 3, 4\) there and float32"):
        C.check_shapes(d, {"c": ((2, 3, 4), "float32")}, exact=False)
    with pytest.raises(CheckpointError, match=r"tensor 'b' is float64 \(13,\) there and absent here"):
        C.check_shapes(d, {n: (s, "float64") for n, s in SHAPES.items() if n != "b"})
    C.check_shapes(d, {n: (s, "float64") for n, s in SHAPES.items()})  # the same model: no error
    os.unlink(os.path.join(d, C.shard_name(0, 2)))
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00002.helios: missing"):
        C.load(d, {"b": (10, 13)})
    os.unlink(os.path.join(d, C.METADATA))
    with pytest.raises(CheckpointError, match=r"metadata.json: missing"):
        C.global_shapes(d)


def test_sharded_array_refuses_a_range_or_dtype_that_does_not_fit():
    with pytest.raises(CheckpointError, match=r"range \[0, 5\)"):
        C.ShardedArray((4,), "float32", 0, 5, np.zeros(5, np.float32))
    with pytest.raises(CheckpointError, match="3 elements"):
        C.ShardedArray((4,), "float32", 0, 2, np.zeros(3, np.float32))
    with pytest.raises(DTypeError, match="float64 for a tensor of dtype 'float32'"):
        C.ShardedArray((4,), "float32", 0, 4, np.zeros(4))
    with pytest.raises(DTypeError, match="bfloat16"):
        C.ShardedArray((4,), "bfloat16", 0, 4, np.zeros(4, np.float16))
    with pytest.raises(DTypeError, match="unknown dtype"):
        C.ShardedArray((4,), "float13", 0, 4, np.zeros(4, np.float16))


# ---------------------------------------------------------------------------------------------
# Asynchronous writer


def _slow_save(monkeypatch, seconds: float, log: list):
    real_save = C.save

    def slow(*a, **k):
        log.append(("start", a[1], time.monotonic()))
        time.sleep(seconds)
        out = real_save(*a, **k)
        log.append(("end", a[1], time.monotonic()))
        return out

    monkeypatch.setattr(C, "save", slow)


def test_async_save_returns_before_the_write_and_writes_the_snapshot(tmp_path, monkeypatch):
    log: list = []
    _slow_save(monkeypatch, 0.5, log)
    ck = C.AsyncCheckpointer(str(tmp_path), 0, 1)
    data = np.arange(100_000, dtype=np.float32)
    meta = {"loader": {"pos": 1}}
    t0 = time.monotonic()
    ck.save(7, {"x": C.ShardedArray((100_000,), "float32", 0, 100_000, data)}, meta)
    returned = time.monotonic() - t0
    data[:] = -1  # the caller changes its buffers at once
    meta["loader"]["pos"] = 99
    assert returned < 0.3 and ck.pending() and ck.last_snapshot_s < 0.3
    assert not os.path.exists(os.path.join(C.step_dir(str(tmp_path), 7), C.METADATA))  # not written yet
    ck.wait()
    assert not ck.pending() and ck.last_write_s >= 0.5
    got, got_meta = C.load(C.step_dir(str(tmp_path), 7), {"x": (0, 100_000)})
    assert np.array_equal(got["x"], np.arange(100_000, dtype=np.float32)) and got_meta == {"loader": {"pos": 1}}


def test_a_second_save_waits_for_the_first(tmp_path, monkeypatch):
    log: list = []
    _slow_save(monkeypatch, 0.2, log)
    with C.AsyncCheckpointer(str(tmp_path), 0, 1, keep=5) as ck:
        for step in (1, 2):
            ck.save(step, {"x": C.ShardedArray((3,), "int32", 0, 3, np.full(3, step, np.int32))})
    assert [e[:2] for e in log] == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert C.latest_complete(str(tmp_path))[0] == 2
    got, _ = C.load(C.step_dir(str(tmp_path), 1), {"x": (0, 3)})
    assert got["x"].tolist() == [1, 1, 1]


def test_an_error_in_the_background_write_is_raised_by_wait(tmp_path, monkeypatch):
    real_save = C.save
    calls = []

    def broken(*a, **k):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise OSError("disk full")
        return real_save(*a, **k)

    monkeypatch.setattr(C, "save", broken)
    ck = C.AsyncCheckpointer(str(tmp_path), 0, 1)
    x = {"x": C.ShardedArray((1,), "float32", 0, 1, np.zeros(1, np.float32))}
    ck.save(1, x)
    with pytest.raises(OSError, match="disk full"):
        ck.wait()
    assert calls == ["helios-ckpt-1"]  # it ran on the background thread
    ck.wait()  # reported once
    ck.save(2, x)
    ck.close()
    assert C.latest_complete(str(tmp_path))[0] == 2
    with pytest.raises(TypeError, match="not JSON-serialisable"):  # on the caller's thread, at once
        ck.save(3, x, {"f": object()})


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    """Rank 1 of 2 is SIGKILLed while its background thread writes the shard of step 2 (rank 0
    wrote its shard and the metadata): step 1 stays the newest complete checkpoint."""
    _save_world(tmp_path, 1, 2)
    C.save(str(tmp_path), 2, _shards(0, 2), 0, 2)
    d2 = C.step_dir(str(tmp_path), 2)
    # A slow disk: every hashed chunk takes 20 ms, so the write takes seconds and is surely
    # under way when the signal comes.
    script = textwrap.dedent(f"""
        import hashlib, time
        import numpy as np
        import helios.fileio
        from helios.schedule import checkpoint as C

        class SlowSha:
            def __init__(self):
                self.h = hashlib.sha256()
            def update(self, b):
                time.sleep(0.02)
                self.h.update(b)
            def digest(self):
                return self.h.digest()

        class Slow:
            sha256 = SlowSha

        helios.fileio.hashlib = Slow
        shards = {{f"t{{i}}": C.ShardedArray((20_000,), "float64", 0, 20_000, np.full(20_000, i, np.float64))
                  for i in range(200)}}
        ck = C.AsyncCheckpointer({str(tmp_path)!r}, 1, 2)
        ck.save(2, shards)
        print("writing", flush=True)
        ck.wait()
        print("done", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 20
        tmp_name = "." + C.shard_name(1, 2) + ".tmp-"
        while not any(n.startswith(tmp_name) and os.path.getsize(os.path.join(d2, n)) > 0 for n in os.listdir(d2)):
            assert time.monotonic() < deadline and p.poll() is None, "the write never started"
            time.sleep(0.005)
        time.sleep(0.1)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert p.returncode == -signal.SIGKILL
    names = os.listdir(d2)
    assert C.shard_name(1, 2) not in names and any(n.startswith(tmp_name) for n in names)  # only the temp file
    with pytest.warns(UserWarning, match=r"step-00000002.*shard-00001-of-00002.helios: missing"):
        step, d = C.latest_complete(str(tmp_path))
    assert step == 1
    _check_all(d, 3)
    # The restarted rank writes step 2 again; the dead write's temp file does not get in the way.
    C.save(str(tmp_path), 2, _shards(1, 2), 1, 2)
    assert C.latest_complete(str(tmp_path))[0] == 2
    _check_all(d2, 1)
