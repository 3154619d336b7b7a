"""Step timers: where each training step's wall time went.

A step is split into the phases of :data:`PHASES` plus ``idle``::

    timer = StepTimer()
    for step in range(n):
        timer.start_step()
        with timer.phase("data_load"):
            x, y = next(loader)
        with timer.phase("forward"):
            loss = model(x, y)
        ...
        rec = timer.end_step(step, tokens=x.numel(), loss=loss_value, lr=lr)

Rules
-----
* ``wall`` is ``end_step`` time minus ``start_step`` time.
* **Nested phases do not double count: time belongs to the innermost open phase.**
  ``comm`` opened inside ``backward`` (an overlapped gradient all-reduce) takes
  its time out of ``backward``; ``backward`` keeps only its self time. The same
  phase opened twice in one step adds up.
* ``idle = wall - sum(phases)``: host time spent outside any phase (Python glue,
  logging, the wait for a lagging device that no phase covered). With the
  innermost rule the phases never overlap, so ``idle >= 0`` and
  ``sum(phases) + idle == wall`` exactly, in integer nanoseconds.
* A phase still open at ``end_step`` is an error (:class:`ProfileError`): its
  time would belong to no step.
* ``dispatches`` (kernel launches in the step) comes from the runtime: it calls
  :meth:`StepTimer.count_dispatches` (or passes ``dispatches=`` to
  ``end_step``).

Phases are measured on the host clock (``time.monotonic_ns``), the clock the
device events are converted to, so the phase spans line up with device events in
a trace.

Device phases from marks
------------------------
Execution is deferred: the host records a phase's work and the device runs it later.
Timed on the host alone, a phase would need a device synchronisation at its end to own
its device time.  ``StepTimer(mark=rt.mark)`` avoids that: a phase of
:data:`DEVICE_PHASES` then puts a device mark (a timestamp in the command stream) at
its start and at its end and never waits; the host time spent recording it is no phase
(``idle``).  The step's marks are taken with :meth:`StepTimer.take_marks` once
recorded, and their device times (``rt.take_marks()``, resolved when the work finished)
go to ``end_step(device_ns=device_phase_ns(marks, times))``, possibly a step later
(helios-train, where it defers reading a step, records step k+1, then waits for step
k's last mark: there it closes step k's window, ``end_step(complete=False)``, opens the
next one, reads k's loss and completes k's record with :meth:`complete_step`).  Set
``timer.device_marks = False`` to time the device phases on the host again (a
profiled step).  Rules for a step with device phases:

* a device phase's time is the device time between its two marks: the work recorded
  inside it, exactly (a mark is written when everything recorded before it finished);
* host-only phases (data_load, host_to_device, ...) keep their host time;
* the host and the device work at once, and the device may run part of a step outside the
  step's host window (it began while the host still logged the previous step), so the
  sum can exceed ``wall``: then the device phases are scaled down, all by the same
  factor, to the wall time the host-only phases leave; their proportions stay exact.  So the phases stay
  non-negative, ``sum(phases) + idle == wall`` still holds, and ``idle`` is the time
  neither side accounted for.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from helios.profile.errors import ProfileError
from helios.profile.profiler import current_collector

#: Timed phases of a step, in display order. ``idle`` is the remainder and is never opened.
PHASES: tuple[str, ...] = (
    "data_load",
    "host_to_device",
    "forward",
    "backward",
    "grad_clip",
    "optimizer",
    "replay",
    "comm",
    "device_to_host",
    "checkpoint",
    "sample_gen",
)
#: Phases whose work runs on the device: timed by device marks when the timer has them.
DEVICE_PHASES: tuple[str, ...] = ("forward", "backward", "grad_clip", "optimizer", "replay")
IDLE = "idle"
#: Every column of a step's breakdown: the phases, then idle.
ALL_PHASES: tuple[str, ...] = PHASES + (IDLE,)

# Spellings users reach for; all map to the canonical names above.
_ALIASES = {
    "h2d": "host_to_device",
    "host->device": "host_to_device",
    "d2h": "device_to_host",
    "device->host": "device_to_host",
    "optim": "optimizer",
    "clip": "grad_clip",
    "data": "data_load",
    "sample": "sample_gen",
}


def canonical_phase(name: str) -> str:
    """Return the canonical phase name for ``name`` (accepts aliases like ``"h2d"``)."""
    name = _ALIASES.get(name, name)
    if name not in PHASES:
        raise ProfileError(
            f"unknown step phase {name!r}: expected one of {', '.join(PHASES)} "
            f"(or an alias: {', '.join(sorted(_ALIASES))}); idle is the remainder and cannot be opened"
        )
    return name


@dataclass(frozen=True)
class PhaseSpan:
    """The full interval of one opened phase (host clock, ns), children included. For traces."""

    name: str
    start_ns: int
    end_ns: int
    depth: int  # 0 for an outermost phase, 1 for a phase opened inside it, ...


@dataclass
class StepRecord:
    """The timing of one step. ``phases_ns`` has every name of :data:`ALL_PHASES`."""

    step: int
    start_ns: int
    end_ns: int
    phases_ns: dict[str, int]
    tokens: int
    loss: float | None = None
    lr: float | None = None
    dispatches: int | None = None
    spans: list[PhaseSpan] = field(default_factory=list)

    @property
    def wall_ns(self) -> int:
        """Wall time of the step, ns."""
        return self.end_ns - self.start_ns

    @property
    def wall_s(self) -> float:
        """Wall time of the step, seconds."""
        return self.wall_ns / 1e9

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput of the step; None for a zero-length step."""
        return self.tokens / self.wall_s if self.wall_ns > 0 else None

    def fraction(self, phase: str) -> float:
        """Share of the wall time spent in ``phase`` (0..1)."""
        return self.phases_ns[phase] / self.wall_ns if self.wall_ns > 0 else 0.0


class StepTimer:
    """Splits each step's wall time into phases (see the module docstring for the rules).

    ``clock`` returns integer nanoseconds; it defaults to ``time.monotonic_ns``
    and is injectable for tests. Not thread-safe: one timer per training loop.
    """

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns, mark: Callable[[], object] | None = None) -> None:
        self._clock = clock
        # mark(): a device mark's id (helios.backend.Runtime.mark); None: host timing only.
        self._mark = mark
        self.device_marks = mark is not None  # False: device phases timed on the host (a profiled step)
        self._marks: list[tuple[str, object, object]] = []  # (phase, start mark, end mark) not yet taken
        self._step_start: int | None = None
        self._acc: dict[str, int] = {}
        self._stack: list[list] = []  # [name, self_time_resumed_at_ns, entered_at_ns, device-marked]
        self._spans: list[PhaseSpan] = []
        self._dispatches: int | None = None
        self.records: list[StepRecord] = []

    @property
    def in_step(self) -> bool:
        """True between ``start_step`` and ``end_step``."""
        return self._step_start is not None

    def start_step(self) -> None:
        """Mark the start of a step."""
        if self._step_start is not None:
            raise ProfileError("start_step() called twice: call end_step() to close the open step first")
        self._acc = dict.fromkeys(PHASES, 0)
        self._stack = []
        self._spans = []
        self._dispatches = None
        self._step_start = self._clock()

    def count_dispatches(self, n: int) -> None:
        """Add ``n`` kernel launches to the open step (the runtime calls this)."""
        self._dispatches = (self._dispatches or 0) + int(n)

    def take_marks(self) -> list[tuple[str, object, object]]:
        """The (phase, start mark, end mark) triples of the device phases closed since the last take."""
        out, self._marks = self._marks, []
        return out

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name``; the innermost open phase owns the time (a device phase
        with marks on: the device time between a mark before the body and one after it)."""
        name = canonical_phase(name)
        if self._step_start is None:
            raise ProfileError(f"phase {name!r} opened outside a step: call start_step() first")
        if self.device_marks and name in DEVICE_PHASES:
            yield from self._marked_phase(name)
            return
        now = self._clock()
        if self._stack:
            # Pause the parent: bank its self time up to now.
            parent = self._stack[-1]
            self._acc[parent[0]] += now - parent[1]
        entry = [name, now, now, False]  # [name, self time resumed at, entered at, marked]
        self._stack.append(entry)
        try:
            yield
        finally:
            end = self._clock()
            top = self._stack.pop()
            self._acc[top[0]] += end - top[1]
            # The span is the phase's full interval (children nest inside it in a trace).
            self._spans.append(PhaseSpan(top[0], top[2], end, len(self._stack)))
            if self._stack:
                # Resume the parent: its self time counts again from now.
                self._stack[-1][1] = end

    def _marked_phase(self, name: str) -> Iterator[None]:
        # Device time between two marks; the host's recording time is no phase's (idle).
        if any(e[3] for e in self._stack):
            raise ProfileError(f"device phase {name!r} opened inside another device phase: their marks would overlap")
        now = self._clock()
        if self._stack:
            parent = self._stack[-1]
            self._acc[parent[0]] += now - parent[1]
        start = self._mark()
        self._stack.append([name, now, now, True])
        try:
            yield
        finally:
            end_mark = self._mark()
            end = self._clock()
            top = self._stack.pop()
            self._spans.append(PhaseSpan(top[0], top[2], end, len(self._stack)))
            self._marks.append((name, start, end_mark))
            if self._stack:
                self._stack[-1][1] = end

    def end_step(
        self,
        step: int,
        tokens: int,
        loss: float | None = None,
        lr: float | None = None,
        dispatches: int | None = None,
        device_ns: dict[str, int] | None = None,
        complete: bool = True,
    ) -> StepRecord:
        """Close the step and return its :class:`StepRecord` (also appended to ``records``).
        ``device_ns``: the device phases' times from marks (:func:`device_phase_ns`), fitted into
        the wall time by the module docstring's rules.  ``complete=False``: the device times (and
        the loss) come later, through :meth:`complete_step`; the record is held back until then
        and the next step may open meanwhile."""
        if self._step_start is None:
            raise ProfileError("end_step() without start_step(): open the step first")
        if self._stack:
            open_names = [e[0] for e in self._stack]
            raise ProfileError(f"end_step() with phases still open: {open_names}; close them before ending")
        end = self._clock()
        wall = end - self._step_start
        phases = dict(self._acc)
        phases[IDLE] = wall - sum(phases.values())
        if phases[IDLE] < 0:
            # Only a non-monotonic clock gets here; say so rather than store nonsense.
            raise ProfileError(f"phases sum to more than the step's wall time ({wall} ns): the clock went backwards")
        if dispatches is None:
            dispatches = self._dispatches
        rec = StepRecord(
            step=int(step),
            start_ns=self._step_start,
            end_ns=end,
            phases_ns=phases,
            tokens=int(tokens),
            loss=None if loss is None else float(loss),
            lr=None if lr is None else float(lr),
            dispatches=dispatches,
            spans=sorted(self._spans, key=lambda s: (s.start_ns, s.depth)),
        )
        self._step_start = None
        if complete:
            self.complete_step(rec, device_ns)
        return rec

    def complete_step(self, rec: StepRecord, device_ns: dict[str, int] | None = None,
                      loss: float | None = None) -> StepRecord:
        """Finish a record closed by ``end_step(complete=False)``: fit in the device phases' times,
        set the loss, append it to ``records`` (and hand it to an open profiler)."""
        if device_ns:
            phases = rec.phases_ns
            del phases[IDLE]
            _fit_device_phases(phases, device_ns, rec.wall_ns)
            phases[IDLE] = rec.wall_ns - sum(phases.values())
        if loss is not None:
            rec.loss = float(loss)
        self.records.append(rec)
        # The active profiler (if any) gets the step so its trace can show the phases.
        col = current_collector()
        if col is not None:
            col.record_step(rec)
        return rec


def device_phase_ns(marks: list[tuple[str, object, object]], times: dict) -> dict[str, int] | None:
    """Device ns per phase from (phase, start mark, end mark) triples and the marks' resolved
    times (``{id: ns}``); None if any mark is not resolved yet."""
    out: dict[str, int] = {}
    for name, a, b in marks:
        if a not in times or b not in times:
            return None
        out[name] = out.get(name, 0) + max(0, int(times[b]) - int(times[a]))
    return out


def _fit_device_phases(phases: dict[str, int], device_ns: dict[str, int], wall: int) -> None:
    """Add the device phases' times into ``phases`` (host phases, no idle), scaled down to the
    wall time the host phases leave when they do not fit (module docstring)."""
    for name in device_ns:
        if name not in DEVICE_PHASES:
            raise ProfileError(f"device time given for {name!r}, which is not a device phase ({', '.join(DEVICE_PHASES)})")
    room = max(0, wall - sum(phases.values()))
    total = sum(int(ns) for ns in device_ns.values())
    for name, ns in device_ns.items():
        phases[name] += int(ns) if total <= room else int(ns) * room // total
