"""Device selection and the runtimes behind the device contract (helios.backend).

``devices()`` lists what exists, ``set_device("vulkan:N")`` / ``set_device("cuda:N")`` (or
``HELIOS_DEVICE``) picks one; the default is the best Vulkan device present (discrete GPU >
integrated GPU > CPU).  :class:`VulkanRuntime` implements :class:`helios.backend.Runtime` on
one ``helios._vulkan.Device``: it turns (kernel, variant, specialization constants) into
cached pipelines and records dispatches.  ``cuda:N`` opens
``helios.cuda_ptx.tensor_runtime.CudaRuntime`` (PTX made from the same SPIR-V, run through
the CUDA driver API or, with ``HELIOS_CUDA_DEVICE=emulator``, the PTX emulator).  "cpu" is
:class:`HostRuntime`: host memory that holds data and runs no kernels.  Nothing here waits:
work is recorded and submitted by the backend's command stream.
"""

from __future__ import annotations

import collections
import os
import time

import numpy as np

from helios.backend import POOLS, Runtime  # noqa: F401  (Runtime: the contract, imported from here too)
from helios import elementwise_jit
from helios import backends, op_trace
from helios.backends import DeviceInfo
from helios.errors import DeviceError, OutOfMemoryError
from helios.kernels_spirv import registry
from helios.kernels_spirv.specialize import specialize
from helios.profile import debug as _debug
from helios.profile import profiler as _prof
from helios.profile.profiler import current_collector

# The op each dispatch belongs to (HELIOS_DEBUG operands, the profiler's op -> kernels links).
_TRACE = op_trace.current()


INSTALL_HINT = (
    "Helios needs a Vulkan 1.2 device. On Debian/Ubuntu install the loader and the CPU driver "
    "(lavapipe): apt-get install libvulkan1 mesa-vulkan-drivers; check with `vulkaninfo --summary`."
)
_vk = None


def _addon():
    global _vk
    if _vk is None:
        try:
            from helios import _vulkan
        except ImportError as e:  # missing loader (libvulkan.so.1) or an unbuilt addon
            raise DeviceError(f"cannot load the Vulkan addon helios._vulkan ({e}). {INSTALL_HINT}") from None
        _vk = _vulkan
    return _vk


def _vulkan_devices() -> list[DeviceInfo]:
    """Every Vulkan device, GPUs first (lavapipe shows as a ``cpu`` device); DeviceError where the
    addon cannot load (it says what to install)."""
    return [DeviceInfo(f"vulkan:{d['index']}", d["name"], d["type"], d) for d in _addon().enumerate_devices()]


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): whether ``cuda:N`` can open here (see helios.cuda_ptx.tensor_runtime.cuda_status)."""
    try:
        from helios.cuda_ptx.tensor_runtime import cuda_status as status
    except Exception as e:  # noqa: BLE001 - a broken install must not break Vulkan users
        return False, f"cannot import helios.cuda_ptx ({type(e).__name__}: {e})"
    return status()


def devices() -> list[DeviceInfo]:
    """Every device of every registered backend (helios.backends), in registration order: the
    Vulkan devices (GPUs first; lavapipe shows as a ``cpu`` device), then the CUDA devices when a
    CUDA driver answers (or ``HELIOS_CUDA_DEVICE=emulator`` selects the emulator).  A backend that
    cannot run here is left out; with no device at all, the first such backend's DeviceError (the
    Vulkan addon's: what to install) is raised."""
    found, first_error = [], None
    for kind in backends.kinds():
        try:
            found += backends.backend(kind).list()
        except DeviceError as e:
            first_error = first_error or e
    if not found and first_error is not None:
        raise first_error
    return found


def device_names() -> str:
    """The devices a tensor can live on, for error messages: "cpu, vulkan:0 (llvmpipe ...), cuda:0 (...)"."""
    names = ["cpu"]
    for kind in backends.kinds():
        try:
            names += [f"{d.name} ({d.description})" for d in backends.backend(kind).list()]
        except DeviceError:
            pass
    return ", ".join(names)


def parse_device(spec) -> tuple[str, int] | None:
    """(kind, index) that ``spec`` names -- ("vulkan", N) or ("cuda", N) -- or None for "cpu".

    ``spec``: "cpu", "vulkan" / "cuda" (the current device of that kind, else index 0),
    "vulkan:N", "cuda:N", a :class:`device`, or an int N (vulkan:N).  Anything else is a
    DeviceError naming it and the devices that exist."""
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return ("vulkan", spec)
    if not isinstance(spec, str):  # torch.device and the like: their str() is the name
        spec = str(spec) if type(spec).__name__ == "device" else spec
    if not isinstance(spec, str):
        raise DeviceError(f"unknown device {spec!r} ({type(spec).__name__}): expected {backends.spellings()}; "
                          f"devices here: {device_names()}")
    kind, sep, num = spec.strip().partition(":")
    if kind == "cpu" and (not sep or num == "0"):
        return None
    if kind in backends.kinds():
        if not sep:
            if _current is not None and _current.name.startswith(kind + ":"):
                return (kind, _current.index)
            env = os.environ.get("HELIOS_DEVICE", "")
            return parse_device(env) if env.startswith(kind + ":") else (kind, 0)
        if num.isdigit():
            return (kind, int(num))
        raise DeviceError(f"bad device {spec!r}: expected '{kind}:N' with N an integer; devices here: {device_names()}")
    raise DeviceError(f"unknown device {spec!r}: expected {backends.spellings()}; devices here: {device_names()}")


class device(str):
    """A device as PyTorch spells it: ``device("vulkan:0")``, ``device("cuda", 0)``,
    ``device("cpu")``; ``.type`` ("cpu", "vulkan" or "cuda") and ``.index`` (None for "cpu"
    and for a bare "vulkan" / "cuda", which means the current device of that kind).  It is a
    ``str`` subclass, so ``t.device == "vulkan:0"`` holds and it goes wherever a device name
    goes.  Naming a device that does not exist is not checked here but where a tensor is put on it."""

    def __new__(cls, type_or_name="vulkan", index: int | None = None):
        if isinstance(type_or_name, device) and index is None:
            return type_or_name
        if isinstance(type_or_name, int) and not isinstance(type_or_name, bool) and index is None:
            type_or_name = f"vulkan:{type_or_name}"
        name = str(type_or_name) if type(type_or_name).__name__ == "device" else type_or_name
        if not isinstance(name, str):
            raise DeviceError(f"unknown device {type_or_name!r}: expected {backends.spellings()}; devices here: {device_names()}")
        if index is not None:
            if ":" in name:
                raise DeviceError(f"device({name!r}, {index}): give the index once, in the name or as the second argument")
            name = f"{name}:{int(index)}"
        if name.strip() == "cpu:0":
            name = "cpu"
        parsed = parse_device(name)  # validates the spelling
        kind, idx = ("cpu", None) if parsed is None else parsed
        out = str.__new__(cls, kind if ":" not in name else f"{kind}:{idx}")
        out._type, out._index = kind, (idx if ":" in name else None)
        return out

    @property
    def type(self) -> str:
        """"cpu", "vulkan" or "cuda"."""
        return self._type

    @property
    def index(self) -> int | None:
        """The device number, or None for "cpu" and a bare "vulkan" / "cuda"."""
        return self._index

    def __repr__(self) -> str:
        return f"device(type={self._type!r})" if self._index is None else f"device(type={self._type!r}, index={self._index})"


class VulkanRuntime(Runtime):
    """One open Vulkan device behind the contract: pipelines, dispatch, memory, synchronisation."""

    is_host = False

    def __init__(self, index: int):
        vk = _addon()
        found = vk.enumerate_devices()
        if not found:
            reason = vk.last_error() if hasattr(vk, "last_error") else "no device"
            raise DeviceError(f"no Vulkan device found ({reason}). {INSTALL_HINT}")
        if not 0 <= index < len(found):
            raise DeviceError(f"no device vulkan:{index}: devices here: {device_names()}")
        self.index = index
        self.name = f"vulkan:{index}"
        self.device = device(self.name)
        cache = os.path.join(registry.cache_dir(), "pipelines")
        os.makedirs(cache, exist_ok=True)
        self.dev = vk.Device(index, cache)  # the addon: only this class drives it
        self.info = self.dev.info
        self.max_range = int(self.info["limits"]["max_storage_buffer_range"])
        self.align = max(256, int(self.info["limits"]["min_storage_buffer_offset_alignment"]))
        self.features = self.info["features"]
        self.has_marks = bool(self.dev.marks_supported)  # the compute queue writes timestamps: mark() works
        self._pipelines: dict[tuple, int] = {}
        self.last_wait_ns = 0
        # HELIOS_DEBUG >= 1 prints one line per kernel with its device time: timestamps stay on.
        self.debug = _debug.debug_level()
        # For the HELIOS_DEBUG lines: ((kernel, variant) or None, (shapes, dtype)) of every
        # timestamped command, in recording order (= the order of the device events).
        self._kernel_of_pipeline: dict[int, tuple] = {}
        self._debug_kernels: collections.deque = collections.deque()
        col = current_collector()
        if self.debug or (col is not None and col.device_timestamps):  # opened inside a profiling session
            self.dev.set_profiling(True)
        if self.debug:
            op_trace.enable_operand_notes()  # autograd then notes each op's operands for the kernel lines
        # Elementwise ops wait here to be fused (helios.elementwise_jit); every method below that
        # records, reads or waits emits them first (``q = self.ew_queue; if q.ops: q.emit()``).
        self.ew_queue = elementwise_jit.Queue(self)

    # -- allocator ------------------------------------------------------------------------
    def alloc(self, nbytes: int, pool: str = "activations") -> int:
        """A device allocation of at least ``nbytes`` (rounded up to 4 bytes)."""
        try:
            return self.dev.alloc((nbytes + 3) & ~3, pool)
        except MemoryError as e:
            raise OutOfMemoryError(f"{self.name}: {e}") from None

    def free(self, handle: int) -> None:
        """Free ``handle`` (the addon reuses its range once the recorded work is done)."""
        if self.ew_queue.defer_free(handle):  # a queued op names it: freed after the queue is emitted
            return
        self.dev.free(handle)

    def read(self, handle: int, offset: int, out) -> None:
        """Fill the uint8 array ``out`` from ``handle`` at ``offset``; waits only for the work writing those bytes."""
        self.ew_queue.settle()
        self.dev.read(handle, offset, out)

    def write(self, handle: int, offset: int, data) -> None:
        """Copy the uint8 array ``data`` into ``handle`` at ``offset``; waits only for the work touching those bytes."""
        self.ew_queue.settle()
        self.dev.write(handle, offset, data)

    def ready(self, handle: int, offset: int, nbytes: int, for_write: bool = False) -> bool:
        """True when no unfinished work writes the range (``for_write``: touches it); never waits."""
        self.ew_queue.settle()
        return self.dev.ready(handle, offset, nbytes, for_write)

    def map(self, handle: int, offset: int, nbytes: int, for_write: bool = False):
        """A memoryview of the bytes in host-visible memory (lavapipe, integrated GPUs), after the work
        writing them (``for_write``: touching them); None where the memory is not mapped."""
        self.ew_queue.settle()
        return self.dev.map(handle, offset, nbytes, for_write)

    def host_wrote(self, handle: int, offset: int, nbytes: int) -> None:
        """Make host writes through :meth:`map` visible to the device (flushes non-coherent memory)."""
        self.ew_queue.settle()
        self.dev.host_wrote(handle, offset, nbytes)

    def copy(self, src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
        """Record a buffer-to-buffer copy (hazard-tracked; returns at once)."""
        self._transfer("copy", nbytes, self.dev.copy, src, src_offset, dst, dst_offset, nbytes)

    def fill(self, handle: int, offset: int, nbytes: int, word: int) -> None:
        """Record a fill of ``nbytes`` at ``offset`` with a repeated 32-bit ``word``."""
        self._transfer("fill", nbytes, self.dev.fill, handle, offset, nbytes, word)

    def _transfer(self, name: str, nbytes: int, record, *args) -> None:
        """Record a command that moves bytes without a shader (a copy, a fill) after the queued
        element-wise work, in the debug list and, when profiling, in the trace as ``name``."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        col = current_collector()
        t0 = time.monotonic_ns() if col is not None else 0
        if self.debug:
            self._debug_kernels.append((None, (f"{nbytes} B", "")))
        record(*args)
        if col is not None:
            self._traced(col, name, t0)

    def pool_stats(self) -> dict:
        """Per pool: blocks, dedicated, reserved_bytes, in_use_bytes, peak_in_use_bytes, pending_free_bytes,
        allocs, frees."""
        q = self.ew_queue
        if q.ops:  # its frees are held back until then
            q.emit()
        return self.dev.pool_stats()

    # -- program --------------------------------------------------------------------------
    def pipeline(self, kernel: str, variant: str, spec: tuple = (), subgroup_size: int = 0) -> int:
        """Pipeline id for (kernel, variant, specialization constants), built once.  ``subgroup_size``:
        the required subgroup size (limits min_subgroup_size..max_subgroup_size; 0: the driver's)."""
        key = (kernel, variant, spec, subgroup_size)
        pid = self._pipelines.get(key)
        if pid is None:
            info = registry.KERNELS[kernel]
            code = registry.spirv(kernel, variant)
            frozen = specialize(code, spec)  # the constants frozen in: the driver builds it ~5x faster
            if frozen is not None:
                code, driver_spec = frozen, []
            else:
                driver_spec = [int(s) for s in spec]
            pid = self.dev.pipeline(code, info.num_buffers, info.push_size, driver_spec, f"{kernel}.{variant}",
                                    subgroup_size)
            self._pipelines[key] = pid
            self._kernel_of_pipeline[pid] = (kernel, variant)
        return pid

    def dispatch(self, pid: int, buffers: list, push: bytes, groups: tuple, name: str, flops: int = 0, nbytes: int = 0):
        """Record one dispatch (returns at once)."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        col = current_collector()
        if self.debug:
            self._debug_kernels.append((self._kernel_of_pipeline.get(pid), _TRACE.operands))
        try:
            if col is None:
                self.dev.dispatch(pid, buffers, push, groups, name, flops, nbytes)
                return
            t0 = time.monotonic_ns()
            self.dev.dispatch(pid, buffers, push, groups, name, flops, nbytes)
        except TypeError:
            if any(not isinstance(b[0], int) for b in buffers):  # a cpu tensor's buffer among the operands
                raise DeviceError(f"{name}: an operand is a cpu tensor and the others are on {self.name}; "
                                  f"move it first with .to({self.name!r})") from None
            raise
        self._traced(col, name, t0)

    def run_commands(self, commands) -> None:
        """Issue recorded commands (see helios.backend.Runtime.run_commands) straight to the addon
        when nothing is traced or logged (a graph replay's hot loop); else one by one as usual."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        if self.debug or current_collector() is not None:
            return super().run_commands(commands)
        dev = self.dev
        calls = (dev.dispatch, dev.copy, dev.fill)  # no GEMM: Vulkan has no matrix engine (gemm() is False)
        for kind, args in commands:
            calls[kind](*args)

    def _traced(self, col, name: str, t0: int) -> None:
        # Every timestamped command gets a sequence number in recording order, which is
        # also the order of the addon's events: the collector pairs them up by it.
        seq = col.next_dispatch_seq()
        if not op_trace.file_dispatch(seq):
            col.record_op(name, "", "", t0, time.monotonic_ns(), (seq,))

    # -- stream ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Submit what is recorded; do not wait."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        self.dev.flush()

    def synchronize(self) -> None:
        """Submit everything recorded and wait for it (and hand timestamps to the profiler)."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        t0 = time.monotonic_ns()
        self.dev.synchronize()
        t1 = time.monotonic_ns()
        self.last_wait_ns = t1 - t0
        col = current_collector()
        if col is not None:
            col.record_op("fence_wait", "", "", t0, t1, ())  # host time blocked on the device
        if col is not None or self.debug:
            self._drain_events(col)

    def mark(self) -> int | None:
        """A device timestamp after the work recorded so far (see helios.backend.Runtime.mark); None
        where the compute queue writes no timestamps."""
        q = self.ew_queue
        if q.ops:  # the queued elementwise ops come before the mark
            q.emit()
        return self.dev.mark() if self.has_marks else None

    def wait_mark(self, mark: int) -> None:
        """Wait until the work recorded before ``mark`` has finished (later work may still run)."""
        self.dev.wait_mark(mark)

    def take_marks(self) -> dict:
        """``{id: device ns}`` of the marks whose work has finished since the last take (never waits)."""
        return self.dev.take_marks()

    def stats(self) -> dict:
        """Stream counters: submits, dispatches, barriers, fence_waits, copies, pending_dispatches."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        return self.dev.stats()

    def profiling_started(self, col) -> None:
        """Nothing recorded before the session may land in it: drain, then timestamp every dispatch."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        self.dev.synchronize()
        self.dev.take_events()
        self._debug_kernels.clear()  # their events were just dropped
        self.dev.set_profiling(bool(col.device_timestamps or self.debug))

    def profiling_stopping(self, col) -> None:
        """The closing wait is the session's own, not the user's: it is not recorded as a fence_wait."""
        q = self.ew_queue
        if q.ops:
            q.emit()
        self.dev.synchronize()
        self._drain_events(col)
        self.dev.set_profiling(bool(self.debug))

    def _drain_events(self, col) -> None:
        payload = self.dev.take_events()
        if col is not None:
            col.add_device_events(payload)
            for pool, st in self.dev.pool_stats().items():
                col.record_memory(time.monotonic_ns(), pool, st["in_use_bytes"])
        if self.debug:
            for e in payload["events"]:
                kv, (shape, dtype) = self._debug_kernels.popleft() if self._debug_kernels else (None, ("", ""))
                src = spv = None
                if self.debug >= 2 and kv is not None:
                    src, spv = registry.source_path(kv[0]), registry.spirv_path(*kv)
                _debug.log_kernel(e["name"], shape, e["end_ns"] - e["start_ns"], e["flops"], e["bytes"], dtype,
                                  level=self.debug, source=src, binary=spv)


class HostRuntime(Runtime):
    """The "cpu" device: tensors whose bytes are numpy buffers in host memory.

    A cpu tensor holds data: ``numpy()``, ``item()``, ``tolist()``, views (reshape, slicing,
    transpose...), ``contiguous()``, ``clone()``, dtype casts, ``copy_()``, ``fill_``/``zero_``,
    ``helios.save`` and ``.to()`` back to a GPU device.  It runs no kernels: any other op on
    it is a DeviceError saying to move it to a device first."""

    is_host = True
    name = "cpu"
    index = None
    max_range = 1 << 62  # no binding limit: nothing is bound
    align = 64
    features = {"storage16": True, "storage8": True, "int64": True}
    info = {"name": "host memory", "type": "cpu", "features": features, "limits": {}}

    def __init__(self):
        self.device = device("cpu")

    def alloc(self, nbytes: int, pool: str = "activations"):
        """A numpy byte buffer of at least ``nbytes``."""
        return np.empty(max(8, (nbytes + 7) & ~7), dtype=np.uint8)  # 8-aligned: any dtype views it

    def free(self, handle) -> None:
        """Nothing to do: numpy frees the buffer with its last reference."""

    def read(self, handle, offset: int, out) -> None:
        """Copy ``out.nbytes`` bytes at ``offset`` into ``out``."""
        out[...] = handle[offset:offset + out.nbytes]

    def write(self, handle, offset: int, data) -> None:
        """Copy ``data``'s bytes into the buffer at ``offset``."""
        data = data.reshape(-1).view(np.uint8)
        handle[offset:offset + data.nbytes] = data

    def map(self, handle, offset: int, nbytes: int, for_write: bool = False):
        """The bytes themselves: host memory is always mapped."""
        return memoryview(handle[offset:offset + nbytes])

    def copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` between two buffers."""
        dst[dst_offset:dst_offset + nbytes] = src[src_offset:src_offset + nbytes]

    def fill(self, handle, offset: int, nbytes: int, word: int) -> None:
        """Repeat the 32-bit ``word`` over ``nbytes`` at ``offset``."""
        handle[offset:offset + nbytes].view(np.uint32)[...] = word

    def pool_stats(self) -> dict:
        """No pools: host buffers are numpy's."""
        return {}

    def synchronize(self) -> None:
        """Nothing runs asynchronously on the host."""

    def stats(self) -> dict:
        """No stream: nothing is ever dispatched here."""
        return {"dispatches": 0}

    def pipeline(self, kernel: str, variant: str, spec: tuple = (), subgroup_size: int = 0):
        """Refused: the cpu device runs no kernels (a DeviceError saying where to move the tensor)."""
        target = _current.name if _current is not None else "vulkan:0"
        raise DeviceError(f"{kernel}: the tensor is on cpu, where Helios keeps data but runs no kernels "
                          f"(numpy(), item(), views, casts, copies and save work there); move it first with .to({target!r})")

    def dispatch(self, *args, **kwargs):  # pragma: no cover - pipeline() refuses first
        """Refused, as :meth:`pipeline`."""
        self.pipeline(args[4] if len(args) > 4 else "op", "")


HOST = HostRuntime()

_current: Runtime | None = None
_runtimes: dict[str, Runtime] = {}  # every open device runtime, by name ("vulkan:0", "cuda:0")


def _open(kind: str, index: int) -> Runtime:
    """The runtime of (kind, index), opened on first use through its backend (helios.backends)."""
    name = f"{kind}:{index}"
    rt = _runtimes.get(name)
    if rt is None:
        try:
            rt = backends.backend(kind).open(index)
        except DeviceError as e:
            if "devices here" in str(e):
                raise
            raise DeviceError(f"{e}; devices here: {device_names()}") from None
        _runtimes[name] = rt
    return rt


def set_device(spec: str) -> None:
    """Make ``spec`` ("vulkan:N" or "cuda:N") the device new tensors go to."""
    global _current
    parsed = parse_device(spec)
    if parsed is None:
        raise DeviceError("set_device('cpu'): the current device runs the ops, and cpu tensors only hold data; "
                          f"choose a Vulkan device or a CUDA device ({device_names()}) and move results with .to('cpu')")
    _current = _open(*parsed)


def get_runtime(spec: str | None = None) -> Runtime:
    """The runtime of ``spec`` ("cpu" gives :data:`HOST`), or of the current device (opened on first use)."""
    if spec is not None:
        if isinstance(spec, Runtime):
            return spec
        parsed = parse_device(spec)
        if parsed is None:
            return HOST
        return _open(*parsed)
    if _current is None:
        set_device(os.environ.get("HELIOS_DEVICE", "vulkan:0"))
    return _current


def open_runtimes() -> list[Runtime]:
    """Every device runtime opened so far (Vulkan and CUDA), in opening order."""
    return list(_runtimes.values())


def close_device(name: str) -> None:
    """Finish the work of open device ``name`` ("cuda:0") and forget its runtime: the next use
    opens it afresh (and reads ``HELIOS_CUDA_DEVICE`` again).  Its tensors must not be used
    afterwards.  If it was the current device, the current device is chosen again on next use."""
    global _current
    rt = _runtimes.pop(str(name), None)
    if rt is None:
        return
    rt.synchronize()
    if _current is rt:
        _current = None


def current_device() -> str:
    """Name of the current device ("vulkan:N" or "cuda:N")."""
    return get_runtime().name


def synchronize() -> None:
    """Wait until every recorded op on every open device has finished."""
    for rt in list(_runtimes.values()):
        rt.synchronize()


def _profiling_started(col) -> None:
    # Every open runtime, of either backend: nothing recorded before the session lands in it.
    for rt in list(_runtimes.values()):
        rt.profiling_started(col)


def _profiling_stopping(col) -> None:
    for rt in list(_runtimes.values()):
        rt.profiling_stopping(col)


_prof.register_runtime_hooks(_profiling_started, _profiling_stopping)

# The built-in backends, in the order devices() lists them: Vulkan (this module), then CUDA
# (helios.cuda_ptx, imported when a cuda device is first named or listed).
backends.register("vulkan", lambda index: VulkanRuntime(index), _vulkan_devices)
backends.register_module("cuda", "helios.cuda_ptx.tensor_runtime")
