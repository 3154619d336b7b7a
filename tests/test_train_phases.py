"""Device marks and helios-train's phase timing without a synchronisation per phase: the same losses
as the synchronising timer, phases that fit the step's wall time, the next step recorded before a
step is read, and the synchronising fallback where marks are refused."""

import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

import helios as hl
from helios.profile import timers
from helios.profile.timers import ALL_PHASES, DEVICE_PHASES, IDLE
from helios.runtime import HostRuntime, VulkanRuntime, get_runtime

pytestmark = pytest.mark.vulkan

ARGS = ["--config", "nano", "--steps", "8", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
        "--ckpt-every", "0", "--block-size", "16", "--batch-size", "4"]


def test_marks_time_device_work_in_order_and_resolve_once_it_finished():
    rt = get_runtime()
    assert rt.has_marks  # lavapipe's compute queue writes timestamps
    a = hl.tensor(np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32))
    first = rt.mark()
    for _ in range(4):
        a = a @ a * 0.01
    ids = [first] + [rt.mark() for _ in range(70)]  # more than one command buffer's 64 mark queries
    rt.wait_mark(ids[-1])
    times = rt.take_marks()
    assert set(ids) <= set(times)
    got = [times[i] for i in ids]
    assert got == sorted(got) and got[1] > got[0]  # the matmuls took device time between the first two
    assert rt.take_marks() == {}  # each mark is handed out once
    assert HostRuntime().mark() is None  # no device timestamps: callers synchronise instead


def test_a_replay_is_prepared_without_waiting_for_the_previous_one():
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 64, (4, 16)), rng.integers(0, 64, (4, 16))) for _ in range(3)]
    rt = get_runtime()

    def run(replay: bool):
        model = GPT(cfg, seed=3)
        opt = AdamW(model.parameters(), lr=1e-2)
        x, y = hl.tensor(batches[0][0]), hl.tensor(batches[0][1])

        def step():
            loss = model(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        if not replay:
            out = []
            for xb, yb in batches:
                x.copy_(xb)
                y.copy_(yb)
                out.append(step().item())
            return out
        with hl.graph.capture(inputs=(x, y)) as g:
            loss = step()
        out = [loss.detach().clone()]
        waits = []
        for xb, yb in batches[1:]:
            # Not submitted: unfinished work reads the inputs and the embedding's index grouping,
            # which the next replay refills; it must not wait for that work.
            w0 = rt.stats()["fence_waits"]
            g.replay(xb, yb, flush=False)
            waits.append(rt.stats()["fence_waits"] - w0)
            out.append(loss.detach().clone())
        assert waits == [0, 0]
        return [t.item() for t in out]

    assert run(True) == run(False)  # bit for bit


def test_marked_phases_fit_the_wall_time():
    clock = iter(range(0, 10_000, 10))
    t = timers.StepTimer(lambda: next(clock), mark=iter(range(1, 100)).__next__)
    t.start_step()
    with t.phase("data_load"):
        pass
    with t.phase("forward"):
        pass
    marks = t.take_marks()
    assert [m[0] for m in marks] == ["forward"]
    with pytest.raises(timers.ProfileError, match="inside another device phase"):
        with t.phase("backward"):
            with t.phase("optimizer"):
                pass
    # More device time than the wall leaves (the device ran on while the next step was recorded):
    # the device phases shrink, in proportion; the host phase keeps its time.
    rec = t.end_step(1, 10, device_ns={"forward": 300_000, "backward": 600_000})
    assert all(v >= 0 for v in rec.phases_ns.values()) and sum(rec.phases_ns.values()) == rec.wall_ns
    assert rec.phases_ns["data_load"] == 10 and rec.phases_ns["backward"] == 2 * rec.phases_ns["forward"] > 0
    t.start_step()
    rec = t.end_step(2, 10, complete=False)
    assert len(t.records) == 1 and rec.loss is None  # held back until completed
    t.complete_step(rec, {"forward": 5}, loss=2.5)
    assert t.records[-1] is rec and rec.loss == 2.5 and rec.phases_ns["forward"] == 5


def _db_rows(out):
    con = sqlite3.connect(os.path.join(out, "run.db"))
    cols = ["step", "loss", "val_loss", "wall_ns"] + [f"{p}_ns" for p in ALL_PHASES]
    rows = [dict(zip(cols, r)) for r in con.execute(f"SELECT {', '.join(cols)} FROM step_timing ORDER BY step")]
    con.close()
    return rows


def _run(tmp_path, name, extra, env=None):
    out = str(tmp_path / name)
    e = dict(os.environ, HELIOS_CACHE_DIR=str(tmp_path / "cache"), **(env or {}))
    r = subprocess.run([sys.executable, "-m", "helios.train", *ARGS, "--eval-every", "3", "--out", out, *extra],
                       capture_output=True, text=True, env=e, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout, _db_rows(out)


def _check_phases(rows):
    for r in rows:
        phases = [r[f"{p}_ns"] for p in ALL_PHASES]
        assert min(phases) >= 0 and sum(phases) == r["wall_ns"], r
        assert sum(r[f"{p}_ns"] for p in DEVICE_PHASES) > 0, r  # every step's device work is timed


def test_deferred_steps_give_the_losses_of_the_synchronising_timer(tmp_path):
    out, marked = _run(tmp_path, "marked", [], env={"HELIOS_DEFER_STEPS": "1"})
    assert "a step is read once the next is recorded" in out and "graph capture: on" in out
    out_default, default = _run(tmp_path, "default", [])
    assert "each step read before the next is recorded" in out_default  # lavapipe: a CPU device
    out_sync, synced = _run(tmp_path, "synced", [], env={"HELIOS_PHASE_SYNC": "1"})
    assert "each phase ends with a device synchronisation (HELIOS_PHASE_SYNC is set)" in out_sync
    _, plain = _run(tmp_path, "plain", ["--no-capture"])
    key = [(r["step"], r["loss"], r["val_loss"]) for r in marked]
    assert [r["step"] for r in marked] == list(range(1, 9))
    assert key == [(r["step"], r["loss"], r["val_loss"]) for r in synced]  # bit for bit
    assert key == [(r["step"], r["loss"], r["val_loss"]) for r in plain]
    assert key == [(r["step"], r["loss"], r["val_loss"]) for r in default]
    for rows in (marked, synced, plain, default):
        _check_phases(rows)
    assert all(r["replay_ns"] > 0 for r in marked[1:]) and all(r["forward_ns"] > 0 for r in plain)


def _train_in_process(tmp_path, monkeypatch, name, extra, defer=None):
    """Run helios-train here; returns (stdout, the synchronize() calls made inside a device phase,
    the order of step records and reads)."""
    from helios import train

    monkeypatch.setenv("HELIOS_CACHE_DIR", str(tmp_path / "cache"))
    if defer is not None:
        monkeypatch.setenv("HELIOS_DEFER_STEPS", defer)
    inside = [0]
    calls = {"sync_in_phase": 0, "events": []}
    phase, sync, take, wait = timers.StepTimer.phase, VulkanRuntime.synchronize, timers.StepTimer.take_marks, \
        VulkanRuntime.wait_mark

    def counted_phase(self, name):
        cm = phase(self, name)
        if timers.canonical_phase(name) not in DEVICE_PHASES:
            return cm

        class Inside:
            def __enter__(s):
                inside[0] += 1
                return cm.__enter__()

            def __exit__(s, *exc):
                try:
                    return cm.__exit__(*exc)
                finally:
                    inside[0] -= 1
        return Inside()

    def counted_sync(self):
        calls["sync_in_phase"] += inside[0] > 0
        return sync(self)

    def taken(self):
        calls["events"].append("recorded")
        return take(self)

    def waited(self, mark):
        calls["events"].append("read")
        return wait(self, mark)

    monkeypatch.setattr(timers.StepTimer, "phase", counted_phase)
    monkeypatch.setattr(VulkanRuntime, "synchronize", counted_sync)
    monkeypatch.setattr(timers.StepTimer, "take_marks", taken)
    monkeypatch.setattr(VulkanRuntime, "wait_mark", waited)
    assert train.main([*ARGS, "--out", str(tmp_path / name), *extra]) == 0
    monkeypatch.undo()
    return calls


def test_no_synchronisation_inside_a_phase_and_the_next_step_recorded_before_a_read(tmp_path, monkeypatch, capsys):
    calls = _train_in_process(tmp_path, monkeypatch, "plain", ["--no-capture"], defer="1")
    assert "phase timing: device timestamps" in capsys.readouterr().out
    assert calls["sync_in_phase"] == 0
    ev = calls["events"]
    assert ev.count("recorded") == ev.count("read") == 8
    # Step k is read after step k+1 was recorded (the last step is read at once).
    assert ev[:3] == ["recorded", "recorded", "read"] and ev[-2:] == ["recorded", "read"]
    _check_phases(_db_rows(str(tmp_path / "plain")))
    # By default a CPU device reads each step before recording the next, still without a
    # synchronisation inside a phase.
    calls = _train_in_process(tmp_path, monkeypatch, "default", ["--no-capture"])
    assert calls["sync_in_phase"] == 0 and calls["events"] == ["recorded", "read"] * 8


def test_the_fallback_synchronises_each_phase_and_still_gives_phases(tmp_path, monkeypatch, capsys):
    rt = get_runtime()
    monkeypatch.setattr(rt, "has_marks", False)  # a device whose compute queue writes no timestamps
    calls = _train_in_process(tmp_path, monkeypatch, "nomarks", ["--no-capture"])
    out = capsys.readouterr().out
    assert f"each phase ends with a device synchronisation ({rt.name} writes no device timestamps)" in out
    assert calls["sync_in_phase"] == 4 * 8  # forward, backward, clip, optimizer of every step
    assert calls["events"].count("read") == 0
    rows = _db_rows(str(tmp_path / "nomarks"))
    _check_phases(rows)
    assert all(r[IDLE + "_ns"] >= 0 for r in rows)
