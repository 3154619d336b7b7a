"""Device selection and the per-device runtime (the seam between tensors and the Vulkan addon).

``devices()`` lists what exists, ``set_device("vulkan:N")`` (or ``HELIOS_DEVICE``) picks
one; the default is the best device present (discrete GPU > integrated GPU > CPU).  A
``Runtime`` wraps one ``helios._vulkan.Device``: it turns (kernel, variant,
specialization constants) into cached pipelines and records dispatches.  Nothing here
waits: work is recorded and submitted by the addon's command stream.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from helios.errors import DeviceError, OutOfMemoryError
from helios.kernels_spirv import registry

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


def _parse_device(spec: str) -> int:
    if not isinstance(spec, str) or not spec.startswith("vulkan"):
        raise DeviceError(f"unknown device {spec!r}: expected 'vulkan' or 'vulkan:N' (see helios.devices())")
    if spec == "vulkan":
        return 0
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise DeviceError(f"bad device {spec!r}: expected 'vulkan:N' with N an integer") from None


class Runtime:
    """One open Vulkan device: pipelines, dispatch, memory, synchronisation."""

    def __init__(self, index: int):
        vk = _addon()
        found = vk.enumerate_devices()
        if not found:
            reason = vk.last_error() if hasattr(vk, "last_error") else "no device"
            raise DeviceError(f"no Vulkan device found ({reason}). {INSTALL_HINT}")
        if not 0 <= index < len(found):
            names = ", ".join(f"vulkan:{d['index']} ({d['name']})" for d in found)
            raise DeviceError(f"no device vulkan:{index}: this machine has {names}")
        self.index = index
        self.name = f"vulkan:{index}"
        cache = os.path.join(registry.cache_dir(), "pipelines")
        os.makedirs(cache, exist_ok=True)
        self.dev = vk.Device(index, cache)
        self.info = self.dev.info
        self.max_range = int(self.info["limits"]["max_storage_buffer_range"])
        self.align = max(256, int(self.info["limits"]["min_storage_buffer_offset_alignment"]))
        self.features = self.info["features"]
        self._pipelines: dict[tuple, int] = {}
        # Hooks the profiler installs; None keeps the dispatch path free of profiling work.
        self.on_dispatch = None

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
        return pid

    def dispatch(self, pid: int, buffers: list, push: bytes, groups: tuple, name: str, flops: int = 0, nbytes: int = 0):
        """Record one dispatch (returns at once)."""
        self.dev.dispatch(pid, buffers, push, groups, name, flops, nbytes)
        if self.on_dispatch is not None:
            self.on_dispatch(name, flops, nbytes)

    def synchronize(self) -> None:
        """Submit everything recorded and wait for it."""
        t0 = time.monotonic_ns()
        self.dev.synchronize()
        self.last_wait_ns = time.monotonic_ns() - t0


_current: Runtime | None = None
_runtimes: dict[int, Runtime] = {}


def set_device(spec: str) -> None:
    """Make ``spec`` ("vulkan:N") the device new tensors go to."""
    global _current
    idx = _parse_device(spec)
    rt = _runtimes.get(idx)
    if rt is None:
        rt = _runtimes[idx] = Runtime(idx)
    _current = rt


def get_runtime(spec: str | None = None) -> Runtime:
    """The runtime of ``spec``, or of the current device (opened on first use)."""
    if spec is not None:
        idx = _parse_device(spec)
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
