"""Across namespace hosts: all_reduce hierarchical vs flat ring vs gloo, data-parallel training
on two hosts against one (with helios-plan's prediction from the measured links), and link-down trials.

    python bench/multihost.py                                   # every part, the defaults below
    python bench/multihost.py --parts collectives --layouts 2x2,2x4 --rates 1gbit --rounds 5
    python bench/multihost.py --parts train --rates 1gbit --train-rounds 3
    python bench/multihost.py --parts linkdown --trials 20 --timeout 3
    python bench/multihost.py --smoke                           # CI's seconds-long run

Needs root and ``ip netns`` (the hosts are tests/cluster_fixture.py's fake cluster: network,
UTS and mount namespaces joined through a bridge, every link shaped with ``tc ... tbf rate R``);
it makes each cluster itself and always tears it down.  The ranks run in their hosts and are
this file run with ``--worker MODE``.  All figures are JSON lines:

* ``multihost_levels`` (per layout and rate): α and bandwidth of each level, fitted to the ring
  all-reduce formula 2(n-1)α + 2(n-1)/n·S·β at 4 KiB and 4 MiB: inside a host (the host group,
  shared memory, every host at once) and between hosts (local rank 0 of each host, a forced
  ring over TCP, the other ranks idle).  The same figures go to a links file for
  ``helios-plan --calibrate``.
* ``multihost_all_reduce`` (per layout, rate and size): for each side -- Helios forced
  hierarchical, Helios forced flat ring, torch.distributed gloo in the same processes -- the
  median over calls of the slowest rank's time (bursts of the three sides alternate, so they see
  the same load), algbw = S/t and busbw = algbw·2(n-1)/n (nccl-tests), each host's bytes sent
  per call over S (its veth ``tx_bytes``, read by its local rank 0 between barriers: headers and
  acknowledgements included) and ``link_share``: the busiest host's bytes per second over the
  link's rate.  ``hier_speedup_vs_ring`` / ``_vs_gloo``: the ratios of the times.
* ``multihost_train``: helios-train (``--train-config``, ``--per-rank-batch`` sequences a rank)
  on 1 host x 2 ranks and on 2 hosts x 2 ranks (helios-run --nnodes 2 in each host), alternated
  ``--train-rounds`` times; tokens/s is the median over rank 0's steps after the first two (as
  helios-plan's run.db reader takes them); ``scaling`` = tokens/s on 2 hosts / (2 x on 1 host).
  Beside each, helios-plan's prediction for exactly that run (``--run-db``) with the links
  measured on that cluster (``--calibrate``; every fake host shares the machine's cores, and the
  links file says so) and the table's compute rate; and ``plan_two_hosts_from_one_host``: the
  median 2-host run planned with the compute rate fitted to the median 1-host run
  (``--compute-from``), so the prediction tests what the model says a second host changes, not
  the day's load (``from_one_host_measured_over_planned_rounds``: each round's 2-host run
  planned from the 1-host run just before it).
* ``multihost_linkdown``: ``--trials`` times a fresh 2-host cluster, 2 ranks a host
  all-reducing 1 MiB (flat ring and hierarchical in turn) with ``--timeout``; host 1's eth0 is set
  down; counted: trials where every rank raised CommError within the timeout of the failed
  operation's start, and of the link going down, trials where every message named the other
  host, and hangs (a rank still running 4 x the timeout + 10 s after the link went down:
  killed); ``misses`` lists every rank that missed one of these, with its message.

``--smoke`` (tests/test_bench_smoke.py): 2 hosts x 2 ranks unshaped, 4 KiB, one round of one
call a side; a nano helios-train of 4 steps on each layout with the plan; one link-down trial
with a 2 s timeout.  The same lines, their figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from cluster_fixture import FakeCluster, unavailable  # noqa: E402

SMALL, LARGE = 4 << 10, 64 << 20
FIT_SIZES = (4 << 10, 4 << 20)  # the two sizes α and β are fitted to
HELIOS_PORT, GLOO_PORT = 29500, 29600


# ================================================================================ rank side
def _tx() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def _fit(n: int, times: tuple[float, float]) -> dict:
    """α and bandwidth from ring all-reduce times at FIT_SIZES over ``n`` ranks."""
    k = 2 * (n - 1) / n
    beta = max(1e-15, (times[1] - times[0]) / (k * (FIT_SIZES[1] - FIT_SIZES[0])))
    alpha = max(1e-9, (times[0] - k * FIT_SIZES[0] * beta) / (2 * (n - 1)))
    return {"alpha_s": alpha, "bytes_per_s": 1 / beta, "t_small_s": times[0], "t_large_s": times[1]}


def _median_time(dist, group, fn, reps: int) -> float:
    """Median over ``reps`` calls of the slowest member's seconds (a barrier before each)."""
    import numpy as np

    ts = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        t = np.array([time.perf_counter() - t0])
        dist.all_reduce(t, op="max", group=group)
        ts.append(float(t[0]))
    return statistics.median(ts)


def _levels(dist, reps: int) -> dict:
    """α-β inside each host (its host group, all hosts at once) and between hosts (local rank 0s)."""
    import numpy as np

    topo = dist.get_topology()
    hosts = [list(h) for h in topo.hosts]
    out = {}
    host = dist.get_host_group()
    bufs = [np.zeros(s // 4, np.float32) for s in FIT_SIZES]
    t = tuple(_median_time(dist, host, lambda b=b: dist.all_reduce(b, group=host), reps) for b in bufs)
    out["intra"] = _fit(len(hosts[0]), t)
    inter = dist.new_group([h[0] for h in hosts], role="bench-inter")
    if dist.get_local_rank() == 0:
        t = tuple(_median_time(dist, inter, lambda b=b: dist.all_reduce(b, group=inter, algorithm="ring"), reps)
                  for b in bufs)
        out["inter"] = _fit(len(hosts), t)
    dist.barrier()
    return out


def _timed_call(dist, fn, count_bytes: bool) -> tuple[float, int | None]:
    """(slowest rank's seconds, this host's bytes sent) of one call, barriers around it."""
    import numpy as np

    dist.barrier()
    b0 = _tx() if count_bytes else 0
    dist.barrier()  # nobody sends before every host has read its counter
    t0 = time.perf_counter()
    fn()
    t = np.array([time.perf_counter() - t0])
    dist.barrier()  # every rank of every host is done sending
    b1 = _tx() if count_bytes else 0
    dist.all_reduce(t, op="max")
    return float(t[0]), (b1 - b0 if count_bytes else None)


def worker_collectives(cfg: dict) -> None:
    """One rank: the levels' α-β, then hierarchical / ring / gloo all_reduce bursts in alternation."""
    import helios.comm as dist
    import numpy as np
    import torch
    import torch.distributed as td
    from datetime import timedelta

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(timeout=float(cfg["timeout"]))
    td.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{cfg['gloo_port']}", rank=rank,
                          world_size=n, timeout=timedelta(seconds=float(cfg["timeout"])))
    levels = _levels(dist, cfg["fit_reps"])
    count_bytes = dist.get_local_rank() == 0
    rows = []
    for size in cfg["sizes"]:
        h, g = np.zeros(size // 4, np.float32), torch.zeros(size // 4)  # zeros: sums stay finite
        sides = {"hierarchical": lambda: dist.all_reduce(h, algorithm="hierarchical"),
                 "ring": lambda: dist.all_reduce(h, algorithm="ring"), "gloo": lambda: td.all_reduce(g)}
        for fn in sides.values():  # warm up: connections, buffers, pages
            fn()
        res: dict = {k: {"t": [], "tx": []} for k in sides}
        for _ in range(cfg["rounds"]):
            for name, fn in sides.items():
                for _ in range(cfg["iters"] or (2 if size >= (16 << 20) else 20)):
                    t, tx = _timed_call(dist, fn, count_bytes)
                    res[name]["t"].append(t)
                    res[name]["tx"].append(tx)
        rows.append({"bytes": size, "sides": res})
    print("RESULT " + json.dumps({"rank": rank, "node": dist.get_node_rank(), "local_rank": dist.get_local_rank(),
                                  "levels": levels, "rows": rows}), flush=True)
    td.destroy_process_group()
    dist.destroy_process_group()


def worker_linkdown(cfg: dict) -> None:
    """One rank: all-reduce 1 MiB (flat ring and hierarchical in turn) until a CommError; print when and what."""
    import helios.comm as dist
    import numpy as np

    from helios.errors import CommError

    dist.init_process_group(timeout=float(cfg["timeout"]))
    x = np.ones(1 << 18, np.float32)
    dist.all_reduce(x)
    print("READY", flush=True)
    k = 0
    try:
        while True:
            t0 = time.time()
            dist.all_reduce(x, op="max", algorithm=("ring", "hierarchical")[k % 2])
            k += 1
    except CommError as e:
        print("ERR " + json.dumps({"t": time.time(), "t_op": t0, "rank": dist.get_rank(), "msg": str(e)}), flush=True)


# =============================================================================== parent side
class Job:
    """Processes started in fake hosts, their output read as it comes (so a hang cannot block us)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.out: list[list[str]] = [[] for _ in procs]
        self.err: list[list[str]] = [[] for _ in procs]
        self.threads = [threading.Thread(target=self._read, args=(s, dst), daemon=True)
                        for i, p in enumerate(procs) for s, dst in ((p.stdout, self.out[i]), (p.stderr, self.err[i]))]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(stream, dst: list[str]) -> None:
        for line in stream:
            dst.append(line)

    def wait_for(self, prefix: str, timeout: float) -> bool:
        """True once every process printed a line starting with ``prefix`` (False at the deadline or an exit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(any(x.startswith(prefix) for x in o) for o in self.out):
                return True
            if any(p.poll() is not None for p in self.procs):
                return all(any(x.startswith(prefix) for x in o) for o in self.out)
            time.sleep(0.02)
        return False

    def finish(self, timeout: float) -> list[int | None]:
        """Exit codes by the deadline; None for a process still running then (killed: a hang)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.01, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        for t in self.threads:
            t.join(timeout=5)
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def tail(self, i: int) -> str:
        return "".join(self.out[i])[-1500:] + "".join(self.err[i])[-2500:]


def _env(**extra: str) -> dict:
    e = dict(os.environ, LP_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HELIOS_LAUNCHER", "HELIOS_JOB_ID",
              "HELIOS_COMM_BACKEND", "HELIOS_JOB_SECRET_FILE", "HELIOS_COMM_HIERARCHICAL"):
        e.pop(k, None)
    e.update(extra)
    return e


def start_ranks(c: FakeCluster, per_host: int, mode: str, cfg: dict, port: int = HELIOS_PORT) -> Job:
    """``per_host`` ranks of ``--worker mode`` in each host of ``c`` (ranks host-major), one job secret."""
    secret, n = secrets.token_hex(16), per_host * len(c.hosts)
    procs = []
    for r in range(n):
        env = _env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r % per_host), MASTER_ADDR=c.hosts[0].addr,
                   MASTER_PORT=str(port), HELIOS_JOB_ID=f"bench-{mode}", HELIOS_JOB_SECRET=secret)
        procs.append(c.hosts[r // per_host].popen([sys.executable, HERE, "--worker", mode, "--cfg", json.dumps(cfg)],
                                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                  cwd=ROOT))
    return Job(procs)


def _results(job: Job, codes: list[int | None], what: str) -> list[dict]:
    for i, code in enumerate(codes):
        if code != 0:
            raise RuntimeError(f"{what}: rank {i} {'hung' if code is None else f'exited {code}'}:\n{job.tail(i)}")
    return [json.loads(x[7:]) for o in job.out for x in o if x.startswith("RESULT ")]


def rate_bytes(rate: str | None) -> float | None:
    """A tc rate (``1gbit``, ``200mbit``) in bytes per second (tc's bit units are decimal)."""
    if not rate:
        return None
    scale = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, mult in scale.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * mult / 8
    raise SystemExit(f"multihost.py: --rates: {rate!r} is not a tc rate such as 1gbit or 200mbit")


def _side(ts: list[float], txs_by_host: list[list[int]], size: int, n: int, link: float | None) -> dict:
    t = statistics.median(ts)
    algbw = size / t / 1e9
    per_host = [statistics.median(x) / size for x in txs_by_host]
    out = {"time_ms": round(t * 1e3, 3), "p90_ms": round(sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3, 3),
           "algbw_GBps": round(algbw, 4), "busbw_GBps": round(algbw * 2 * (n - 1) / n, 4),
           "host_tx_over_S": [round(x, 4) for x in per_host]}
    if link:
        out["link_share"] = round(max(per_host) * size / t / link, 3)
    return out


def collectives(h: int, per_host: int, rate: str | None, sizes: list[int], rounds: int, iters: int | None,
                fit_reps: int) -> tuple[list[dict], dict]:
    """One cluster of ``h`` hosts x ``per_host`` ranks at ``rate``: the levels row and one row per size."""
    cfg = {"sizes": sizes, "rounds": rounds, "iters": iters, "fit_reps": fit_reps, "timeout": 300,
           "gloo_port": GLOO_PORT}
    with FakeCluster(h, rate=rate, prefix="bm" + secrets.token_hex(3)) as c:
        job = start_ranks(c, per_host, "collectives", cfg)
        try:
            res = _results(job, job.finish(1800), f"collectives {h}x{per_host} {rate}")
        finally:
            job.kill()
    n = h * per_host
    r0 = next(r for r in res if r["rank"] == 0)
    heads = sorted((r for r in res if r["local_rank"] == 0), key=lambda r: r["node"])
    base = {"hosts": h, "ranks_per_host": per_host, "rate": rate or "unshaped"}
    lv = {k: {"alpha_us": round(v["alpha_s"] * 1e6, 2), "GBps": round(v["bytes_per_s"] / 1e9, 4)}
          for k, v in r0["levels"].items()}
    rows = [{"bench": "multihost_levels", **base, **lv}]
    link = rate_bytes(rate)
    for i, row in enumerate(r0["rows"]):
        size = row["bytes"]
        out = {"bench": "multihost_all_reduce", **base, "bytes": size, "calls": len(row["sides"]["gloo"]["t"])}
        for side, v in row["sides"].items():
            out[side] = _side(v["t"], [hd["rows"][i]["sides"][side]["tx"] for hd in heads], size, n, link)
        out["hier_speedup_vs_ring"] = round(out["ring"]["time_ms"] / out["hierarchical"]["time_ms"], 3)
        out["hier_speedup_vs_gloo"] = round(out["gloo"]["time_ms"] / out["hierarchical"]["time_ms"], 3)
        rows.append(out)
    return rows, r0["levels"]


def write_links(path: str, levels: dict, h: int, per_host: int, rate: str | None) -> None:
    """The links file helios-plan --calibrate reads (temp name, fsync, rename)."""
    doc = {"per_node": per_host, "compute_ranks": h * per_host,  # the fake hosts share this machine's cores
           "intra": {k: levels["intra"][k] for k in ("alpha_s", "bytes_per_s")},
           "inter": {k: levels["inter"][k] for k in ("alpha_s", "bytes_per_s")},
           "source": f"bench/multihost.py, {h} namespace hosts x {per_host} ranks, links {rate or 'unshaped'}, "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------- training
def _train_argv(a: argparse.Namespace, world: int, out: str) -> list[str]:
    return ["-m", "helios.train", "--config", a.train_config, "--steps", str(a.train_steps), "--batch-size",
            str(a.per_rank_batch * world), "--no-progress", "--eval-every", "0", "--ckpt-every", "0",
            "--sample-tokens", "1", "--out", out]


def _train_once(c: FakeCluster, nodes: int, a: argparse.Namespace, out: str, port: int) -> None:
    """helios-train on ``nodes`` hosts x 2 ranks (helios-run in each host)."""
    run = os.path.join(BIN, "helios-run")
    env = _env(HELIOS_JOB_SECRET=secrets.token_hex(16))
    if nodes == 1:
        argvs = [[run, "--nproc-per-node", "2", *_train_argv(a, 2, out)]]
    else:
        argvs = [[run, "--nproc-per-node", "2", "--nnodes", str(nodes), "--node-rank", str(k), "--master-addr",
                  c.hosts[0].addr, "--master-port", str(port), *_train_argv(a, 2 * nodes, out)] for k in range(nodes)]
    job = Job([c.hosts[k].popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
               for k, argv in enumerate(argvs)])
    codes = job.finish(1800)
    if any(code != 0 for code in codes):
        i = next(i for i, code in enumerate(codes) if code != 0)
        raise RuntimeError(f"helios-train on {nodes} host(s): node {i} exited {codes[i]}:\n{job.tail(i)}")


class PlanFailed(RuntimeError):
    """helios-plan refused; ``reason`` is the refusal's kind from its --json output (None if absent)."""

    def __init__(self, message: str, reason: str | None):
        super().__init__(message)
        self.reason = reason


def _plan(run_dir: str, links: str, world: int, a: argparse.Namespace, compute_from: str | None = None) -> dict:
    """helios-plan's prediction for the run in ``run_dir`` with the measured links (and the compute
    rate fitted to the run in ``compute_from``, else the device table's), beside its measurement."""
    fit = ["--compute-from", compute_from] if compute_from else []
    r = subprocess.run([os.path.join(BIN, "helios-plan"), "--model", a.train_config, "--gpu", "lavapipe", "--gpus",
                        str(world), "--global-batch", str(a.per_rank_batch * world), "--calibrate", links, *fit,
                        "--run-db", run_dir, "--json"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        try:
            reason = json.loads(r.stdout)["reason"]  # --json says why
        except (ValueError, KeyError, TypeError):
            reason = None
        raise PlanFailed(f"helios-plan failed ({r.returncode}): {r.stderr.strip()}", reason)
    cal = json.loads(r.stdout)["calibration"]
    rows = {x["quantity"]: x for x in cal["rows"]}
    st, tps = rows["step time (s)"], rows["tokens/s"]
    return {"step_ms_planned": round(st["planned"] * 1e3, 1), "step_ms_measured": round(st["measured"] * 1e3, 1),
            "measured_over_planned": round(st["ratio"], 3), "tok_s_planned": round(tps["planned"], 1),
            "tok_s_measured": round(tps["measured"], 1), "compute": cal["compute_source"],
            "planned_parts_ms": {k: round(v * 1e3, 2) for k, v in cal["planned_parts_s"].items() if v > 0}}


def _fitted_plan(run_dir: str, one_host_run: str, links: str, a: argparse.Namespace) -> dict:
    """The 2-host run planned with the compute rate fitted to a 1-host run; where none fits (a run
    of a few milliseconds a step, shorter than the plan's launches: --smoke's), the reason."""
    try:
        return _plan(run_dir, links, 4, a, compute_from=one_host_run)
    except PlanFailed as e:
        if e.reason != "no_compute_rate_fits":
            raise
        return {"error": str(e)}


def train(a: argparse.Namespace, rate: str | None, levels: dict | None, tmp: str) -> dict:
    """1 host x 2 ranks against 2 hosts x 2 ranks, alternated; the plan beside each."""
    with FakeCluster(2, rate=rate, prefix="bt" + secrets.token_hex(3)) as c:
        if levels is None:  # the links of this cluster, measured as the collectives part does
            job = start_ranks(c, 2, "collectives", {"sizes": [], "rounds": 0, "iters": 0, "fit_reps": a.fit_reps,
                                                    "timeout": 300, "gloo_port": GLOO_PORT})
            try:
                levels = next(r for r in _results(job, job.finish(600), "levels") if r["rank"] == 0)["levels"]
            finally:
                job.kill()
        links = os.path.join(tmp, f"links-{rate or 'unshaped'}.json")
        write_links(links, levels, 2, 2, rate)
        tok: dict[int, list[float]] = {1: [], 2: []}
        plans: dict[int, list[dict]] = {1: [], 2: []}
        fitted: list[dict] = []  # the 2-host run planned from the 1-host run just before it

        def run_dir(nodes: int, k: int) -> str:
            return os.path.join(tmp, f"train-{nodes}-{k}")

        for k in range(a.train_rounds):
            for nodes in (1, 2):
                _train_once(c, nodes, a, run_dir(nodes, k), 29700 + 10 * k + nodes)
                p = _plan(run_dir(nodes, k), links, 2 * nodes, a)
                plans[nodes].append(p)
                tok[nodes].append(p["tok_s_measured"])
                if nodes == 2:
                    fitted.append(_fitted_plan(run_dir(2, k), run_dir(1, k), links, a))
    med = {n: statistics.median(v) for n, v in tok.items()}
    best = {n: min(plans[n], key=lambda p: abs(p["tok_s_measured"] - med[n])) for n in plans}  # the median round's
    ratios = [p.get("measured_over_planned") for p in fitted]
    i1, i2 = plans[1].index(best[1]), plans[2].index(best[2])
    from_median = fitted[i2] if i1 == i2 else _fitted_plan(run_dir(2, i2), run_dir(1, i1), links, a)
    return {"bench": "multihost_train", "rate": rate or "unshaped", "config": a.train_config,
            "per_rank_batch": a.per_rank_batch, "steps": a.train_steps, "rounds": a.train_rounds,
            "one_host_2_ranks_tok_s": med[1], "two_hosts_2_ranks_tok_s": med[2],
            "scaling": round(med[2] / (2 * med[1]), 3), "tok_s_rounds": {"1x2": tok[1], "2x2": tok[2]},
            "plan_one_host": best[1], "plan_two_hosts": best[2],
            "plan_two_hosts_from_one_host": from_median, "from_one_host_measured_over_planned_rounds": ratios}


# ------------------------------------------------------------------------------ link down
def _one_trial(timeout: float, rate: str | None) -> dict:
    """A fresh 2 x 2 cluster; host 1's link set down mid all_reduce; what each rank saw."""
    with FakeCluster(2, rate=rate, prefix="bl" + secrets.token_hex(3)) as c:
        where = [f"on host {h.run(['hostname']).stdout.strip()} ({h.addr})" for h in c.hosts]
        job = start_ranks(c, 2, "linkdown", {"timeout": timeout})
        try:
            if not job.wait_for("READY", 120):
                raise RuntimeError("link-down trial: the ranks did not start:\n" + job.tail(0) + job.tail(3))
            time.sleep(0.3)
            c.hosts[1].run(["ip", "link", "set", "eth0", "down"])
            t_down = time.time()  # the link is down by now
            codes = job.finish(4 * timeout + 10)
        finally:
            job.kill()
    ranks = []
    for r, code in enumerate(codes):
        err = [json.loads(x[4:]) for x in job.out[r] if x.startswith("ERR ")]
        e = err[0] if err else None
        ranks.append({"rank": r, "hung": code is None, "commerror": e is not None,
                      "after_op_s": round(e["t"] - e["t_op"], 3) if e else None,
                      "after_down_s": round(e["t"] - t_down, 3) if e else None,
                      "names_other_host": bool(e) and where[1 - r // 2] in e["msg"], "msg": e["msg"] if e else None})
    return {"ranks": ranks}


def linkdown(trials: int, timeout: float, rate: str | None) -> dict:
    """``trials`` link-down trials: how many gave every rank a CommError in time, naming the host; hangs."""
    runs = [_one_trial(timeout, rate) for _ in range(trials)]
    every = lambda run, key: all(x[key] for x in run["ranks"])  # noqa: E731
    within = lambda run, key: all(x[key] is not None and x[key] <= timeout for x in run["ranks"])  # noqa: E731
    times = lambda key: [x[key] for run in runs for x in run["ranks"] if x[key] is not None]  # noqa: E731
    return {"bench": "multihost_linkdown", "trials": trials, "timeout_s": timeout, "rate": rate or "unshaped",
            "all_ranks_commerror": sum(every(r, "commerror") for r in runs),
            "all_within_timeout_of_op": sum(within(r, "after_op_s") for r in runs),
            "all_within_timeout_of_link_down": sum(within(r, "after_down_s") for r in runs),
            "all_named_other_host": sum(every(r, "names_other_host") for r in runs),
            "hangs": sum(any(x["hung"] for x in r["ranks"]) for r in runs),
            "max_after_op_s": max(times("after_op_s"), default=None),
            "max_after_down_s": max(times("after_down_s"), default=None),
            "median_after_down_s": statistics.median(times("after_down_s")) if times("after_down_s") else None,
            # every rank that missed something: late, silent, hung, or not naming the other host
            "misses": [{"trial": i, **{k: v for k, v in x.items() if k != "msg"}, "msg": (x["msg"] or "")[:400]}
                       for i, run in enumerate(runs) for x in run["ranks"]
                       if x["hung"] or not x["names_other_host"] or not (x["after_op_s"] or 1e9) <= timeout]}


# ==================================================================================== main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="all_reduce, training and link-down trials across namespace hosts")
    p.add_argument("--worker", choices=("collectives", "linkdown"), help=argparse.SUPPRESS)
    p.add_argument("--cfg", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--parts", default="collectives,train,linkdown", help="which parts (default all three)")
    p.add_argument("--layouts", default="2x2,2x4,4x2", help="hosts x ranks per host (default 2x2,2x4,4x2)")
    p.add_argument("--rates", default="1gbit,10gbit", help="tc rates of every link (default 1gbit,10gbit; "
                   "'none': unshaped); training and link-down trials use the first")
    p.add_argument("--sizes", default=f"{SMALL},{LARGE}", help="all_reduce bytes (default 4 KiB and 64 MiB)")
    p.add_argument("--rounds", type=int, default=5, help="alternating bursts of the three sides (default 5)")
    p.add_argument("--iters", type=int, default=None, help="calls a burst (default 2 at >= 16 MiB, else 20)")
    p.add_argument("--fit-reps", type=int, default=7, help="calls per size for the levels' alpha-beta (default 7)")
    p.add_argument("--train-config", default="tiny", help="helios-train --config (default tiny)")
    p.add_argument("--per-rank-batch", type=int, default=8, help="sequences per rank a step (default 8)")
    p.add_argument("--train-steps", type=int, default=12, help="steps a run (default 12; the first 2 left out)")
    p.add_argument("--train-rounds", type=int, default=2, help="1-host / 2-host runs alternated (default 2)")
    p.add_argument("--trials", type=int, default=20, help="link-down trials (default 20)")
    p.add_argument("--timeout", type=float, default=3.0, help="the link-down ranks' timeout, seconds (default 3)")
    p.add_argument("--links-out", default=None, help="also keep the links file of the training cluster here")
    p.add_argument("--smoke", action="store_true", help="CI's quick run (see the docstring)")
    return p


def _smoke(a: argparse.Namespace) -> None:
    a.layouts, a.rates, a.sizes, a.rounds, a.iters, a.fit_reps = "2x2", "none", str(SMALL), 1, 1, 2
    a.train_config, a.per_rank_batch, a.train_steps, a.train_rounds = "nano", 2, 4, 1
    a.trials, a.timeout = 1, 2.0


def main() -> int:
    """Run the parts asked for (or one rank with --worker)."""
    a = _parser().parse_args()
    if a.worker:
        {"collectives": worker_collectives, "linkdown": worker_linkdown}[a.worker](json.loads(a.cfg))
        return 0
    if a.smoke:
        _smoke(a)
    why = unavailable()
    if why:
        print(f"multihost.py: {why}", file=sys.stderr)
        return 2
    parts = set(a.parts.split(","))
    if parts - {"collectives", "train", "linkdown"}:
        print(f"multihost.py: --parts: unknown {sorted(parts - {'collectives', 'train', 'linkdown'})}", file=sys.stderr)
        return 2
    try:
        layouts = [tuple(int(v) for v in x.split("x")) for x in a.layouts.split(",")]
        sizes = [int(s) for s in a.sizes.split(",")]
    except ValueError:
        print("multihost.py: --layouts is HxL,... (2x2,4x2) and --sizes bytes,... (4096,67108864)", file=sys.stderr)
        return 2
    rates = [None if r == "none" else r for r in a.rates.split(",")]
    for r in rates:
        rate_bytes(r)
    print(json.dumps({"bench": "multihost_machine", "cores": os.cpu_count(), "load_avg": os.getloadavg(),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}), flush=True)
    levels: dict = {}
    if "collectives" in parts:
        for rate in rates:
            for h, per_host in layouts:
                rows, lv = collectives(h, per_host, rate, sizes, a.rounds, a.iters, a.fit_reps)
                levels[(h, per_host, rate)] = lv
                for row in rows:
                    print(json.dumps(row), flush=True)
    with tempfile.TemporaryDirectory(prefix="helios-multihost-") as tmp:
        if "train" in parts:
            row = train(a, rates[0], levels.get((2, 2, rates[0])), tmp)
            print(json.dumps(row), flush=True)
            if a.links_out:
                os.replace(os.path.join(tmp, f"links-{rates[0] or 'unshaped'}.json"), a.links_out)
    if "linkdown" in parts:
        print(json.dumps(linkdown(a.trials, a.timeout, rates[0])), flush=True)
    print(json.dumps({"bench": "multihost_machine_end", "load_avg": os.getloadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
