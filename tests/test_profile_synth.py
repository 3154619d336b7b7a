"""A simulated runtime that drives helios.profile through its real contract, with consistent timings.

Other profile tests import :class:`FakeRuntime` and :func:`simulate_training`
from here. The simulation: a fake clock; each op spends host time enqueueing,
numbers its dispatches through ``current_collector().next_dispatch_seq()`` and
reports itself with ``record_op``; dispatches queue up and are submitted when
the queue holds ``submit_every`` of them or at synchronize; the device runs a
submit's dispatches back to back (starting after the submit, after the previous
submit finished), each for flops/rate or bytes/bandwidth, whichever is longer;
synchronize waits (the host clock jumps) to the fence and pushes the events.
"""

from __future__ import annotations

import random

from helios.profile import StepTimer, current_collector


class FakeClock:
    """A monotonic ns clock that only moves when told."""

    def __init__(self, t0: int = 1_000_000_000) -> None:
        self.t = t0

    def __call__(self) -> int:
        return self.t

    def advance(self, ns: int) -> None:
        assert ns >= 0
        self.t += int(ns)


class FakeRuntime:
    """Records ops the way the real runtime will, against a fake device."""

    DEVICE_GFLOPS = 2000.0  # FLOP per ns = GFLOP/s
    DEVICE_GBPS = 300.0

    def __init__(self, clock: FakeClock, seed: int = 0, submit_every: int = 16) -> None:
        self.clock = clock
        self.rng = random.Random(seed)
        self.submit_every = submit_every
        self.pending: list[dict] = []
        self.device_free_ns = 0
        self.events: list[dict] = []
        self.submits: list[dict] = []
        self.n_submit = 0
        self.mem = {"weights": 50_000_000, "activations": 0}
        self.dispatches_total = 0

    def op(self, name: str, shape: tuple, dtype: str, flops: int, nbytes: int, n_dispatch: int = 1,
           kernel: str | None = None) -> None:
        col = current_collector()  # the per-op check the runtime makes
        start = self.clock()
        ids = []
        for k in range(n_dispatch):
            self.clock.advance(self.rng.randint(2_000, 9_000))  # host enqueue cost per dispatch
            seq = col.next_dispatch_seq() if col is not None else None
            ids.append(seq)
            self.pending.append({"name": kernel or f"{name}_k{k}", "flops": flops // n_dispatch,
                                 "bytes": nbytes // n_dispatch, "host_record_ns": self.clock(), "dispatch_seq": seq})
            self.dispatches_total += 1
            if len(self.pending) >= self.submit_every:
                self._submit()
        self.clock.advance(self.rng.randint(500, 3_000))
        if col is not None:
            col.record_op(name, shape, dtype, start, self.clock(), ids)
            if name in ("matmul", "gelu", "softmax"):
                self.mem["activations"] += nbytes // 4
                col.record_memory(self.clock(), "activations", self.mem["activations"])

    def _submit(self) -> None:
        if not self.pending:
            return
        self.clock.advance(3_000)
        sub_ns = self.clock()
        t = max(sub_ns + 5_000, self.device_free_ns)  # queue latency, then after the previous submit
        for d in self.pending:
            dur = max(1_000, int(max(d["flops"] / self.DEVICE_GFLOPS, d["bytes"] / self.DEVICE_GBPS)))
            ev = dict(d, start_ns=t, end_ns=t + dur, submit=self.n_submit)
            if ev.get("dispatch_seq") is None:
                ev.pop("dispatch_seq", None)
            self.events.append(ev)
            t += dur + 300  # barrier gap
        self.device_free_ns = t
        self.submits.append({"submit": self.n_submit, "host_submit_ns": sub_ns, "host_done_ns": t + 2_000,
                             "dispatches": len(self.pending)})
        self.n_submit += 1
        self.pending = []

    def synchronize(self) -> None:
        self._submit()
        if self.submits:
            self.clock.t = max(self.clock.t, self.submits[-1]["host_done_ns"])  # wait on the fence
        col = current_collector()
        if col is not None:
            col.add_device_events({"events": self.events, "submits": self.submits})
            col.record_memory(self.clock(), "weights", self.mem["weights"])
        self.events, self.submits = [], []

    def reset_activations(self) -> None:
        self.mem["activations"] = 0
        col = current_collector()
        if col is not None:
            col.record_memory(self.clock(), "activations", 0)


N_LAYER, D, T, B, V = 2, 128, 64, 4, 512


def gpt_step(rt: FakeRuntime, timer: StepTimer) -> None:
    """One simulated GPT training step, with phases."""
    c = rt.clock
    with timer.phase("data_load"):
        c.advance(rt.rng.randint(40_000, 80_000))
    with timer.phase("host_to_device"):
        rt.op("copy_in", (B, T), "i32", 0, B * T * 4, kernel="copy")
    with timer.phase("forward"):
        rt.op("embedding", (B, T, D), "f32", 0, B * T * D * 4)
        for _ in range(N_LAYER):
            rt.op("layernorm", (B, T, D), "f32", 8 * B * T * D, 2 * B * T * D * 4)
            rt.op("matmul", ((B * T, D), (D, 3 * D)), "f32", 2 * B * T * D * 3 * D, 4 * (B * T * D + 3 * D * D + 3 * B * T * D))
            rt.op("attention", (B, 4, T, T), "f32", 4 * B * T * T * D, 4 * 4 * B * T * D, n_dispatch=3)
            rt.op("matmul", ((B * T, D), (D, 4 * D)), "f32", 2 * B * T * D * 4 * D, 4 * (B * T * D + 4 * D * D + 4 * B * T * D))
            rt.op("gelu", (B, T, 4 * D), "f32", 8 * B * T * 4 * D, 2 * 4 * B * T * 4 * D)
            rt.op("matmul", ((B * T, 4 * D), (4 * D, D)), "f32", 2 * B * T * D * 4 * D, 4 * (B * T * 4 * D + 4 * D * D + B * T * D))
        rt.op("matmul", ((B * T, D), (D, V)), "f32", 2 * B * T * D * V, 4 * (B * T * D + D * V + B * T * V))
        rt.op("cross_entropy", (B * T, V), "f32", 5 * B * T * V, 4 * B * T * V, n_dispatch=2)
    with timer.phase("backward"):
        for _ in range(N_LAYER):
            rt.op("matmul_backward", ((B * T, D), (D, 4 * D)), "f32", 4 * B * T * D * 4 * D, 8 * (B * T * D + 4 * D * D), n_dispatch=2)
            rt.op("gelu_backward", (B, T, 4 * D), "f32", 10 * B * T * 4 * D, 3 * 4 * B * T * 4 * D)
            rt.op("attention_backward", (B, 4, T, T), "f32", 8 * B * T * T * D, 8 * 4 * B * T * D, n_dispatch=4)
        with timer.phase("comm"):  # an overlapped all-reduce nested in backward
            c.advance(rt.rng.randint(20_000, 40_000))
    with timer.phase("grad_clip"):
        rt.op("grad_norm", (1,), "f32", 2 * 400_000, 4 * 400_000)
    with timer.phase("optimizer"):
        rt.op("adamw", (400_000,), "f32", 12 * 400_000, 4 * 4 * 400_000)
    with timer.phase("device_to_host"):
        rt.synchronize()
        rt.op("copy_out", (1,), "f32", 0, 4, kernel="copy")
        rt.synchronize()
    c.advance(rt.rng.randint(5_000, 15_000))  # glue outside any phase -> idle
    rt.reset_activations()


def simulate_training(steps: int, seed: int = 0, clock: FakeClock | None = None
                      ) -> tuple[FakeClock, FakeRuntime, StepTimer]:
    """Run ``steps`` simulated steps (inside or outside a profile() session, as the caller arranges)."""
    clock = clock or FakeClock()
    rt = FakeRuntime(clock, seed)
    timer = StepTimer(clock)
    for step in range(steps):
        before = rt.dispatches_total
        timer.start_step()
        gpt_step(rt, timer)
        timer.end_step(step, tokens=B * T, loss=4.0 * 0.97 ** step + rt.rng.random() * 0.05, lr=3e-4,
                       dispatches=rt.dispatches_total - before)
    return clock, rt, timer


def test_simulation_is_self_consistent() -> None:
    """The generator itself: every event inside its submit; dispatch numbers dense; step records add up."""
    from helios.profile import profile

    clock = FakeClock()
    with profile(clock=clock) as prof:
        _, rt, timer = simulate_training(3, clock=clock)
    col = prof.collector
    subs = {s.submit: s for s in col.submits}
    assert col.events and len(col.events) == rt.dispatches_total
    assert sorted(e.dispatch_seq for e in col.events) == list(range(rt.dispatches_total))
    for e in col.events:
        s = subs[e.submit]
        assert s.host_submit_ns <= e.start_ns <= e.end_ns <= s.host_done_ns
    assert sum(s.dispatches for s in col.submits) == len(col.events)
    for r in timer.records:
        assert sum(r.phases_ns.values()) == r.wall_ns
