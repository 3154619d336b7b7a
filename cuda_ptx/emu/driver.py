"""An emulated CUDA driver: the calls :class:`driver.Context` makes, answered on the CPU.

``Context(cu=EmulatedDriver(), jit=True)`` is a Hopper-like device whose kernels run
in the PTX emulator.  :class:`runner.GemmLaunch` and :class:`driver.Context` run on it
unchanged, so the host code that otherwise only a GPU exercises -- kernel parameters
packed by ``cuLaunchKernel``'s pointer array, tensor maps from
``cuTensorMapEncodeTiled``, the grid and cluster shape, the dynamic shared memory
opt-in, copies in and out -- is checked against what the driver API documents before
the kernel runs thread by thread.

It also answers what a tensor runtime needs: ``cuMemcpyDtoD``, ``cuMemsetD32``, the
``...Async`` copies and sets, streams (``cuStreamCreate/Synchronize/Destroy``; work runs
at once, so a stream only has to exist), ``cuModuleUnload``, ``cuMemGetInfo`` and
``cuDeviceTotalMem``; 3-D blocks and grids for compute kernels; graphs of kernel nodes
(``cuGraphCreate``, ``cuGraphAddKernelNode`` reading each node's parameters when it is added,
``cuGraphInstantiate`` as a snapshot, ``cuGraphExecKernelNodeSetParams``, ``cuGraphLaunch``
running the nodes in the order added, the destroy calls).

What the real driver refuses, this one refuses with the same ``CUresult`` (and says
exactly why in ``cuGetErrorString``); arguments the bindings themselves refuse (a
negative size, a string for a handle) raise their ``OverflowError``/``TypeError``.  What would fault or hang on a GPU raises
:class:`EmulationError` from the launch.  It loads PTX text only (the driver's JIT
path), not cubins.  Launches run to completion before they return, so events time
host wall-clock.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import time
from dataclasses import dataclass

import numpy as np

from ..config import MAX_DYN_SMEM
from ..driver import ENCODE_TILED, Context
from .ops import compile_program, is_compute_program
from .state import EmulationError, GlobalMemory, TensorMap
from .ptx_parse import PtxParseError, PtxProgram, parse

MAX_THREADS = 1024
MAX_GRID = (2**31 - 1, 65535, 65535)
DEFAULT_TOTAL_MEM = 8 << 30  # what cuMemGetInfo / cuDeviceTotalMem report; allocations beyond it fail


def _handle_int(h) -> int:
    """A handle argument as the bindings take it (None, an int, or a CU* object); anything
    else is refused with their ``TypeError``."""
    if h is None:
        return 0
    try:
        return int(h)
    except (TypeError, ValueError):
        raise TypeError("an integer is required") from None


def _c_unsigned(v, bits: int, what: str) -> int:
    """An unsigned C integer argument: the bindings refuse negative or too large values
    with ``OverflowError`` before calling the driver."""
    v = int(v)
    if v < 0:
        raise OverflowError(f"can't convert negative value to {what}")
    if v >= 1 << bits:
        raise OverflowError(f"value too large to convert to {what}")
    return v
DEFAULT_DYN_SMEM = 48 * 1024  # dynamic shared memory a function gets without opting in
MAX_CLUSTER = 8  # portable cluster size
PARAM_BYTES = {"u64": 8, "s64": 8, "b64": 8, "u32": 4, "s32": 4, "b32": 4, "f32": 4, "tmap": 128}  # f32: its bits, read by ld.param.f32

# Element sizes of the tensor map data types (CUtensorMapDataType), by enum name.
TMAP_ELEMENT_BYTES = {
    "UINT8": 1, "UINT16": 2, "UINT32": 4, "INT32": 4, "UINT64": 8, "INT64": 8, "FLOAT16": 2, "FLOAT32": 4,
    "FLOAT64": 8, "BFLOAT16": 2, "FLOAT32_FTZ": 4, "TFLOAT32": 4, "TFLOAT32_FTZ": 4,
}
SWIZZLE_BYTES = {"NONE": 0, "32B": 32, "64B": 64, "128B": 128}

# The 128 opaque bytes of an emulated tensor map: a tag, then the encoding arguments (111 bytes in
# all): tag, address, rank, dims[5], strides[4] (of dims 1..), box[5], element size, swizzle bytes,
# data type; entries past the rank are 0.
_TMAP_TAG = b"HELIOS-EMU-TMAP\0"
_TMAP_LAYOUT = struct.Struct("<16s Q B 5Q 4Q 5H B H B")


def _host_read(src, nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory at an address (int) or in a bytes-like object."""
    if isinstance(src, int):
        return np.frombuffer(ctypes.string_at(src, nbytes), np.uint8)
    view = memoryview(src).cast("B")
    if view.nbytes < nbytes:
        raise _DriverError("INVALID_VALUE", f"host buffer of {view.nbytes} bytes for a copy of {nbytes}")
    return np.frombuffer(view, np.uint8, nbytes)


def _host_write(dst, data: np.ndarray, nbytes: int) -> None:
    if isinstance(dst, int):
        ctypes.memmove(dst, data.ctypes.data, nbytes)
        return
    view = memoryview(dst).cast("B")
    view[:nbytes] = data.tobytes()[:nbytes]


class _DriverError(Exception):
    """A call the driver refuses: its CUresult name and why."""

    def __init__(self, code: str, why: str) -> None:
        super().__init__(why)
        self.code, self.why = code, why


@dataclass
class _Function:
    """A kernel of a loaded module, and the dynamic shared memory it opted into."""

    prog: PtxProgram
    max_dynamic_smem: int = DEFAULT_DYN_SMEM


def decode_tensor_map(raw: bytes) -> TensorMap:
    """The emulator's :class:`TensorMap` for 128 bytes that the emulated ``cuTensorMapEncodeTiled``
    wrote; :class:`EmulationError` for anything else (on a GPU, a TMA through garbage faults)."""
    if len(raw) != 128 or not raw.startswith(_TMAP_TAG):
        raise EmulationError(f"a tensor-map parameter holds {raw[:16]!r}...: not bytes cuTensorMapEncodeTiled made "
                             "(a parameter out of order, or a pointer where a tensor map belongs?)")
    fields = _TMAP_LAYOUT.unpack_from(raw)
    addr, rank = fields[1], fields[2]
    dims, strides, box = fields[3:8], fields[8:12], fields[12:17]
    esize, swizzle = fields[17], fields[18]
    return TensorMap.tiled(addr, dims[:rank], strides[: rank - 1], box[:rank], esize, swizzle)


class EmulatedDriver:
    """The subset of ``cuda.bindings.driver`` that :class:`driver.Context` uses, on the emulator.

    One device of compute capability 9.0 with ``sm_count`` SMs.  ``seed`` varies warp
    order and copy latencies; ``ctas`` limits every launch to those ``(x, y)`` CTAs
    (with their whole clusters).  Allocations start filled with ``0xFF`` bytes (NaN in
    f32 and bf16), so an output element no thread wrote shows.  ``launches`` records
    each launch: grid, block, shared bytes and the decoded parameters.  Methods named
    ``cu*`` are the driver API's calls, with the bindings' arguments and result tuples.
    """

    def __init__(self, sm_count: int = 2, seed: int = 0, ctas: list[tuple[int, int]] | None = None,
                 total_mem: int = DEFAULT_TOTAL_MEM) -> None:
        if sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, got {sm_count}")
        from cuda.bindings import driver as real  # the enums and structs are the real ones

        for enum in ("CUresult", "CUdevice_attribute", "CUjit_option", "CUfunction_attribute", "CUtensorMapDataType",
                     "CUtensorMapInterleave", "CUtensorMapSwizzle", "CUtensorMapL2promotion",
                     "CUtensorMapFloatOOBfill", "CUlaunchConfig", "CUdriverProcAddress_flags",
                     "CUdriverProcAddressQueryResult", "CUDA_KERNEL_NODE_PARAMS"):
            setattr(self, enum, getattr(real, enum))
        # Handles are the bindings' own types (CUmodule, CUfunction, ...) holding an id, so the
        # host code gets back exactly the types it gets from a real driver.
        self._real = real
        self._handles: dict[tuple[str, int], object] = {}
        self._next_id = itertools.count(1)  # never reused, also after a handle is destroyed
        # a C function pointer, as the real driver hands out; kept alive with the driver
        self._encode_tiled_c = ENCODE_TILED(self._encode_tiled)
        self.sm_count, self.seed, self.ctas = sm_count, seed, ctas
        self.memory = GlobalMemory()
        self.total_mem = total_mem
        self._module_functions: dict[int, list[int]] = {}
        self.launches: list[dict] = []
        self._why = ""

    # -- results and handles ---------------------------------------------------------
    def _handle(self, kind: str, obj) -> object:
        """A new ``CU<kind>`` handle of the bindings that stands for ``obj``."""
        key = (kind, next(self._next_id))
        self._handles[key] = obj
        return getattr(self._real, f"CU{kind}")(key[1])

    def _lookup(self, kind: str, handle):
        """What a handle from :meth:`_handle` stands for; INVALID_HANDLE for anything else."""
        obj = self._handles.get((kind, int(handle))) if isinstance(handle, getattr(self._real, f"CU{kind}")) else None
        if obj is None:
            raise _DriverError("INVALID_HANDLE", f"{handle!r} is not a CU{kind} this driver handed out")
        return obj

    def _ok(self, *values):
        return (self.CUresult.CUDA_SUCCESS, *values)

    def _fail(self, e: _DriverError, *nones):
        self._why = e.why
        return (getattr(self.CUresult, f"CUDA_ERROR_{e.code}"), *nones)

    def cuGetErrorName(self, err):
        return self._ok(err.name.encode())

    def cuGetErrorString(self, err):
        return self._ok(f"(emulated driver) {self._why}".encode() if self._why else b"")

    # -- device and context ----------------------------------------------------------
    def cuInit(self, flags):
        return self._ok()

    def cuDeviceGetCount(self):
        return self._ok(1)

    def cuDeviceGet(self, ordinal):
        if ordinal != 0:
            return self._fail(_DriverError("INVALID_DEVICE", f"device {ordinal}: the emulator has device 0 only"), None)
        return self._ok(self._real.CUdevice(0))

    def cuDevicePrimaryCtxRetain(self, device):
        return self._ok(self._real.CUcontext(1))

    def cuCtxSetCurrent(self, ctx):
        return self._ok()

    def cuCtxSynchronize(self):
        return self._ok()  # launches have already finished

    def cuDeviceGetAttribute(self, attr, device):
        a = self.CUdevice_attribute
        values = {a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9, a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                  a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: self.sm_count}
        if attr not in values:
            return self._fail(_DriverError("INVALID_VALUE", f"attribute {attr.name} is not emulated"), None)
        return self._ok(values[attr])

    def cuDeviceGetName(self, length, device):
        return self._ok(b"Helios PTX emulator (sm_90a)".ljust(length, b"\0")[:length])

    # -- modules ---------------------------------------------------------------------
    def cuModuleLoadDataEx(self, image, num_options, options, values):
        """Load NUL-terminated PTX; a parse error goes to the error log buffer, if one was given.

        As in the bindings, a log buffer is a writable bytes-like object (handed to the
        driver as its ``char*``); an int address is refused with a ``TypeError``.
        """
        log = dict(zip(options, values))
        buf = log.get(self.CUjit_option.CU_JIT_ERROR_LOG_BUFFER)
        size = log.get(self.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, 0)
        if buf is not None and not isinstance(buf, (bytes, bytearray)):
            raise TypeError(f"expected bytes, {type(buf).__name__} found")
        try:
            return self._ok(self._handle("module", self._load(image)))
        except _DriverError as e:
            if isinstance(buf, bytearray) and size:
                text = e.why.encode()[: min(size, len(buf)) - 1] + b"\0"
                buf[: len(text)] = text
            return self._fail(e, None)

    def _load(self, image: bytes) -> PtxProgram:
        if bytes(image[:4]) == b"\x7fELF":
            raise _DriverError("INVALID_IMAGE", "the emulated driver runs PTX, not cubins: load with Context(jit=True)")
        if not bytes(image).endswith(b"\0"):
            raise _DriverError("INVALID_IMAGE", "a PTX image must be NUL-terminated")
        text = bytes(image[:-1]).decode()
        try:
            prog = parse(text)
        except PtxParseError as e:
            raise _DriverError("INVALID_PTX", f"ptx parse error: {e}") from e
        if prog.target not in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"):
            raise _DriverError("NO_BINARY_FOR_GPU", f".target {prog.target} does not run on an sm_90 device")
        if is_compute_program(prog):  # compiled at load, as the driver's JIT would, so errors show here
            try:
                compile_program(prog)
            except EmulationError as e:
                raise _DriverError("INVALID_PTX", f"the emulator cannot run this kernel: {e}") from e
        return prog

    def cuModuleGetFunction(self, handle, name: bytes):
        try:
            prog = self._lookup("module", handle)
            if name.decode() != prog.name:
                raise _DriverError("NOT_FOUND", f"no kernel {name.decode()!r} in the module (it has {prog.name!r})")
        except _DriverError as e:
            return self._fail(e, None)
        fn = self._handle("function", _Function(prog))
        self._module_functions.setdefault(int(handle), []).append(int(fn))
        return self._ok(fn)

    def cuModuleUnload(self, handle):
        """Unload a module; its functions' handles stop being valid, as on the driver."""
        _handle_int(handle)
        try:
            self._lookup("module", handle)
        except _DriverError as e:
            return self._fail(e)
        del self._handles[("module", int(handle))]
        for f in self._module_functions.pop(int(handle), []):
            self._handles.pop(("function", f), None)
        return self._ok()

    def cuFuncSetAttribute(self, handle, attr, value):
        try:
            fn = self._lookup("function", handle)
        except _DriverError as e:
            return self._fail(e)
        if attr != self.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            return self._fail(_DriverError("INVALID_VALUE", f"function attribute {attr.name} is not emulated"))
        if not 0 <= value <= MAX_DYN_SMEM:
            return self._fail(_DriverError("INVALID_VALUE", f"dynamic shared memory {value} B: the device allows "
                                                            f"{MAX_DYN_SMEM}"))
        fn.max_dynamic_smem = value
        return self._ok()

    # -- memory ----------------------------------------------------------------------
    def cuMemAlloc(self, nbytes):
        _c_unsigned(nbytes, 64, "size_t")
        if nbytes == 0:
            return self._fail(_DriverError("INVALID_VALUE", "cuMemAlloc of 0 bytes"), None)
        if self.memory.allocated_bytes + nbytes > self.total_mem:
            return self._fail(_DriverError("OUT_OF_MEMORY", f"cuMemAlloc of {nbytes} bytes: "
                                                            f"{self.total_mem - self.memory.allocated_bytes} free"), None)
        return self._ok(self._real.CUdeviceptr(self.memory.alloc(nbytes, fill=0xFF)))

    def cuMemFree(self, ptr):
        try:
            self.memory.free(int(ptr))
        except EmulationError as e:
            return self._fail(_DriverError("INVALID_VALUE", str(e)))
        return self._ok()

    def _device_bytes(self, ptr, nbytes) -> np.ndarray:
        try:
            return self.memory.view(int(ptr), nbytes)
        except EmulationError as e:
            raise _DriverError("INVALID_VALUE", str(e)) from e

    def cuMemcpyHtoD(self, dst, src, nbytes):
        _c_unsigned(nbytes, 64, "size_t")
        try:
            self._device_bytes(dst, nbytes)[:] = _host_read(src, nbytes)
        except _DriverError as e:
            return self._fail(e)
        return self._ok()

    def cuMemcpyDtoH(self, dst, src, nbytes):
        _c_unsigned(nbytes, 64, "size_t")
        try:
            data = np.ascontiguousarray(self._device_bytes(src, nbytes))
        except _DriverError as e:
            return self._fail(e)
        _host_write(dst, data, nbytes)
        return self._ok()

    def cuMemsetD8(self, ptr, value, nbytes):
        value = _c_unsigned(value, 8, "unsigned char")
        _c_unsigned(nbytes, 64, "size_t")
        try:
            self._device_bytes(ptr, nbytes)[:] = value
        except _DriverError as e:
            return self._fail(e)
        return self._ok()

    def cuMemsetD32(self, ptr, value, count):
        """Set ``count`` 32-bit words at a 4-byte aligned ``ptr`` to ``value``."""
        value = _c_unsigned(value, 32, "unsigned int")
        count = _c_unsigned(count, 64, "size_t")
        try:
            if int(ptr) % 4:
                raise _DriverError("INVALID_VALUE", f"cuMemsetD32 at {int(ptr):#x}: not 4-byte aligned")
            self._device_bytes(ptr, 4 * count).view(np.uint32)[:] = value
        except _DriverError as e:
            return self._fail(e)
        return self._ok()

    def cuMemcpyDtoD(self, dst, src, nbytes):
        """Copy ``nbytes`` between device allocations (overlapping ranges copy as if through a buffer)."""
        _c_unsigned(nbytes, 64, "size_t")
        try:
            data = self._device_bytes(src, nbytes).copy()
            self._device_bytes(dst, nbytes)[:] = data
        except _DriverError as e:
            return self._fail(e)
        return self._ok()

    def cuMemGetInfo(self):
        """``(free, total)`` bytes of the emulated device."""
        used = self.memory.allocated_bytes
        return self._ok(max(self.total_mem - used, 0), self.total_mem)

    def cuDeviceTotalMem(self, device):
        if _handle_int(device) != 0:
            return self._fail(_DriverError("INVALID_DEVICE", f"device {int(device)}: the emulator has device 0 only"),
                              None)
        return self._ok(self.total_mem)

    # -- streams: work runs at once, so a stream only has to exist -------------------
    def _stream(self, stream) -> None:
        """Check a stream argument: 0 / None (the default stream) or one from cuStreamCreate."""
        if _handle_int(stream) == 0:
            return
        if not isinstance(stream, self._real.CUstream) or ("stream", int(stream)) not in self._handles:
            raise _DriverError("INVALID_HANDLE", f"{stream!r} is not a CUstream this driver handed out")

    def cuStreamCreate(self, flags):
        _c_unsigned(flags, 32, "unsigned int")
        return self._ok(self._handle("stream", {"flags": int(flags)}))

    def cuStreamSynchronize(self, stream):
        try:
            self._stream(stream)
        except _DriverError as e:
            return self._fail(e)
        return self._ok()  # its work has already run

    def cuStreamDestroy(self, stream):
        try:
            if _handle_int(stream) == 0:
                raise _DriverError("INVALID_HANDLE", "the default stream cannot be destroyed")
            self._stream(stream)
        except _DriverError as e:
            return self._fail(e)
        del self._handles[("stream", int(stream))]
        return self._ok()

    def _on_stream(self, stream, call, *args):
        try:
            self._stream(stream)
        except _DriverError as e:
            return self._fail(e)
        return call(*args)

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        return self._on_stream(stream, self.cuMemcpyHtoD, dst, src, nbytes)

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
        return self._on_stream(stream, self.cuMemcpyDtoH, dst, src, nbytes)

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        return self._on_stream(stream, self.cuMemcpyDtoD, dst, src, nbytes)

    def cuMemsetD32Async(self, ptr, value, count, stream):
        return self._on_stream(stream, self.cuMemsetD32, ptr, value, count)

    def cuMemsetD8Async(self, ptr, value, nbytes, stream):
        return self._on_stream(stream, self.cuMemsetD8, ptr, value, nbytes)

    # -- tensor maps -----------------------------------------------------------------
    def cuGetProcAddress(self, symbol, cuda_version, flags):
        """The C entry points the host calls directly: ``cuTensorMapEncodeTiled`` only."""
        found = self.CUdriverProcAddressQueryResult
        if bytes(symbol) != b"cuTensorMapEncodeTiled":
            return self._ok(0, found.CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        return self._ok(ctypes.cast(self._encode_tiled_c, ctypes.c_void_p).value, found.CU_GET_PROC_ADDRESS_SUCCESS)

    def _encode_tiled(self, out, dtype, rank, address, dims, strides, box, element_strides, interleave, swizzle,
                      l2_promotion, oob_fill) -> int:
        """``cuTensorMapEncodeTiled`` called through its C signature: check the arguments
        against the driver API's documented rules, then against what the emulator models
        (rank 1..5, strides of any size, no interleave, 128-byte swizzle, unit element
        strides), and write the 128 bytes."""
        try:
            if not 1 <= rank <= 5:
                raise _DriverError("INVALID_VALUE", f"tensorRank {rank} must be 1..5")
            if not out or out % 64:
                raise _DriverError("INVALID_VALUE", f"tensorMap address {out or 0:#x} must be 64-byte aligned")
            payload = self._encode(self.CUtensorMapDataType(dtype), rank, address or 0, [dims[i] for i in range(rank)],
                                   [strides[i] for i in range(rank - 1)], [box[i] for i in range(rank)],
                                   [element_strides[i] for i in range(rank)],
                                   self.CUtensorMapInterleave(interleave), self.CUtensorMapSwizzle(swizzle))
        except _DriverError as e:
            return int(self._fail(e)[0])
        except ValueError as e:  # an int that is no member of its enum
            return int(self._fail(_DriverError("INVALID_VALUE", str(e)))[0])
        ctypes.memmove(out, payload.ljust(128, b"\0"), 128)
        return 0

    def _encode(self, dtype, rank, address, dims, strides, box, element_strides, interleave, swizzle) -> bytes:
        bad = lambda why: _DriverError("INVALID_VALUE", why)  # noqa: E731
        kind = dtype.name.removeprefix("CU_TENSOR_MAP_DATA_TYPE_")
        if kind not in TMAP_ELEMENT_BYTES:
            raise _DriverError("NOT_SUPPORTED", f"tensor map data type {kind} is not emulated")
        esize = TMAP_ELEMENT_BYTES[kind]
        no_interleave = interleave == self.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
        if address % 16:
            raise bad(f"globalAddress {address:#x} is not 16-byte aligned")
        if any(not 0 < d <= 1 << 32 for d in dims):
            raise bad(f"globalDim {dims}: each must be in 1..2^32")
        if any(s % 16 or s >= 1 << 40 for s in strides):
            raise bad(f"globalStrides {strides}: each must be a multiple of 16 below 2^40")
        if any(not 0 < b <= 256 for b in box):
            raise bad(f"boxDim {box}: each must be in 1..256")
        if no_interleave and box[0] * esize % 16:
            raise bad(f"boxDim[0] * element size = {box[0] * esize} B must be a multiple of 16")
        if any(not 0 < e <= 8 for e in element_strides):
            raise bad(f"elementStrides {element_strides}: each must be in 1..8")
        span = SWIZZLE_BYTES.get(swizzle.name.removeprefix("CU_TENSOR_MAP_SWIZZLE_"))
        if span is None:
            raise _DriverError("NOT_SUPPORTED", f"swizzle {swizzle.name} is not emulated")
        if no_interleave and span and box[0] * esize > span:
            raise bad(f"the box's inner extent {box[0] * esize} B exceeds the {span}-byte swizzle")
        # what the emulator's TMA models
        if not no_interleave or span != 128 or any(e != 1 for e in element_strides):
            raise _DriverError("NOT_SUPPORTED", "the emulator models tensor maps with 128-byte swizzle, no "
                                                "interleave and unit element strides")
        if rank > 1 and strides[0] < dims[0] * esize:
            raise bad(f"globalStrides[0] = {strides[0]} B is shorter than a row of {dims[0]} elements of {esize} B")
        pad = lambda v, n: list(v) + [0] * (n - len(v))  # noqa: E731
        return _TMAP_LAYOUT.pack(_TMAP_TAG, address, rank, *pad(dims, 5), *pad(strides, 4), *pad(box, 5), esize, span,
                                 int(dtype))

    # -- occupancy and launch --------------------------------------------------------
    def cuOccupancyMaxActiveClusters(self, handle, config):
        """Clusters of the kernel's required size that fit at once: one CTA per SM."""
        try:
            fn = self._lookup("function", handle)
            self._check_block(fn, config.blockDimX, config.blockDimY, config.blockDimZ, config.sharedMemBytes)
        except _DriverError as e:
            return self._fail(e, None)
        size = (fn.prog.cluster or (1, 1, 1))[0]
        return self._ok(self.sm_count // size)

    def _check_block(self, fn: _Function, bx, by, bz, shared) -> None:
        threads = bx * by * bz
        if threads > MAX_THREADS or (fn.prog.maxntid is not None and threads > fn.prog.maxntid):
            raise _DriverError("INVALID_VALUE", f"{threads} threads per block exceed the kernel's .maxntid "
                                                f"{fn.prog.maxntid} (or {MAX_THREADS})")
        if min(bx, by, bz) < 1 or bx > 1024 or by > 1024 or bz > 64:
            raise _DriverError("INVALID_VALUE", f"block ({bx}, {by}, {bz}): each extent must be at least 1 and at most "
                                                "(1024, 1024, 64)")
        if (by, bz) != (1, 1) and not is_compute_program(fn.prog):
            raise _DriverError("NOT_SUPPORTED", f"{fn.prog.name} runs on the emulator's warp scheduler, which takes "
                                                "1-D blocks only")
        if shared > fn.max_dynamic_smem:
            raise _DriverError("INVALID_VALUE", f"{shared} B of dynamic shared memory; {fn.prog.name} allows "
                                                f"{fn.max_dynamic_smem} (raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)")

    def cuLaunchKernel(self, handle, gx, gy, gz, bx, by, bz, shared, stream, kernel_params, extra):
        """Run the kernel to completion.  ``kernel_params`` is the address of an array holding
        one pointer per kernel parameter; each parameter's bytes are read from there."""
        try:
            fn = self._lookup("function", handle)
            self._check_block(fn, bx, by, bz, shared)
            self._stream(stream)
            if extra:
                raise _DriverError("NOT_SUPPORTED", "parameters through `extra` are not emulated")
            self._check_grid(fn, (gx, gy, gz))
            params = self._read_params(fn.prog, int(kernel_params))
        except _DriverError as e:
            return self._fail(e)
        self._run(fn, (gx, gy, gz), (bx, by, bz), shared, params)
        return self._ok()

    def _check_grid(self, fn: _Function, grid: tuple) -> None:
        """A launch's (or a graph kernel node's) grid, checked as the driver checks it."""
        gx, gy, gz = grid
        if min(gx, gy, gz) < 1 or gx > MAX_GRID[0] or gy > MAX_GRID[1] or gz > MAX_GRID[2]:
            raise _DriverError("INVALID_VALUE", f"grid ({gx}, {gy}, {gz}): each extent must be at least 1 and at "
                                                f"most {MAX_GRID}")
        if gz != 1 and not is_compute_program(fn.prog):
            raise _DriverError("NOT_SUPPORTED", f"grid ({gx}, {gy}, {gz}): {fn.prog.name} runs on the emulator's "
                                                "warp scheduler, which takes 2-D grids")
        size = (fn.prog.cluster or (1, 1, 1))[0]
        if size > MAX_CLUSTER or gx % size:
            raise _DriverError("INVALID_CLUSTER_SIZE", f"grid x {gx} is not a whole number of clusters of "
                                                       f"{size} CTAs (at most {MAX_CLUSTER})")

    def _run(self, fn: _Function, grid: tuple, block: tuple, shared: int, params: dict, graph: bool = False) -> None:
        """Emulate one launch to completion (recorded in :attr:`launches`)."""
        from .launch import emulate_kernel  # here, not at the top: emulate imports this module

        self.launches.append({"kernel": fn.prog.name, "grid": grid, "block": block, "shared_bytes": shared,
                              "params": params, "graph": graph})
        emulate_kernel(fn.prog, block, shared, params, self.memory, grid, self.seed, self.ctas)

    # -- graphs: kernel nodes only; a launch runs an instantiated graph's nodes in the order added
    # (each node's dependencies were added before it), on the stream at once ---------------------
    def cuGraphCreate(self, flags):
        _c_unsigned(flags, 32, "unsigned int")
        if flags:
            return self._fail(_DriverError("INVALID_VALUE", "cuGraphCreate's flags must be 0"), None)
        return self._ok(self._handle("graph", {"nodes": []}))

    def cuGraphAddKernelNode(self, graph, dependencies, num_dependencies, params):
        """A kernel node; its parameters' values are read now, as the driver copies them."""
        try:
            g = self._lookup("graph", graph)
            deps = list(dependencies or [])
            if len(deps) != num_dependencies or len({int(d) for d in deps}) != len(deps):
                raise _DriverError("INVALID_VALUE", f"{num_dependencies} dependencies declared, {len(deps)} distinct given")
            for d in deps:
                if self._lookup("graphNode", d)["graph"] is not g:
                    raise _DriverError("INVALID_VALUE", f"dependency {d!r} is a node of another graph")
            node = dict(self._kernel_node(params), graph=g)
        except _DriverError as e:
            return self._fail(e, None)
        node["index"] = len(g["nodes"])
        g["nodes"].append(node)
        return self._ok(self._handle("graphNode", node))

    def cuGraphInstantiate(self, graph, flags):
        try:
            g = self._lookup("graph", graph)
        except _DriverError as e:
            return self._fail(e, None)
        # the executable graph is a snapshot: later changes to the graph do not reach it
        return self._ok(self._handle("graphExec", {"graph": g, "nodes": [dict(n) for n in g["nodes"]]}))

    def cuGraphExecKernelNodeSetParams(self, graph_exec, node, params):
        """New parameters (read now) for one kernel node of an executable graph."""
        try:
            e = self._lookup("graphExec", graph_exec)
            n = self._lookup("graphNode", node)
            if n["graph"] is not e["graph"]:
                raise _DriverError("INVALID_VALUE", f"{node!r} is not a node of the graph this one was instantiated from")
            launch = self._kernel_node(params)
        except _DriverError as err:
            return self._fail(err)
        e["nodes"][n["index"]] = dict(n, **launch)
        return self._ok()

    def _kernel_node(self, params) -> dict:
        """A CUDA_KERNEL_NODE_PARAMS checked as a launch is, its parameter values read now."""
        if params.extra:
            raise _DriverError("NOT_SUPPORTED", "parameters through `extra` are not emulated")
        grid = (params.gridDimX, params.gridDimY, params.gridDimZ)
        block = (params.blockDimX, params.blockDimY, params.blockDimZ)
        fn = self._lookup("function", params.func)
        self._check_block(fn, *block, params.sharedMemBytes)
        self._check_grid(fn, grid)
        return {"fn": fn, "grid": grid, "block": block, "shared": params.sharedMemBytes,
                "params": self._read_params(fn.prog, int(params.kernelParams))}

    def cuGraphLaunch(self, graph_exec, stream):
        try:
            e = self._lookup("graphExec", graph_exec)
            self._stream(stream)
        except _DriverError as err:
            return self._fail(err)
        for n in e["nodes"]:
            self._run(n["fn"], n["grid"], n["block"], n["shared"], n["params"], graph=True)
        return self._ok()

    def cuGraphExecDestroy(self, graph_exec):
        return self._destroy("graphExec", graph_exec)

    def cuGraphDestroy(self, graph):
        """Destroy a graph and its nodes (executable graphs made from it live on)."""
        try:
            g = self._lookup("graph", graph)
        except _DriverError as e:
            return self._fail(e)
        for key in [k for k, v in self._handles.items() if k[0] == "graphNode" and v["graph"] is g]:
            del self._handles[key]
        return self._destroy("graph", graph)

    def _destroy(self, kind: str, handle):
        try:
            self._lookup(kind, handle)
        except _DriverError as e:
            return self._fail(e)
        del self._handles[(kind, int(handle))]
        return self._ok()

    def _read_params(self, prog: PtxProgram, array: int) -> dict[str, object]:
        if not array:
            raise _DriverError("INVALID_VALUE", f"{prog.name} has {len(prog.params)} parameters and none were given")
        params: dict[str, object] = {}
        for i, p in enumerate(prog.params):
            ptr = ctypes.c_void_p.from_address(array + 8 * i).value
            if not ptr:
                raise _DriverError("INVALID_VALUE", f"kernelParams[{i}] ({p.name}) is a null pointer")
            if p.kind not in PARAM_BYTES:
                raise _DriverError("NOT_SUPPORTED", f"parameter {p.name} of type .{p.kind} is not emulated")
            raw = ctypes.string_at(ptr, PARAM_BYTES[p.kind])
            params[p.name] = decode_tensor_map(raw) if p.kind == "tmap" else int.from_bytes(raw, "little")
        return params

    # -- events ----------------------------------------------------------------------
    def cuEventCreate(self, flags):
        return self._ok(self._handle("event", {"recorded": None}))

    def cuEventRecord(self, event, stream):
        try:
            self._lookup("event", event)["recorded"] = time.perf_counter()
        except _DriverError as e:
            return self._fail(e)
        return self._ok()

    def cuEventSynchronize(self, event):
        try:
            self._lookup("event", event)
        except _DriverError as e:
            return self._fail(e)
        return self._ok()  # launches have already finished

    def cuEventElapsedTime(self, start, stop):
        try:
            t0, t1 = self._lookup("event", start)["recorded"], self._lookup("event", stop)["recorded"]
            if t0 is None or t1 is None:
                raise _DriverError("INVALID_HANDLE", "an event that was never recorded")
        except _DriverError as e:
            return self._fail(e, None)
        return self._ok((t1 - t0) * 1e3)

    def cuEventDestroy(self, event):
        self._handles.pop(("event", int(event)), None)
        return self._ok()


def emulated_context(sm_count: int = 2, seed: int = 0, ctas: list[tuple[int, int]] | None = None):
    """A :class:`driver.Context` on a fresh :class:`EmulatedDriver` (loading PTX, not cubins)."""
    return Context(cu=EmulatedDriver(sm_count, seed, ctas), jit=True)


__all__ = ["EmulatedDriver", "decode_tensor_map", "emulated_context"]
