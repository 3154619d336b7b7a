"""Chrome trace export: field validity, device events inside their submits, one event per dispatch."""

from __future__ import annotations

import json
import os

import pytest
from helios.profile import Collector, build_trace, profile, validate_trace, write_trace
from helios.profile.trace import _assign_lanes
from test_profile_synth import FakeClock, FakeRuntime, simulate_training

NEEDS = {"X": {"name", "ts", "dur", "pid", "tid"}, "C": {"name", "ts", "pid", "args"}, "M": {"name", "pid", "args"},
         "s": {"name", "cat", "id", "ts", "pid", "tid"}, "f": {"name", "cat", "id", "ts", "pid", "tid", "bp"}}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    clock = FakeClock()
    with profile(clock=clock) as prof:
        _, rt, timer = simulate_training(4, seed=3, clock=clock)
    path = prof.export_chrome_trace(str(tmp_path_factory.mktemp("trace") / "trace.json"))
    with open(path) as f:
        trace = json.load(f)
    return prof, rt, timer, trace


def test_every_event_has_the_fields_its_phase_needs(session) -> None:
    _, _, _, trace = session
    evs = trace["traceEvents"]
    assert {e["ph"] for e in evs} == set(NEEDS)
    for e in evs:
        missing = NEEDS[e["ph"]] - set(e)
        assert not missing, (e, missing)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    assert validate_trace(trace) == []


def test_device_events_fall_inside_their_submit_window(session) -> None:
    _, _, _, trace = session
    evs = trace["traceEvents"]
    subs = {e["args"]["submit"]: e for e in evs if e.get("cat") == "submit"}
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    assert kernels and subs
    per_submit: dict[int, int] = {}
    for k in kernels:
        s = subs[k["args"]["submit"]]
        assert s["ts"] <= k["ts"] and k["ts"] + k["dur"] <= s["ts"] + s["dur"] + 1e-9, (k, s)
        per_submit[k["args"]["submit"]] = per_submit.get(k["args"]["submit"], 0) + 1
    assert all(per_submit[i] == s["args"]["dispatches"] for i, s in subs.items())


def test_one_device_event_per_dispatch_and_one_arrow_each(session) -> None:
    prof, rt, timer, trace = session
    evs = trace["traceEvents"]
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    recorded = sum(len(op.dispatch_ids) for op in prof.collector.ops)
    assert len(kernels) == recorded == rt.dispatches_total == sum(r.dispatches for r in timer.records)
    assert sorted(k["args"]["dispatch_seq"] for k in kernels) == list(range(recorded))
    starts = {e["id"]: e for e in evs if e["ph"] == "s"}
    ends = {e["id"]: e for e in evs if e["ph"] == "f"}
    assert set(starts) == set(ends) == set(range(recorded))
    ops = {(e["tid"], e["ts"], e["dur"]) for e in evs if e.get("cat") == "op"}
    by_seq = {k["args"]["dispatch_seq"]: k for k in kernels}
    for i, s in starts.items():
        # The arrow leaves from inside a host op slice and lands at the kernel's start on its track.
        assert any(tid == s["tid"] and ts <= s["ts"] <= ts + d for tid, ts, d in ops)
        assert ends[i]["ts"] == by_seq[i]["ts"] and ends[i]["tid"] == by_seq[i]["tid"]
        assert s["ts"] <= ends[i]["ts"]  # recorded before it ran


def test_args_metadata_and_counters(session) -> None:
    _, _, timer, trace = session
    evs = trace["traceEvents"]
    k = next(e for e in evs if e.get("cat") == "kernel" and e["args"]["op"] == "matmul")
    for key in ("shape", "dtype", "flops", "bytes", "GFLOP/s", "GB/s"):
        assert key in k["args"]
    assert k["args"]["GFLOP/s"] == pytest.approx(k["args"]["flops"] / (k["dur"] * 1000), rel=1e-3)
    assert k["args"]["shape"] == "(256, 128)x(128, 384)" and k["args"]["dtype"] == "f32"
    names = {(e["name"], e["args"].get("name")) for e in evs if e["ph"] == "M"}
    assert ("process_name", "helios host") in names and ("process_name", "helios device") in names
    assert ("thread_name", "host ops") in names and ("thread_name", "queue 0: kernels") in names
    assert ("thread_name", "step phases") in names
    counters = [e for e in evs if e["ph"] == "C"]
    assert counters and {"activations", "weights"} <= set(counters[-1]["args"])
    steps = [e for e in evs if e.get("cat") == "step"]
    assert len(steps) == len(timer.records)
    phases = [e for e in evs if e.get("cat") == "phase"]
    for p in phases:  # every phase slice lies inside its step slice
        st = next(s for s in steps if s["name"] == f"step {p['args']['step']}")
        assert st["ts"] <= p["ts"] and p["ts"] + p["dur"] <= st["ts"] + st["dur"] + 1e-9


def _slices_nest(slices: list[tuple[float, float]]) -> bool:
    stack: list[float] = []
    for s, e in sorted(slices, key=lambda x: (x[0], -x[1])):
        while stack and stack[-1] <= s:
            stack.pop()
        if stack and e > stack[-1]:
            return False
        stack.append(e)
    return True


def test_overlapping_dispatches_get_separate_lanes(tmp_path) -> None:
    col = Collector(clock=lambda: 0)
    # Three dispatches that overlap on the device (no barrier between them) in one submit.
    col.add_device_events({"events": [
        {"name": "a", "flops": 10, "bytes": 10, "start_ns": 100, "end_ns": 500, "submit": 0, "host_record_ns": 10},
        {"name": "b", "flops": 10, "bytes": 10, "start_ns": 200, "end_ns": 700, "submit": 0, "host_record_ns": 20},
        {"name": "c", "flops": 10, "bytes": 10, "start_ns": 600, "end_ns": 800, "submit": 0, "host_record_ns": 30},
    ], "submits": [{"submit": 0, "host_submit_ns": 50, "host_done_ns": 900, "dispatches": 3}]})
    trace = build_trace(col)
    assert validate_trace(trace) == []
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    assert [k["args"]["dispatch_seq"] for k in kernels] == [0, 1, 2]  # numbered by arrival without a seq
    by_tid: dict[int, list] = {}
    for k in kernels:
        by_tid.setdefault(k["tid"], []).append((k["ts"], k["ts"] + k["dur"]))
    assert len(by_tid) == 2 and all(_slices_nest(v) for v in by_tid.values())
    assert _assign_lanes([(0, 10), (2, 5), (3, 12), (10, 11)]) == [0, 0, 1, 0]


def test_validator_catches_broken_traces() -> None:
    good = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "q"}},
        {"ph": "X", "cat": "submit", "name": "submit 0", "pid": 2, "tid": 1, "ts": 10.0, "dur": 5.0,
         "args": {"submit": 0}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 2, "tid": 1, "ts": 11.0, "dur": 2.0, "args": {"submit": 0}},
    ]}
    assert validate_trace(good) == []
    import copy

    bad = copy.deepcopy(good)
    bad["traceEvents"][2]["dur"] = -1.0
    assert any("negative duration" in e for e in validate_trace(bad))
    bad = copy.deepcopy(good)
    bad["traceEvents"][2]["ts"] = 14.0
    assert any("outside its submit window" in e for e in validate_trace(bad))
    bad = copy.deepcopy(good)
    del bad["traceEvents"][1]["dur"]
    assert any("missing ['dur']" in e for e in validate_trace(bad))
    bad = copy.deepcopy(good)
    bad["traceEvents"].append({"ph": "s", "cat": "d", "name": "d", "id": 7, "ts": 1.0, "pid": 2, "tid": 1})
    assert any("flow id 7" in e for e in validate_trace(bad))
    bad = copy.deepcopy(good)
    bad["traceEvents"].append({"ph": "X", "name": "x", "pid": 3, "tid": 9, "ts": 1.0, "dur": 1.0})
    assert any("no thread_name" in e for e in validate_trace(bad))
    assert validate_trace({}) == ["top level has no 'traceEvents' list"]


def test_write_is_atomic_and_leaves_no_temp(tmp_path) -> None:
    p = tmp_path / "sub" / "t.json"
    write_trace(str(p), {"traceEvents": []})
    write_trace(str(p), {"traceEvents": [], "otherData": {"n": 2}})
    assert json.loads(p.read_text())["otherData"] == {"n": 2}
    assert os.listdir(p.parent) == ["t.json"]
    with pytest.raises(ValueError):  # NaN is not JSON: nothing written, old file intact
        write_trace(str(p), {"traceEvents": [{"ts": float("nan")}]})
    assert json.loads(p.read_text())["otherData"] == {"n": 2} and os.listdir(p.parent) == ["t.json"]


def test_runtime_without_seq_numbers_matches_by_order() -> None:
    """An addon that omits dispatch_seq: events are numbered by arrival, which is recording order."""
    clock = FakeClock()
    with profile(clock=clock) as prof:
        rt = FakeRuntime(clock)
        rt.op("matmul", (4, 4), "f32", 128, 192, n_dispatch=2)
        rt.op("relu", (4, 4), "f32", 16, 128)
        for ev in rt.pending:
            ev.pop("dispatch_seq")
        rt.synchronize()
    owner = prof.collector.op_of_dispatch()
    assert [owner[e.dispatch_seq].name for e in prof.collector.events] == ["matmul", "matmul", "relu"]
