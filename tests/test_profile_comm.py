"""Collectives reach the profiler: Collector.record_comm, comm_events(), comm time totals,
and the "collectives" track of the Chrome trace.

The two-rank test runs this file as a script per rank (shm backend), each inside a
profiling session, and checks the events and the exported trace of both ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helios.comm.launcher import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import finish  # noqa: E402
from helios.profile import Collector, build_trace, profile, validate_trace

HERE = os.path.abspath(__file__)
PY = sys.executable
N = 1000  # float32 elements per all_reduce


# =============================================================================== rank side
def rank_main(out_dir: str) -> None:
    """Profile a sync and an async all_reduce (and a few others); write the trace and a summary."""
    import helios.comm as dist

    dist.init_process_group(backend="shm", timeout=30)
    r, n = dist.get_rank(), dist.get_world_size()
    x = np.full(N, r + 1, np.float32)
    dist.all_reduce(x)  # before the session: not recorded
    with profile() as prof:
        col = prof.collector
        mark_total, mark_t = col.comm_total_ns, time.monotonic_ns()
        y = np.full(N, r + 1, np.float32)
        dist.all_reduce(y)
        z = np.full(2 * N, r + 1, np.float32)
        work = dist.all_reduce(z, async_op=True)
        work.wait()
        if r == 0:
            dist.send(np.arange(7, dtype=np.int64), dst=1)
        else:
            got = np.empty(7, np.int64)
            dist.recv(got, src=0)
        dist.barrier()
        since_total = col.comm_total_ns - mark_total
        since_t = col.comm_ns_since(mark_t)
    dist.all_reduce(x)  # after the session: not recorded
    total = sum(range(1, n + 1))
    assert (y == total).all() and (z == total).all()
    path = prof.export_chrome_trace(os.path.join(out_dir, f"trace{r}.json"))
    evs = [{"name": e.name, "group": e.group, "seq": e.seq, "nbytes": e.nbytes, "start": e.start_ns,
            "end": e.end_ns, "async": e.async_op, "thread": e.thread, "tid": e.thread_id, "issue": e.issue_ns,
            "ok": e.ok, "p2p": e.p2p, "backend": e.backend} for e in col.comm_events()]
    summary = {"rank": r, "trace": path, "events": evs, "since_total": since_total, "since_t": since_t,
               "session": [col.start_ns, col.end_ns], "main_tid": threading.get_native_id()}
    dist.destroy_process_group()
    print("SUMMARY " + json.dumps(summary), flush=True)


# ================================================================================ test side
@pytest.mark.multiproc
def test_two_rank_collectives_are_profiled_and_traced(tmp_path):
    port = free_port("127.0.0.1")
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([PY, HERE, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    res = finish(procs, 60)
    for r, (rc, o, e) in enumerate(res):
        assert rc == 0 and "SUMMARY" in o, f"rank {r} (rc {rc}):\n{o}\n{e[-3000:]}"
        s = json.loads(o.split("SUMMARY ", 1)[1])
        evs = s["events"]
        # Exactly the operations issued inside the session, in order.
        assert [e["name"] for e in evs] == ["all_reduce", "all_reduce", "send" if r == 0 else "recv", "barrier"], evs
        sync, asy, p2p, bar = evs
        assert [sync["nbytes"], asy["nbytes"], p2p["nbytes"], bar["nbytes"]] == [4 * N, 8 * N, 56, 0]
        assert all(e["group"] == "world" and e["ok"] and e["backend"] == "shm" for e in evs)
        assert (sync["async"], asy["async"], p2p["async"], bar["async"]) == (False, True, False, False)
        assert asy["seq"] == sync["seq"] + 1 and bar["seq"] == asy["seq"] + 1 and p2p["p2p"] and not bar["p2p"]
        # The sync one ran on the caller's thread, the async one on the group's comm worker.
        assert sync["thread"] == "MainThread" and sync["tid"] == s["main_tid"]
        assert asy["thread"] == "helios-comm-world" and asy["tid"] != s["main_tid"]
        t_open, t_close = s["session"]
        for e in evs:
            assert t_open <= e["issue"] <= e["start"] <= e["end"] <= t_close, e
        for a, b in zip(evs, evs[1:]):
            assert a["end"] <= b["start"], "operations of one group run one after another"
        durations = sum(e["end"] - e["start"] for e in evs)
        assert s["since_total"] == durations and s["since_t"] == durations

        # The trace: one "collectives" track in the host process, one slice per operation.
        with open(s["trace"]) as f:
            trace = json.load(f)
        assert validate_trace(trace) == []
        names = {(m["pid"], m["tid"]): m["args"]["name"] for m in trace["traceEvents"]
                 if m["ph"] == "M" and m["name"] == "thread_name"}
        procs_named = {m["pid"]: m["args"]["name"] for m in trace["traceEvents"]
                       if m["ph"] == "M" and m["name"] == "process_name"}
        comm = [e for e in trace["traceEvents"] if e.get("cat") == "comm"]
        assert [e["name"] for e in comm] == [e["name"] for e in evs]
        assert {names[(e["pid"], e["tid"])] for e in comm} == {"collectives"}
        assert procs_named[comm[0]["pid"]] == "helios host"
        ops_tids = {tid for (pid, tid), nm in names.items() if nm.startswith("host ops")}
        assert comm[0]["tid"] not in ops_tids
        tsync, tasync = comm[0], comm[1]
        assert tsync["args"]["async"] is False and tasync["args"]["async"] is True
        assert tsync["args"]["bytes"] == 4 * N and tasync["args"]["bytes"] == 8 * N
        assert tsync["args"]["group"] == "world" and tasync["args"]["seq"] == sync["seq"] + 1
        assert tasync["args"]["thread"] == "helios-comm-world" and tsync["args"]["thread"] == "MainThread"
        assert tasync["args"]["queued_us"] >= 0 and tsync["args"]["ok"] is True
        assert abs(tsync["dur"] - (sync["end"] - sync["start"]) / 1000) < 0.01
        assert abs((tasync["ts"] - tsync["ts"]) - (asy["start"] - sync["start"]) / 1000) < 0.01
        assert trace["otherData"]["collectives"] == 4


def test_record_comm_is_thread_safe_and_totals_add_up():
    col = Collector()
    per, threads = 2000, 4

    def worker(k: int) -> None:
        for i in range(per):
            col.record_comm("all_reduce", f"g{k}", i, 8, 1000 * i, 1000 * i + 10, async_op=True)

    ts = [threading.Thread(target=worker, args=(k,), name=f"w{k}") for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    evs = col.comm_events()
    assert len(evs) == per * threads
    assert col.comm_total_ns == 10 * per * threads
    assert {e.thread for e in evs} == {f"w{k}" for k in range(threads)}
    assert all(evs[i].start_ns <= evs[i + 1].start_ns for i in range(len(evs) - 1))
    # Since a time: whole operations after it, the part after it of one that straddles it.
    assert col.comm_ns_since(1000 * (per - 1)) == 10 * threads
    assert col.comm_ns_since(1000 * (per - 1) + 4) == 6 * threads
    assert col.comm_ns_since(10 ** 12) == 0


def test_trace_spreads_overlapping_collectives_over_lanes():
    col = Collector(clock=lambda: 0)
    col.record_comm("all_reduce", "world", 0, 4096, 1_000, 9_000, thread="MainThread", thread_id=1)
    col.record_comm("all_gather", "g0", 0, 1024, 2_000, 12_000, async_op=True, thread="helios-comm-g0",
                    thread_id=2, issue_ns=1_500)
    col.record_comm("barrier", "world", 1, 0, 13_000, 13_000, thread="MainThread", thread_id=1, ok=False)
    col.end_ns = 20_000
    trace = build_trace(col)
    assert validate_trace(trace) == []
    comm = [e for e in trace["traceEvents"] if e.get("cat") == "comm"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert [names[e["tid"]] for e in comm] == ["collectives", "collectives (lane 1)", "collectives"]
    ag = comm[1]["args"]
    assert ag["queued_us"] == 0.5 and ag["async"] is True and ag["GB/s"] == round(1024 / 10_000, 3)
    assert comm[2]["dur"] == 0 and comm[2]["args"]["ok"] is False and comm[2]["args"]["GB/s"] is None


def test_trace_puts_each_group_role_on_its_own_track():
    """Tensor-, data- and expert-parallel collectives (new_group(role=)) overlap in time but sit
    on tracks of their own, the world's on "collectives"."""
    col = Collector(clock=lambda: 0)
    col.record_comm("all_reduce", "g1", 0, 4096, 1_000, 9_000, role="tp")
    col.record_comm("all_reduce", "g2", 0, 8192, 2_000, 12_000, role="dp", async_op=True)
    col.record_comm("all_to_all", "g3", 0, 1024, 3_000, 4_000, role="ep")
    col.record_comm("all_reduce", "world", 0, 16, 13_000, 14_000)
    col.record_comm("all_reduce", "g1", 1, 4096, 5_000, 6_000, role="tp")
    col.end_ns = 20_000
    trace = build_trace(col)
    assert validate_trace(trace) == []
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    comm = [e for e in trace["traceEvents"] if e.get("cat") == "comm"]
    tracks = {(e["args"]["group"], e["args"]["seq"]): names[e["tid"]] for e in comm}
    assert tracks == {("g1", 0): "collectives: tp", ("g1", 1): "collectives: tp", ("g2", 0): "collectives: dp",
                      ("g3", 0): "collectives: ep", ("world", 0): "collectives"}
    assert all(e["args"].get("role", "") == {"g1": "tp", "g2": "dp", "g3": "ep"}.get(e["args"]["group"], "")
               for e in comm)


def test_no_session_no_recording():
    import helios.comm as dist

    dist.init_process_group(backend="shm", timeout=10, rank=0, world_size=1, master_port=free_port("127.0.0.1"))
    try:
        x = np.ones(10, np.float32)
        dist.all_reduce(x)  # profiling off: nothing to record into
        with profile() as prof:
            dist.all_reduce(x)
            dist.all_reduce(x, async_op=True).wait()
        dist.all_reduce(x)
    finally:
        dist.destroy_process_group()
    evs = prof.collector.comm_events()
    assert [(e.name, e.async_op, e.seq) for e in evs] == [("all_reduce", False, 1), ("all_reduce", True, 2)]


if __name__ == "__main__":
    rank_main(sys.argv[1])
