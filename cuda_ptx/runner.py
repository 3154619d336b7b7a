"""Run generated GEMMs on a GPU: ``gemm(a, b)`` on numpy arrays, and a reusable launch for benchmarks.

Shapes are padded with zeros to the variant's tile multiples (zero rows/columns do
not change the product) and cut back afterwards.  ``gemm()`` takes B as numpy's
``K x N`` and picks the kernel's B layout to match: N-major (``b_major="n"``), so B
goes to the device untouched -- the wgmma rungs read it through the descriptor's
transpose bit -- except for fp8, which wgmma reads K-major only, so there B is
transposed on the host.  :class:`GemmLaunch` runs a config exactly as given.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from helios.errors import DeviceError, DTypeError

from . import dtypes, operands
from .config import GemmConfig, out_dtype_name, variants, with_dtypes
from .driver import Context, context
from .emit import build_kernel, resolve
from .render import render

def native_b_major(cfg: GemmConfig) -> str:
    """The B layout ``gemm()`` runs ``cfg`` with for a numpy ``K x N`` B.

    ``"n"`` (no host transpose) wherever the kernel can read it, i.e. every kind with
    16-bit inputs; ``"k"`` for fp8 e4m3, which wgmma takes K-major only.
    """
    return "k" if cfg.in_dtype == "e4m3" else "n"


def default_variant(ctx: Context, in_dtype: str) -> str:
    """The best landed variant for this device and input dtype."""
    if ctx.cc >= (9, 0) and ctx.cc < (10, 0):
        return "wgmma_fp8" if in_dtype == "e4m3" else "wgmma_ws"
    if in_dtype == "e4m3":
        raise DTypeError(f"fp8 e4m3 GEMM needs a Hopper GPU (sm_90); this one is sm_{ctx.cc[0]}{ctx.cc[1]}")
    return "mma_sync"


def check_device(cfg: GemmConfig, ctx: Context) -> None:
    """Refuse, naming both, a config the device cannot run: the wgmma rungs are built for
    ``sm_90a``, which only Hopper (compute capability 9.0) loads; the others need sm_80+."""
    if cfg.target == "sm_90a" and ctx.cc != (9, 0):
        raise DeviceError(f"{cfg.name} is built for sm_90a (Hopper: wgmma, TMA, clusters); this GPU "
                          f"({ctx.name}) is sm_{ctx.cc[0]}{ctx.cc[1]}: use mma_sync or simt")
    if ctx.cc < (8, 0):
        raise DeviceError(f"{cfg.name} needs sm_80 or newer; this GPU ({ctx.name}) is sm_{ctx.cc[0]}{ctx.cc[1]}")


class GemmLaunch:
    """A compiled, loaded kernel with device buffers for one (M, N, K): run it, time it, read C.

    The config runs as given: :meth:`upload` takes B as ``K x N`` and stores it that way
    for ``b_major="n"``, transposed to ``N x K`` for ``b_major="k"``.  ``ptx`` replaces
    the generated text (an edited kernel: same entry name and parameters) for experiments.

    A batched config (``cfg.batched`` = d) computes ``batch`` products (d extents, outermost
    first; all 1 by default) in its one launch: :meth:`upload` then takes A ``[*, M, K]`` and
    B ``[*, K, N]`` whose leading dims broadcast to ``batch`` as numpy's do (an operand of
    extent 1 in a batch dim, or without it, is stored once and read by every product: its
    ``batch_mask`` bit is clear), and :meth:`result` is ``[*batch, M, N]``.
    """

    def __init__(self, cfg: GemmConfig, m: int, n: int, k: int, ctx: Context | None = None,
                 ptx: str | None = None, batch: tuple[int, ...] = ()) -> None:
        cfg.validate()
        self.cfg, self.ctx = cfg, ctx or context()
        check_device(cfg, self.ctx)
        self.m, self.n, self.k = m, n, k
        self.batch = tuple(batch) if batch else (1,) * cfg.batched
        if len(self.batch) != cfg.batched or min(self.batch, default=1) < 1:
            raise ValueError(f"{cfg.name} has {cfg.batched} batch dimensions; batch extents {batch} do not match")
        nb = int(np.prod(self.batch))
        self.padded = operands.padded(cfg, m, n, k)
        self.mp, self.np_, self.kp = self.padded.m, self.padded.n, self.padded.k
        kern = build_kernel(cfg)
        self.fn = self.ctx.load_kernel(ptx if ptx is not None else render(kern), kern.name, kern.shared_bytes, cfg.target)
        self.threads = kern.threads
        # A persistent cluster kernel gets as many clusters as the device can hold at once.
        clusters = (self.ctx.max_active_clusters(self.fn, cfg.cluster, self.threads)
                    if cfg.cluster > 1 and cfg.persistent else None)
        self.grid = operands.grid(cfg, self.padded, self.ctx.sm_count, clusters, nb)
        esz, osz = cfg.in_bytes, 4 if cfg.out_dtype == "f32" else 2
        # room for every product's operands (a broadcast operand uses the first matrix only)
        self.a_ptr = self.ctx.alloc(nb * self.mp * self.kp * esz)
        self.b_ptr = self.ctx.alloc(nb * self.kp * self.np_ * esz)
        self.c_ptr = self.ctx.alloc(nb * self.mp * self.np_ * osz)
        self.bias_ptr = self.ctx.alloc(self.np_ * esz) if cfg.bias else None
        self.res_ptr = self.ctx.alloc(self.mp * self.np_ * 4) if cfg.residual else None
        self.args: list | None = None  # the kernel's arguments for upload()'s operands (Context.launch's form)
        self._launch: tuple | None = None  # the same, prepared once (Context.prepare_launch)

    def upload(self, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> None:
        """Encode, pad and copy A (M x K) and B (K x N, float) to the device, for a ``bias``
        config the N-vector ``bias`` and for a ``residual`` one the float32 M x N ``residual``
        (zeros when None).  A batched config takes leading batch dims that broadcast to its
        ``batch`` (see the class docstring)."""
        a, b = np.asarray(a), np.asarray(b)
        nd = self.cfg.batched
        a_batch, b_batch = self._operand_batch(a, "A"), self._operand_batch(b, "B")
        # each operand's own matrices, densely one after the other in C order (the maps' strides)
        a3, b3 = a.reshape((-1,) + a.shape[-2:]), b.reshape((-1,) + b.shape[-2:])
        for i in range(max(len(a3), len(b3))):
            ra, rb = operands.encode_operands(self.cfg, a3[min(i, len(a3) - 1)], b3[min(i, len(b3) - 1)],
                                              self.padded)
            if i < len(a3):
                self.ctx.upload(self.a_ptr + i * ra.nbytes, ra)
            if i < len(b3):
                self.ctx.upload(self.b_ptr + i * rb.nbytes, rb)
        dims = [("u32", self.mp), ("u32", self.np_), ("u32", self.kp)]
        if self.cfg.bias:
            vec = np.zeros(self.np_, np.float32)
            if bias is not None:
                vec[: self.n] = np.asarray(bias, np.float32).reshape(self.n)
            self.ctx.upload(self.bias_ptr, dtypes.encode(vec, self.cfg.in_dtype))
            dims += [("u64", self.bias_ptr), ("u32", self.n)]
        elif bias is not None:
            raise ValueError(f"{self.cfg.name} adds no bias (its config has bias=False)")
        if self.cfg.residual:  # stored with the padded row pitch; the kernel reads the real M x N of it
            res = np.zeros((self.mp, self.np_), np.float32)
            if residual is not None:
                res[: self.m, : self.n] = np.asarray(residual, np.float32).reshape(self.m, self.n)
            self.ctx.upload(self.res_ptr, res)
            dims += [("u64", self.res_ptr), ("u32", self.np_), ("u32", self.m), ("u32", self.n)]
        elif residual is not None:
            raise ValueError(f"{self.cfg.name} adds no residual (its config has residual=False)")
        ptrs = {"a": self.a_ptr, "b": self.b_ptr, "c": self.c_ptr}
        boxes = operands.tma_boxes(self.cfg, self.padded)
        if nd:
            own = {"a": a_batch, "b": b_batch, "c": self.batch}
            tmaps = [self._batched_map(ptrs[t.operand], t, own[t.operand]) for t in boxes]
            mask = sum(1 << (2 * i + j) for i in range(nd) for j, o in enumerate("ab") if own[o][i] > 1)
            args = [*tmaps, ("u64", self.c_ptr), *dims, *(("u32", e) for e in self.batch), ("u32", mask)]
        elif boxes:
            tmaps = [self.ctx.tensor_map(ptrs[t.operand], t.dtype, t.rows, t.cols, t.box_rows, t.box_cols)
                     for t in boxes]
            args = [*tmaps, ("u64", self.c_ptr), *dims]
        else:
            args = [("u64", self.a_ptr), ("u64", self.b_ptr), ("u64", self.c_ptr), *dims]
        # built once: a timing loop of run() then measures launches, not Python building their parameters
        self.args = args
        self._launch = self.ctx.prepare_launch(self.fn, (*self.grid, 1), (self.threads, 1, 1), args)

    def _operand_batch(self, x: np.ndarray, what: str) -> tuple[int, ...]:
        """The batch extents operand ``x`` is stored with: its leading dims, padded with 1s to the
        config's batch dims; each must be 1 (broadcast) or the launch's extent."""
        lead = x.shape[:-2]
        if len(lead) > self.cfg.batched:
            raise ValueError(f"{self.cfg.name}: {what} of shape {x.shape} has more batch dims than the config's "
                             f"{self.cfg.batched}")
        own = (1,) * (self.cfg.batched - len(lead)) + lead
        if any(s not in (1, e) for s, e in zip(own, self.batch)):
            raise ValueError(f"{self.cfg.name}: {what}'s batch dims {lead} do not broadcast to {self.batch}")
        return own

    def _batched_map(self, ptr: int, t: operands.TmaBox, own: tuple[int, ...]) -> bytes:
        """The tensor map of one operand of a batched launch, stored as ``own`` dense padded matrices:
        a broadcast dimension has extent 1 (the kernel reads its coordinate 0)."""
        matrix = t.rows * t.cols * t.itemsize
        strides = [int(np.prod(own[i + 1:])) * matrix for i in range(len(own))]
        return self.ctx.tensor_map_nd(ptr, t.dtype, (t.cols, t.rows, *own[::-1]),
                                      (t.cols * t.itemsize, *strides[::-1]), t.box())

    def run(self) -> None:
        """Launch once (asynchronously)."""
        if self._launch is None:
            raise DeviceError("GemmLaunch.run() before upload(): no operands on the device")
        self.ctx.launch_prepared(self._launch, self.fn.name)

    def result(self) -> np.ndarray:
        """Synchronise and return C (M x N; ``[*batch, M, N]`` for a batched config) as float32
        (bf16 outputs widened exactly)."""
        self.ctx.synchronize()
        shape = self.batch + (self.mp, self.np_)
        if self.cfg.out_dtype == "f32":
            c = np.empty(shape, np.float32)
            self.ctx.download(c, self.c_ptr)
        else:
            raw = np.empty(shape, np.uint16)
            self.ctx.download(raw, self.c_ptr)
            c = dtypes.bf16_bits_to_f32(raw)
        return c[..., : self.m, : self.n]

    def close(self) -> None:
        """Free the device buffers."""
        for p in (self.a_ptr, self.b_ptr, self.c_ptr, self.bias_ptr, self.res_ptr):
            if p is not None:
                self.ctx.free(p)


def gemm_config(variant: str | GemmConfig | None = None, in_dtype: str | None = None,
                out_dtype: str = "float32", ctx: Context | None = None) -> GemmConfig:
    """The config :func:`gemm` runs for these arguments (validated).

    The variant (by default the best for ``ctx``'s device, which then must be given)
    with ``in_dtype`` and ``out_dtype`` applied and ``b_major`` set by
    :func:`native_b_major` for a numpy ``K x N`` B.  Needs no driver when ``variant``
    is given.
    """
    out_dtype_name(out_dtype)  # refuse a bad name before touching the device
    if variant is None:
        variant = default_variant(ctx or context(), in_dtype or "bf16")
    cfg = with_dtypes(resolve(variant), in_dtype, out_dtype)
    cfg = cfg.with_(b_major=native_b_major(cfg))
    cfg.validate()
    return cfg


def gemm(a: np.ndarray, b: np.ndarray, out_dtype: str = "float32", variant: str | GemmConfig | None = None,
         in_dtype: str | None = None) -> np.ndarray:
    """``a @ b`` through a generated kernel: inputs rounded to ``in_dtype`` (bf16, fp16, e4m3),
    fp32 accumulation, output ``float32`` or ``bfloat16`` (returned as float32 holding bf16 values).

    ``variant`` is a name from :func:`variants` or a config; by default the best one for
    the device.  ``in_dtype`` defaults to the variant's (bf16, or e4m3 for ``wgmma_fp8``).
    The variant's ``b_major`` is replaced by :func:`native_b_major`: for 16-bit inputs the
    kernel reads this ``K x N`` B as it is (the wgmma rungs with ``imm-trans-b = 1``);
    only fp8 B is transposed on the host.  Use :class:`GemmLaunch` to run a config's
    own B layout.
    """
    a, b = np.asarray(a), np.asarray(b)
    m, n, k = operands.matmul_shape(a, b)
    out_dtype_name(out_dtype)  # before the device: a bad name fails the same without a driver
    ctx = context()
    cfg = gemm_config(variant, in_dtype, out_dtype, ctx)
    if 0 in (m, n, k):
        return np.zeros((m, n), np.float32)
    launch = GemmLaunch(cfg, m, n, k, ctx)
    try:
        launch.upload(a, b)
        launch.run()
        return launch.result()
    finally:
        launch.close()


def run_isolated(code: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run Python ``code`` in a fresh interpreter with a deadline.

    GPU checks go through this: a wrong mbarrier phase hangs the kernel forever and an
    illegal address poisons the CUDA context for the rest of the process.
    """
    env = dict(os.environ)
    try:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise DeviceError(
            f"GPU check did not finish in {timeout:.0f} s (a kernel waiting on an mbarrier that never "
            f"completes hangs like this); output so far:\n{e.stdout or ''}{e.stderr or ''}"
        ) from e


__all__ = ["GemmLaunch", "check_device", "default_variant", "gemm", "gemm_config", "native_b_major", "run_isolated", "variants"]
