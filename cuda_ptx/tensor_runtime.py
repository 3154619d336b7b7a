"""``cuda:N`` for Helios tensors: the device contract (helios.backend) on the CUDA driver API.

:class:`CudaRuntime` is the CUDA backend behind ``helios.set_device("cuda:0")``.  Ops are
the same as on Vulkan: ``helios._kernels`` records (kernel, variant, specialization
constants, bindings, push constants, workgroup grid); here the kernel's SPIR-V from the
registry becomes PTX through ``helios.cuda_ptx.spirv_ptx.translate()``, is loaded once per
(kernel, variant, spec) and launched on the default stream.  It runs on
``helios.cuda_ptx.driver.context()``: a real GPU, or with ``HELIOS_CUDA_DEVICE=emulator``
the emulated driver, whose kernels run thread by thread on the CPU (slow; for tests).

Memory is a caching allocator by size class: requests up to 512 bytes take a 512-byte
block, larger ones the next power of two; a freed block goes back on its pool's free list
for its class and is reused by the next request of that class.  Reuse needs no fence: every
launch, copy and fill goes to the one default stream, so work recorded before a free
finishes before work recorded after it starts.  ``empty_cache()`` returns the cached blocks
to the driver (done once, before failing, when the driver is out of memory).

Copies between host and device are the driver's synchronous ones on the default stream
(``cuMemcpyHtoD`` / ``cuMemcpyDtoH``): a read waits for the launches before it.  While a
profiling session is open every launch, fill and copy is bracketed by two CUDA events;
``synchronize()`` turns them into the device events the Vulkan runtime hands over (times on
the host ``CLOCK_MONOTONIC`` clock), so traces, run.db and MFU read the same records.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
import threading
import time
import warnings

import numpy as np

from helios import op_trace
from helios.backend import COPY, DISPATCH, FILL, GEMM, POOLS, Runtime
from helios.errors import DeviceError, OutOfMemoryError
from helios.profile import debug as _debug
from helios.profile.profiler import current_collector

from . import driver as _driver
from . import replay_graphs

MIN_BLOCK = 512  # the smallest size class; above it classes are powers of two

# The kernels index their buffers with 32-bit element offsets (GLSL uint / int), as on
# Vulkan: one binding spans at most 2^31 - 1 bytes, and bind() windows larger tensors.
MAX_RANGE = (1 << 31) - 1
ALIGN = 256  # cuMemAlloc returns 256-byte aligned addresses; windows start on this alignment

CUDA_LIMITS = {
    "max_storage_buffer_range": MAX_RANGE,
    "min_storage_buffer_offset_alignment": ALIGN,
    "subgroup_size": 32,  # a warp
    "max_workgroup_invocations": 1024,
    "max_workgroup_size": (1024, 1024, 64),
    "max_workgroup_count": ((1 << 31) - 1, 65535, 65535),
    "max_shared_memory": 48 * 1024,  # static; more is dynamic, opted into per kernel
    "max_push_constants": 4096,  # kernel parameter space
    "timestamp_period": 1.0,
    "timestamp_valid_bits": 64,
}
CUDA_FEATURES = {"storage16": True, "storage8": True, "int64": True, "int16": True, "float16": True,
                 "push_descriptor": False, "unified_memory": False, "calibrated_timestamps": False}
# What every CUDA device reports before it is opened (helios.devices() fills in the name).
CUDA_INFO = {"name": "", "type": "discrete", "limits": CUDA_LIMITS, "features": CUDA_FEATURES}

# The driver context each thread last made current through a CudaRuntime: a context is current
# per thread, and comm worker threads read and write tensors too.
_tls = threading.local()


def size_class(nbytes: int) -> int:
    """The block size a request of ``nbytes`` takes: 512 up to 512 bytes, else the next power of two."""
    if nbytes <= MIN_BLOCK:
        return MIN_BLOCK
    return 1 << (int(nbytes) - 1).bit_length()


class _Pool:
    """One pool's blocks: free lists by size class and the counters pool_stats() reports."""

    __slots__ = ("free", "blocks", "reserved", "in_use", "peak", "allocs", "frees")

    def __init__(self):
        self.free: dict[int, list[int]] = {}
        self.blocks = self.reserved = self.in_use = self.peak = self.allocs = self.frees = 0


class _Program:
    """A loaded kernel and its launch parameter block: one 8-byte slot per parameter (a .u32 is
    read from the low half of its slot, little-endian) and the array of pointers to the slots
    that ``cuLaunchKernel`` takes; the driver copies the values during the call."""

    __slots__ = ("fn", "t", "handle", "bindings", "nbind", "push_bytes", "words", "vals", "ptrs", "params", "bx",
                 "by", "bz", "shared")

    def __init__(self, fn, t):
        self.fn, self.t, self.handle = fn, t, fn.handle
        self.bindings = tuple(t.bindings)
        self.nbind = len(self.bindings)
        self.push_bytes = 4 * t.push_words
        self.words = struct.Struct(f"<{t.push_words}I")
        n = max(1, self.nbind + t.push_words)
        self.vals = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self.vals)
        self.ptrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.params = ctypes.addressof(self.ptrs)  # dispatch()'s block, refilled per launch
        self.bx, self.by, self.bz = t.block
        self.shared = fn.shared_bytes

    def new_block(self) -> tuple:
        """A parameter block of this program's size: (values, pointers to each value)."""
        vals = (ctypes.c_uint64 * len(self.vals))()
        base = ctypes.addressof(vals)
        return vals, (ctypes.c_void_p * len(self.vals))(*[base + 8 * i for i in range(len(self.vals))])

    def fill(self, vals, buffers: list, push: bytes, live: dict, device: str, name: str) -> None:
        """Write one launch's parameters into ``vals``: one address per binding the kernel declares
        (the bound range's; 0 where the dispatch gives none), then the push constants as words."""
        for i, b in enumerate(self.bindings):
            if b < len(buffers):
                h = buffers[b][0]
                if type(h) is not int or h not in live:
                    raise DeviceError(f"{name}: an operand is not on {device} (a cpu tensor, or one on another "
                                      f"device); move it first with .to({device!r})")
                vals[i] = h + buffers[b][1]
            else:
                vals[i] = 0
        if self.push_bytes:
            raw = push if len(push) >= self.push_bytes else bytes(push).ljust(self.push_bytes, b"\0")
            vals[self.nbind:] = self.words.unpack_from(raw)


def _reach(pb, heads: int, t_len: int, strides) -> int:
    """The elements a [B, heads, T, D] flash operand of problem ``pb`` with element strides ``strides``
    (of B, heads and T; D's is 1) reaches from its first."""
    return sum((n - 1) * x for n, x in zip((pb.B, heads, t_len), strides)) + pb.D


def _command_name(kind: int, args: tuple) -> str:
    """The kernel a recorded command launches, for errors: a dispatch's name, or the tensor-core kernel's."""
    if kind == DISPATCH:
        return args[4]
    return "matmul_wgmma" if kind == GEMM else f"flash_wgmma_{args[0]}"


class CudaRuntime(Runtime):
    """``cuda:N`` behind the device contract (see the module docstring)."""

    is_host = False

    def __init__(self, index: int = 0, ctx=None):
        self.index = int(index)
        self.name = f"cuda:{self.index}"
        from helios.runtime import device

        self.device = device(self.name)
        self.ctx = ctx if ctx is not None else _open_context(self.index)
        _tls.ctx = None  # opening a context may have made it current here: the next call sets it for sure
        self.cu = self.ctx.cu
        self.emulated = type(self.cu).__name__ == "EmulatedDriver"
        major, minor = self.ctx.cc
        self.target = f"sm_{major}{minor}"  # PTX the translator writes; ctx.load_kernel assembles it for the device
        self.info = dict(CUDA_INFO, name=self.ctx.name, index=self.index, compute_capability=f"{major}.{minor}",
                         sm_count=self.ctx.sm_count, emulated=self.emulated)
        self.features = CUDA_FEATURES
        self.max_range = MAX_RANGE
        self.align = ALIGN
        self.debug = _debug.debug_level()
        self._pools = {p: _Pool() for p in POOLS}
        self._live: dict[int, tuple[str, int]] = {}  # address -> (pool, size class)
        self._programs: list[_Program] = []  # by pid
        self._lock = threading.Lock()
        self._mem_lock = threading.Lock()
        self._success = self.cu.CUresult.CUDA_SUCCESS
        self._pipelines: dict[tuple, int] = {}
        self._tensor_cores = None  # tensor_gemm.TensorCoreGemm on first gemm(), False where there is none
        self._flash_kernels = None  # tensor_flash.TensorCoreFlash on first flash(), False where there is none
        # run_commands' launches prepared per command list (a graph's replays): id -> (list, slots,
        # its runs' CUDA graphs unless HELIOS_CUDA_GRAPHS=0: cuda_ptx/replay_graphs.py)
        self._prepared: dict[int, tuple] = {}
        self._cuda_graphs = replay_graphs.enabled()
        self._stats = {"dispatches": 0, "copies": 0, "fills": 0, "fence_waits": 0}
        self.last_wait_ns = 0
        # Profiling: events bracketing each timed command until synchronize() reads them.
        self._timing = False
        # (seq, name, flops, bytes, start event, stop event, host_record_ns, (shapes, dtype) for HELIOS_DEBUG)
        self._pending: list[tuple] = []
        self._spare_events: list = []
        self._anchor = None  # (event, host ns when it completed): device times are measured from it
        self._submit = 0
        self._batch_t0 = 0
        col = current_collector()
        if self.debug or (col is not None and col.device_timestamps):  # opened inside a profiling session
            self._start_timing()
        if self.debug:
            op_trace.enable_operand_notes()  # autograd then notes each op's operands for the kernel lines

    # -- driver plumbing ------------------------------------------------------------------
    def _use(self) -> None:
        # Each call goes to this runtime's context, on whichever thread makes it (several CUDA
        # devices in one process, or a comm worker thread reading a gradient).
        if getattr(_tls, "ctx", None) is not self.ctx:
            self.ctx._check("cuCtxSetCurrent", self.cu.cuCtxSetCurrent(self.ctx.ctx))
            _tls.ctx = self.ctx

    def _check(self, call: str, result):
        return self.ctx._check(call, result)

    # -- allocator ------------------------------------------------------------------------
    def alloc(self, nbytes: int, pool: str = "activations") -> int:
        """The address of a block of at least ``nbytes`` in ``pool`` (reused from the pool's free list)."""
        p = self._pools.get(pool)
        if p is None:
            raise ValueError(f"alloc: pool must be one of {', '.join(POOLS)}, got {pool!r}")
        if nbytes < 0:
            raise ValueError(f"alloc: nbytes must be >= 0, got {nbytes}")
        cls = size_class(nbytes)
        with self._mem_lock:  # a tensor may be freed on a comm worker thread while another allocates
            cached = p.free.get(cls)
            if cached:
                addr = cached.pop()
            else:
                addr = self._driver_alloc(cls, pool)
                p.blocks += 1
                p.reserved += cls
            self._live[addr] = (pool, cls)
            p.in_use += cls
            p.allocs += 1
            if p.in_use > p.peak:
                p.peak = p.in_use
        return addr

    def _driver_alloc(self, nbytes: int, pool: str) -> int:
        self._use()
        try:
            return self.ctx.alloc(nbytes)
        except OutOfMemoryError:
            pass
        # Out of memory with blocks cached: give them back to the driver and try once more.
        if self._empty_cache():
            try:
                return self.ctx.alloc(nbytes)
            except OutOfMemoryError:
                pass
        in_use = sum(q.in_use for q in self._pools.values())
        raise OutOfMemoryError(f"{self.name}: out of device memory allocating {nbytes} B in pool {pool!r} "
                               f"({in_use} B in use by tensors)") from None

    def free(self, handle: int) -> None:
        """Put ``handle``'s block back on its pool's free list (stream order makes reuse safe)."""
        with self._mem_lock:
            found = self._live.pop(handle, None)
            if found is None:
                raise ValueError(f"free: {handle!r} is not a live allocation of {self.name}")
            pool, cls = found
            p = self._pools[pool]
            p.free.setdefault(cls, []).append(handle)
            p.in_use -= cls
            p.frees += 1

    def empty_cache(self) -> int:
        """Return every cached (free) block to the driver; the bytes released."""
        with self._mem_lock:
            return self._empty_cache()

    def _empty_cache(self) -> int:
        released = 0
        if not any(p.free for p in self._pools.values()):
            return 0
        self._use()
        self.ctx.synchronize()  # a free block may still be read by a launch recorded before its free
        for p in self._pools.values():
            for cls, addrs in p.free.items():
                for a in addrs:
                    self.ctx.free(a)
                    p.blocks -= 1
                    p.reserved -= cls
                    released += cls
            p.free.clear()
        return released

    def pool_stats(self) -> dict:
        """Per pool: blocks, dedicated, reserved_bytes, in_use_bytes, peak_in_use_bytes, cached_bytes,
        pending_free_bytes, allocs, frees (the Vulkan runtime's keys; sizes count whole size classes)."""
        return {name: {"blocks": p.blocks, "dedicated": 0, "reserved_bytes": p.reserved, "in_use_bytes": p.in_use,
                       "peak_in_use_bytes": p.peak, "cached_bytes": p.reserved - p.in_use, "pending_free_bytes": 0,
                       "allocs": p.allocs, "frees": p.frees}
                for name, p in self._pools.items()}

    def _address(self, handle, offset: int, nbytes: int, what: str) -> int:
        found = self._live.get(handle) if type(handle) is int else None
        if found is None:
            raise DeviceError(f"{what}: {handle!r} is not an allocation of {self.name} (a tensor on another device?)")
        if offset < 0 or nbytes < 0 or offset + nbytes > found[1]:
            raise ValueError(f"{what}: bytes [{offset}, {offset + nbytes}) lie outside the {found[1]}-byte block")
        return handle + offset

    def read(self, handle: int, offset: int, out) -> None:
        """Fill the uint8 array ``out`` from ``handle`` at ``offset`` (waits for the launches before it)."""
        addr = self._address(handle, offset, out.nbytes, "read")
        self._use()
        if out.flags.c_contiguous:
            self.ctx.download(out, addr)
        else:
            tmp = np.empty(out.shape, out.dtype)
            self.ctx.download(tmp, addr)
            out[...] = tmp

    def write(self, handle: int, offset: int, data) -> None:
        """Copy the uint8 array ``data`` into ``handle`` at ``offset`` (ordered after the launches before it)."""
        data = np.ascontiguousarray(data)
        addr = self._address(handle, offset, data.nbytes, "write")
        self._use()
        self.ctx.upload(addr, data)

    def copy(self, src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` on the default stream."""
        s = self._address(src, src_offset, nbytes, "copy")
        d = self._address(dst, dst_offset, nbytes, "copy")
        self._use()
        timed = self._begin("copy", 0, 2 * nbytes) if self._timing else None
        if hasattr(self.cu, "cuMemcpyDtoD"):
            self._check("cuMemcpyDtoD", self.cu.cuMemcpyDtoD(d, s, nbytes))
        else:  # a driver stand-in without device-to-device copies: through the host, in order
            tmp = np.empty(nbytes, np.uint8)
            self.ctx.download(tmp, s)
            self.ctx.upload(d, tmp)
        self._stats["copies"] += 1
        if timed is not None:
            self._end(timed)

    def fill(self, handle: int, offset: int, nbytes: int, word: int) -> None:
        """Fill ``nbytes`` (a multiple of 4) at ``offset`` with the repeated 32-bit ``word``."""
        if nbytes % 4 or offset % 4:
            raise ValueError(f"fill: offset {offset} and nbytes {nbytes} must be multiples of 4")
        addr = self._address(handle, offset, nbytes, "fill")
        word &= 0xFFFFFFFF
        self._use()
        timed = self._begin("fill", 0, nbytes) if self._timing else None
        if hasattr(self.cu, "cuMemsetD32"):
            self._check("cuMemsetD32", self.cu.cuMemsetD32(addr, word, nbytes // 4))
        elif word == 0:
            self.ctx.memset0(addr, nbytes)
        else:  # a driver stand-in without cuMemsetD32: write the words
            self.ctx.upload(addr, np.full(nbytes // 4, word, np.uint32))
        self._stats["fills"] += 1
        if timed is not None:
            self._end(timed)

    # -- program --------------------------------------------------------------------------
    def pipeline(self, kernel: str, variant: str, spec: tuple = (), subgroup_size: int = 0) -> int:
        """Program id for (kernel, variant, specialization constants): the registry's SPIR-V
        translated to PTX and loaded, once.  Warps are 32 threads: ``subgroup_size`` may only be
        0 or 32 (the translator refuses subgroup kernels anyway)."""
        if subgroup_size not in (0, 32):
            raise DeviceError(f"{kernel}.{variant}: {self.name} runs warps of 32 threads, not subgroups of {subgroup_size}")
        key = (kernel, variant, spec)
        pid = self._pipelines.get(key)
        if pid is not None:
            return pid
        from helios.kernels_spirv import registry

        try:
            from . import spirv_ptx
        except ImportError as e:
            raise DeviceError(f"{kernel}.{variant}: {self.name} runs kernels as PTX translated from their SPIR-V, and "
                              f"the translator (helios.cuda_ptx.spirv_ptx) cannot be imported ({e})") from None
        entry = re.sub(r"\W", "_", f"{kernel}_{variant}")
        t = spirv_ptx.translate_cached(registry.spirv(kernel, variant), tuple(int(s) for s in spec), entry, self.target)
        self._use()
        fn = self.ctx.load_kernel(t.ptx, t.entry, t.shared_bytes, self.target)
        pid = len(self._programs)
        self._programs.append(_Program(fn, t))
        self._pipelines[key] = pid
        return pid

    def dispatch(self, pid: int, buffers: list, push: bytes, groups: tuple, name: str, flops: int = 0,
                 nbytes: int = 0) -> None:
        """Launch program ``pid`` over the workgroup grid ``groups``: one .u64 parameter per binding the
        kernel declares (the bound range's address; 0 where the dispatch gives none), then the push
        constants as little-endian .u32 words (padded with zeros).

        This is ``Context.launch(fn, grid=groups, block, args)`` with the parameter block built once
        per program and refilled in place: the per-launch Python cost is most of a small kernel's."""
        p = self._programs[pid]
        with self._lock:  # the program's parameter block is shared by every launch of it
            p.fill(p.vals, buffers, push, self._live, self.name, name)
            if getattr(_tls, "ctx", None) is not self.ctx:
                self._use()
            timed = self._begin(name, flops, nbytes) if self._timing else None
            gx, gy, gz = groups
            res = self.cu.cuLaunchKernel(p.handle, gx, gy, gz, p.bx, p.by, p.bz, p.shared, 0, p.params, 0)
        if res[0] != self._success:
            self._check(f"cuLaunchKernel({p.fn.name})", res)
        self._stats["dispatches"] += 1
        if timed is not None:
            self._end(timed)

    def _engine(self):
        """The tensor-core GEMM (``tensor_gemm.TensorCoreGemm``), or False where this GPU has none or
        HELIOS_TENSOR_CORES=0 (decided once, at first use)."""
        if self._tensor_cores is None:
            from . import tensor_gemm

            self._tensor_cores = (tensor_gemm.TensorCoreGemm(self.ctx)
                                  if tensor_gemm.enabled() and tensor_gemm.runs_on(self.ctx) else False)
        return self._tensor_cores

    def has_gemm(self, in_dtype: str) -> bool:
        """Whether bf16 / fp16 products can go to the tensor cores here (sm_90, not switched off)."""
        from .tensor_gemm import INPUTS

        return in_dtype in INPUTS and bool(self._engine())

    def _gemm_plan(self, a: tuple, b: tuple, c: tuple, m: int, n: int, k: int, in_dtype: str, out_dtype: str,
                   bias: tuple | None, batch: tuple, round_out: bool = False, residual: tuple | None = None) -> tuple | None:
        """The tensor-core GEMM's arguments for one product (``TensorCoreGemm.run`` / ``prepare``), with
        the operands' addresses resolved; None where the engine does not take it."""
        if not self.has_gemm(in_dtype):
            return None
        (ha, oa, lda, a_major), (hb, ob, ldb, major), (hc, oc, ldc) = a, b, c
        isz = 2
        osz = 4 if out_dtype == "float32" else 2
        arows, acols = (m, k) if a_major == "k" else (k, m)
        brows, bcols = (k, n) if major == "n" else (n, k)
        # each operand's span: its matrix, plus the farthest batch offset from the first
        reach = [sum((d[0] - 1) * d[i] for d in batch) for i in (1, 2, 3)]
        pa = self._address(ha, oa, ((arows - 1) * lda + acols + reach[0]) * isz, "gemm")
        pb = self._address(hb, ob, ((brows - 1) * ldb + bcols + reach[1]) * isz, "gemm")
        pc = self._address(hc, oc, ((m - 1) * ldc + n + reach[2]) * osz, "gemm")
        pbias = None if bias is None else self._address(bias[0], bias[1], n * isz, "gemm")
        pres = None
        if residual is not None:  # (handle, byte offset, row pitch) of a float32 M x N matrix
            pres = (self._address(residual[0], residual[1], ((m - 1) * residual[2] + n) * 4, "gemm"), residual[2])
        if not self._engine().accepts(in_dtype, out_dtype, (pa, lda), (pb, ldb), (pc, ldc), m, n, k, pbias, batch,
                                      round_out, pres):
            return None
        return (in_dtype, out_dtype, (pa, lda), a_major, (pb, ldb), major, (pc, ldc), m, n, k, pbias, batch, round_out,
                pres)

    def gemm(self, a: tuple, b: tuple, c: tuple, m: int, n: int, k: int, in_dtype: str, out_dtype: str,
             bias: tuple | None = None, batch: tuple = (), round_out: bool = False, residual: tuple | None = None) -> bool:
        """C = A @ B on the tensor cores (``tensor_gemm``: the ladder's wgmma kernel) where this GPU and
        these operands allow it, every product of ``batch`` in one launch; False otherwise (see the
        contract's ``gemm``)."""
        plan = self._gemm_plan(a, b, c, m, n, k, in_dtype, out_dtype, bias, batch, round_out, residual)
        if plan is None:
            return False
        self._use()
        products = 1
        for d in batch:
            products *= d[0]
        osz = 4 if out_dtype == "float32" else 2
        timed = (self._begin("matmul_wgmma", 2 * m * n * k * products,
                             products * ((m * k + k * n) * 2 + m * n * osz)) if self._timing else None)
        self._engine().run(*plan)
        self._stats["dispatches"] += 1
        if timed is not None:
            self._end(timed)
        return True

    def _flash_engine(self):
        """The tensor-core flash kernels (``tensor_flash.TensorCoreFlash``), or False where this GPU has
        none or HELIOS_TENSOR_CORES=0 (decided once, at first use)."""
        if self._flash_kernels is None:
            from . import tensor_flash, tensor_gemm

            self._flash_kernels = (tensor_flash.TensorCoreFlash(self.ctx)
                                   if tensor_gemm.enabled() and tensor_gemm.runs_on(self.ctx) else False)
        return self._flash_kernels

    def has_flash(self, dtype: str, head_dim: int) -> bool:
        """Whether bf16 / fp16 attention can go to the tensor-core flash kernels here (sm_90, not
        switched off); other head dims run the SIMT kernel, said once at ``HELIOS_DEBUG=1``."""
        from . import tensor_flash

        if dtype not in tensor_flash.DTYPES or not self._flash_engine():
            return False
        if head_dim not in tensor_flash.gen_flash.HEAD_DIMS:
            _debug.log_choice(f"flash attention: head dim {head_dim} runs the SIMT kernel (flash_attn); the "
                              f"tensor-core kernels take {tensor_flash.gen_flash.HEAD_DIMS}")
            return False
        return True

    def _flash_plan(self, pass_: str, dtype: str, problem: tuple, inputs: tuple, outputs: tuple, scale: float,
                    causal: bool, block_mask: tuple | None) -> tuple | None:
        """(the engine's method for the pass, its arguments with the addresses resolved, the trace's name,
        FLOPs, bytes) of one flash pass on the tensor cores; None where they do not take it."""
        from . import tensor_flash as tf

        if not self.has_flash(dtype, problem[5]):
            return None
        engine = self._flash_engine()
        pb = tf.Problem(*problem)
        n_ops = 3 if pass_ == "fwd" else 4
        isz = 2
        ops = []
        for i, (h, off, strides) in enumerate(inputs[:n_ops]):
            heads, t_len = (pb.H, pb.Tq) if i in (0, 3) else (pb.Hk, pb.Tk)
            ops.append(tf.Operand(self._address(h, off, _reach(pb, heads, t_len, strides) * isz, "flash"), tuple(strides)))
        why = tf.why_not(dtype, pb, ops)
        if why is not None:
            _debug.log_choice(f"flash attention {pass_}: {why}: runs the SIMT kernel (flash_attn)")
            return None
        rows_q, rows_k = pb.B * pb.H * pb.Tq, pb.B * pb.Hk * pb.Tk
        mask, pairs = None, None
        if block_mask is not None:
            hm, om, bs, pairs = block_mask
            mask = (self._address(hm, om, 4 * -(-pb.Tq // bs) * -(-pb.Tk // bs), "flash"), bs)
        if pass_ == "fwd":
            o = self._flash_out(outputs[0], pb, pb.H, pb.Tq)
            (hl, ol) = outputs[1]
            lse = self._address(hl, ol, rows_q * 4, "flash")
            if o is None:
                return None
            return (engine.forward_launches, (dtype, pb, *ops, o, lse, scale, causal, mask), "flash_wgmma_fwd",
                    tf.flops(pb, causal, pairs=pairs), (2 * rows_q + 2 * rows_k) * pb.D * isz)
        (hl, ol), (hd, od) = inputs[4], inputs[5]
        lse = self._address(hl, ol, rows_q * 4, "flash")
        delta = self._address(hd, od, rows_q * 4, "flash")
        outs = [None if t is None else self._flash_out(t, pb, heads, t_len)
                for t, heads, t_len in zip(outputs, (pb.H, pb.Hk, pb.Hk), (pb.Tq, pb.Tk, pb.Tk))]
        if any(o is None for o, t in zip(outs, outputs) if t is not None):
            return None  # (_flash_out said why)
        if outs[1] is not None and outs[2] is not None and outs[1].strides != outs[2].strides:
            _debug.log_choice("flash attention bwd: dK and dV with different strides (one pass writes both): runs the "
                              "SIMT kernel (flash_attn)")
            return None
        o, d_bytes = None, 0
        if len(inputs) > 6:  # O: the dQ pass computes D (the contract's flash)
            if outs[0] is None:
                raise ValueError("flash bwd: O is given for the dQ pass to compute D, but dQ is not wanted")
            ho, oo, so = inputs[6]
            o = tf.Operand(self._address(ho, oo, _reach(pb, pb.H, pb.Tq, so) * isz, "flash"), tuple(so))
            why = tf.d_inputs_why_not(o, ops[3])
            if why is not None:
                _debug.log_choice(f"flash attention bwd: D from O and dO in the dQ pass: {why}: declined")
                return None
            d_bytes = rows_q * (2 * pb.D * isz + 4)
        return (engine.backward_launches, (dtype, pb, *ops, lse, delta, *outs, scale, causal, mask, o), "flash_wgmma_bwd",
                tf.flops(pb, causal, backward=True, pairs=pairs), (3 * rows_q + 4 * rows_k) * pb.D * isz + d_bytes)

    def _flash_out(self, out: tuple, pb, heads: int, t_len: int):
        """A flash output ``out`` = (handle, byte offset[, element strides of B, heads, T]: contiguous
        without) as the engine's Operand, or None (logged) where the kernels cannot write it."""
        from . import tensor_flash as tf

        strides = tuple(out[2]) if len(out) > 2 else (heads * t_len * pb.D, t_len * pb.D, pb.D)
        op = tf.Operand(self._address(out[0], out[1], _reach(pb, heads, t_len, strides) * 2, "flash"), strides)
        why = tf.out_strides_why_not(op)
        if why is not None:
            _debug.log_choice(f"flash attention: an output's {why}: runs the SIMT kernel (flash_attn)")
            return None
        return op

    def flash(self, pass_: str, dtype: str, problem: tuple, inputs: tuple, outputs: tuple, scale: float,
              causal: bool, block_mask: tuple | None = None) -> bool:
        """Flash attention on the tensor cores (``tensor_flash``: the ``gen_flash`` kernels) where
        these operands allow it; False otherwise (see the contract's ``flash``)."""
        plan = self._flash_plan(pass_, dtype, problem, inputs, outputs, scale, causal, block_mask)
        if plan is None:
            return False
        launches_of, args, name, flops, nbytes = plan
        self._use()
        timed = self._begin(name, flops, nbytes) if self._timing else None
        launches = launches_of(*args)
        self._flash_engine().run(launches)
        self._stats["dispatches"] += len(launches)
        if timed is not None:
            self._end(timed)
        return True

    # The command lists whose launches run_commands keeps prepared (the graphs being replayed).
    MAX_PREPARED = 8

    def run_commands(self, commands) -> None:
        """Issue recorded commands (a graph's replay; see helios.backend.Runtime.run_commands).

        Each kernel command's launches (a dispatch's one, a tensor-core product's one, a flash pass's
        one or two) are prepared once per command list and kept: their parameter blocks (the bound
        addresses, push words, tensor maps) built in memory of their own, so a replay is one
        ``cuLaunchKernel`` per launch with nothing rebuilt.  A command the graph replaced since (a
        dynamic push constant) is prepared again.  Timed (profiling, HELIOS_DEBUG) runs go through
        :meth:`dispatch`, :meth:`gemm` and :meth:`flash` one by one."""
        if self._timing or self.debug or current_collector() is not None:
            return super().run_commands(commands)
        entry = self._prepared.get(id(commands))
        if entry is None or entry[0] is not commands:
            if entry is not None:  # another list under a reused id
                entry[2].release()
            if len(self._prepared) >= self.MAX_PREPARED:
                self._prepared.pop(next(iter(self._prepared)))[2].release()
            entry = self._prepared[id(commands)] = (commands, [None] * len(commands),
                                                    replay_graphs.RunGraphs(self.cu, self._check))
        slots = entry[1]
        if len(slots) != len(commands):  # the list changed length: prepare it afresh
            slots[:] = [None] * len(commands)
            entry[2].release()
        self._use()
        if self._cuda_graphs:
            self._stats["dispatches"] += self._run_in_graphs(commands, slots, entry[2])
            return
        n = 0
        for i, (kind, args) in enumerate(commands):
            if kind == COPY or kind == FILL:
                (self.copy if kind == COPY else self.fill)(*args)
                continue
            launches, _ = self._slot_launches(slots, i, kind, args)
            self._launch_each(kind, args, launches)
            n += len(launches)
        self._stats["dispatches"] += n

    def _slot_launches(self, slots: list, i: int, kind: int, args: tuple) -> tuple[list, bool]:
        """(the prepared launches of command ``i``, whether they were prepared now): kept in ``slots``
        while the command is the same object, prepared again when the replay replaced it."""
        slot = slots[i]
        if slot is not None and slot[0] is args:
            return slot[1], False
        slots[i] = (args, self._command_launches(kind, args))
        return slots[i][1], True

    def _launch_each(self, kind: int, args: tuple, launches: list) -> None:
        """``cuLaunchKernel`` each prepared launch of one command on the default stream."""
        launch, ok = self.cu.cuLaunchKernel, self._success
        for handle, gx, gy, gz, bx, by, bz, shared, params, _keep in launches:
            res = launch(handle, gx, gy, gz, bx, by, bz, shared, 0, params, 0)
            if res[0] != ok:
                self._check(f"cuLaunchKernel({_command_name(kind, args)})", res)

    def _command_launches(self, kind: int, args: tuple) -> list[tuple]:
        """The prepared launches of one recorded kernel command (DISPATCH, GEMM or FLASH)."""
        if kind == DISPATCH:
            return [self._prepare_launch(*args)]
        if kind == GEMM:
            plan = self._gemm_plan(*args)
            if plan is not None:
                return [self._engine().prepare(*plan)]
        else:
            plan = self._flash_plan(*args)
            if plan is not None:
                return plan[0](*plan[1])
        # the engine took this command when it was recorded, so it takes the same operands now
        raise DeviceError(f"{self.name}: a recorded {_command_name(kind, args)} no longer runs on the tensor cores")

    def use_cuda_graphs(self, on: bool) -> None:
        """Issue replays' runs of launches as CUDA graphs (True) or one launch at a time (False) from
        now on; ``HELIOS_CUDA_GRAPHS`` sets what a new runtime starts with (cuda_ptx/replay_graphs.py)."""
        self._cuda_graphs = bool(on)

    def _run_in_graphs(self, commands, slots: list, graphs: replay_graphs.RunGraphs) -> int:
        """:meth:`run_commands` with each run of consecutive kernel commands (dispatches, tensor-core
        products, flash passes) that holds two or more launches issued as one CUDA graph
        (cuda_ptx/replay_graphs.py); the number of launches issued."""
        i, total, n = 0, len(commands), 0
        while i < total:
            kind, args = commands[i]
            if kind == COPY or kind == FILL:
                (self.copy if kind == COPY else self.fill)(*args)
                i += 1
                continue
            end = i + 1
            while end < total and commands[end][0] not in (COPY, FILL):
                end += 1
            launches, changed = [], []  # changed: positions in the run of launches new since the last replay
            for j in range(i, end):
                kind, a = commands[j]
                more, new = self._slot_launches(slots, j, kind, a)
                if new:
                    changed += range(len(launches), len(launches) + len(more))
                launches += more
            as_graph = len(launches) >= 2 and self._cuda_graphs
            if as_graph and not graphs.launch(i, launches, changed):
                as_graph = self._cuda_graphs = False  # the driver could not build it: one by one from now on
                warnings.warn(f"{self.name}: a replay's launches cannot run as a CUDA graph here "
                              f"({replay_graphs.ENV}=1); they go one by one", RuntimeWarning, stacklevel=3)
            if not as_graph:
                for j in range(i, end):
                    self._launch_each(*commands[j], slots[j][1])
            n += len(launches)
            i = end
        return n

    def _prepare_launch(self, pid: int, buffers: list, push: bytes, groups: tuple, name: str, flops: int = 0,
                        nbytes: int = 0) -> tuple:
        """The arguments of :meth:`dispatch`'s cuLaunchKernel for one command, in a parameter block
        of its own: (function, grid, block, shared bytes, parameter address, the block's owners)."""
        p = self._programs[pid]
        vals, ptrs = p.new_block()
        p.fill(vals, buffers, push, self._live, self.name, name)
        gx, gy, gz = groups
        return (p.handle, gx, gy, gz, p.bx, p.by, p.bz, p.shared, ctypes.addressof(ptrs), (vals, ptrs))

    # -- stream ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every launch on the device (and hand the timed ones to the profiler)."""
        self._use()
        t0 = time.monotonic_ns()
        self.ctx.synchronize()
        t1 = time.monotonic_ns()
        self.last_wait_ns = t1 - t0
        self._stats["fence_waits"] += 1
        col = current_collector()
        if col is not None:
            col.record_op("fence_wait", "", "", t0, t1, ())  # host time blocked on the device
        if self._pending:
            self._drain(col, t1)
        if col is not None:
            now = time.monotonic_ns()
            for pool, p in self._pools.items():
                col.record_memory(now, pool, p.in_use)

    def stats(self) -> dict:
        """Counters since the runtime opened (or :meth:`reset_stats`): dispatches, copies, fills, fence_waits."""
        return dict(self._stats, pending_dispatches=0)

    def reset_stats(self) -> None:
        """Zero the :meth:`stats` counters."""
        for k in self._stats:
            self._stats[k] = 0

    def profiling_started(self, col) -> None:
        """Wait for earlier work (none of it lands in the session), then time every launch."""
        self._use()
        self.ctx.synchronize()
        self._recycle([e for p in self._pending for e in p[4:6]])
        self._pending.clear()
        if col.device_timestamps or self.debug:
            self._start_timing()
        else:
            self._timing = False

    def profiling_stopping(self, col) -> None:
        """Wait, hand the last timed launches to ``col`` (not as a user's fence_wait), stop timing."""
        self._use()
        self.ctx.synchronize()
        if self._pending:
            self._drain(col, time.monotonic_ns())
        self._timing = bool(self.debug)

    # -- timing (profiling and HELIOS_DEBUG) ----------------------------------------------
    def _event(self):
        if self._spare_events:
            return self._spare_events.pop()
        return self._check("cuEventCreate", self.cu.cuEventCreate(0))

    def _recycle(self, events) -> None:
        self._spare_events.extend(events)

    def _start_timing(self) -> None:
        # The anchor: an event recorded on the idle device at a known host time; every device
        # time is its elapsed time from this event plus that host time.  The host time is read
        # before the record: the event completes at it or just after, so device times are never
        # placed later than they happened (after the wait they were, by however long the host
        # took to resume, and a busy host pushed a session's last launches past its end).
        self._use()
        self.ctx.synchronize()
        ev = self._anchor[0] if self._anchor is not None else self._event()
        recorded_ns = time.monotonic_ns()
        self._check("cuEventRecord", self.cu.cuEventRecord(ev, 0))
        self._check("cuEventSynchronize", self.cu.cuEventSynchronize(ev))
        self._anchor = (ev, recorded_ns)
        self._timing = True

    def _begin(self, name: str, flops: int, nbytes: int) -> tuple:
        start, stop = self._event(), self._event()
        host_ns = time.monotonic_ns()
        if not self._pending:
            self._batch_t0 = host_ns
        self._check("cuEventRecord", self.cu.cuEventRecord(start, 0))
        return (name, flops, nbytes, start, stop, host_ns)

    def _end(self, timed: tuple) -> None:
        name, flops, nbytes, start, stop, host_ns = timed
        self._check("cuEventRecord", self.cu.cuEventRecord(stop, 0))
        col = current_collector()
        seq = -1
        if col is not None:
            # Sequence numbers in recording order, as the Vulkan runtime gives them: the host op
            # being recorded (autograd's scope) claims them, or each becomes a host op of its own.
            seq = col.next_dispatch_seq()
            if not op_trace.file_dispatch(seq):
                col.record_op(name, "", "", host_ns, time.monotonic_ns(), (seq,))
        operands = ("", "")
        if self.debug:
            operands = op_trace.current().operands if name not in ("fill", "copy") else (f"{nbytes} B", "")
        self._pending.append((seq, name, flops, nbytes, start, stop, host_ns, operands))

    def _drain(self, col, done_ns: int) -> None:
        """Turn the completed timed commands into device events (the context was just synchronized)."""
        anchor, anchor_ns = self._anchor
        events = []
        for seq, name, flops, nbytes, start, stop, host_ns, operands in self._pending:
            t0 = self._check("cuEventElapsedTime", self.cu.cuEventElapsedTime(anchor, start))
            t1 = self._check("cuEventElapsedTime", self.cu.cuEventElapsedTime(anchor, stop))
            e = {"name": name, "flops": int(flops), "bytes": int(nbytes), "start_ns": anchor_ns + int(t0 * 1e6),
                 "end_ns": anchor_ns + int(t1 * 1e6), "submit": self._submit, "host_record_ns": host_ns}
            if seq >= 0:
                e["dispatch_seq"] = seq
            events.append((e, operands))
            self._recycle((start, stop))
        submits = [{"submit": self._submit, "host_submit_ns": self._batch_t0, "host_done_ns": done_ns,
                    "dispatches": len(events)}]
        self._pending.clear()
        self._submit += 1
        if col is not None:
            col.add_device_events({"events": [e for e, _ in events if "dispatch_seq" in e], "submits": submits})
        if self.debug:
            for e, (shape, dtype) in events:
                _debug.log_kernel(e["name"], shape, e["end_ns"] - e["start_ns"], e["flops"], e["bytes"], dtype,
                                  level=self.debug)


# -- the cuda backend's entry points (helios.backends) ---------------------------------------

CUDA_HINT = ("install NVIDIA's driver; or HELIOS_CUDA_DEVICE=emulator runs the CUDA path on the CPU emulator, "
             "slowly, for tests")


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): whether ``cuda:N`` can open here -- a CUDA driver with a device, or the
    emulator that ``HELIOS_CUDA_DEVICE=emulator`` selects; the reason is the driver's own."""
    from . import driver

    if driver.emulator_requested():
        return True, "emulator"
    return driver.driver_status()


def list_devices() -> list:
    """The CUDA devices a driver (or the emulator) answers for; nothing where none does."""
    from helios.backends import DeviceInfo

    from . import driver

    ok, _ = cuda_status()
    if not ok:
        return []
    if driver.emulator_requested():
        names = ["Helios PTX emulator (sm_90a)"]
    else:
        try:
            cu = driver.driver_api()
            n = driver.check("cuDeviceGetCount", cu.cuDeviceGetCount(), cu=cu)
            names = []
            for i in range(int(n)):
                dev = driver.check("cuDeviceGet", cu.cuDeviceGet(i), cu=cu)
                raw = driver.check("cuDeviceGetName", cu.cuDeviceGetName(128, dev), cu=cu)
                names.append(raw.split(b"\0")[0].decode())
        except DeviceError:
            return []
    return [DeviceInfo(f"cuda:{i}", n, "discrete", dict(CUDA_INFO, name=n, index=i)) for i, n in enumerate(names)]


def open_device(index: int) -> CudaRuntime:
    """A CudaRuntime for cuda:``index``, or a one-line DeviceError saying why not and what to do."""
    ok, why = cuda_status()
    if not ok:
        why = " ".join(str(why).split())  # the driver's reason, on one line
        raise DeviceError(f"cannot open cuda:{index}: {why}. To use it: {CUDA_HINT}")
    return CudaRuntime(index)


def _open_context(index: int):
    """The driver context of cuda:``index``: the process-wide one (``driver.context()``, shared with
    the GEMM runner) for the device HELIOS_CUDA_DEVICE selects, else a context of its own."""
    if _driver.emulator_requested():
        if index != 0:
            raise DeviceError(f"no device cuda:{index}: the CUDA emulator (HELIOS_CUDA_DEVICE=emulator) has cuda:0 only")
        return _driver.context()
    ok, why = _driver.driver_status()
    if not ok:
        raise DeviceError(f"cannot open cuda:{index}: {' '.join(why.split())}")
    cu = _driver.driver_api()
    count = int(_driver.check("cuDeviceGetCount", cu.cuDeviceGetCount(), cu=cu))
    if not 0 <= index < count:
        raise DeviceError(f"no device cuda:{index}: the CUDA driver reports {count} device(s), cuda:0..cuda:{count - 1}")
    chosen = os.environ.get("HELIOS_CUDA_DEVICE", "0").strip()
    if chosen.isdigit() and int(chosen) == index:
        return _driver.context()
    return _driver.Context(index)


__all__ = ["CUDA_INFO", "CudaRuntime", "size_class"]
