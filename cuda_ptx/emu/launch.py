"""``emulate_gemm``: run a generated GEMM kernel on the CPU emulator, exactly as the GPU runner would.

The runner's own launch code drives an emulated CUDA driver (:mod:`emu_driver`), so
operands, tensor maps, parameters and grid are what a GPU gets; the PTX is the text
``ptxas`` gets.
Every CTA of the grid runs (or only ``ctas``), so use small problems: the gate's
128 x 512 x 384 ``wgmma_ws`` problem (two tiles) takes about half a second.

``emulate_kernel`` runs any kernel in the emulated subset: compute kernels (the SPIR-V
translator's, the SIMT rung) on the vectorised :class:`executor.Grid`, the rest on the
warp scheduler.
"""

from __future__ import annotations

import numpy as np

from helios.errors import ShapeError

from .. import operands
from ..config import GemmConfig, with_dtypes
from ..emit import resolve
from .driver import emulated_context
from .state import EmulationError, GlobalMemory, TensorMap
from .ops import compile_program, is_compute_program
from .executor import Cluster, Cta, Grid
from .ptx_parse import PtxProgram, parse
from ..runner import GemmLaunch

# A batch of CTAs run together by the vectorised executor holds at most this many threads
# and about this many bytes of registers (the rest of the grid runs in further batches).
BATCH_THREADS = 1 << 17
BATCH_REG_BYTES = 256 << 20


def _dims3(v, what: str) -> tuple[int, int, int]:
    t = (int(v),) if np.isscalar(v) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3 or min(t) < 1:
        raise ShapeError(f"{what} must be 1 to 3 positive extents, got {v!r}")
    return t + (1,) * (3 - len(t))


def emulate_kernel(ptx: str | PtxProgram, threads, shared_bytes: int, params: dict[str, object], memory: GlobalMemory,
                   grid: tuple = (1, 1), seed: int = 0, ctas: list[tuple] | None = None) -> None:
    """Run any kernel in the emulated subset over a ``grid`` of CTAs (or only the
    ``(x, y[, z])`` in ``ctas``).

    A compute kernel (:func:`ops.is_compute_program`: no async copies, tensor cores,
    mbarriers or clusters) runs on :class:`executor.Grid`, the CTAs together in batches of
    up to ``BATCH_THREADS`` threads; ``threads`` (the block) and ``grid`` may be 3-D.
    Any other kernel runs CTA after CTA on the warp scheduler (:class:`executor.Cta`), or,
    for a kernel with ``.reqnctapercluster``, one cluster after another, the CTAs of each
    running together (a CTA in ``ctas`` brings its whole cluster); those take 1-D blocks
    and 2-D grids.

    ``ptx`` is the kernel's text or its parsed program.  ``params`` maps parameter names
    to ints (pointers from ``memory.alloc``, scalars) or :class:`TensorMap` objects.
    Results are read back from ``memory``.
    """
    prog = ptx if isinstance(ptx, PtxProgram) else parse(ptx)
    missing = [p.name for p in prog.params if p.name not in params]
    if missing:
        raise EmulationError(f"kernel {prog.name} needs parameters {missing}")
    block = _dims3(threads, "threads (the block)")
    nthreads = block[0] * block[1] * block[2]
    if prog.maxntid is not None and nthreads > prog.maxntid:
        raise EmulationError(f"{nthreads} threads per CTA exceed the kernel's .maxntid {prog.maxntid}")
    full = _dims3(grid, "grid")
    if ctas is None:
        todo = [(x, y, z) for z in range(full[2]) for y in range(full[1]) for x in range(full[0])]
    else:
        todo = [tuple(c) + (0,) * (3 - len(c)) for c in ctas]
    for c in todo:
        if not all(0 <= c[i] < full[i] for i in range(3)):
            raise ShapeError(f"CTA {c[:len(grid)]} is outside the grid {tuple(grid)}")
    if is_compute_program(prog):
        ops, comp = compile_program(prog)
        per_thread = 16 * (len(comp.store) + 4) + comp.local_bytes
        cap = max(1, min(BATCH_THREADS, BATCH_REG_BYTES // per_thread) // nthreads)
        for i in range(0, len(todo), cap):
            Grid(prog, block, shared_bytes, params, memory, todo[i: i + cap], full).run()
        return
    if block[1:] != (1, 1) or full[2] != 1:
        raise EmulationError(f"kernel {prog.name} runs on the warp scheduler, which takes 1-D blocks and 2-D grids "
                             f"(got block {block}, grid {full})")
    threads = nthreads
    full = (full[0], full[1], 1)
    todo = [(x, y) for x, y, _ in todo]
    dims = prog.cluster or (1, 1, 1)
    if dims == (1, 1, 1):
        for i, (x, y) in enumerate(todo):
            Cta(prog, threads, shared_bytes, params, memory, (x, y, 0), full, seed=seed + i).run()
        return
    size = dims[0]
    if dims[1:] != (1, 1):
        raise EmulationError(f"clusters of {dims} are not modelled (only n x 1 x 1)")
    if grid[0] % size:
        raise EmulationError(f"grid {grid} is not a whole number of clusters of {size} CTAs along x: "
                             "the launch would fail (CUDA_ERROR_INVALID_CLUSTER_SIZE)")
    blocks = list(dict.fromkeys((x // size, y) for x, y in todo))
    # independent random streams for every CTA and every cluster scheduler, and for each seed
    for seq, (cx, y) in zip(np.random.SeedSequence(seed).spawn(len(blocks)), blocks):
        streams = seq.spawn(size + 1)
        members = [Cta(prog, threads, shared_bytes, params, memory, (cx * size + r, y, 0), full,
                       seed=streams[r]) for r in range(size)]
        Cluster(members, dims, seed=streams[size]).run()


def emulate_gemm(a: np.ndarray, b: np.ndarray, variant: str | GemmConfig = "wgmma_ws", out_dtype: str = "float32",
                 in_dtype: str | None = None, seed: int = 0, ptx: str | None = None,
                 ctas: list[tuple[int, int]] | None = None, sm_count: int | None = None) -> np.ndarray:
    """``a @ b`` computed by emulating the generated kernel for ``variant`` thread by thread.

    It runs exactly what the GPU runner runs: a :class:`runner.GemmLaunch` on a
    :class:`driver.Context` whose driver is :class:`driver.EmulatedDriver`, so the
    operand encoding, tensor maps, kernel parameters and grid are the runner's own.
    Arguments mirror :func:`helios.cuda_ptx.gemm`, but the config runs as given (its
    ``b_major`` too); ``seed`` varies the warp order and TMA latencies; ``ptx``
    replaces the generated text (to check an edited kernel); ``ctas`` limits the run to
    some ``(x, y)`` CTAs (the rest of C stays NaN); ``sm_count`` is the emulated
    device's SM count, which sets how many CTAs a persistent kernel gets (default: one
    CTA, or one cluster, which then walks every tile, so its ring runs on from tile to
    tile).  A batched config (``batched`` = d) takes ``a`` [*, M, K] and ``b`` [*, K, N] whose
    leading dims broadcast (numpy's rules) to at most d batch dims, and returns [*batch, M, N]
    (2-D operands: one product, batch extents 1).
    Raises :class:`EmulationError` for hangs, faults and misuse the GPU would not report.
    """
    a, b = np.asarray(a), np.asarray(b)
    cfg = with_dtypes(resolve(variant), in_dtype, out_dtype)  # GemmLaunch validates it
    batch = ()
    if cfg.batched and min(a.ndim, b.ndim) >= 2:
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        if len(lead) > cfg.batched:
            raise ShapeError(f"{cfg.name} has {cfg.batched} batch dimensions; the operands broadcast to {lead}")
        batch = (1,) * (cfg.batched - len(lead)) + tuple(lead)
        a2, b2 = a[(0,) * (a.ndim - 2)], b[(0,) * (b.ndim - 2)]  # one matrix of each, for M, N, K
    else:
        a2, b2 = a, b
    m, n, k = operands.matmul_shape(a2, b2)
    launch = GemmLaunch(cfg, m, n, k, emulated_context(sm_count or cfg.cluster, seed, ctas), ptx=ptx, batch=batch)
    try:
        launch.upload(a, b)
        launch.run()
        return np.array(launch.result(), np.float32)
    finally:
        launch.close()


__all__ = ["EmulationError", "GlobalMemory", "TensorMap", "emulate_gemm", "emulate_kernel"]
