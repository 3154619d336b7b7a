"""The CUDA driver API through ``cuda-bindings``: context, modules, memory, tensor maps, launch.

Every call is checked; a failure raises :class:`helios.errors.DeviceError` naming the
call, the driver's error name and string, and (for module loads) the JIT log.
``cuda.bindings`` imports without a driver; :func:`driver_status` says whether one
can actually be initialised, and why not.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from dataclasses import dataclass

from helios.errors import DeviceError, OutOfMemoryError

from . import toolchain
from .config import MAX_DYN_SMEM



def driver_api():
    """The CUDA driver API bindings (``cuda.bindings.driver``); a DeviceError saying how to install them
    where they are missing."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DeviceError("cuda-bindings is not installed; `pip install cuda-bindings` (the `cuda` extra)") from e
    return cu


def _err_text(cu, err) -> str:
    name = cu.cuGetErrorName(err)
    text = cu.cuGetErrorString(err)
    n = name[1].decode() if name[0] == cu.CUresult.CUDA_SUCCESS and name[1] else str(err)
    t = text[1].decode() if text[0] == cu.CUresult.CUDA_SUCCESS and text[1] else ""
    return f"{n}: {t}" if t else n


def check(call: str, result, log: str = "", cu=None):
    """Unpack a cuda-bindings result tuple; raise DeviceError on anything but CUDA_SUCCESS.

    ``cu`` is the driver module that gave ``result`` (by default the real one): it also
    names the error.
    """
    cu = cu or driver_api()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        msg = f"{call} failed: {_err_text(cu, err)}"
        if log:
            msg += f"\nJIT log:\n{log}"
        if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfMemoryError(msg)
        raise DeviceError(msg)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


@functools.lru_cache(maxsize=1)
def driver_status() -> tuple[bool, str]:
    """(usable, reason): whether cuInit succeeds and a device exists here."""
    try:
        cu = driver_api()
    except DeviceError as e:
        return False, str(e)
    try:
        r = cu.cuInit(0)
    except Exception as e:  # noqa: BLE001 - no libcuda: the binding raises its own loader error type
        return False, f"no CUDA driver on this machine ({type(e).__name__}: {e})"
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        return False, f"cuInit failed: {_err_text(cu, r[0])}"
    n = cu.cuDeviceGetCount()
    if n[0] != cu.CUresult.CUDA_SUCCESS or n[1] == 0:
        return False, "the CUDA driver reports no device"
    return True, "ok"


# cuTensorMapEncodeTiled's C signature: (CUtensorMap*, dtype, rank, globalAddress, globalDim*,
# globalStrides*, boxDim*, elementStrides*, interleave, swizzle, l2Promotion, oobFill) -> CUresult.
ENCODE_TILED = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
    ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)


def aligned_buffer(nbytes: int, align: int):
    """(owner, address): ``nbytes`` of zeroed host memory at an ``align``-byte boundary; keep
    the owner alive as long as the address is used."""
    raw = ctypes.create_string_buffer(nbytes + align)
    return raw, (ctypes.addressof(raw) + align - 1) // align * align


@dataclass
class Function:
    """A loaded kernel with the dynamic shared memory it was enabled for."""

    handle: object
    name: str
    shared_bytes: int


class Context:
    """The primary context of one device, made current on this thread.

    ``cu`` is the driver module to use: by default the real one (``cuda.bindings.driver``),
    or a stand-in with the same calls, such as :class:`helios.cuda_ptx.emu.driver.EmulatedDriver`.
    ``jit`` loads kernels as PTX for the driver to compile instead of as cubins built by
    ``ptxas``; by default only where ``ptxas`` is not installed or ``HELIOS_CUDA_JIT=1``.
    """

    def __init__(self, ordinal: int = 0, cu=None, jit: bool | None = None) -> None:
        if cu is None:
            ok, why = driver_status()
            if not ok:
                raise DeviceError(f"cannot use the CUDA driver: {why}")
            cu = driver_api()
        else:
            check("cuInit", cu.cuInit(0), cu=cu)
        self.cu = cu
        if jit is None:
            jit = os.environ.get("HELIOS_CUDA_JIT") == "1" or toolchain.find_tool("ptxas") is None
        self.jit = jit
        self.device = self._check("cuDeviceGet", cu.cuDeviceGet(ordinal))
        self.ctx = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.device))
        self._check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self.ctx))
        a = cu.CUdevice_attribute

        def attr(which) -> int:
            return self._check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(which, self.device))

        self.cc = (attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.sm_count = attr(a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)  # CTAs of a persistent kernel
        self.name = self._check("cuDeviceGetName", cu.cuDeviceGetName(128, self.device)).split(b"\0")[0].decode()
        self._modules: list = []
        self._encode_tiled_fn = None

    def _check(self, call: str, result, log: str = ""):
        return check(call, result, log, self.cu)

    @property
    def arch(self) -> str:
        """ptxas arch for this device: sm_90a on Hopper (wgmma needs the 'a' target)."""
        major, minor = self.cc
        return f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"

    # -- modules ---------------------------------------------------------------------
    def load(self, image: bytes, name: str, shared_bytes: int, ptxas_log: str = "") -> Function:
        """Load a cubin (or PTX) image, fetch ``name``, and allow ``shared_bytes`` of dynamic smem."""
        cu = self.cu
        # The bindings hand the driver a bytes-like option value as its char* (an int address
        # is refused with a TypeError), so the driver writes the log into this bytearray.
        log = bytearray(1 << 14)
        opts = [cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
        res = cu.cuModuleLoadDataEx(image, len(opts), opts, [log, len(log)])
        jit = bytes(log).split(b"\0", 1)[0].decode(errors="replace")
        mod = self._check("cuModuleLoadDataEx", res, log="\n".join(x for x in (jit, ptxas_log) if x))
        self._modules.append(mod)
        fn = self._check(f"cuModuleGetFunction({name})", cu.cuModuleGetFunction(mod, name.encode()))
        if shared_bytes > MAX_DYN_SMEM:
            raise DeviceError(f"{name} asks {shared_bytes} B of shared memory; the device allows {MAX_DYN_SMEM}")
        if shared_bytes > 48 * 1024:
            # Above 48 KiB dynamic shared memory must be opted into per function.
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self._check("cuFuncSetAttribute", cu.cuFuncSetAttribute(fn, attr, shared_bytes))
        return Function(fn, name, shared_bytes)

    def load_kernel(self, ptx: str, name: str, shared_bytes: int, target: str) -> Function:
        """Load the kernel ``name`` of ``ptx`` (built for ``target``): as a cubin that ``ptxas``
        builds (cached), or with :attr:`jit` as the PTX text itself, which the driver compiles."""
        if self.jit:
            return self.load(ptx.encode() + b"\0", name, shared_bytes)  # the driver takes NUL-terminated PTX
        comp = toolchain.compile_ptx(ptx, self.cubin_arch(target))
        return self.load(comp.cubin.read_bytes(), name, shared_bytes, comp.info.log)

    def cubin_arch(self, target: str) -> str:
        """The arch to assemble PTX written for ``target`` into on this device.

        A cubin runs only on the major architecture it was built for (an sm_80 cubin is
        refused by an sm_90 GPU with CUDA_ERROR_NO_BINARY_FOR_GPU), while PTX for a portable
        target assembles for any newer one; so portable targets are built for this device.
        An arch-specific target ('a', such as sm_90a) stays as it is: only that GPU runs it.
        """
        if target.endswith("a"):
            return target
        return self.arch

    # -- memory ----------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Device allocation; returns the address as an int."""
        return int(self._check(f"cuMemAlloc({nbytes})", self.cu.cuMemAlloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        """Free an allocation from :meth:`alloc`."""
        self._check("cuMemFree", self.cu.cuMemFree(ptr))

    def upload(self, ptr: int, host) -> None:
        """Copy a contiguous numpy array to device address ``ptr``."""
        self._check("cuMemcpyHtoD", self.cu.cuMemcpyHtoD(ptr, host.ctypes.data, host.nbytes))

    def download(self, host, ptr: int) -> None:
        """Copy ``host.nbytes`` from device address ``ptr`` into a contiguous numpy array."""
        self._check("cuMemcpyDtoH", self.cu.cuMemcpyDtoH(host.ctypes.data, ptr, host.nbytes))

    def memset0(self, ptr: int, nbytes: int) -> None:
        """Zero ``nbytes`` at ``ptr``."""
        self._check("cuMemsetD8", self.cu.cuMemsetD8(ptr, 0, nbytes))

    def synchronize(self) -> None:
        """Wait for all work on the context; surfaces asynchronous launch errors."""
        self._check("cuCtxSynchronize", self.cu.cuCtxSynchronize())

    # -- tensor maps -----------------------------------------------------------------
    def tensor_map(self, ptr: int, dtype: str, rows: int, cols: int, box_rows: int, box_cols: int,
                   pitch: int | None = None) -> bytes:
        """A 2-D TMA descriptor (128 bytes) over a row-major ``rows x cols`` matrix, 128B swizzle.

        ``cols`` is the contiguous dimension; ``pitch`` the elements from one row to the next
        (default ``cols``: dense rows; more for a view of a wider matrix).  The box is
        ``box_rows x box_cols`` and its inner extent must be the 128-byte swizzle width.
        The 2-D case of :meth:`tensor_map_nd`.
        """
        esz = self._tmap_dtype(dtype)[0]
        pitch = cols if pitch is None else pitch
        if pitch < cols:
            raise DeviceError(f"TMA row pitch {pitch} is shorter than a row of {cols} elements")
        if ptr % 16 or (pitch * esz) % 16:
            raise DeviceError(f"TMA needs 16-byte aligned base and row pitch; got base {ptr:#x}, pitch {pitch * esz}")
        if box_cols * esz != 128 or box_rows > 256:
            raise DeviceError(f"TMA box {box_rows}x{box_cols} must be <=256 rows of exactly 128 bytes")
        return self.tensor_map_nd(ptr, dtype, (cols, rows), (pitch * esz,), (box_cols, box_rows))

    def tensor_map_nd(self, ptr: int, dtype: str, dims, strides, box) -> bytes:
        """A TMA descriptor (128 bytes) over a tensor of rank 1..5, tile mode, 128B swizzle.

        ``dims``: element counts, innermost (contiguous) first; ``strides``: byte strides of
        dims 1..rank-1 (any order of sizes: a view such as one head of a packed
        ``[B, T, 3, H, D]`` buffer is fine); ``box``: the box extents, innermost first, whose
        inner extent must be the 128-byte swizzle width.  ``dtype`` is one of
        ``bf16 fp16 e4m3 f32``.  Element strides are all 1; interleave, L2 promotion and
        out-of-bounds fill are those of :meth:`tensor_map` (elements outside the tensor
        load as zero).  Raises :class:`DeviceError` naming the argument it refuses.
        """
        cu = self.cu
        esz, dt = self._tmap_dtype(dtype)
        dims, strides, box = tuple(int(d) for d in dims), tuple(int(s) for s in strides), tuple(int(b) for b in box)
        rank = len(dims)
        if not 1 <= rank <= 5:
            raise DeviceError(f"TMA dims {dims}: the rank must be 1..5")
        if len(strides) != rank - 1:
            raise DeviceError(f"TMA strides {strides}: a rank-{rank} tensor takes {rank - 1} (bytes, of dims 1..{rank - 1})")
        if len(box) != rank:
            raise DeviceError(f"TMA box {box}: a rank-{rank} tensor takes {rank} extents")
        if ptr % 16:
            raise DeviceError(f"TMA base {ptr:#x} is not 16-byte aligned")
        if any(s % 16 for s in strides):
            raise DeviceError(f"TMA strides {strides} (bytes) must be multiples of 16")
        if box[0] * esz != 128:
            raise DeviceError(f"TMA box {box}: the inner extent is {box[0] * esz} bytes, not the 128-byte swizzle width")
        if any(not 1 <= b <= 256 for b in box):
            raise DeviceError(f"TMA box {box}: each extent must be 1..256")
        # Through the driver's C entry point into our own aligned buffer, not the bindings'
        # wrapper: that one takes the arrays only as cuuint64_t/cuuint32_t objects, and its
        # CUtensorMap lives inside a Python object that is not 64-byte aligned (the API
        # requires 64).  A descriptor's bytes do not depend on where they are written.
        raw, out = aligned_buffer(128, 128)
        err = self._encode_tiled()(
            out, dt.value, rank, ptr,
            (ctypes.c_uint64 * rank)(*dims),  # innermost first
            (ctypes.c_uint64 * max(rank - 1, 1))(*strides),  # strides of dims 1.. in bytes
            (ctypes.c_uint32 * rank)(*box),
            (ctypes.c_uint32 * rank)(*([1] * rank)),
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE.value,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B.value,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B.value,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE.value,
        )
        self._check("cuTensorMapEncodeTiled", (cu.CUresult(err),))
        return ctypes.string_at(out, 128)

    def _tmap_dtype(self, dtype: str):
        """(element bytes, CUtensorMapDataType) of a tensor map dtype name."""
        t = self.cu.CUtensorMapDataType
        table = {
            "bf16": (2, t.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
            "fp16": (2, t.CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
            "e4m3": (1, t.CU_TENSOR_MAP_DATA_TYPE_UINT8),
            "f32": (4, t.CU_TENSOR_MAP_DATA_TYPE_FLOAT32),
        }
        if dtype not in table:
            raise DeviceError(f"TMA dtype {dtype!r}: expected one of {sorted(table)}")
        return table[dtype]

    def _encode_tiled(self):
        """``cuTensorMapEncodeTiled`` as a C function (looked up once, from the driver itself)."""
        if self._encode_tiled_fn is None:
            cu = self.cu
            found = self._check("cuGetProcAddress(cuTensorMapEncodeTiled)", cu.cuGetProcAddress(
                b"cuTensorMapEncodeTiled", 12000, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT))
            pfn = found[0] if isinstance(found, tuple) else found
            if not int(pfn):
                raise DeviceError("the CUDA driver has no cuTensorMapEncodeTiled (it needs CUDA 12.0 or newer)")
            self._encode_tiled_fn = ENCODE_TILED(int(pfn))
        return self._encode_tiled_fn

    def max_active_clusters(self, fn: Function, cluster: int, threads: int) -> int:
        """How many clusters of ``fn`` (``cluster`` CTAs of ``threads`` threads and its dynamic
        shared memory each) the device can hold at once.

        A persistent cluster kernel launches exactly that many: GPCs hold whole clusters
        only, so ``sm_count // cluster`` can be more than fit, and the clusters left over
        would run as a second wave after the others finished all their tiles.  If the
        driver cannot say, a warning names why and ``sm_count // cluster`` is used.
        """
        cu = self.cu
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
        cfg.sharedMemBytes = fn.shared_bytes
        cfg.numAttrs = 0  # the kernel's .reqnctapercluster gives the cluster shape
        err, n = cu.cuOccupancyMaxActiveClusters(fn.handle, cfg)
        n = int(n) if n is not None else 0  # the bindings return (error, None) on failure
        if err != cu.CUresult.CUDA_SUCCESS or n < 1:
            why = _err_text(cu, err) if err != cu.CUresult.CUDA_SUCCESS else "no cluster fits"
            warnings.warn(f"cuOccupancyMaxActiveClusters({fn.name}): {why}; assuming {self.sm_count // cluster}",
                          RuntimeWarning, stacklevel=2)
            return max(1, self.sm_count // cluster)
        return n

    # -- launch ----------------------------------------------------------------------
    def prepare_launch(self, fn: Function, grid: tuple[int, int, int], block: tuple[int, int, int], args: list) -> tuple:
        """A prepared launch of ``fn``: the arguments of ``cuLaunchKernel`` but the stream and ``extra``,
        as (function handle, grid x, y, z, block x, y, z, shared bytes, parameter-array address, the
        owners of the parameter block), built once and launchable any number of times (the runtime's
        replays and CUDA graphs take this form).  ``args``: ("u64" | "u32", int) or ("f32", float)
        pairs, or 128-byte tensor maps (bytes)."""
        store = []
        for a in args:
            if isinstance(a, (bytes, bytearray)):
                raw, base = aligned_buffer(len(a), 128)  # a CUtensorMap is 64- (CUDA 13: 128-) aligned
                ctypes.memmove(base, bytes(a), len(a))
                store.append((raw, base))
            else:
                kind, v = a
                c = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "f32": ctypes.c_float}[kind](v)
                store.append((c, ctypes.addressof(c)))
        ptrs = (ctypes.c_void_p * len(store))(*[p for _, p in store])
        return (fn.handle, *grid, *block, fn.shared_bytes, ctypes.addressof(ptrs), (store, ptrs))

    def launch_prepared(self, launch: tuple, name: str) -> None:
        """Issue one :meth:`prepare_launch` launch on the default stream (``name`` for the error)."""
        handle, gx, gy, gz, bx, by, bz, shared, params, _keep = launch
        self._check(f"cuLaunchKernel({name})", self.cu.cuLaunchKernel(handle, gx, gy, gz, bx, by, bz, shared, 0, params, 0))

    def launch(self, fn: Function, grid: tuple[int, int, int], block: tuple[int, int, int], args: list) -> None:
        """Launch ``fn``; ``args`` are ("u64" | "u32", int) or ("f32", float) pairs, or 128-byte tensor maps (bytes)."""
        self.launch_prepared(self.prepare_launch(fn, grid, block, args), fn.name)

    # -- timing ----------------------------------------------------------------------
    def time_ms(self, body, iters: int) -> float:
        """Mean milliseconds of ``body()`` over ``iters`` runs, bracketed by CUDA events."""
        cu = self.cu
        start = self._check("cuEventCreate", cu.cuEventCreate(0))
        stop = self._check("cuEventCreate", cu.cuEventCreate(0))
        self._check("cuEventRecord", cu.cuEventRecord(start, 0))
        for _ in range(iters):
            body()
        self._check("cuEventRecord", cu.cuEventRecord(stop, 0))
        self._check("cuEventSynchronize", cu.cuEventSynchronize(stop))
        ms = self._check("cuEventElapsedTime", cu.cuEventElapsedTime(start, stop))
        cu.cuEventDestroy(start)
        cu.cuEventDestroy(stop)
        return float(ms) / iters


def emulator_requested() -> bool:
    """Whether ``HELIOS_CUDA_DEVICE`` names the emulated device (``emulator`` or ``emulator:N``)."""
    which = os.environ.get("HELIOS_CUDA_DEVICE", "").strip()
    return which == "emulator" or which.startswith("emulator:")


def context() -> Context:
    """The process-wide context: device 0, or the one ``HELIOS_CUDA_DEVICE`` names.

    That is an ordinal, or ``emulator`` (``emulator:N`` for N SMs; 4 by default): the CPU
    emulator behind :class:`emu_driver.EmulatedDriver`, on which :func:`runner.gemm`, the
    smoke run and anything else that asks for this context run their kernels thread by
    thread -- correct but slow, for checking code paths without a GPU.  One context per
    value of the variable: setting it back gives back the context it named before.
    """
    return _context_for(os.environ.get("HELIOS_CUDA_DEVICE", "0").strip())


def _reset_contexts() -> None:
    """Forget every context made so far (the next :func:`context` makes a fresh one)."""
    _context_for.cache_clear()


context.cache_clear = _reset_contexts  # as when context() itself was the cached function


@functools.lru_cache(maxsize=None)
def _context_for(which: str) -> Context:
    if which == "emulator" or which.startswith("emulator:"):
        from .emu.driver import emulated_context  # here, not at the top: the emulated driver imports this module

        sms = which.partition(":")[2] or "4"
        if not sms.isdigit() or int(sms) < 1:
            raise DeviceError(f"HELIOS_CUDA_DEVICE={which!r}: write emulator:N with N >= 1 SMs")
        return emulated_context(sm_count=int(sms))
    if not which.isdigit():
        raise DeviceError(f"HELIOS_CUDA_DEVICE={which!r}: expected a device ordinal or 'emulator[:SMs]'")
    return Context(int(which))
