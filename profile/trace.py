"""Chrome Trace Event Format export (loads in Perfetto and chrome://tracing).

Layout of a Helios trace
------------------------
* process 1 ``<name> host``: thread "host ops" (one ``X`` slice per op the
  tensor layer recorded: its host enqueue time, args shape/dtype/dispatches),
  thread "step phases" (a ``step N`` slice with the phases nested inside), and
  the counter "memory in use (bytes)" (one series per pool).
* process 2 ``<name> device``: per queue, a thread "queue Q: kernels" where each
  dispatch is an ``X`` slice at its *device* time (args: op, shape, dtype, FLOPs,
  bytes, GFLOP/s, GB/s, submit, dispatch_seq) and a thread "queue Q: submits"
  with one slice per submission, from host submit to the host seeing its fence.
* process 1 also has the thread "collectives": one ``X`` slice (category "comm") per
  collective or point-to-point operation helios.comm ran, from its host start to its end
  (args: group, seq, bytes, async, thread, thread_id, backend, GB/s, queued_us = time
  between issue and start, ok, p2p).
* flow arrows (``s`` -> ``f``, category "dispatch", id = dispatch_seq) from the
  host op that recorded a dispatch to the slice where it ran.
* ``M`` metadata events name and order every process and thread.

Times are microseconds from the session start (``ts``/``dur`` as floats with
nanosecond resolution). Slices on one thread must nest; where they would
overlap (dispatches that run concurrently, ops from several threads), they are
spread over extra lanes named "... (lane k)".
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from helios.profile._atomic import atomic_write_text
from helios.profile.timers import ALL_PHASES

if TYPE_CHECKING:
    from helios.profile.profiler import Collector

HOST_PID = 1
DEVICE_PID = 2
TID_OPS = 1
TID_STEPS = 1000
TID_COMM = 2000  # "collectives" (+ role index x _LANES_PER_ROLE + lane)
_LANES_PER_ROLE = 100
# Device threads: queue q kernels at 10000*(q+1) + lane, submits at 10000*(q+1) + 5000 + lane.


def _assign_lanes(intervals: list[tuple[int, int]]) -> list[int]:
    """Lane per interval so that slices in one lane are disjoint or properly nested."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    lanes: list[list[int]] = []  # per lane: stack of end times of open slices
    out = [0] * len(intervals)
    for i in order:
        s, e = intervals[i]
        for k, stack in enumerate(lanes):
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or e <= stack[-1]:
                stack.append(e)
                out[i] = k
                break
        else:
            lanes.append([e])
            out[i] = len(lanes) - 1
    return out


def _rate(num: int, ns: int) -> float | None:
    return round(num / ns, 3) if ns > 0 else None  # per ns == G per s


class _Clock:
    """The trace's time base: microseconds since the session's earliest timestamp ``t0`` (ns)."""

    def __init__(self, t0: int):
        self.t0 = t0

    def us(self, ns: int) -> float:
        return round((ns - self.t0) / 1000.0, 3)

    @staticmethod
    def dur(a: int, b: int) -> float:
        return round(max(0, b - a) / 1000.0, 3)


Threads = dict[tuple[int, int], tuple[str, int]]  # (pid, tid) -> (track name, sort index)


def build_trace(col: Collector, process_name: str = "helios") -> dict[str, Any]:
    """Build the Trace Event Format object of a collector's session (see the module docstring)."""
    comm = col.comm_events()
    times = [col.start_ns]
    times += [op.host_start_ns for op in col.ops]
    times += [ev.start_ns for ev in col.events] + [ev.host_record_ns for ev in col.events]
    times += [s.host_submit_ns for s in col.submits] + [m.time_ns for m in col.memory]
    times += [r.start_ns for r in col.steps]
    times += [c.start_ns for c in comm]
    clock = _Clock(min(times))
    threads: Threads = {}
    op_events, op_tid = _op_events(col, clock, threads)
    ev_out = (op_events + _step_events(col, clock, threads) + _comm_events(comm, clock, threads)
              + _submit_events(col, clock, threads) + _kernel_events(col, clock, threads, op_tid)
              + _memory_events(col, clock))
    return {
        "traceEvents": _metadata(threads, process_name) + ev_out,
        "displayTimeUnit": "ns",
        "otherData": {"clock": "CLOCK_MONOTONIC", "t0_ns": clock.t0, "ops": len(col.ops), "dispatches": len(col.events),
                      "submits": len(col.submits), "steps": len(col.steps), "collectives": len(comm)},
    }


def _op_events(col: Collector, clock: _Clock, threads: Threads) -> tuple[list[dict], dict[int, int]]:
    """The host ops' slices (lanes where ops overlap), and each op's track by its sequence number."""
    out: list[dict[str, Any]] = []
    op_tid: dict[int, int] = {}
    op_lanes = _assign_lanes([(op.host_start_ns, max(op.host_end_ns, op.host_start_ns)) for op in col.ops])
    for op, lane in zip(col.ops, op_lanes):
        tid = TID_OPS + lane
        op_tid[op.seq] = tid
        threads[(HOST_PID, tid)] = ("host ops" + (f" (lane {lane})" if lane else ""), tid)
        args: dict[str, Any] = {"shape": op.shape, "dtype": op.dtype, "dispatches": len(op.dispatch_ids)}
        if op.dispatch_ids:
            args["dispatch_seq"] = op.dispatch_ids if len(op.dispatch_ids) <= 8 else \
                f"{op.dispatch_ids[0]}..{op.dispatch_ids[-1]}"
        out.append({"ph": "X", "cat": "op", "name": op.name, "pid": HOST_PID, "tid": tid,
                    "ts": clock.us(op.host_start_ns), "dur": clock.dur(op.host_start_ns, op.host_end_ns), "args": args})
    return out, op_tid


def _step_events(col: Collector, clock: _Clock, threads: Threads) -> list[dict]:
    """Each training step's slice and its phases' slices, on the "step phases" track."""
    out: list[dict[str, Any]] = []
    for rec in col.steps:
        threads[(HOST_PID, TID_STEPS)] = ("step phases", TID_STEPS)
        args = {"wall_ms": round(rec.wall_ns / 1e6, 4), "tokens": rec.tokens}
        if rec.loss is not None:
            args["loss"] = rec.loss
        if rec.dispatches is not None:
            args["dispatches"] = rec.dispatches
        for ph in ALL_PHASES:
            if rec.phases_ns.get(ph):
                args[f"{ph}_ms"] = round(rec.phases_ns[ph] / 1e6, 4)
        out.append({"ph": "X", "cat": "step", "name": f"step {rec.step}", "pid": HOST_PID, "tid": TID_STEPS,
                    "ts": clock.us(rec.start_ns), "dur": clock.dur(rec.start_ns, rec.end_ns), "args": args})
        for sp in rec.spans:
            out.append({"ph": "X", "cat": "phase", "name": sp.name, "pid": HOST_PID, "tid": TID_STEPS,
                        "ts": clock.us(sp.start_ns), "dur": clock.dur(sp.start_ns, sp.end_ns), "args": {"step": rec.step}})
    return out


def _comm_events(comm: list, clock: _Clock, threads: Threads) -> list[dict]:
    """Collectives on a track per group role (tensor, data, pipeline, expert, context parallel:
    new_group(role=)), the world's and unnamed groups' on "collectives"; lanes where operations
    overlap within a track."""
    out: list[dict[str, Any]] = []
    roles = sorted({c.role for c in comm})
    for ri, role in enumerate(roles):
        of_role = [c for c in comm if c.role == role]
        lanes = _assign_lanes([(c.start_ns, max(c.end_ns, c.start_ns)) for c in of_role])
        for c, lane in zip(of_role, lanes):
            tid = TID_COMM + ri * _LANES_PER_ROLE + min(lane, _LANES_PER_ROLE - 1)
            label = "collectives" + (f": {role}" if role else "")
            threads[(HOST_PID, tid)] = (label + (f" (lane {lane})" if lane else ""), tid)
            args = {"group": c.group, "seq": c.seq, "bytes": c.nbytes, "async": c.async_op, "thread": c.thread,
                    "thread_id": c.thread_id, "backend": c.backend, "GB/s": _rate(c.nbytes, c.duration_ns),
                    "queued_us": clock.dur(c.issue_ns, c.start_ns), "device_wait_us": c.device_wait_ns / 1e3, "ok": c.ok}
            if c.p2p:
                args["p2p"] = True
            if c.role:
                args["role"] = c.role
            out.append({"ph": "X", "cat": "comm", "name": c.name, "pid": HOST_PID, "tid": tid,
                        "ts": clock.us(c.start_ns), "dur": clock.dur(c.start_ns, c.end_ns), "args": args})
    return out


def _submit_events(col: Collector, clock: _Clock, threads: Threads) -> list[dict]:
    """Submits, one track per queue (lanes if two submits of one queue overlap)."""
    out: list[dict[str, Any]] = []
    by_queue: dict[int, list] = {}
    for s in col.submits:
        by_queue.setdefault(s.queue, []).append(s)
    for q, subs in by_queue.items():
        lanes = _assign_lanes([(s.host_submit_ns, max(s.host_done_ns, s.host_submit_ns)) for s in subs])
        for s, lane in zip(subs, lanes):
            tid = 10000 * (q + 1) + 5000 + lane
            threads[(DEVICE_PID, tid)] = (f"queue {q}: submits" + (f" (lane {lane})" if lane else ""), tid)
            out.append({"ph": "X", "cat": "submit", "name": f"submit {s.submit}", "pid": DEVICE_PID, "tid": tid,
                        "ts": clock.us(s.host_submit_ns), "dur": clock.dur(s.host_submit_ns, s.host_done_ns),
                        "args": {"submit": s.submit, "dispatches": s.dispatches}})
    return out


def _kernel_events(col: Collector, clock: _Clock, threads: Threads, op_tid: dict[int, int]) -> list[dict]:
    """Device dispatches at their device time, a track per queue, with flow arrows from the op that
    recorded each (``op_tid``: the ops' tracks)."""
    out: list[dict[str, Any]] = []
    owner = col.op_of_dispatch()
    by_queue: dict[int, list] = {}
    for e in col.events:
        by_queue.setdefault(e.queue, []).append(e)
    for q, evs in by_queue.items():
        lanes = _assign_lanes([(e.start_ns, max(e.end_ns, e.start_ns)) for e in evs])
        for e, lane in zip(evs, lanes):
            tid = 10000 * (q + 1) + lane
            threads[(DEVICE_PID, tid)] = (f"queue {q}: kernels" + (f" (lane {lane})" if lane else ""), tid)
            op = owner.get(e.dispatch_seq)
            args = {"op": op.name if op else None, "shape": op.shape if op else None,
                    "dtype": op.dtype if op else None, "flops": e.flops, "bytes": e.bytes,
                    "GFLOP/s": _rate(e.flops, e.device_ns), "GB/s": _rate(e.bytes, e.device_ns),
                    "submit": e.submit, "dispatch_seq": e.dispatch_seq}
            out.append({"ph": "X", "cat": "kernel", "name": e.name, "pid": DEVICE_PID, "tid": tid,
                        "ts": clock.us(e.start_ns), "dur": clock.dur(e.start_ns, e.end_ns), "args": args})
            if op is not None:
                # The arrow leaves the op where the dispatch was recorded (clamped into the op's slice).
                t_rec = min(max(e.host_record_ns, op.host_start_ns), max(op.host_end_ns, op.host_start_ns))
                out.append({"ph": "s", "cat": "dispatch", "name": "dispatch", "id": e.dispatch_seq,
                            "pid": HOST_PID, "tid": op_tid[op.seq], "ts": clock.us(t_rec)})
                out.append({"ph": "f", "bp": "e", "cat": "dispatch", "name": "dispatch", "id": e.dispatch_seq,
                            "pid": DEVICE_PID, "tid": tid, "ts": clock.us(e.start_ns)})
    return out


def _memory_events(col: Collector, clock: _Clock) -> list[dict]:
    """Memory counters: each sample carries every pool's latest value, so the series stay continuous."""
    out: list[dict[str, Any]] = []
    current: dict[str, int] = {}
    for m in sorted(col.memory, key=lambda m: m.time_ns):
        current[m.pool] = m.in_use_bytes
        out.append({"ph": "C", "name": "memory in use (bytes)", "pid": HOST_PID, "ts": clock.us(m.time_ns),
                    "args": dict(current)})
    return out


def _metadata(threads: Threads, process_name: str) -> list[dict]:
    """The processes' and tracks' names and sort order."""
    meta: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": HOST_PID, "tid": 0, "args": {"name": f"{process_name} host"}},
        {"ph": "M", "name": "process_sort_index", "pid": HOST_PID, "tid": 0, "args": {"sort_index": 0}},
        {"ph": "M", "name": "process_name", "pid": DEVICE_PID, "tid": 0, "args": {"name": f"{process_name} device"}},
        {"ph": "M", "name": "process_sort_index", "pid": DEVICE_PID, "tid": 0, "args": {"sort_index": 1}},
    ]
    for (pid, tid), (name, idx) in sorted(threads.items()):
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": idx}})
    return meta


def write_trace(path: str, trace: dict[str, Any]) -> str:
    """Write a trace object as JSON atomically (temp, fsync, rename); returns the absolute path."""
    return atomic_write_text(path, json.dumps(trace, separators=(",", ":"), allow_nan=False))


_NEEDS = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "B": ("name", "ts", "pid", "tid"),
    "E": ("ts", "pid", "tid"),
    "i": ("name", "ts", "pid", "tid"),
    "I": ("name", "ts", "pid", "tid"),
    "C": ("name", "ts", "pid", "args"),
    "M": ("name", "pid", "args"),
    "s": ("name", "cat", "id", "ts", "pid", "tid"),
    "t": ("name", "cat", "id", "ts", "pid", "tid"),
    "f": ("name", "cat", "id", "ts", "pid", "tid"),
}
_META_ARG = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
             "thread_sort_index": "sort_index", "process_labels": "labels"}


def validate_trace(trace: dict[str, Any]) -> list[str]:
    """Problems found in a trace object ([] when valid).

    Checks: each event has the fields its phase needs; numbers are finite;
    ``X`` durations are >= 0; counter values are numbers; metadata carries its
    argument; every flow start has a finish; each ``kernel`` slice lies inside the
    window of its ``submit`` slice; thread-name metadata exists for every thread used.
    """
    errs: list[str] = []
    evs = trace.get("traceEvents")
    if not isinstance(evs, list):
        return ["top level has no 'traceEvents' list"]
    submits: dict[int, tuple[float, float]] = {}
    named_threads = set()
    used_threads = set()
    flows: dict[str, dict[Any, int]] = {"s": {}, "f": {}}
    for i, ev in enumerate(evs):
        ph = ev.get("ph")
        if ph not in _NEEDS:
            errs.append(f"event {i}: unknown or missing ph {ph!r}")
            continue
        missing = [k for k in _NEEDS[ph] if k not in ev]
        if missing:
            errs.append(f"event {i} ({ph} {ev.get('name')!r}): missing {missing}")
            continue
        for k in ("ts", "dur"):
            if k in ev and not (isinstance(ev[k], (int, float)) and math.isfinite(ev[k])):
                errs.append(f"event {i}: {k} is not a finite number: {ev[k]!r}")
        if ph == "X":
            if isinstance(ev["dur"], (int, float)) and ev["dur"] < 0:
                errs.append(f"event {i} ({ev['name']!r}): negative duration {ev['dur']}")
            if ev.get("cat") == "submit":
                submits[ev["args"]["submit"]] = (ev["ts"], ev["ts"] + ev["dur"])
        if ph == "C":
            bad = {k: v for k, v in ev["args"].items() if not isinstance(v, (int, float))}
            if bad:
                errs.append(f"event {i}: counter values must be numbers: {bad}")
        if ph == "M":
            want = _META_ARG.get(ev["name"])
            if want is None or want not in ev["args"]:
                errs.append(f"event {i}: metadata {ev['name']!r} lacks args.{want}")
            if ev["name"] == "thread_name":
                named_threads.add((ev["pid"], ev.get("tid")))
        elif ph != "C":
            used_threads.add((ev["pid"], ev["tid"]))
        if ph in ("s", "f"):
            flows[ph][ev["id"]] = flows[ph].get(ev["id"], 0) + 1
    for fid, n in flows["s"].items():
        if flows["f"].get(fid, 0) != n:
            errs.append(f"flow id {fid}: {n} start(s) but {flows['f'].get(fid, 0)} finish(es)")
    for fid in flows["f"]:
        if fid not in flows["s"]:
            errs.append(f"flow id {fid}: finish without start")
    eps = 1e-6
    for i, ev in enumerate(evs):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel" and "args" in ev and "submit" in ev["args"]:
            win = submits.get(ev["args"]["submit"])
            if win is None:
                errs.append(f"event {i} ({ev['name']!r}): its submit {ev['args']['submit']} has no submit slice")
            elif ev["ts"] < win[0] - eps or ev["ts"] + ev["dur"] > win[1] + eps:
                errs.append(f"event {i} ({ev['name']!r}): [{ev['ts']}, {ev['ts'] + ev['dur']}] us lies outside "
                            f"its submit window [{win[0]}, {win[1]}] us")
    for t in sorted(used_threads - named_threads):
        errs.append(f"thread {t} has no thread_name metadata")
    return errs
