"""Sharded checkpoints: every rank writes its own shard, in the background, and a checkpoint
saved at one world size (or ZeRO stage) loads at another.

Layout of ``RUN_DIR/ckpt/step-00000100/``::

    shard-00000-of-00002.helios   rank 0's arrays (helios.fileio container: temp + fsync +
    shard-00001-of-00002.helios   rename, SHA-256 over the payload), one per rank
    metadata.json                 written by rank 0: format, step, world size, the shard
                                  file names, and the caller's meta (config, data-loader
                                  position, RNG state, optimizer hyper-parameters, ZeRO stage)

A tensor is described by its global shape and logical dtype, and each rank holds one
contiguous range [start, stop) of its flattened (C-order) elements; the ranges of all
ranks partition the tensor.  A replicated tensor is written by splitting its range evenly
over the ranks, so every rank writes about the same bytes in parallel.

A checkpoint is *complete* when metadata.json parses, every shard it lists exists and
verifies, and every tensor's ranges partition it.  No rank waits for another to write (a
background thread must never issue collectives: they would interleave with training's),
so completeness is judged when loading: :func:`latest_complete` returns the newest
complete checkpoint and warns about any newer one that is not (a crash mid-write, a
corrupt file).  Loading asks, per tensor, for any range: resharding reads the pieces from
whichever shards hold them.  Rank 0 removes step folders older than the newest ``keep``
complete ones, never the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from helios.errors import CheckpointError
from helios.fileio import atomic_write_bytes, load_checkpoint, save_checkpoint

FORMAT = 1
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass
class ShardedArray:
    """This rank's elements [start, stop) of a tensor's flattened global elements."""

    global_shape: tuple
    dtype: str  # numpy dtype name, or "bfloat16" (stored as uint16 bit patterns)
    start: int
    stop: int
    data: np.ndarray  # 1-D, stop - start elements

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        n = int(np.prod(self.global_shape, dtype=np.int64))
        if not 0 <= self.start <= self.stop <= n or self.data.size != self.stop - self.start:
            raise CheckpointError(f"ShardedArray: range [{self.start}, {self.stop}) with {self.data.size} elements does "
                                  f"not fit a tensor of shape {self.global_shape}")


def even_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s share [start, stop) of ``numel`` elements split evenly over ``world`` ranks."""
    return numel * rank // world, numel * (rank + 1) // world


def step_dir(run_dir: str, step: int) -> str:
    """The folder of the checkpoint taken after ``step``."""
    return os.path.join(run_dir, "ckpt", f"step-{step:08d}")


def shard_name(rank: int, world: int) -> str:
    """File name of rank ``rank``'s shard."""
    return f"shard-{rank:05d}-of-{world:05d}.helios"


def save(run_dir: str, step: int, shards: dict[str, ShardedArray], rank: int, world: int, meta: dict | None = None,
         keep: int = 2) -> str:
    """Write this rank's shard of the checkpoint of ``step`` (rank 0 also the metadata); returns the folder."""
    d = step_dir(run_dir, step)
    os.makedirs(d, exist_ok=True)
    index = {name: {"shape": list(s.global_shape), "dtype": s.dtype, "start": s.start, "stop": s.stop}
             for name, s in shards.items()}
    arrays = {name: np.ascontiguousarray(s.data).reshape(-1) for name, s in shards.items()}
    dtypes = {name: s.dtype for name, s in shards.items() if s.dtype == "bfloat16"}
    save_checkpoint(os.path.join(d, shard_name(rank, world)), arrays,
                    {"format": FORMAT, "step": step, "rank": rank, "world": world, "tensors": index}, dtypes=dtypes)
    if rank == 0:
        md = {"format": FORMAT, "step": step, "world": world, "shards": [shard_name(r, world) for r in range(world)],
              "meta": meta or {}}
        atomic_write_bytes(os.path.join(d, METADATA), json.dumps(md, sort_keys=True, default=str).encode())
        _prune(run_dir, keep)
    return d


def _step_dirs(run_dir: str) -> list[tuple[int, str]]:
    root = os.path.join(run_dir, "ckpt")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out, reverse=True)


def _problem(d: str) -> str | None:
    """Why the checkpoint in ``d`` is not complete, or None when it is (reads and verifies every shard)."""
    try:
        with open(os.path.join(d, METADATA), "rb") as f:
            md = json.loads(f.read())
    except FileNotFoundError:
        return "no metadata.json (rank 0 did not finish writing it)"
    except (OSError, ValueError) as e:
        return f"metadata.json is unreadable ({e})"
    if md.get("format") != FORMAT:
        return f"format {md.get('format')!r}, this Helios reads {FORMAT}"
    try:
        _index(d, md)
    except CheckpointError as e:
        return str(e)
    return None


def _index(d: str, md: dict) -> dict[str, dict]:
    """name -> {"shape", "dtype", "pieces": [(start, stop, shard file)]}, validated to partition each tensor."""
    cache = _shard_meta_cache(d, md)
    tensors: dict[str, dict] = {}
    for fname, tmeta in cache.items():
        for name, t in tmeta.items():
            e = tensors.setdefault(name, {"shape": tuple(t["shape"]), "dtype": t["dtype"], "pieces": []})
            if e["shape"] != tuple(t["shape"]) or e["dtype"] != t["dtype"]:
                raise CheckpointError(f"{d}: shards disagree on the shape or dtype of {name!r}")
            if t["stop"] > t["start"]:
                e["pieces"].append((t["start"], t["stop"], fname))
    for name, e in tensors.items():
        n = int(np.prod(e["shape"], dtype=np.int64))
        at = 0
        for start, stop, fname in sorted(e["pieces"]):
            if start != at:
                what = "a gap" if start > at else "an overlap"
                raise CheckpointError(f"{d}: the shards' ranges of {name!r} leave {what} at element {min(at, start)}")
            at = stop
        if at != n:
            raise CheckpointError(f"{d}: the shards hold elements [0, {at}) of {name!r}, which has {n}")
        e["pieces"].sort()
    return tensors


_VERIFIED: dict[str, dict] = {}  # folder -> {shard file: tensor index}, for folders verified in this process


def _shard_meta_cache(d: str, md: dict) -> dict[str, dict]:
    key = os.path.abspath(d)
    if key in _VERIFIED:
        return _VERIFIED[key]
    out = {}
    for fname in md.get("shards", []):
        path = os.path.join(d, fname)
        if not os.path.exists(path):
            raise CheckpointError(f"{d}: shard {fname} is missing (its rank did not finish writing it)")
        _, meta = load_checkpoint(path)  # verifies the SHA-256; raises CheckpointError naming the file
        if meta.get("step") != md.get("step"):
            raise CheckpointError(f"{path}: shard of step {meta.get('step')} in the folder of step {md.get('step')}")
        out[fname] = meta["tensors"]
    _VERIFIED[key] = out
    return out


def latest_complete(run_dir: str) -> tuple[int, str] | None:
    """(step, folder) of the newest complete checkpoint, warning about newer incomplete ones; None if none."""
    for step, d in _step_dirs(run_dir):
        why = _problem(d)
        if why is None:
            return step, d
        warnings.warn(f"checkpoint {d} is not usable ({why}); falling back to an earlier one", stacklevel=2)
    return None


def metadata(ckpt_dir: str) -> dict:
    """The metadata.json of a checkpoint folder."""
    with open(os.path.join(ckpt_dir, METADATA), "rb") as f:
        return json.loads(f.read())


def global_shapes(ckpt_dir: str) -> dict[str, tuple[tuple, str]]:
    """name -> (global shape, dtype) of every tensor in a complete checkpoint."""
    return {n: (e["shape"], e["dtype"]) for n, e in _index(ckpt_dir, metadata(ckpt_dir)).items()}


def load(ckpt_dir: str, wanted: dict[str, tuple[int, int]]) -> tuple[dict[str, np.ndarray], dict]:
    """For each tensor name, its flattened elements [start, stop), assembled from whichever shards hold them,
    and the caller's meta saved with the checkpoint.  Reads only the shards it needs."""
    md = metadata(ckpt_dir)
    index = _index(ckpt_dir, md)
    need: dict[str, list[tuple[str, int, int, int]]] = {}  # shard -> [(name, lo, hi, out offset)]
    out: dict[str, np.ndarray] = {}
    dtypes: dict[str, Any] = {}
    for name, (start, stop) in wanted.items():
        e = index.get(name)
        if e is None:
            raise CheckpointError(f"{ckpt_dir}: the checkpoint has no tensor {name!r}")
        n = int(np.prod(e["shape"], dtype=np.int64))
        if not 0 <= start <= stop <= n:
            raise CheckpointError(f"{ckpt_dir}: range [{start}, {stop}) of {name!r} is outside its {n} elements")
        dtypes[name] = e["dtype"]
        for pstart, pstop, fname in e["pieces"]:
            lo, hi = max(start, pstart), min(stop, pstop)
            if lo < hi:
                need.setdefault(fname, []).append((name, lo - pstart, hi - pstart, lo - start))
        out[name] = None  # type: ignore[assignment]
    for name, (start, stop) in wanted.items():
        dt = np.uint16 if dtypes[name] == "bfloat16" else np.dtype(dtypes[name])
        out[name] = np.empty(stop - start, dt)
    for fname, parts in need.items():
        arrays, _ = load_checkpoint(os.path.join(ckpt_dir, fname))
        for name, lo, hi, at in parts:
            out[name][at: at + hi - lo] = arrays[name].reshape(-1)[lo:hi]
    return out, md.get("meta", {})


def _prune(run_dir: str, keep: int) -> None:
    """Remove step folders older than the newest ``keep`` complete ones (never the newest complete)."""
    complete = 0
    for _, d in _step_dirs(run_dir):
        if complete >= max(keep, 1):
            shutil.rmtree(d, ignore_errors=True)
            _VERIFIED.pop(os.path.abspath(d), None)
        elif _problem(d) is None:
            complete += 1


class AsyncCheckpointer:
    """Writes checkpoints on one background thread from a snapshot taken on the caller's thread.

    ``save()`` copies every array (the caller may change its buffers right after) and returns;
    the write happens meanwhile.  A second ``save()`` first waits for the previous write.
    ``wait()`` blocks until the pending write is done and re-raises its error.
    """

    def __init__(self, run_dir: str, rank: int, world: int, keep: int = 2) -> None:
        self.run_dir, self.rank, self.world, self.keep = run_dir, rank, world, keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, shards: dict[str, ShardedArray], meta: dict | None = None, copy: bool = True) -> None:
        """Snapshot ``shards`` and write them in the background.  ``copy=False``: the arrays are
        already the caller's own snapshot (fresh copies nothing else will change)."""
        self.wait()
        snap = {n: ShardedArray(s.global_shape, s.dtype, s.start, s.stop, np.array(s.data, copy=True) if copy else s.data)
                for n, s in shards.items()}
        meta = json.loads(json.dumps(meta or {}, default=str))

        def write() -> None:
            try:
                save(self.run_dir, step, snap, self.rank, self.world, meta, self.keep)
            except BaseException as e:  # noqa: BLE001 - handed to wait(), which re-raises it
                self._error = e

        self._thread = threading.Thread(target=write, name=f"helios-ckpt-{step}", daemon=False)
        self._thread.start()

    def pending(self) -> bool:
        """Whether a write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the pending write is done; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        """Wait for the pending write."""
        self.wait()
