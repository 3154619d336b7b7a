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

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock = clock
        self._step_start: int | None = None
        self._acc: dict[str, int] = {}
        self._stack: list[list] = []  # [name, self_time_resumed_at_ns, entered_at_ns]
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

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name``; the innermost open phase owns the time."""
        name = canonical_phase(name)
        if self._step_start is None:
            raise ProfileError(f"phase {name!r} opened outside a step: call start_step() first")
        now = self._clock()
        if self._stack:
            # Pause the parent: bank its self time up to now.
            parent = self._stack[-1]
            self._acc[parent[0]] += now - parent[1]
        entry = [name, now, now]
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

    def end_step(
        self,
        step: int,
        tokens: int,
        loss: float | None = None,
        lr: float | None = None,
        dispatches: int | None = None,
    ) -> StepRecord:
        """Close the step and return its :class:`StepRecord` (also appended to ``records``)."""
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
        self.records.append(rec)
        # The active profiler (if any) gets the step so its trace can show the phases.
        col = current_collector()
        if col is not None:
            col.record_step(rec)
        return rec
