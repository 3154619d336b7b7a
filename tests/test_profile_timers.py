"""StepTimer: phases + idle add up to the wall time; nesting never double counts."""

from __future__ import annotations

import time

import pytest
from helios.profile import ALL_PHASES, PHASES, ProfileError, StepTimer, profile
from test_profile_synth import FakeClock, simulate_training


def test_real_clock_phases_add_up_to_wall_within_5_percent() -> None:
    timer = StepTimer()
    outer_start = time.monotonic_ns()
    timer.start_step()
    with timer.phase("data_load"):
        time.sleep(0.010)
    with timer.phase("forward"):
        time.sleep(0.020)
    with timer.phase("backward"):
        time.sleep(0.015)
        with timer.phase("comm"):
            time.sleep(0.010)
    with timer.phase("optimizer"):
        time.sleep(0.005)
    time.sleep(0.005)  # outside every phase: idle
    rec = timer.end_step(0, tokens=1024)
    outer = time.monotonic_ns() - outer_start
    assert sum(rec.phases_ns.values()) == rec.wall_ns  # exact by construction
    assert abs(rec.wall_ns - outer) / outer < 0.05
    # Each phase holds at least its sleep, and the named phases are most of the step.
    assert rec.phases_ns["forward"] >= 20_000_000 and rec.phases_ns["comm"] >= 10_000_000
    assert rec.phases_ns["backward"] >= 15_000_000 and rec.phases_ns["idle"] >= 5_000_000
    named = sum(v for k, v in rec.phases_ns.items() if k != "idle")
    assert abs((named + rec.phases_ns["idle"]) - outer) / outer < 0.05
    assert rec.tokens_per_s == pytest.approx(1024 / rec.wall_s)


def test_nested_phase_time_goes_to_innermost() -> None:
    c = FakeClock()
    t = StepTimer(c)
    t.start_step()
    c.advance(7)  # idle
    with t.phase("backward"):
        c.advance(100)
        with t.phase("comm"):
            c.advance(40)
            with t.phase("device_to_host"):
                c.advance(5)
            c.advance(10)
        c.advance(30)
    with t.phase("backward"):  # re-entered: adds up
        c.advance(3)
    rec = t.end_step(3, tokens=10, loss=2.5, lr=1e-3, dispatches=17)
    assert rec.phases_ns["backward"] == 133
    assert rec.phases_ns["comm"] == 50
    assert rec.phases_ns["device_to_host"] == 5
    assert rec.phases_ns["idle"] == 7
    assert rec.wall_ns == 195 and sum(rec.phases_ns.values()) == 195
    assert set(rec.phases_ns) == set(ALL_PHASES)
    # Spans are the full intervals, children nested inside parents.
    names = [(s.name, s.depth, s.end_ns - s.start_ns) for s in rec.spans]
    assert names == [("backward", 0, 185), ("comm", 1, 55), ("device_to_host", 2, 5), ("backward", 0, 3)]
    assert (rec.step, rec.loss, rec.lr, rec.dispatches) == (3, 2.5, 1e-3, 17)


def test_aliases_and_counted_dispatches() -> None:
    c = FakeClock()
    t = StepTimer(c)
    t.start_step()
    with t.phase("h2d"):
        c.advance(4)
    with t.phase("d2h"):
        c.advance(6)
    t.count_dispatches(5)
    t.count_dispatches(2)
    rec = t.end_step(0, tokens=1)
    assert rec.phases_ns["host_to_device"] == 4 and rec.phases_ns["device_to_host"] == 6
    assert rec.dispatches == 7
    assert "h2d" not in PHASES


def test_misuse_is_reported() -> None:
    t = StepTimer(FakeClock())
    with pytest.raises(ProfileError, match="outside a step"), t.phase("forward"):
        pass
    with pytest.raises(ProfileError, match="without start_step"):
        t.end_step(0, 1)
    t.start_step()
    with pytest.raises(ProfileError, match="called twice"):
        t.start_step()
    with pytest.raises(ProfileError, match="unknown step phase 'idle'"), t.phase("idle"):
        pass
    with pytest.raises(ValueError, match="unknown step phase 'fwd'"), t.phase("fwd"):  # a ValueError too
        pass
    cm = t.phase("forward")
    cm.__enter__()
    with pytest.raises(ProfileError, match=r"still open: \['forward'\]"):
        t.end_step(0, 1)


def test_simulated_steps_add_up_and_reach_the_profiler() -> None:
    clock = FakeClock()
    with profile(clock=clock) as prof:
        _, rt, timer = simulate_training(5, clock=clock)
    assert len(prof.collector.steps) == 5
    for rec in timer.records:
        assert sum(rec.phases_ns.values()) == rec.wall_ns
        assert rec.phases_ns["idle"] > 0 and rec.phases_ns["comm"] > 0
        assert rec.dispatches and rec.dispatches > 0
    assert sum(r.dispatches for r in timer.records) == rt.dispatches_total
