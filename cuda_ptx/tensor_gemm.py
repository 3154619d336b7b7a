"""Tensor-core matrix products for ``cuda:N`` tensors: the GEMM ladder's wgmma kernel on device memory.

:meth:`CudaRuntime.gemm <helios.cuda_ptx.tensor_runtime.CudaRuntime.gemm>` hands a 16-bit
Helios matmul's operands here, as addresses and row pitches, instead of running the
translated GLSL kernel (SIMT fp32 arithmetic).  The kernel is the ladder's
``wgmma_persistent`` (one CTA per SM walking the tiles, a producer warpgroup feeding a
4-stage TMA ring, two consumer warpgroups, TMA-store epilogue), built for the operands' input dtype,
the output dtype, the operands' layouts and the bias, loaded once per process.

Why that rung: its loads and its stores go through tensor maps.  A tensor map carries the
matrix's true extents, and TMA fills the parts of a box outside them with zeros on loads and
clips them on stores, so a product of any M, N, K runs on the tensors themselves: the
kernel's M, N, K parameters are the padded extents (its tile count and K loop), the maps the
real ones.  No operand is padded or copied, and a row pitch wider than the row (a view of a
wider matrix) is the map's stride.

A Linear layer's bias is added in the same kernel's epilogue (``bias=True`` configs), in
fp32 before C is rounded, so ``x @ W^T + b`` is one launch.  ``round_out`` rounds a float32 C
to the input dtype in the epilogue and stores it widened: autocast's 16-bit product and the
cast of its result to float32 (a float32 operand's gradient) in one launch, the same bits.

A batch of products (``batch``: up to three batch dimensions, each with its extent and each
operand's stride along it: a bmm, attention's per-head ``q @ k^T`` on views of one ``[B, T,
3C]`` projection) is one launch of the ``batched`` form of the same kernel: its tensor maps
have the batch dimensions outside the matrix's two, and its tile walk covers every product.
An operand broadcast along a batch dimension (stride 0) gets extent 1 there, and the kernel
reads its batch coordinate 0 (``batch_mask``), rather than a stride-0 map, which TMA's
documented rules do not promise.

What it takes (:meth:`TensorCoreGemm.accepts`; anything else stays on the generic kernel):
a Hopper GPU (sm_90, what the wgmma rungs are built for), bf16 or fp16 inputs, an fp32 or
bf16 output, base addresses 16-byte aligned and row pitches and batch strides multiples of 16
bytes (TMA's rules).  ``HELIOS_TENSOR_CORES=0`` turns it off (every matmul then runs the GLSL kernel).
"""

from __future__ import annotations

import ctypes
import os
import threading

from . import operands
from .config import IN_DTYPES, LADDER, OUT_DTYPES
from .driver import Context, aligned_buffer, check
from .emit import build_kernel, resolve
from .render import render

VARIANT = "wgmma_persistent"
# Helios dtype names -> the ladder's names.
INPUTS = {"bfloat16": "bf16", "float16": "fp16"}
OUTPUTS = {"float32": "f32", "bfloat16": "bf16"}


def enabled() -> bool:
    """Whether ``HELIOS_TENSOR_CORES`` allows the tensor-core path (on unless 0/false/off/no)."""
    return os.environ.get("HELIOS_TENSOR_CORES", "1").strip().lower() not in ("0", "false", "off", "no")


def runs_on(ctx: Context) -> bool:
    """Whether the device can run the wgmma kernel: compute capability 9.0 exactly (sm_90a)."""
    return tuple(ctx.cc) == (9, 0)


class _Block:
    """One kernel-parameter block: three 128-byte tensor maps (128-byte aligned, as CUDA 13 asks),
    C's pointer, M, N, K, then a bias config's and a batched config's parameters.  ``params`` is
    the array of pointers to them that ``cuLaunchKernel`` takes."""

    __slots__ = ("_owner", "maps_at", "c", "dims", "bias", "res", "batch", "params", "last_maps")

    def __init__(self, cfg):
        self._owner, base = aligned_buffer(3 * 128, 128)
        self.maps_at = [base + 128 * i for i in range(3)]
        self.c = ctypes.c_uint64(0)
        self.dims = [ctypes.c_uint32(0) for _ in range(3)]
        # a bias config's two more parameters: the vector's address and its length
        self.bias = (ctypes.c_uint64(0), ctypes.c_uint32(0)) if cfg.bias else ()
        # a residual config's four: the float32 matrix's address, row pitch, rows and columns
        self.res = (ctypes.c_uint64(0), *(ctypes.c_uint32(0) for _ in range(3))) if cfg.residual else ()
        # a batched config's: the batch extents (outermost first), then batch_mask
        self.batch = tuple(ctypes.c_uint32(0) for _ in range(cfg.batched + 1)) if cfg.batched else ()
        slots = [*self.maps_at, ctypes.addressof(self.c),
                 *(ctypes.addressof(d) for d in (*self.dims, *self.bias, *self.res, *self.batch))]
        self.params = (ctypes.c_void_p * len(slots))(*slots)
        self.last_maps: tuple = ()

    def fill(self, maps: tuple, c: int, dims: tuple, bias: int | None, n: int, batch_words: tuple,
             res_words: tuple = ()) -> None:
        """Write one launch's parameters (a map is copied only where it is not the one already there)."""
        if maps != self.last_maps:
            for at, raw, old in zip(self.maps_at, maps, self.last_maps or (None,) * 3):
                if raw is not old:
                    ctypes.memmove(at, raw, 128)
            self.last_maps = maps
        self.c.value = c
        self.dims[0].value, self.dims[1].value, self.dims[2].value = dims
        if self.bias:
            self.bias[0].value, self.bias[1].value = bias, n
        for slot, word in zip(self.res, res_words):
            slot.value = word
        for slot, word in zip(self.batch, batch_words):
            slot.value = word


class _Kernel:
    """One loaded config: its function, threads per CTA, the config, the grids of the shapes it ran,
    and the parameter block its eager launches share.

    That block is refilled in place for each launch (cuLaunchKernel copies the parameters when it is
    called, and building them anew costs more host time than a small product takes on the GPU); a
    prepared launch (:meth:`TensorCoreGemm.prepare`) gets a block of its own."""

    __slots__ = ("cfg", "fn", "threads", "grids", "block")

    def __init__(self, cfg, fn, threads: int):
        self.cfg, self.fn, self.threads = cfg, fn, threads
        self.grids: dict[tuple, tuple] = {}  # (m, n, k, batch extents) -> (padded extents, grid, TMA boxes)
        self.block = _Block(cfg)


class TensorCoreGemm:
    """C = A @ B with wgmma on one driver context (see the module docstring).

    Operands are ``(address, pitch)`` pairs, pitches in elements: A row-major ``M x K``
    (``a_major="k"``) or its transpose stored row-major ``K x M`` (``a_major="m"``: read with
    wgmma's transpose bit, as a weight gradient's X^T is); B row-major ``K x N``
    (``b_major="n"``) or its transpose stored row-major ``N x K`` (``b_major="k"``); C
    row-major ``M x N`` in the output dtype.  ``batch`` (optional): one ``(extent, A's stride,
    B's stride, C's stride)`` per batch dimension, outermost first, strides in elements; a
    stride of 0 broadcasts that operand (never C's).
    """

    # Tensor maps kept for reuse (the caching allocator hands the same addresses out again, and a
    # weight is the same operand every step); the cache is emptied when it reaches this size.
    MAX_MAPS = 4096

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._kernels: dict[tuple, _Kernel] = {}
        self._maps: dict[tuple, bytes] = {}
        self._lock = threading.Lock()  # a kernel's parameter block is shared by its launches

    def _map(self, *key) -> bytes:
        """``ctx.tensor_map(*key)``, or for a key that starts with ``"nd"`` ``ctx.tensor_map_nd(*key[1:])``,
        encoded once per distinct operand."""
        m = self._maps.get(key)
        if m is None:
            if len(self._maps) >= self.MAX_MAPS:
                self._maps.clear()
            m = self._maps[key] = (self.ctx.tensor_map_nd(*key[1:]) if key[0] == "nd" else
                                   self.ctx.tensor_map(*key))
        return m

    @staticmethod
    def accepts(in_dtype: str, out_dtype: str, a: tuple, b: tuple, c: tuple, m: int, n: int, k: int,
                bias: int | None = None, batch: tuple = (), round_out: bool = False, residual: tuple | None = None) -> bool:
        """Whether this product can run here: dtypes the kernel has (``round_out``: a float32 C),
        TMA's alignment rules (and a 4-byte aligned bias: its pairs are loaded as words), and
        extents the kernel's 32-bit parameters and TMA's signed coordinates hold (the tiles of
        every product of a batch counted together); a ``residual`` (address, row pitch) only with
        ``round_out`` and one product, 8-byte aligned pairs (an even N and pitch), and its elements
        indexed in 32 bits."""
        if in_dtype not in INPUTS or out_dtype not in OUTPUTS or min(m, n, k) < 1:
            return False
        if round_out and out_dtype != "float32":
            return False
        if residual is not None and (not round_out or _batch_dims(batch) or residual[0] % 8 or residual[1] % 2
                                     or n % 2 or residual[1] < n or m * residual[1] >= 1 << 32):
            return False
        if bias is not None and (bias % 4 or n % 2):
            return False
        isz, osz = IN_DTYPES[INPUTS[in_dtype]][0], OUT_DTYPES[OUTPUTS[out_dtype]]
        for (addr, pitch), size in ((a, isz), (b, isz), (c, osz)):
            if addr % 16 or (pitch * size) % 16 or pitch < 1:
                return False
        batch = _batch_dims(batch)
        if len(batch) > 3:  # TMA maps have at most 5 dimensions
            return False
        products = 1
        for extent, sa, sb, sc in batch:
            if extent < 1 or min(sa, sb) < 0 or sc < 1 or (sa * isz) % 16 or (sb * isz) % 16 or (sc * osz) % 16:
                return False
            products *= extent
        tile = LADDER[VARIANT]
        tiles = -(-m // tile.bm) * -(-n // tile.bn) * products  # the kernel counts them in 32 bits
        return max(m, n, k) < 1 << 30 and tiles < 1 << 31

    def kernel(self, in_dtype: str, out_dtype: str, a_major: str, b_major: str, bias: bool = False,
               batched: int = 0, round_out: bool = False, residual: bool = False) -> _Kernel:
        """The loaded kernel for these dtypes, operand layouts, bias, number of batch dimensions,
        rounding of a float32 C to the input dtype and residual (built and loaded on first use)."""
        key = (in_dtype, out_dtype, a_major, b_major, bias, batched, round_out, residual)
        kern = self._kernels.get(key)
        if kern is None:
            cfg = resolve(VARIANT).with_(in_dtype=INPUTS[in_dtype], out_dtype=OUTPUTS[out_dtype], a_major=a_major,
                                         b_major=b_major, bias=bias, batched=batched, round_out=round_out,
                                         residual=residual)
            cfg.validate()
            built = build_kernel(cfg)
            fn = self.ctx.load_kernel(render(built), built.name, built.shared_bytes, cfg.target)
            kern = self._kernels[key] = _Kernel(cfg, fn, built.threads)
        return kern

    def _plan(self, in_dtype: str, out_dtype: str, a: tuple, a_major: str, b: tuple, b_major: str, c: tuple,
              m: int, n: int, k: int, bias: int | None, batch: tuple, round_out: bool, residual: tuple | None) -> tuple:
        """(kernel, grid, the arguments of ``_Block.fill``) of one product."""
        batch = _batch_dims(batch)
        kern = self.kernel(in_dtype, out_dtype, a_major, b_major, bias is not None, len(batch), round_out,
                           residual is not None)
        cfg = kern.cfg
        extents = tuple(d[0] for d in batch)
        shape = kern.grids.get((m, n, k, extents))
        if shape is None:
            p = operands.padded(cfg, m, n, k)
            # the kernel's boxes over the real extents: TMA fills and clips what lies past them
            boxes = operands.tma_boxes(cfg, operands.Padded(m, n, k))
            products = 1
            for e in extents:
                products *= e
            grid = operands.grid(cfg, p, self.ctx.sm_count, batch=products)
            shape = kern.grids[(m, n, k, extents)] = (p, grid, boxes)
        p, grid, boxes = shape
        at = {"a": a, "b": b, "c": c}  # operand -> (address, pitch)
        words: tuple = ()
        if batch:
            stride_at = {"a": 1, "b": 2, "c": 3}  # where an operand's stride sits in a batch entry
            maps = tuple(self._batched_map(t, *at[t.operand], extents, [d[stride_at[t.operand]] for d in batch])
                         for t in boxes)
            # the extents, then which batch dimensions A (bit 2 i) and B (bit 2 i + 1) have
            words = (*extents, sum((bool(sa) << 2 * i) | (bool(sb) << 2 * i + 1) for i, (_, sa, sb, _) in enumerate(batch)))
        else:
            maps = tuple(self._map(at[t.operand][0], t.dtype, t.rows, t.cols, t.box_rows, t.box_cols,
                                   at[t.operand][1]) for t in boxes)
        res_words = () if residual is None else (*residual, m, n)  # address, pitch; the real rows and columns
        return kern, grid, (maps, c[0], (p.m, p.n, p.k), bias, n, words, res_words)

    def run(self, in_dtype: str, out_dtype: str, a: tuple, a_major: str, b: tuple, b_major: str, c: tuple,
            m: int, n: int, k: int, bias: int | None = None, batch: tuple = (), round_out: bool = False,
            residual: tuple | None = None) -> None:
        """Launch C = A @ B (+ the N-vector of the input dtype at address ``bias``, added before C is
        rounded) asynchronously, on the default stream, for every product of ``batch`` (see the
        class docstring); ``round_out``: a float32 C gets each result rounded to the input dtype
        (widened back: exact in float32), and then ``residual`` = (address, row pitch) of a float32
        M x N matrix added to it.  The caller checked :meth:`accepts`."""
        kern, (gx, gy), fill = self._plan(in_dtype, out_dtype, a, a_major, b, b_major, c, m, n, k, bias, batch,
                                          round_out, residual)
        fn, cu = kern.fn, self.ctx.cu
        with self._lock:
            kern.block.fill(*fill)
            res = cu.cuLaunchKernel(fn.handle, gx, gy, 1, kern.threads, 1, 1, fn.shared_bytes, 0,
                                    ctypes.addressof(kern.block.params), 0)
        check(f"cuLaunchKernel({fn.name})", res, cu=cu)

    def prepare(self, in_dtype: str, out_dtype: str, a: tuple, a_major: str, b: tuple, b_major: str, c: tuple,
                m: int, n: int, k: int, bias: int | None = None, batch: tuple = (), round_out: bool = False,
                residual: tuple | None = None) -> tuple:
        """:meth:`run`'s launch prepared once, in a parameter block of its own, to be issued any number of
        times (``Context.prepare_launch``'s form: a replayed step's products, or nodes of a CUDA graph)."""
        kern, (gx, gy), fill = self._plan(in_dtype, out_dtype, a, a_major, b, b_major, c, m, n, k, bias, batch,
                                          round_out, residual)
        block = _Block(kern.cfg)
        block.fill(*fill)
        fn = kern.fn
        return (fn.handle, gx, gy, 1, kern.threads, 1, 1, fn.shared_bytes, ctypes.addressof(block.params), block)

    def _batched_map(self, t: operands.TmaBox, addr: int, pitch: int, extents: list, strides: list) -> bytes:
        """The tensor map of one operand of a batched launch: the matrix's two dimensions, then the batch
        dimensions innermost first (TMA's order).  Where the operand is broadcast (stride 0) the
        dimension has extent 1 and the kernel reads coordinate 0; its stride is then never applied,
        so it is given as one whole matrix, a value any TMA accepts."""
        isz = t.itemsize
        outer = [(e, s * isz) if s else (1, t.rows * pitch * isz) for e, s in zip(extents, strides)][::-1]
        return self._map("nd", addr, t.dtype, (t.cols, t.rows, *(e for e, _ in outer)),
                         (pitch * isz, *(s for _, s in outer)), t.box())


def _batch_dims(batch) -> tuple:
    """``batch`` as a tuple of ``(extent, A's stride, B's stride, C's stride)`` without the dimensions of
    extent 1 (they index nothing), so a batch of one product is the plain kernel's launch."""
    return tuple(tuple(d) for d in batch if d[0] != 1)


__all__ = ["INPUTS", "OUTPUTS", "TensorCoreGemm", "VARIANT", "enabled", "runs_on"]
