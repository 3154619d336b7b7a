"""``profile()``: collect host ops, device dispatches, memory and steps; tabulate; export a trace.

Usage::

    import helios as hl
    with hl.profile.profile() as prof:
        loss = model(x, y); loss.backward()
    print(prof.key_averages().table(sort_by="device_time", row_limit=10))
    prof.export_chrome_trace("trace.json")

The runtime contract (for the tensor layer and the Vulkan/CUDA backends)
-----------------------------------------------------------------------
1. **Per op, check** ``col = current_collector()``: one module-global read, None
   when profiling is off -- do nothing else then.
2. **Per dispatch recorded** while ``col`` is not None: ``seq = col.next_dispatch_seq()``;
   attach ``seq`` to the dispatch (the addon returns it in the event as
   ``"dispatch_seq"``) and write timestamp queries around it.
3. **Per op**, when it returns: ``col.record_op(name, shape, dtype, host_start_ns,
   host_end_ns, dispatch_ids=[seq, ...])`` with ``time.monotonic_ns()`` times
   (host enqueue time of the op).
4. **At synchronize** (and at the end of profiling): ``col.add_device_events(addon.take_events())``
   with the dict ``{"events": [...], "submits": [...]}`` whose times are converted to
   ``CLOCK_MONOTONIC`` ns. An event without ``"dispatch_seq"`` is numbered by arrival
   order, which equals recording order as long as steps 2 and 4 see every dispatch.
5. **Memory**: ``col.record_memory(time_ns, pool, in_use_bytes)`` when a pool's use changes
   (or at each synchronize).
6. **Collectives** (helios.comm calls this, from whichever thread ran the operation):
   ``col.record_comm(name, group, seq, nbytes, start_ns, end_ns, async_op=..., ...)`` once
   per collective or point-to-point operation; ``col.comm_events()`` lists them and
   ``col.comm_total_ns`` / ``col.comm_ns_since(t_ns)`` total their time.
7. **Start/stop**: the backend registers ``register_runtime_hooks(on_start, on_stop)`` once.
   ``on_start(col)`` runs when a session opens (synchronize, so no earlier dispatch
   lands in it, then enable timestamps); ``on_stop(col)`` runs before it closes
   (synchronize, push the last events, disable timestamps).

:class:`~helios.profile.timers.StepTimer` pushes each finished step to the active
collector, so a trace shows the step phases next to the ops.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from helios.profile.errors import ProfileError
from helios.profile.events import DeviceEvent, HostOpRecord, MemorySample, SubmitRecord

if TYPE_CHECKING:
    from helios.profile.timers import StepRecord

_ACTIVE: Collector | None = None
_START_HOOKS: list[Callable[[Collector], None]] = []
_STOP_HOOKS: list[Callable[[Collector], None]] = []


def current_collector() -> Collector | None:
    """The collector of the open profiling session, or None when profiling is off (cheap: a global read)."""
    return _ACTIVE


def register_runtime_hooks(on_start: Callable[[Collector], None] | None = None,
                           on_stop: Callable[[Collector], None] | None = None) -> None:
    """Register backend callbacks run when a profiling session opens / is about to close."""
    if on_start is not None and on_start not in _START_HOOKS:
        _START_HOOKS.append(on_start)
    if on_stop is not None and on_stop not in _STOP_HOOKS:
        _STOP_HOOKS.append(on_stop)


def unregister_runtime_hooks(on_start: Callable[[Collector], None] | None = None,
                             on_stop: Callable[[Collector], None] | None = None) -> None:
    """Remove callbacks added by :func:`register_runtime_hooks`."""
    if on_start in _START_HOOKS:
        _START_HOOKS.remove(on_start)
    if on_stop in _STOP_HOOKS:
        _STOP_HOOKS.remove(on_stop)


def _shape_text(shape: Any) -> str:
    if isinstance(shape, str):
        return shape
    if isinstance(shape, (list, tuple)) and shape and all(isinstance(s, (list, tuple)) for s in shape):
        return "x".join(_shape_text(s) for s in shape)  # several operands: (4, 8)x(8, 16)
    if isinstance(shape, (list, tuple)):
        return "(" + ", ".join(str(int(d)) for d in shape) + ")"
    return str(shape)


@dataclass(frozen=True)
class CommEvent:
    """One collective or point-to-point operation as helios.comm ran it (host ``CLOCK_MONOTONIC`` ns).

    ``seq`` is the group's collective sequence number (a point-to-point operation, ``p2p``,
    carries the number of the next collective).  ``issue_ns`` is when the caller issued it;
    it is earlier than ``start_ns`` when the operation waited in the group's queue.
    ``thread`` / ``thread_id`` name the thread it ran on (the caller's, or the group's comm
    worker for ``async_op=True`` and for operations queued behind one).  ``ok`` is False
    when it raised.  ``device_wait_ns`` is how long the operation, once running, waited for
    the device work producing its Helios tensors; ``start_ns`` is after that wait (the
    transfer itself), so a gradient all-reduce's interval does not count backward's compute.
    """

    name: str
    group: str
    seq: int
    nbytes: int
    start_ns: int
    end_ns: int
    async_op: bool = False
    thread: str = ""
    thread_id: int = 0
    issue_ns: int = 0
    ok: bool = True
    backend: str = ""
    p2p: bool = False
    device_wait_ns: int = 0
    role: str = ""  # what the group is for ("tp", "dp", "pp", "ep", "cp"), as new_group(role=) named it

    @property
    def duration_ns(self) -> int:
        """How long the operation ran."""
        return max(0, self.end_ns - self.start_ns)

    @property
    def gbytes_per_s(self) -> float | None:
        """Operand bytes over the duration (10^9 bytes/s); None for a zero-length interval."""
        return self.nbytes / self.duration_ns if self.duration_ns > 0 else None


class Collector:
    """Receives what the runtime records during one profiling session (see the module docstring)."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.clock = clock
        self.device_timestamps = True  # whether the runtime brackets dispatches with device timestamps
        self.start_ns: int = clock()
        self.end_ns: int | None = None
        # Ops are kept raw while recording (an append of a tuple: the per-op cost while profiling)
        # and turned into HostOpRecords when first read.
        self._raw_ops: list[tuple] = []
        self._ops: list[HostOpRecord] = []
        self.events: list[DeviceEvent] = []
        self.submits: list[SubmitRecord] = []
        self.memory: list[MemorySample] = []
        self.steps: list[StepRecord] = []
        # itertools.count's next() is atomic under the GIL: safe from several recording threads.
        self._dispatch_counter = itertools.count()
        self._events_seen = 0
        # Collectives arrive from comm worker threads: guarded by a lock.
        self._comm_lock = threading.Lock()
        self._comm: list[CommEvent] = []
        self._comm_ns = 0

    def next_dispatch_seq(self) -> int:
        """Number the next dispatch (0, 1, 2, ...). Call once per dispatch recorded."""
        return next(self._dispatch_counter)

    def record_op(self, name: str, shape: Any, dtype: Any, host_start_ns: int, host_end_ns: int,
                  dispatch_ids: Iterable[int] = ()) -> None:
        """Record one host op; ``shape`` may be a tuple, a list of tuples (operands) or text.

        Kept as given until read (about 0.2 us per call), so pass ``dispatch_ids`` and
        ``shape`` objects the caller will not mutate afterwards.
        """
        self._raw_ops.append((name, shape, dtype, host_start_ns, host_end_ns, dispatch_ids))

    @property
    def ops(self) -> list[HostOpRecord]:
        """The host ops recorded so far, in recording order."""
        if len(self._ops) < len(self._raw_ops):
            for name, shape, dtype, t0, t1, ids in self._raw_ops[len(self._ops):]:
                self._ops.append(HostOpRecord(str(name), _shape_text(shape), str(dtype), int(t0), int(t1),
                                              [int(i) for i in ids], len(self._ops)))
        return self._ops

    def add_device_events(self, payload: dict[str, Any]) -> None:
        """Take the addon's ``{"events": [...], "submits": [...]}``; events lacking a seq are numbered by arrival."""
        for d in payload.get("events", ()):
            self.events.append(DeviceEvent.from_dict(d, self._events_seen))
            self._events_seen += 1
        for s in payload.get("submits", ()):
            self.submits.append(SubmitRecord.from_dict(s))

    def record_memory(self, time_ns: int, pool: str, in_use_bytes: int) -> None:
        """Record one memory-in-use sample of ``pool``."""
        self.memory.append(MemorySample(int(time_ns), str(pool), int(in_use_bytes)))

    def record_step(self, rec: StepRecord) -> None:
        """Record a finished step (StepTimer calls this)."""
        self.steps.append(rec)

    def record_comm(self, name: str, group: str, seq: int, nbytes: int, start_ns: int, end_ns: int, *,
                    async_op: bool = False, thread: str | None = None, thread_id: int | None = None,
                    issue_ns: int | None = None, ok: bool = True, backend: str = "", p2p: bool = False,
                    device_wait_ns: int = 0, role: str = "") -> None:
        """Record one collective or point-to-point operation (thread-safe; see :class:`CommEvent`).

        ``thread`` / ``thread_id`` default to the calling thread, ``issue_ns`` to ``start_ns``.
        """
        if thread is None or thread_id is None:
            cur = threading.current_thread()
            thread = cur.name if thread is None else thread
            thread_id = threading.get_native_id() if thread_id is None else thread_id
        ev = CommEvent(str(name), str(group), int(seq), int(nbytes), int(start_ns), int(end_ns), bool(async_op),
                       str(thread), int(thread_id), int(start_ns if issue_ns is None else issue_ns), bool(ok),
                       str(backend), bool(p2p), int(device_wait_ns), str(role))
        with self._comm_lock:
            self._comm.append(ev)
            self._comm_ns += ev.duration_ns

    def comm_events(self) -> list[CommEvent]:
        """The collectives recorded so far, by start time (a copy: safe while comm threads record)."""
        with self._comm_lock:
            evs = list(self._comm)
        return sorted(evs, key=lambda e: (e.start_ns, e.end_ns))

    @property
    def comm_total_ns(self) -> int:
        """Running total of the time of every collective recorded so far (ns), counted when each ends.

        Take it at a mark and subtract later for "collective time since the mark".  It sums
        durations: operations of one group never overlap, those of two groups may.
        """
        with self._comm_lock:
            return self._comm_ns

    def comm_ns_since(self, t_ns: int) -> int:
        """Collective time (ns, summed over operations) after ``t_ns`` on the session clock.

        An operation that started before ``t_ns`` counts from ``t_ns``; one still running is
        not recorded yet and does not count.
        """
        with self._comm_lock:
            return sum(max(0, e.end_ns - max(e.start_ns, t_ns)) for e in self._comm)

    def op_of_dispatch(self) -> dict[int, HostOpRecord]:
        """Map ``dispatch_seq`` -> the host op that recorded it."""
        return {i: op for op in self.ops for i in op.dispatch_ids}


# ---------------------------------------------------------------------------- aggregates


@dataclass
class OpAverage:
    """Totals of one op name (and shape, if grouped by shape) over a session."""

    name: str
    shape: str = ""
    calls: int = 0
    host_time_ns: int = 0
    device_time_ns: int = 0
    dispatches: int = 0
    flops: int = 0
    bytes: int = 0

    @property
    def device_avg_ns(self) -> float:
        """Mean device time per dispatch."""
        return self.device_time_ns / self.dispatches if self.dispatches else 0.0

    @property
    def gflops_per_s(self) -> float | None:
        """Achieved GFLOP/s over the op's device time."""
        return self.flops / self.device_time_ns if self.device_time_ns > 0 else None

    @property
    def gbytes_per_s(self) -> float | None:
        """Achieved GB/s over the op's device time."""
        return self.bytes / self.device_time_ns if self.device_time_ns > 0 else None


_SORT_KEYS: dict[str, Callable[[OpAverage], Any]] = {
    "device_time": lambda r: r.device_time_ns,
    "host_time": lambda r: r.host_time_ns,
    "calls": lambda r: r.calls,
    "dispatches": lambda r: r.dispatches,
    "flops": lambda r: r.flops,
    "bytes": lambda r: r.bytes,
    "gflops": lambda r: r.gflops_per_s or 0.0,
    "gbps": lambda r: r.gbytes_per_s or 0.0,
    "device_avg": lambda r: r.device_avg_ns,
}
_SORT_ALIASES = {
    "device_time_total": "device_time", "self_device_time_total": "device_time", "cuda_time_total": "device_time",
    "cpu_time_total": "host_time", "cpu_time": "host_time", "self_cpu_time_total": "host_time",
    "count": "calls", "launches": "dispatches",
}


def fmt_ns(ns: float) -> str:
    """Human time: ``1234`` -> ``"1.23 us"``."""
    if ns >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} us"
    return f"{ns:.0f} ns"


def _fmt_rate(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


class KeyAverages(list):
    """A list of :class:`OpAverage` rows with a ``table()`` view."""

    def sorted_by(self, sort_by: str = "device_time") -> list[OpAverage]:
        """Rows sorted by ``sort_by`` (descending; ``name`` ascending)."""
        key = _SORT_ALIASES.get(sort_by, sort_by)
        if key == "name":
            return sorted(self, key=lambda r: (r.name, r.shape))
        if key not in _SORT_KEYS:
            valid = sorted(set(_SORT_KEYS) | set(_SORT_ALIASES) | {"name"})
            raise ProfileError(f"sort_by={sort_by!r} is not a column: use one of {', '.join(valid)}")
        return sorted(self, key=lambda r: (-_SORT_KEYS[key](r), r.name, r.shape))

    def table(self, sort_by: str = "device_time", row_limit: int = 100) -> str:
        """A fixed-width text table; ``row_limit`` rows at most (<= 0 means all)."""
        rows = self.sorted_by(sort_by)
        if row_limit and row_limit > 0:
            rows = rows[:row_limit]
        total_dev = sum(r.device_time_ns for r in self) or 1
        show_shape = any(r.shape for r in rows)
        head = ["Name"] + (["Shape"] if show_shape else []) + [
            "Calls", "Host total", "Device total", "Device %", "Device avg", "Launches", "GFLOP/s", "GB/s"]
        body = []
        for r in rows:
            body.append([r.name] + ([r.shape] if show_shape else []) + [
                str(r.calls), fmt_ns(r.host_time_ns), fmt_ns(r.device_time_ns),
                f"{100.0 * r.device_time_ns / total_dev:.1f}%", fmt_ns(r.device_avg_ns), str(r.dispatches),
                _fmt_rate(r.gflops_per_s), _fmt_rate(r.gbytes_per_s)])
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        n_text = 2 if show_shape else 1  # text columns are left-aligned, numbers right-aligned

        def line(cells: Sequence[str]) -> str:
            return "  ".join(c.ljust(w) if i < n_text else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        sep = "-" * len(line(head))
        out = [sep, line(head), sep] + [line(b) for b in body] + [sep]
        tot_host = sum(r.host_time_ns for r in self)
        out.append(f"Host total: {fmt_ns(tot_host)}   Device total: {fmt_ns(sum(r.device_time_ns for r in self))}   "
                   f"Launches: {sum(r.dispatches for r in self)}   Rows: {len(rows)} of {len(self)}")
        return "\n".join(out)


def key_averages(col: Collector, group_by_shape: bool = False) -> KeyAverages:
    """Aggregate a collector's host ops and device events per op name (and shape).

    A dispatch counts under the host op that recorded it; a dispatch no op
    claimed (a runtime-internal copy, say) gets a row of its own kernel name.
    """
    rows: dict[tuple[str, str], OpAverage] = {}

    def row(name: str, shape: str) -> OpAverage:
        k = (name, shape if group_by_shape else "")
        if k not in rows:
            rows[k] = OpAverage(name=k[0], shape=k[1])
        return rows[k]

    for op in col.ops:
        r = row(op.name, op.shape)
        r.calls += 1
        r.host_time_ns += op.host_ns
    owner = col.op_of_dispatch()
    for ev in col.events:
        op = owner.get(ev.dispatch_seq)
        if op is not None:
            r = row(op.name, op.shape)
        else:
            r = row(ev.name, "")
            r.calls += 1
        r.dispatches += 1
        r.device_time_ns += ev.device_ns
        r.flops += ev.flops
        r.bytes += ev.bytes
    return KeyAverages(rows.values())


# ---------------------------------------------------------------------------- session


class Profiler:
    """The handle ``profile()`` yields: the session's data, its aggregates, its trace."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def key_averages(self, group_by_shape: bool = False) -> KeyAverages:
        """Per-op totals (see :func:`key_averages`)."""
        return key_averages(self.collector, group_by_shape)

    def export_chrome_trace(self, path: str, process_name: str = "helios") -> str:
        """Write the session as Chrome Trace Event JSON (atomically); returns the absolute path."""
        from helios.profile.trace import build_trace, write_trace

        return write_trace(path, build_trace(self.collector, process_name=process_name))


@contextmanager
def profile(clock: Callable[[], int] = time.monotonic_ns, device_timestamps: bool = True) -> Iterator[Profiler]:
    """Open a profiling session: the runtime records into it until the block exits.

    ``device_timestamps=False`` records host ops, step phases and collectives but brackets no
    dispatch with device timestamps: on lavapipe a timestamp write holds back the completion
    of the work submitted before it, which hides how device work and communication overlap.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise ProfileError("a profiling session is already open: profile() sessions do not nest")
    col = Collector(clock)
    col.device_timestamps = device_timestamps
    _ACTIVE = col
    try:
        for hook in _START_HOOKS:
            hook(col)
        yield Profiler(col)
    finally:
        try:
            for hook in _STOP_HOOKS:
                hook(col)
        finally:
            col.end_ns = clock()
            _ACTIVE = None


def parse_profile_steps(text: str) -> range:
    """Parse ``--profile-steps``: ``"10:20"`` -> steps 10..19 (half-open, like a slice); ``"10:"`` to the end; ``"7"`` one step."""
    t = text.strip()
    try:
        if ":" in t:
            a, b = t.split(":", 1)
            start = int(a) if a.strip() else 0
            stop = int(b) if b.strip() else sys.maxsize
        else:
            start = int(t)
            stop = start + 1
    except ValueError:
        raise ProfileError(f"--profile-steps expects START:STOP (e.g. 10:20), START: or N; got {text!r}") from None
    if start < 0 or stop <= start:
        raise ProfileError(f"--profile-steps {text!r}: need 0 <= START < STOP")
    return range(start, stop)
