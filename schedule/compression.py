"""Gradient compression for data parallel: comm hooks for DistributedDataParallel.

    from helios.schedule import DistributedDataParallel, compression
    model = DistributedDataParallel(gpt, comm_hook=compression.PowerSGD(rank=4, start_iter=100))
    helios-run --nproc-per-node 2 -m helios.train --grad-compression powersgd:rank=4,start=100

Each hook replaces the bucket's all-reduce by a compressed exchange that leaves (an
approximation of) the average of the ranks' gradients in the bucket:

* ``Cast16("fp16" | "bf16")`` -- cast to 16 bits, all-reduce, cast back (half the bytes).
* ``OneBit(warmup, block)`` -- sign and one scale per block of values with error feedback
  (Seide et al. 2014), exchanged as DeepSpeed's compressed all-reduce does: an all-to-all of
  packed bits (each rank averages one chunk, adding its own "server" error feedback, and
  compresses it again), then an all-gather of the packed averages: ~1/28 of a ring
  all-reduce's bytes with 256-value blocks.
* ``TopK(fraction)`` -- each rank keeps its largest ``fraction`` of entries (by magnitude)
  and carries the rest to the next step (error feedback); the (index, value) pairs are
  all-gathered and summed, or, when pairs from every rank would outweigh the dense
  vector, the sparse vectors are all-reduced densely (the same sum, fewer bytes).
* ``PowerSGD(rank, start_iter)`` (Vogels et al. 2019) -- each matrix M (the gradient plus
  its error feedback) is approximated as P Q^T: P = M Q with the previous step's Q (warm
  start), all-reduce P, orthogonalise it, Q = M^T P, all-reduce Q; 1-D tensors and
  matrices too small to gain are all-reduced uncompressed; ``start_iter`` plain steps first.

A hook runs on the communicator's thread as one program (``helios.comm.enqueue``): it
waits for backward to produce the bucket, compresses on the host (the gradients are
mapped in place where the device memory is host-visible), runs its collectives, and
writes the averaged gradients back, while backward goes on.  Its compression and
decompression appear in a profile as host ops named ``comm_hook.<name>.compress`` /
``.decompress``, apart from the collectives.  Error-feedback residuals, PowerSGD's Q
matrices and the step count are the hook's state (``state_dict``), which
DistributedDataParallel's state dict and helios-train's checkpoints carry, so a resumed
run continues bit-exactly.
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np

import helios.comm as dist
from helios.comm.buffers import as_buffer
from helios.dtypes import bf16_bits_to_float32, float32_to_bf16_bits
from helios.profile.profiler import current_collector

SPECS = "none | fp16 | bf16 | onebit[:warmup=N,block=B] | topk:FRACTION | powersgd:rank=R[,start=S]"


class CompressionHook:
    """A DistributedDataParallel comm hook that compresses each bucket (see the module docstring).

    Subclasses implement ``reduce(grad, key, step, group)``: replace the float32 array
    ``grad`` (this rank's bucket) in place by the average over the group, using and
    updating ``self.state`` entries whose names start with ``key``.
    """

    name = "hook"

    def __init__(self) -> None:
        self.steps = 0  # synchronised backward passes this hook has reduced
        self.state: dict[str, np.ndarray] = {}

    @property
    def spec(self) -> str:
        """The hook as a --grad-compression value (parse_spec(hook.spec) builds an equal hook)."""
        return self.name

    def __call__(self, ddp, bucket) -> dist.Work:
        if bucket.flat.dtype.name != "float32":
            raise TypeError(f"{self.spec} compression takes float32 gradients; bucket {bucket.index} holds "
                            f"{bucket.flat.dtype.name}")
        step = self.steps
        if bucket.index == len(ddp.buckets) - 1:
            self.steps += 1
        buf = as_buffer(bucket.view)  # reached on the communicator's thread, once backward produced it
        key, group = f"b{bucket.index}", ddp.group
        params = [(p, p.grad_slot.storage_offset() - bucket.lo) for p in bucket.params]

        def program() -> None:
            self.reduce(buf.flat, key, step, group, params)
            buf.commit()

        return dist.enqueue(program, group, name=f"comm_hook.{self.name}")

    def reduce(self, grad: np.ndarray, key: str, step: int, group, params: list) -> None:
        raise NotImplementedError

    # ---- helpers for subclasses -------------------------------------------------------
    @contextlib.contextmanager
    def span(self, what: str, nbytes: int = 0):
        """Time a compression phase as a host op in an open profile (``comm_hook.<name>.<what>``)."""
        col = current_collector()
        if col is None:
            yield
            return
        t0 = time.monotonic_ns()
        try:
            yield
        finally:
            col.record_op(f"comm_hook.{self.name}.{what}", (nbytes // 4,), "float32", t0, time.monotonic_ns())

    def buffer(self, name: str, size: int, init=None) -> np.ndarray:
        """The state array ``name`` (zeros, or ``init()``, the first time); its size must stay the same."""
        a = self.state.get(name)
        if a is None:
            a = self.state[name] = (np.zeros(size, np.float32) if init is None else init())
        elif a.size != size:
            raise ValueError(f"{self.spec}: state {name!r} holds {a.size} values but the bucket needs {size}: the "
                             "buckets changed since it was saved (another --bucket-cap-mb, model or optimizer)")
        return a

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The hook's state: ``{"spec", "steps", "tensors": {name: float32 array}}`` (copies)."""
        return {"spec": self.spec, "steps": self.steps, "tensors": {k: v.copy() for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what ``state_dict`` returned (from a hook with the same spec)."""
        if sd.get("spec") != self.spec:
            raise ValueError(f"comm hook state of {sd.get('spec')!r} cannot be loaded into {self.spec!r}")
        self.steps = int(sd["steps"])
        self.state = {k: np.array(v, np.float32).reshape(-1) for k, v in sd["tensors"].items()}


class Cast16(CompressionHook):
    """Divide by the world size, cast to fp16 or bf16, all-reduce in 16 bits, cast back."""

    def __init__(self, dtype: str = "bf16") -> None:
        super().__init__()
        if dtype not in ("fp16", "bf16"):
            raise ValueError(f"Cast16: dtype must be fp16 or bf16, got {dtype!r}")
        self.name = dtype

    def reduce(self, grad, key, step, group, params) -> None:
        n = dist.get_world_size(group)
        with self.span("compress", grad.nbytes):
            # Divided first, as PyTorch's fp16 hook does: the sum of n values stays in range.
            scaled = grad * np.float32(1.0 / n)
            low = scaled.astype(np.float16) if self.name == "fp16" else float32_to_bf16_bits(scaled)
        dist.all_reduce(low, group=group, dtype="float16" if self.name == "fp16" else "bfloat16")
        with self.span("decompress", grad.nbytes):
            grad[:] = low.astype(np.float32) if self.name == "fp16" else bf16_bits_to_float32(low)


def _sign_compress(x: np.ndarray, real: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``x`` (padded with zeros) as one scale per ``block`` values -- the mean magnitude
    of the block's real elements (``real`` counts them), the scale that minimises the squared
    error of sign x scale -- and the rows' packed sign bits (1: >= 0)."""
    rows, size = x.shape
    sums = np.abs(x).reshape(rows, size // block, block).sum(axis=2, dtype=np.float64)
    scales = (sums / np.maximum(real, 1)).astype(np.float32)
    return scales, np.packbits(x >= 0, axis=1)


def _sign_decompress(scales: np.ndarray, bits: np.ndarray, size: int) -> np.ndarray:
    rows, blocks = scales.shape
    signs = np.unpackbits(bits, axis=1, count=size).astype(np.float32) * 2.0 - 1.0
    return (signs.reshape(rows, blocks, size // blocks) * scales[:, :, None]).reshape(rows, size)


class OneBit(CompressionHook):
    """Sign + one scale per ``block`` values with error feedback on the workers and on the
    averaging ("server") side, after ``warmup`` uncompressed steps.

    The scale's granularity matters: one scale for a whole chunk (DeepSpeed's) gives the
    small gradients of one tensor the magnitude of another's; a scale per 256 values costs
    4 bytes per 32 of signs (1/8 more) and keeps each region's magnitude."""

    name = "onebit"

    def __init__(self, warmup: int = 20, block: int = 256) -> None:
        super().__init__()
        if warmup < 0:
            raise ValueError(f"onebit: warmup must be >= 0, got {warmup}")
        if block < 8 or block % 8:
            raise ValueError(f"onebit: block must be a positive multiple of 8, got {block}")
        self.warmup, self.block = warmup, block

    @property
    def spec(self) -> str:
        return f"onebit:warmup={self.warmup},block={self.block}"

    def reduce(self, grad, key, step, group, params) -> None:
        if step < self.warmup:
            dist.all_reduce(grad, op="avg", group=group)
            return
        n, me, total, b = dist.get_world_size(group), dist.get_rank(group), grad.size, self.block
        size = -(-total // (b * n)) * b  # each rank averages one chunk of whole blocks
        nblk = size // b
        # Real (not padding) elements of every block of every chunk: rows are chunks.
        real = np.clip(total - np.arange(n * nblk).reshape(n, nblk) * b, 0, b)
        with self.span("compress", grad.nbytes):
            err = self.buffer(f"{key}.worker_error", total)
            c = np.zeros(n * size, np.float32)
            c[:total] = grad + err
            chunks = c.reshape(n, size)
            scales, bits = _sign_compress(chunks, real, b)
            err[:] = (chunks - _sign_decompress(scales, bits, size)).reshape(-1)[:total]
            send = _pack(scales, bits)  # row j: chunk j's scales then its bits, for rank j
        got = np.empty_like(send)
        dist.all_to_all(got, send, group=group)
        with self.span("compress", grad.nbytes // n):
            mine = _sign_decompress(*_unpack(got, nblk), size).mean(axis=0)
            serr = self.buffer(f"{key}.server_error", size)
            mine += serr
            mine[int(real[me].sum()):] = 0.0  # padding stays zero
            s_scales, s_bits = _sign_compress(mine[None, :], real[me:me + 1], b)
            serr[:] = mine - _sign_decompress(s_scales, s_bits, size)[0]
            serr[int(real[me].sum()):] = 0.0
            out = _pack(s_scales, s_bits)[0]
        every = np.empty((n, out.size), np.uint8)
        dist.all_gather(every, out, group=group)
        with self.span("decompress", grad.nbytes):
            grad[:] = _sign_decompress(*_unpack(every, nblk), size).reshape(-1)[:total]


def _pack(scales: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """One uint8 row per chunk: its float32 scales, then its packed sign bits."""
    rows = scales.shape[0]
    return np.concatenate([scales.view(np.uint8).reshape(rows, -1), bits], axis=1)


def _unpack(rows: np.ndarray, nblk: int) -> tuple[np.ndarray, np.ndarray]:
    head = 4 * nblk
    return rows[:, :head].copy().view(np.float32), rows[:, head:]


class TopK(CompressionHook):
    """Keep each rank's largest ``fraction`` of entries, carry the rest over (error feedback),
    sum the kept ones across ranks."""

    name = "topk"

    def __init__(self, fraction: float = 0.01) -> None:
        super().__init__()
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"topk: the fraction of entries kept must be in (0, 1), got {fraction}")
        self.fraction = fraction

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction:g}"

    def reduce(self, grad, key, step, group, params) -> None:
        n, total = dist.get_world_size(group), grad.size
        k = min(total, max(1, math.ceil(self.fraction * total)))
        with self.span("compress", grad.nbytes):
            err = self.buffer(f"{key}.error", total)
            c = grad + err
            idx = np.argpartition(np.abs(c), total - k)[total - k:].astype(np.int32)
            idx.sort()  # the same order whatever argpartition did: summation order is part of the result
            vals = c[idx]
            err[:] = c
            err[idx] = 0.0
        if k * n < total:  # n (index, value) lists of k pairs are smaller than the dense vector
            pairs = np.empty(2 * k, np.int32)
            pairs[:k] = idx
            pairs[k:] = vals.view(np.int32)
            every = np.empty(2 * k * n, np.int32)
            dist.all_gather(every, pairs, group=group)
            with self.span("decompress", grad.nbytes):
                every = every.reshape(n, 2 * k)
                grad[:] = 0.0
                for r in range(n):  # rank order: every rank adds in the same order, so all agree bit for bit
                    grad[every[r, :k]] += every[r, k:].view(np.float32)
                grad *= np.float32(1.0 / n)
        else:
            grad[:] = 0.0
            grad[idx] = vals
            dist.all_reduce(grad, op="avg", group=group)


def _orthonormal_columns(p: np.ndarray) -> None:
    """Gram-Schmidt on the columns of ``p`` in place, deterministic (identical inputs on every
    rank give identical bases).  Each column is projected out twice ("twice is enough"): a
    column that is numerically inside the span of the earlier ones (a gradient of lower rank
    than the approximation's) would otherwise keep O(1) components along them after one
    pass, and P P^T would stop being a projection."""
    for i in range(p.shape[1]):
        col = p[:, i]
        if i:
            done = p[:, :i]
            for _ in range(2):
                col -= done @ (done.T @ col)
        norm = float(np.sqrt(np.dot(col, col)))
        col *= np.float32(1.0 / norm) if norm > 0.0 else np.float32(0.0)


class PowerSGD(CompressionHook):
    """Rank-``rank`` approximation of every gradient matrix with warm start and error feedback,
    after ``start_iter`` uncompressed steps (see the module docstring)."""

    name = "powersgd"

    def __init__(self, rank: int = 4, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"powersgd: rank must be >= 1, got {rank}")
        if start_iter < 0:
            raise ValueError(f"powersgd: start must be >= 0, got {start_iter}")
        self.rank, self.start_iter, self.min_rate, self.seed = rank, start_iter, min_compression_rate, seed

    @property
    def spec(self) -> str:
        return f"powersgd:rank={self.rank},start={self.start_iter}"

    def compressed(self, shape: tuple) -> tuple[int, int] | None:
        """(rows, cols) of a parameter's gradient as a matrix when compressing it pays, else None
        (PyTorch's rule: (rows + cols) x rank x min_rate < rows x cols)."""
        if len(shape) < 2:
            return None
        rows = shape[0]
        cols = int(np.prod(shape[1:]))
        return (rows, cols) if (rows + cols) * self.rank * self.min_rate < rows * cols else None

    def reduce(self, grad, key, step, group, params) -> None:
        if step < self.start_iter:
            dist.all_reduce(grad, op="avg", group=group)
            return
        n, r = dist.get_world_size(group), self.rank
        mats, plain = [], []
        for p, off in params:
            rc = self.compressed(tuple(p.shape))
            (mats if rc else plain).append((off, p.numel(), rc))
        mats.sort()
        plain.sort()
        n_plain = sum(size for _, size, _ in plain)
        with self.span("compress", grad.nbytes):
            err = self.buffer(f"{key}.error", grad.size)
            qs = self.buffer(f"{key}.q", sum(rc[1] * r for _, _, rc in mats), self._initial_q(key, mats))
            first = np.empty(n_plain + sum(rc[0] * r for _, _, rc in mats), np.float32)
            at = 0
            for off, size, _ in plain:
                first[at: at + size] = grad[off: off + size]
                at += size
            ms, ps, qv = [], [], []
            qat = 0
            for off, size, (rows, cols) in mats:
                m = (grad[off: off + size] + err[off: off + size]).reshape(rows, cols)
                q = qs[qat: qat + cols * r].reshape(cols, r)
                qat += cols * r
                p = first[at: at + rows * r].reshape(rows, r)
                np.matmul(m, q, out=p)
                at += rows * r
                ms.append(m)
                ps.append(p)
                qv.append(q)
        dist.all_reduce(first, group=group)  # the plain tensors and every P, summed
        with self.span("compress", grad.nbytes):
            at = 0
            for off, size, _ in plain:
                grad[off: off + size] = first[at: at + size] * np.float32(1.0 / n)
                at += size
            for m, p, q in zip(ms, ps, qv):
                _orthonormal_columns(p)
                np.matmul(m.T, p, out=q)
        dist.all_reduce(qs, group=group)
        with self.span("decompress", grad.nbytes):
            qs *= np.float32(1.0 / n)
            for (off, size, _), m, p, q in zip(mats, ms, ps, qv):
                approx = p @ q.T
                err[off: off + size] = (m - approx).reshape(-1)
                grad[off: off + size] = approx.reshape(-1)

    def _initial_q(self, key: str, mats: list):
        """The first Q of a bucket: the same standard normals on every rank (a seed per bucket)."""
        def init() -> np.ndarray:
            rng = np.random.default_rng([self.seed, int(key[1:])])
            return rng.standard_normal(sum(rc[1] * self.rank for _, _, rc in mats)).astype(np.float32)

        return init


def parse_spec(spec: str | None) -> CompressionHook | None:
    """The hook a ``--grad-compression`` value names (None for ``none``); ValueError names what is wrong."""
    if spec is None or spec.strip() in ("", "none"):
        return None
    kind, _, rest = spec.strip().partition(":")
    try:
        if kind in ("fp16", "bf16"):
            if rest:
                raise ValueError(f"{kind} takes no options")
            return Cast16(kind)
        if kind == "topk":
            if not rest:
                raise ValueError("give the fraction of entries each rank sends, e.g. topk:0.01")
            return TopK(float(rest))
        opts = _options(rest)
        if kind == "onebit":
            return OneBit(**_take(opts, {"warmup": int, "block": int}, kind))
        if kind == "powersgd":
            o = _take(opts, {"rank": int, "start": int}, kind)
            if "start" in o:
                o["start_iter"] = o.pop("start")
            return PowerSGD(**o)
    except ValueError as e:
        raise ValueError(f"--grad-compression {spec}: {e}") from None
    raise ValueError(f"--grad-compression {spec}: unknown method {kind!r}; expected {SPECS}")


def _options(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        k, eq, v = part.partition("=")
        if not eq:
            raise ValueError(f"option {part!r} is not name=value")
        out[k.strip()] = v.strip()
    return out


def _take(opts: dict[str, str], allowed: dict, kind: str) -> dict:
    bad = [k for k in opts if k not in allowed]
    if bad:
        raise ValueError(f"{kind} has no option {bad[0]!r} (options: {', '.join(allowed)})")
    try:
        return {k: allowed[k](v) for k, v in opts.items()}
    except ValueError:
        raise ValueError(f"{kind} options must be numbers: {opts}") from None
