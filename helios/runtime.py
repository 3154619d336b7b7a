"""Device selection and the per-device runtime (the seam between tensors and the Vulkan addon).

``devices()`` lists what exists, ``set_device("vulkan:N")`` (or ``HELIOS_DEVICE``) picks
one; the default is the best device present (discrete GPU > integrated GPU > CPU).  A
``Runtime`` wraps one ``helios._vulkan.Device``: it turns (kernel, variant,
specialization constants) into cached pipelines and records dispatches.  Nothing here
waits: work is recorded and submitted by the addon's command stream.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass

import numpy as np

from helios.errors import DeviceError, OutOfMemoryError
from helios.kernels_spirv import registry
from helios.profile import debug as _debug
from helios.profile import profiler as _prof

# HELIOS_DEBUG: set when a runtime logs kernels; autograd's Function.apply then notes the
# operands of each op here, so each kernel line can show the shapes it worked on.
_debug_on = [False]
_debug_operand = [("", "")]  # (shapes text, dtype name) of the op being recorded

# Dispatch ids of the host op being recorded (set by autograd's Function.apply while a
# profiling session is open), so the trace links each op to the kernels it launched.
_op_dispatches: list | None = None

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


@dataclass(frozen=True)
class DeviceInfo:
    """One Vulkan device as ``helios.devices()`` lists it."""

    name: str  # "vulkan:N"
    description: str
    type: str  # discrete | integrated | virtual | cpu | other
    info: dict

    def __repr__(self) -> str:
        return f"<{self.name}: {self.description} ({self.type})>"


def devices() -> list[DeviceInfo]:
    """Every Vulkan device, GPUs first; lavapipe shows as a ``cpu`` device."""
    vk = _addon()
    return [DeviceInfo(f"vulkan:{d['index']}", d["name"], d["type"], d) for d in vk.enumerate_devices()]


def _vulkan_names() -> list[str]:
    """"vulkan:N (name)" of every Vulkan device, or nothing where the addon cannot load."""
    try:
        return [f"vulkan:{d['index']} ({d['name']})" for d in _addon().enumerate_devices()]
    except DeviceError:
        return []


def device_names() -> str:
    """The devices a tensor can live on, for error messages: "cpu, vulkan:0 (llvmpipe ...)"."""
    return ", ".join(["cpu"] + _vulkan_names())


def _parse_device(spec) -> int | None:
    """The Vulkan index ``spec`` names, or None for "cpu".

    ``spec``: "cpu", "vulkan" (the current Vulkan device), "vulkan:N", a :class:`device`, or an
    int N (vulkan:N).  Anything else is a DeviceError naming it and the devices that exist."""
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return spec
    if not isinstance(spec, str):  # torch.device and the like: their str() is the name
        spec = str(spec) if type(spec).__name__ == "device" else spec
    if not isinstance(spec, str):
        raise DeviceError(f"unknown device {spec!r} ({type(spec).__name__}): expected 'cpu', 'vulkan' or 'vulkan:N'; "
                          f"devices here: {device_names()}")
    kind, sep, num = spec.strip().partition(":")
    if kind == "cpu" and (not sep or num == "0"):
        return None
    if kind == "vulkan":
        if not sep:
            return _current.index if _current is not None else _parse_device(os.environ.get("HELIOS_DEVICE", "vulkan:0"))
        if num.isdigit():
            return int(num)
        raise DeviceError(f"bad device {spec!r}: expected 'vulkan:N' with N an integer; devices here: {device_names()}")
    raise DeviceError(f"unknown device {spec!r}: expected 'cpu', 'vulkan' or 'vulkan:N'; devices here: {device_names()}")


class device(str):
    """A device as PyTorch spells it: ``device("vulkan:0")``, ``device("vulkan", 0)``,
    ``device("cpu")``; ``.type`` ("cpu" or "vulkan") and ``.index`` (None for "cpu" and for a
    bare "vulkan", which means the current Vulkan device).  It is a ``str`` subclass, so
    ``t.device == "vulkan:0"`` holds and it goes wherever a device name goes.  Naming a device
    that does not exist is not checked here but where a tensor is put on it."""

    def __new__(cls, type_or_name="vulkan", index: int | None = None):
        if isinstance(type_or_name, device) and index is None:
            return type_or_name
        if isinstance(type_or_name, int) and not isinstance(type_or_name, bool) and index is None:
            type_or_name = f"vulkan:{type_or_name}"
        name = str(type_or_name) if type(type_or_name).__name__ == "device" else type_or_name
        if not isinstance(name, str):
            raise DeviceError(f"unknown device {type_or_name!r}: expected 'cpu', 'vulkan' or 'vulkan:N'; "
                              f"devices here: {device_names()}")
        if index is not None:
            if ":" in name:
                raise DeviceError(f"device({name!r}, {index}): give the index once, in the name or as the second argument")
            name = f"{name}:{int(index)}"
        if name.strip() == "cpu:0":
            name = "cpu"
        idx = _parse_device(name)  # validates the spelling
        kind = "cpu" if idx is None else "vulkan"
        out = str.__new__(cls, kind if ":" not in name else f"{kind}:{idx}")
        out._type, out._index = kind, (idx if ":" in name else None)
        return out

    @property
    def type(self) -> str:
        return self._type

    @property
    def index(self) -> int | None:
        return self._index

    def __repr__(self) -> str:
        return f"device(type={self._type!r})" if self._index is None else f"device(type={self._type!r}, index={self._index})"


class Runtime:
    """One open Vulkan device: pipelines, dispatch, memory, synchronisation."""

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
        self.dev = vk.Device(index, cache)
        self.info = self.dev.info
        self.max_range = int(self.info["limits"]["max_storage_buffer_range"])
        self.align = max(256, int(self.info["limits"]["min_storage_buffer_offset_alignment"]))
        self.features = self.info["features"]
        self._pipelines: dict[tuple, int] = {}
        # HELIOS_DEBUG >= 1 prints one line per kernel with its device time: timestamps stay on.
        self.debug = _debug.debug_level()
        # For the HELIOS_DEBUG lines: ((kernel, variant) or None, (shapes, dtype)) of every
        # timestamped command, in recording order (= the order of the device events).
        self._kernel_of_pipeline: dict[int, tuple] = {}
        self._debug_kernels: collections.deque = collections.deque()
        if self.debug:
            self.dev.set_profiling(True)
            _debug_on[0] = True

    # -- memory -------------------------------------------------------------------------
    def alloc(self, nbytes: int, pool: str = "activations") -> int:
        """A device allocation of at least ``nbytes`` (rounded up to 4 bytes)."""
        try:
            return self.dev.alloc((nbytes + 3) & ~3, pool)
        except MemoryError as e:
            raise OutOfMemoryError(f"{self.name}: {e}") from None

    def free(self, handle: int) -> None:
        self.dev.free(handle)

    # -- kernels ------------------------------------------------------------------------
    def pipeline(self, kernel: str, variant: str, spec: tuple = ()) -> int:
        """Pipeline id for (kernel, variant, specialization constants), built once."""
        key = (kernel, variant, spec)
        pid = self._pipelines.get(key)
        if pid is None:
            info = registry.KERNELS[kernel]
            code = registry.spirv(kernel, variant)
            pid = self.dev.pipeline(code, info.num_buffers, info.push_size, [int(s) for s in spec], f"{kernel}.{variant}")
            self._pipelines[key] = pid
            self._kernel_of_pipeline[pid] = (kernel, variant)
        return pid

    def dispatch(self, pid: int, buffers: list, push: bytes, groups: tuple, name: str, flops: int = 0, nbytes: int = 0):
        """Record one dispatch (returns at once)."""
        col = _prof._ACTIVE
        if self.debug:
            self._debug_kernels.append((self._kernel_of_pipeline.get(pid), _debug_operand[0]))
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

    def fill(self, handle: int, offset: int, nbytes: int, word: int) -> None:
        """Record a fill of ``nbytes`` at ``offset`` with a repeated 32-bit ``word``."""
        col = _prof._ACTIVE
        t0 = time.monotonic_ns() if col is not None else 0
        if self.debug:
            self._debug_kernels.append((None, (f"{nbytes} B", "")))  # a buffer fill: no shader
        self.dev.fill(handle, offset, nbytes, word)
        if col is not None:
            self._traced(col, "fill", t0)

    def _traced(self, col, name: str, t0: int) -> None:
        # Every timestamped command gets a sequence number in recording order, which is
        # also the order of the addon's events: the collector pairs them up by it.
        seq = col.next_dispatch_seq()
        if _op_dispatches is not None:
            _op_dispatches.append(seq)
        else:
            col.record_op(name, "", "", t0, time.monotonic_ns(), (seq,))

    def synchronize(self) -> None:
        """Submit everything recorded and wait for it (and hand timestamps to the profiler)."""
        t0 = time.monotonic_ns()
        self.dev.synchronize()
        t1 = time.monotonic_ns()
        self.last_wait_ns = t1 - t0
        col = _prof._ACTIVE
        if col is not None:
            col.record_op("fence_wait", "", "", t0, t1, ())  # host time blocked on the device
        if col is not None or self.debug:
            self._drain_events(col)

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


class _HostMemory:
    """The allocator half of the "cpu" device: allocations are numpy byte buffers."""

    def read(self, handle, offset: int, out) -> None:
        out[...] = handle[offset:offset + out.nbytes]

    def write(self, handle, offset: int, data) -> None:
        data = data.reshape(-1).view(np.uint8)
        handle[offset:offset + data.nbytes] = data

    def synchronize(self) -> None:
        pass

    def pool_stats(self) -> dict:
        return {}


class HostRuntime:
    """The "cpu" device: tensors whose bytes are numpy buffers in host memory.

    A cpu tensor holds data: ``numpy()``, ``item()``, ``tolist()``, views (reshape, slicing,
    transpose...), ``contiguous()``, ``clone()``, dtype casts, ``copy_()``, ``fill_``/``zero_``,
    ``helios.save`` and ``.to()`` back to a Vulkan device.  It runs no kernels: any other op on
    it is a DeviceError saying to move it to a Vulkan device first."""

    is_host = True
    name = "cpu"
    index = None
    max_range = 1 << 62  # no binding limit: nothing is bound
    align = 64
    features = {"storage16": True, "storage8": True, "int64": True}
    info = {"name": "host memory", "type": "cpu", "features": features, "limits": {}}

    def __init__(self):
        self.dev = _HostMemory()
        self.device = device("cpu")

    def alloc(self, nbytes: int, pool: str = "activations"):
        return np.empty(max(8, (nbytes + 7) & ~7), dtype=np.uint8)  # 8-aligned: any dtype views it

    def free(self, handle) -> None:
        pass

    def fill(self, handle, offset: int, nbytes: int, word: int) -> None:
        handle[offset:offset + nbytes].view(np.uint32)[...] = word

    def synchronize(self) -> None:
        pass

    def pipeline(self, kernel: str, variant: str, spec: tuple = ()):
        target = _current.name if _current is not None else "vulkan:0"
        raise DeviceError(f"{kernel}: the tensor is on cpu, where Helios keeps data but runs no kernels "
                          f"(numpy(), item(), views, casts, copies and save work there); move it first with .to({target!r})")

    def dispatch(self, *args, **kwargs):  # pragma: no cover - pipeline() refuses first
        self.pipeline(args[4] if len(args) > 4 else "op", "")


HOST = HostRuntime()

_current: Runtime | None = None
_runtimes: dict[int, Runtime] = {}


def set_device(spec: str) -> None:
    """Make ``spec`` ("vulkan:N") the device new tensors go to."""
    global _current
    idx = _parse_device(spec)
    if idx is None:
        raise DeviceError("set_device('cpu'): the current device runs the ops, and cpu tensors only hold data; "
                          f"choose a Vulkan device ({device_names()}) and move results with .to('cpu')")
    rt = _runtimes.get(idx)
    if rt is None:
        rt = _runtimes[idx] = Runtime(idx)
    _current = rt


def get_runtime(spec: str | None = None) -> Runtime:
    """The runtime of ``spec`` ("cpu" gives :data:`HOST`), or of the current device (opened on first use)."""
    if spec is not None:
        if isinstance(spec, (Runtime, HostRuntime)):
            return spec
        idx = _parse_device(spec)
        if idx is None:
            return HOST
        if idx not in _runtimes:
            _runtimes[idx] = Runtime(idx)
        return _runtimes[idx]
    if _current is None:
        set_device(os.environ.get("HELIOS_DEVICE", "vulkan:0"))
    return _current


def current_device() -> str:
    """Name of the current device ("vulkan:N")."""
    return get_runtime().name


def synchronize() -> None:
    """Wait until every recorded op on every open device has finished."""
    for rt in _runtimes.values():
        rt.synchronize()


def _profiling_started(col) -> None:
    # Nothing recorded before the session may land in it: drain, then timestamp every dispatch.
    for rt in _runtimes.values():
        rt.dev.synchronize()
        rt.dev.take_events()
        rt._debug_kernels.clear()  # their events were just dropped
        rt.dev.set_profiling(bool(col.device_timestamps or rt.debug))


def _profiling_stopping(col) -> None:
    # The closing wait is the session's own, not the user's: it is not recorded as a fence_wait.
    for rt in _runtimes.values():
        rt.dev.synchronize()
        rt._drain_events(col)
        rt.dev.set_profiling(bool(rt.debug))


_prof.register_runtime_hooks(_profiling_started, _profiling_stopping)
