"""Sharded checkpoints: every rank writes its own shard, in the background, and a checkpoint
saved at one world size (or ZeRO stage) loads at another.

Layout of ``RUN_DIR/ckpt/step-00000100/``::

    shard-00000-of-00002.helios   rank 0's tensors (helios.fileio container: temp file +
    shard-00001-of-00002.helios   fsync + rename, SHA-256 over the payload), one per rank
    metadata.json                 written by rank 0 after its shard: format, step, world
                                  size, the shard file names, and the caller's meta (config,
                                  data-loader position, RNG state, ZeRO stage, ...)

A tensor is described by its global shape and logical dtype (a numpy dtype name, or
``"bfloat16"`` / ``"float8_e4m3"`` / ``"float8_e5m2"`` stored as unsigned bit patterns, as
``helios.fileio`` stores them); each rank holds one contiguous range ``[start, stop)`` of its
flattened (C-order) elements, possibly empty, and the ranges of all ranks partition
``[0, numel)``.  How a tensor is split is the caller's choice: a replicated tensor may be
written by rank 0 alone (``[0, numel)`` there, empty ranges elsewhere) or split evenly with
:func:`even_range` so that every rank writes its share in parallel.

Nothing here communicates.  The writer runs on a background thread, and a background thread
must never issue collectives: they would interleave with the training thread's and break
their order across ranks.  So no rank waits for another, and completeness is judged when
reading: a checkpoint is *complete* when ``metadata.json`` parses, every shard it lists
exists and verifies (SHA-256), and every tensor's ranges partition it.
:func:`latest_complete` returns the newest complete checkpoint and warns, in one line, about
every newer one that is not (a crash mid-write, a corrupt or missing file).

:func:`load` asks, per tensor, for any flat range ``[start, stop)``: resharding reads the
pieces from whichever shards hold them, and only those shard files.  After a save, rank 0
removes step folders older than the newest ``keep`` complete ones; the newest complete one
is never removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from helios.errors import CheckpointError, DTypeError
from helios.fileio import (LOGICAL_DTYPES, atomic_write_bytes, fsync_dir, load_checkpoint, read_checkpoint_meta,
                           save_checkpoint)

__all__ = [
    "FORMAT",
    "METADATA",
    "ShardedArray",
    "AsyncCheckpointer",
    "save",
    "load",
    "latest_complete",
    "global_shapes",
    "check_shapes",
    "metadata",
    "even_range",
    "step_dir",
    "shard_name",
    "discard_newer",
]

FORMAT = 1
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SHARD = re.compile(r"^shard-(\d{5,})-of-(\d{5,})\.helios$")


def _storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a logical dtype name is stored as."""
    if dtype in LOGICAL_DTYPES:
        return LOGICAL_DTYPES[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise DTypeError(f"unknown dtype {dtype!r}: give a numpy dtype name or one of {sorted(LOGICAL_DTYPES)}") from e
    if dt.kind not in "biufc":
        raise DTypeError(f"dtype {dtype!r} cannot be checkpointed: only booleans, integers, floats and complex")
    return dt


def _numel(shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64))


@dataclass
class ShardedArray:
    """This rank's elements ``[start, stop)`` of a tensor's flattened global elements.

    ``dtype`` is the tensor's logical dtype: a numpy dtype name, or ``"bfloat16"`` (and the
    float8 names) with ``data`` holding the bit patterns as unsigned integers.  ``data`` holds
    ``stop - start`` elements (it is flattened, as a view where it can be).
    """

    global_shape: tuple
    dtype: str
    start: int
    stop: int
    data: np.ndarray

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.start, self.stop = int(self.start), int(self.stop)
        if any(s < 0 for s in self.global_shape):
            raise CheckpointError(f"ShardedArray: negative dimension in shape {self.global_shape}")
        if not isinstance(self.data, np.ndarray):
            raise DTypeError(f"ShardedArray: data must be a numpy.ndarray, got {type(self.data).__name__}")
        n = _numel(self.global_shape)
        if not 0 <= self.start <= self.stop <= n or self.data.size != self.stop - self.start:
            raise CheckpointError(f"ShardedArray: range [{self.start}, {self.stop}) with {self.data.size} elements "
                                  f"does not fit a tensor of shape {self.global_shape} ({n} elements)")
        store = _storage_dtype(self.dtype)
        if (self.data.dtype.kind, self.data.dtype.itemsize) != (store.kind, store.itemsize):
            raise DTypeError(f"ShardedArray: data of dtype {self.data.dtype} for a tensor of dtype {self.dtype!r} "
                             f"(stored as {store}); convert the data or declare its dtype")
        self.data = self.data.reshape(-1)


def even_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s share ``[start, stop)`` of ``numel`` elements split evenly over ``world`` ranks."""
    return numel * rank // world, numel * (rank + 1) // world


def step_dir(run_dir: str, step: int) -> str:
    """The folder of the checkpoint taken after ``step``."""
    return os.path.join(run_dir, "ckpt", f"step-{step:08d}")


def shard_name(rank: int, world: int) -> str:
    """File name of rank ``rank``'s shard in a checkpoint written by ``world`` ranks."""
    return f"shard-{rank:05d}-of-{world:05d}.helios"


def _json_default(obj: Any) -> Any:
    # numpy scalars and small arrays are common in metadata (RNG states, counters).
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def _meta_json(meta: Mapping[str, Any] | None) -> str:
    try:
        return json.dumps(dict(meta or {}), default=_json_default, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta is not JSON-serialisable ({e}); keep arrays in the shards and plain "
                        "numbers, strings, lists and dicts in meta") from e


def save(run_dir: str, step: int, shards: Mapping[str, ShardedArray], rank: int, world: int,
         meta: Mapping[str, Any] | None = None, *, keep: int | None = 2) -> str:
    """Write rank ``rank``'s shard of the checkpoint of ``step``; returns the step folder.

    Rank 0 then writes ``metadata.json`` (format, step, world size, the shard file names and
    ``meta``, which must be JSON) and removes step folders older than the newest ``keep``
    complete checkpoints (``keep=None``: none).  Every file is written atomically.  No rank
    waits for another: see :func:`latest_complete` for when the checkpoint counts.
    """
    step, rank, world = int(step), int(rank), int(world)
    if step < 0 or not 0 <= rank < world:
        raise ValueError(f"save: need step >= 0 and 0 <= rank < world, got step={step}, rank={rank}, world={world}")
    if keep is not None and keep < 1:
        raise ValueError(f"save: keep must be >= 1 (the newest complete checkpoint is always kept) or None, got {keep}")
    for name, s in shards.items():
        if not isinstance(name, str) or not isinstance(s, ShardedArray):
            raise TypeError(f"save: shards must map str to ShardedArray, got {name!r}: {type(s).__name__}")
    meta_json = _meta_json(meta)
    d = step_dir(run_dir, step)
    if not os.path.isdir(d):
        os.makedirs(d, exist_ok=True)
        fsync_dir(os.path.dirname(d))  # the step folder's entry in ckpt/
        fsync_dir(run_dir)  # ckpt/'s entry in the run folder
    index = {name: {"shape": list(s.global_shape), "dtype": s.dtype, "start": s.start, "stop": s.stop}
             for name, s in shards.items()}
    arrays = {name: s.data for name, s in shards.items()}
    dtypes = {name: s.dtype for name, s in shards.items() if s.dtype in LOGICAL_DTYPES}
    save_checkpoint(os.path.join(d, shard_name(rank, world)), arrays,
                    {"format": FORMAT, "step": step, "rank": rank, "world": world, "tensors": index}, dtypes=dtypes)
    if rank == 0:
        md = {"format": FORMAT, "step": step, "world": world,
              "shards": [shard_name(r, world) for r in range(world)], "meta": json.loads(meta_json)}
        atomic_write_bytes(os.path.join(d, METADATA), (json.dumps(md, indent=1) + "\n").encode("utf-8"))
        if keep is not None:
            _prune(run_dir, keep)
    return d


# ---------------------------------------------------------------------------------------------
# Reading and verifying


def _step_dirs(run_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every step folder, newest first."""
    root = os.path.join(run_dir, "ckpt")
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out, reverse=True)


def metadata(ckpt_dir: str) -> dict:
    """The parsed and checked ``metadata.json`` of a step folder (CheckpointError naming what is wrong)."""
    path = os.path.join(ckpt_dir, METADATA)
    try:
        with open(path, "rb") as f:
            md = json.loads(f.read())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing (rank 0 did not finish writing this checkpoint)") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(md, dict):
        raise CheckpointError(f"{path}: holds a {type(md).__name__}, not an object")
    if md.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {md.get('format')!r}, this Helios reads format {FORMAT}")
    world, step = md.get("world"), md.get("step")
    if not isinstance(world, int) or world < 1 or not isinstance(step, int):
        raise CheckpointError(f"{path}: bad world size {world!r} or step {step!r}")
    expected = [shard_name(r, world) for r in range(world)]
    if md.get("shards") != expected:
        raise CheckpointError(f"{path}: lists shards {md.get('shards')!r}, expected the {world} files {expected[0]}...")
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(ckpt_dir)))
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"{path}: says step {step} in the folder of step {int(m.group(1))}")
    if not isinstance(md.get("meta", {}), dict):
        raise CheckpointError(f"{path}: 'meta' is not an object")
    return md


# Shard indexes already read in this process, keyed by the file's identity, so that repeated
# look-ups (retention after every save, latest_complete then load) read each file once.
_CACHE_LOCK = threading.Lock()
_VERIFIED: dict[tuple, dict] = {}  # files whose SHA-256 was checked -> their tensor index
_PEEKED: dict[tuple, dict] = {}  # files whose index was read without the arrays -> their tensor index


def _file_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)


def _remember(cache: dict, key: tuple, value: dict) -> None:
    with _CACHE_LOCK:
        if len(cache) > 4096:
            cache.clear()
        cache[key] = value


def _peek_index(path: str) -> dict:
    """A shard's meta, read from its JSON index alone (the arrays are not read, so not hashed)."""
    try:
        return read_checkpoint_meta(path)
    except CheckpointError as e:
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (its rank did not finish writing it)") from e
        raise


def _check_shard_meta(path: str, smeta: Any, md: dict, fname: str) -> dict[str, dict]:
    """The tensor index of a shard, after checking it belongs here and is well formed."""
    rank, world = (int(g) for g in _SHARD.match(fname).groups())  # type: ignore[union-attr]
    try:
        if smeta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: shard format {smeta.get('format')!r}, this Helios reads {FORMAT}")
        if (smeta.get("step"), smeta.get("rank"), smeta.get("world")) != (md["step"], rank, world):
            raise CheckpointError(f"{path}: the shard of rank {smeta.get('rank')} of {smeta.get('world')} at step "
                                  f"{smeta.get('step')}, expected rank {rank} of {world} at step {md['step']}")
        tensors = {}
        for name, t in smeta["tensors"].items():
            shape = tuple(int(s) for s in t["shape"])
            start, stop, dtype = int(t["start"]), int(t["stop"]), str(t["dtype"])
            _storage_dtype(dtype)
            if any(s < 0 for s in shape) or not 0 <= start <= stop <= _numel(shape):
                raise CheckpointError(f"{path}: tensor {name!r} has range [{start}, {stop}) outside its shape {shape}")
            tensors[name] = {"shape": shape, "dtype": dtype, "start": start, "stop": stop}
        return tensors
    except CheckpointError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: the shard's index is malformed ({type(e).__name__}: {e})") from e


def _shard_tensors(d: str, md: dict, fname: str, verify: bool, cached: bool = True) -> dict[str, dict]:
    """A shard's tensor index; with ``verify`` the whole file is read and its SHA-256 checked,
    unless (``cached``) this process already checked the same, unchanged file."""
    path = os.path.join(d, fname)
    try:
        key = _file_key(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing (its rank did not finish writing this checkpoint)") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from e
    with _CACHE_LOCK:
        hit = None if not cached else _VERIFIED.get(key) or (None if verify else _PEEKED.get(key))
    if hit is not None:
        return hit
    if verify:
        arrays, smeta, logical = load_checkpoint(path, return_dtypes=True)  # checks the SHA-256
        tensors = _check_shard_meta(path, smeta, md, fname)
        for name, t in tensors.items():
            a = arrays.get(name)
            if a is None or a.size != t["stop"] - t["start"] or logical.get(name) != t["dtype"]:
                raise CheckpointError(f"{path}: tensor {name!r}'s stored array does not match its index")
        del arrays
        cache = _VERIFIED
    else:
        tensors = _check_shard_meta(path, _peek_index(path), md, fname)
        cache = _PEEKED
    if _file_key(path) == key:  # not replaced while it was read
        _remember(cache, key, tensors)
    return tensors


def _index(d: str, md: dict, verify: bool, cached: bool = True) -> dict[str, dict]:
    """name -> {"shape", "dtype", "pieces": [(start, stop, shard file)]}, each tensor's pieces
    checked to partition it."""
    tensors: dict[str, dict] = {}
    owner: dict[str, str] = {}
    for fname in md["shards"]:
        for name, t in _shard_tensors(d, md, fname, verify, cached).items():
            e = tensors.get(name)
            if e is None:
                e = tensors[name] = {"shape": t["shape"], "dtype": t["dtype"], "pieces": []}
                owner[name] = fname
            elif (e["shape"], e["dtype"]) != (t["shape"], t["dtype"]):
                raise CheckpointError(f"{d}: tensor {name!r} is {t['dtype']} {t['shape']} in {fname} but "
                                      f"{e['dtype']} {e['shape']} in {owner[name]}")
            if t["stop"] > t["start"]:
                e["pieces"].append((t["start"], t["stop"], fname))
    for name, e in tensors.items():
        e["pieces"].sort()
        at, prev = 0, None
        for start, stop, fname in e["pieces"]:
            if start > at:
                raise CheckpointError(f"{d}: tensor {name!r} has a gap: no shard holds its elements [{at}, {start})")
            if start < at:
                raise CheckpointError(f"{d}: tensor {name!r} has an overlap: elements [{start}, {min(at, stop)}) are "
                                      f"in both {prev} and {fname}")
            at, prev = stop, fname
        n = _numel(e["shape"])
        if at != n:
            raise CheckpointError(f"{d}: tensor {name!r} has a gap: no shard holds its elements [{at}, {n})")
    return tensors


def _problem(d: str, cached: bool = True) -> str | None:
    """Why the checkpoint in ``d`` is not complete (one line), or None when it is.  Reads and
    verifies every shard; ``cached``: skip files this process verified and that look unchanged
    (same inode, size and mtime), which is what retention after every save relies on."""
    try:
        _index(d, metadata(d), verify=True, cached=cached)
    except CheckpointError as e:
        return " ".join(str(e).split())
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint must never stop the search
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return None


def latest_complete(run_dir: str) -> tuple[int, str] | None:
    """(step, folder) of the newest complete checkpoint under ``run_dir/ckpt``, or None.

    Each newer step folder that is not complete (missing or unreadable metadata.json, a
    missing shard, a hash mismatch, ranges that do not partition a tensor) is skipped with a
    one-line ``UserWarning`` naming the folder and what is wrong.  Never raises for them.
    """
    for step, d in _step_dirs(run_dir):
        why = _problem(d, cached=False)  # the authoritative check: every byte is read again
        if why is None:
            return step, d
        warnings.warn(f"checkpoint {d} skipped, it is incomplete or corrupt: {why}", UserWarning, stacklevel=2)
    return None


def global_shapes(ckpt_dir: str) -> dict[str, tuple[tuple, str]]:
    """name -> (global shape, logical dtype) of every tensor of a checkpoint (reads only the
    shards' indexes; raises CheckpointError where the ranges do not partition a tensor)."""
    return {n: (e["shape"], e["dtype"]) for n, e in _index(ckpt_dir, metadata(ckpt_dir), verify=False).items()}


def _differ(ckpt_dir: str, have: Mapping[str, tuple[tuple, str]], expected: Mapping[str, tuple[Any, str | None]],
            exact: bool) -> None:
    names = list(expected) + ([n for n in have if n not in expected] if exact else [])
    bad = []
    for n in names:
        if n not in have:
            bad.append((n, f"absent there and {_describe(expected[n])} here"))
        elif n not in expected:
            bad.append((n, f"{_describe(have[n])} there and absent here"))
        else:
            shape, dtype = expected[n]
            hs, hd = have[n]
            if tuple(int(s) for s in shape) != hs or (dtype is not None and dtype != hd):
                bad.append((n, f"{_describe(have[n])} there and {_describe(expected[n])} here"))
    if bad:
        n, what = bad[0]
        more = f" ({len(bad) - 1} more tensors differ)" if len(bad) > 1 else ""
        raise CheckpointError(f"{ckpt_dir} is a checkpoint of another model: tensor {n!r} is {what}{more}; resume "
                              "from a checkpoint of this model or start afresh")


def _describe(sd: tuple) -> str:
    shape, dtype = sd
    shape = tuple(int(s) for s in shape)
    return f"{dtype} {shape}" if dtype is not None else f"shape {shape}"


def check_shapes(ckpt_dir: str, expected: Mapping[str, tuple[Any, str | None]], *, exact: bool = True) -> None:
    """Raise CheckpointError naming the first tensor whose shape or dtype differs.

    ``expected`` maps name -> (global shape, logical dtype or None for any dtype), in the
    order names should be checked.  ``exact``: the checkpoint must hold no other tensors.
    """
    _differ(ckpt_dir, global_shapes(ckpt_dir), expected, exact)


def load(ckpt_dir: str, wanted: Mapping[str, tuple[int, int]], *,
         expect: Mapping[str, tuple[Any, str | None]] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Elements ``[start, stop)`` of each wanted tensor's flattened global elements, and the
    caller's meta saved with the checkpoint.

    The ranges may cut the tensors differently from the ranks that saved them (resharding);
    each is assembled from whichever shards hold it, and only those shard files are read
    (each SHA-256-checked).  Arrays come back 1-D in the storage dtype (bfloat16 as uint16
    bits).  ``expect`` (name -> (global shape, dtype or None)) is checked first.  Every
    failure is a CheckpointError naming the folder or file and what is wrong.
    """
    md = metadata(ckpt_dir)
    index = _index(ckpt_dir, md, verify=False)
    if expect:
        _differ(ckpt_dir, {n: (e["shape"], e["dtype"]) for n, e in index.items()}, expect, exact=False)
    need: dict[str, list[tuple[str, int, int, int, int]]] = {}  # shard -> [(name, piece start, lo, hi, at)]
    out: dict[str, np.ndarray] = {}
    for name, rng in wanted.items():
        e = index.get(name)
        if e is None:
            close = sorted(index)[:5]
            raise CheckpointError(f"{ckpt_dir}: the checkpoint has no tensor {name!r} (it holds {len(index)} "
                                  f"tensors: {', '.join(close)}{'...' if len(index) > 5 else ''})")
        start, stop = (int(x) for x in rng)
        n = _numel(e["shape"])
        if not 0 <= start <= stop <= n:
            raise CheckpointError(f"{ckpt_dir}: asked for elements [{start}, {stop}) of {name!r}, which has {n} "
                                  f"(shape {e['shape']})")
        for pstart, pstop, fname in e["pieces"]:
            lo, hi = max(start, pstart), min(stop, pstop)
            if lo < hi:
                need.setdefault(fname, []).append((name, pstart, lo - pstart, hi - pstart, lo - start))
        out[name] = np.empty(stop - start, _storage_dtype(e["dtype"]))
    for fname, parts in need.items():
        path = os.path.join(ckpt_dir, fname)
        arrays, smeta = load_checkpoint(path)  # checks the SHA-256
        tensors = _check_shard_meta(path, smeta, md, fname)
        for name, pstart, lo, hi, at in parts:
            t, e, a = tensors.get(name), index[name], arrays.get(name)
            if t is None or a is None or (t["shape"], t["dtype"]) != (e["shape"], e["dtype"]) or \
                    t["start"] != pstart or a.size != t["stop"] - t["start"]:
                raise CheckpointError(f"{path}: changed while the checkpoint was being read, or its index does not "
                                      f"match its arrays (tensor {name!r})")
            out[name][at: at + hi - lo] = a.reshape(-1)[lo:hi]
        del arrays
    return out, md.get("meta", {})


# ---------------------------------------------------------------------------------------------
# Retention


def _forget(d: str) -> None:
    prefix = os.path.abspath(d) + os.sep
    with _CACHE_LOCK:
        for cache in (_VERIFIED, _PEEKED):
            for k in [k for k in cache if k[0].startswith(prefix)]:
                del cache[k]


def _prune(run_dir: str, keep: int) -> None:
    """Remove step folders older than the newest ``keep`` complete checkpoints, and incomplete
    folders older than the newest complete one (every rank has finished those, so nothing
    will complete them).  Folders newer than the newest complete one may be in progress on
    other ranks and are kept; the newest complete checkpoint is never removed."""
    complete = 0
    for _, d in _step_dirs(run_dir):
        if complete >= keep:
            shutil.rmtree(d, ignore_errors=True)
            _forget(d)
        elif _problem(d) is None:
            complete += 1
        elif complete:
            shutil.rmtree(d, ignore_errors=True)
            _forget(d)


def discard_newer(run_dir: str, step: int) -> list[str]:
    """Remove the step folders newer than ``step``; returns them.

    For rank 0 of a run resuming from ``step``, before training goes on: the folders of
    later steps are a dead attempt's, and one of its shards left there could otherwise
    complete, with the new attempt's files, a checkpoint that mixes the two.
    """
    gone = []
    for s, d in _step_dirs(run_dir):
        if s > step:
            shutil.rmtree(d, ignore_errors=True)
            _forget(d)
            gone.append(d)
    if gone:
        fsync_dir(os.path.join(run_dir, "ckpt"))
    return gone


# ---------------------------------------------------------------------------------------------
# Asynchronous writer


class AsyncCheckpointer:
    """Writes this rank's checkpoints on one background thread from a snapshot taken on the
    caller's thread.

    ``save()`` copies every array (the caller may change its buffers as soon as it returns)
    and the meta, then returns; the write runs meanwhile.  A second ``save()`` first waits
    for the previous write.  ``wait()`` blocks until the pending write is done and re-raises
    its error (so does the next ``save()``); ``close()`` (or leaving a ``with`` block) waits.
    The thread only writes files: it never communicates.
    """

    def __init__(self, run_dir: str, rank: int, world: int, keep: int | None = 2) -> None:
        self.run_dir, self.rank, self.world, self.keep = run_dir, rank, world, keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_snapshot_s = 0.0  # time save() spent on the caller's thread
        self.last_write_s = 0.0  # time the last finished write took on the background thread

    def save(self, step: int, shards: Mapping[str, ShardedArray], meta: Mapping[str, Any] | None = None, *,
             copy: bool = True) -> None:
        """Snapshot ``shards`` and ``meta`` and write them in the background.

        ``copy=False``: the arrays already are the caller's own snapshot (fresh arrays that
        nothing else will change), so they are not copied again.
        """
        self.wait()
        t0 = time.perf_counter()
        snap = {}
        for n, s in shards.items():
            if not isinstance(s, ShardedArray):
                raise TypeError(f"AsyncCheckpointer.save: {n!r} is a {type(s).__name__}, expected a ShardedArray")
            data = np.array(s.data, copy=True, order="C") if copy else s.data
            snap[n] = ShardedArray(s.global_shape, s.dtype, s.start, s.stop, data)
        meta_snap = json.loads(_meta_json(meta))  # a deep copy; a meta that is not JSON fails here, not later

        def write() -> None:
            w0 = time.perf_counter()
            try:
                save(self.run_dir, step, snap, self.rank, self.world, meta_snap, keep=self.keep)
            except BaseException as e:  # noqa: BLE001 - handed to wait(), which re-raises it
                self._error = e
            finally:
                self.last_write_s = time.perf_counter() - w0

        # Not a daemon: an interpreter that exits normally first finishes the write.
        self._thread = threading.Thread(target=write, name=f"helios-ckpt-{step}", daemon=False)
        self._thread.start()
        self.last_snapshot_s = time.perf_counter() - t0

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
        """Wait for the pending write (and re-raise its error)."""
        self.wait()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
