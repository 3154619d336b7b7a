"""The profiler's neutral event records (the data model shared by the runtime and the exporters).

Times are host ``CLOCK_MONOTONIC`` nanoseconds (``time.monotonic_ns()``); the
runtime converts device timestamps to that clock before handing them over.
``dispatch_seq`` numbers dispatches from 0 at the start of a profiling session,
in the order the runtime records them; host ops name the dispatches they
recorded by these numbers, and each device event carries its own, so an event
finds its op even when some events are missing or arrive in another order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class HostOpRecord:
    """One op as the tensor layer saw it: name, shape text, dtype, host interval, the dispatches it recorded."""

    name: str
    shape: str
    dtype: str
    host_start_ns: int
    host_end_ns: int
    dispatch_ids: list[int] = field(default_factory=list)
    seq: int = 0  # order of the op in the session

    @property
    def host_ns(self) -> int:
        """Host time spent enqueueing the op."""
        return self.host_end_ns - self.host_start_ns


@dataclass
class DeviceEvent:
    """One dispatch as the device ran it (interval already on the host clock)."""

    name: str
    flops: int
    bytes: int
    start_ns: int
    end_ns: int
    submit: int
    host_record_ns: int
    dispatch_seq: int
    queue: int = 0

    @property
    def device_ns(self) -> int:
        """Device time of the dispatch."""
        return self.end_ns - self.start_ns

    @property
    def gflops_per_s(self) -> float | None:
        """Achieved GFLOP/s; None for a zero-length interval."""
        return self.flops / self.device_ns if self.device_ns > 0 else None  # FLOPs/ns == GFLOP/s

    @property
    def gbytes_per_s(self) -> float | None:
        """Achieved GB/s (10^9 bytes); None for a zero-length interval."""
        return self.bytes / self.device_ns if self.device_ns > 0 else None

    @classmethod
    def from_dict(cls, d: dict[str, Any], dispatch_seq: int) -> DeviceEvent:
        """Build from the addon's event dict; ``dispatch_seq`` is used when the dict has none."""
        return cls(
            name=str(d["name"]),
            flops=int(d.get("flops", 0)),
            bytes=int(d.get("bytes", 0)),
            start_ns=int(d["start_ns"]),
            end_ns=int(d["end_ns"]),
            submit=int(d.get("submit", 0)),
            host_record_ns=int(d.get("host_record_ns", d["start_ns"])),
            dispatch_seq=int(d.get("dispatch_seq", dispatch_seq)),
            queue=int(d.get("queue", 0)),
        )


@dataclass
class SubmitRecord:
    """One queue submission: when the host submitted it, when the host saw its fence signalled."""

    submit: int
    host_submit_ns: int
    host_done_ns: int
    dispatches: int
    queue: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SubmitRecord:
        """Build from the addon's submit dict."""
        return cls(int(d["submit"]), int(d["host_submit_ns"]), int(d["host_done_ns"]), int(d.get("dispatches", 0)),
                   int(d.get("queue", 0)))


@dataclass(frozen=True)
class MemorySample:
    """Bytes in use in one memory pool at one moment."""

    time_ns: int
    pool: str
    in_use_bytes: int
