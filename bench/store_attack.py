"""A job's step time while strangers attack its store (comm/auth.py, comm/store.py).

Two ranks (a secret of their own, as helios-run gives them) all-reduce ``--mib`` MiB per step
for the whole run; rank 0 records when each step ended.  The run alternates quiet windows
and attack windows of ``--window`` seconds, ``--rounds`` of each.  In an attack window
``--strangers`` threads of this process, without the secret, connect to the job's store
over and over: each sends a frame header announcing a 4 GiB key and value (and, on every
other connection, 64 bytes of garbage where the handshake's answer belongs), holds on until the
store drops it (or the window ends), pauses ``--pause`` seconds and connects again.  Steps are assigned to the
window they ended in (the first 0.2 s of each window left out).

One JSON line per kind of window (``{"bench": "store_attack", "window": "quiet"|"attack",
"steps", "median_ms", "p90_ms"}``), then a summary (``attack_over_quiet`` = the ratio of the
medians, the connections the strangers made, and the store's ``rejected`` count, which
must have counted them all).  The attacker runs on the same machine, so its own CPU time
(reported) competes with the ranks'.  ``--smoke``: 0.2 MiB, 10 strangers, one 1 s round.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
OVERSIZED = struct.pack("!BIIq", 1, 0xFFFFFFFF, 0xFFFFFFFF, 0)  # a SET of a 4 GiB key and 4 GiB value


def rank_main() -> None:
    """One rank: all-reduce until rank 0 sees the stop file; rank 0 writes the step end times."""
    import helios.comm as dist
    from helios.comm import api

    dist.init_process_group(backend=os.environ.get("BENCH_BACKEND", "auto"), timeout=120)
    r = dist.get_rank()
    x = np.ones(int(float(os.environ["BENCH_MIB"]) * (1 << 18)), np.float32)
    for _ in range(5):  # warm up
        dist.all_reduce(x, op="max")
    ends: list[float] = []
    durs: list[float] = []
    if r == 0:
        _write(os.environ["BENCH_READY"], os.environ["MASTER_PORT"])
    while True:
        stop = np.array([int(r == 0 and os.path.exists(os.environ["BENCH_STOP"]))], np.int32)
        dist.broadcast(stop, src=0)
        if stop[0]:
            break
        t0 = time.perf_counter()
        dist.all_reduce(x, op="max")  # the values stay ones: every step does the same work
        durs.append(time.perf_counter() - t0)
        ends.append(time.time())
    if r == 0:
        _write(os.environ["BENCH_OUT"], json.dumps({"ends": ends, "durs": durs, "rejected": api._S.store.server.rejected,
                                                    "backend": dist.get_backend()}))
    dist.barrier()
    dist.destroy_process_group()


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".tmp", path)


def _stranger(i: int, port: int, until: float, pause: float, made: list[int], lock: threading.Lock) -> None:
    n = 0
    while time.time() < until:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(OVERSIZED + (bytes(64) if (i + n) % 2 else b""))
                n += 1
                s.settimeout(max(0.0, until - time.time()) + 0.05)  # the window's end closes what is still held
                while s.recv(4096):  # the greeting, then nothing until the store drops us
                    pass
        except OSError:
            pass
        time.sleep(pause)
    with lock:
        made[0] += n


def _attack(port: int, seconds: float, strangers: int, pause: float) -> int:
    made, lock = [0], threading.Lock()
    until = time.time() + seconds
    ts = [threading.Thread(target=_stranger, args=(i, port, until, pause, made, lock), daemon=True)
          for i in range(strangers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 15)
    return made[0]


def _stats(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"steps": len(ms), "median_ms": round(statistics.median(ms), 3) if ms else None,
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3) if ms else None}


def main() -> None:
    """Run the job, the windows and the attacks; print the JSON lines."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=4.0, help="MiB all-reduced per step")
    ap.add_argument("--backend", default="auto", help="the ranks' backend (auto: shm on one host)")
    ap.add_argument("--strangers", type=int, default=100)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds a stranger waits before connecting again")
    ap.add_argument("--window", type=float, default=4.0, help="seconds of each quiet and attack window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.mib, a.strangers, a.window, a.rounds = 0.2, 10, 1.0, 1
    from helios.comm import auth
    from helios.comm.launcher import free_port

    with tempfile.TemporaryDirectory(prefix="helios-bench-") as tmp:
        port = free_port("127.0.0.1")
        paths = {k: os.path.join(tmp, k) for k in ("ready", "stop", "out")}
        procs, secret = [], auth.new_secret()  # the ranks' secret: this process (the attacker) forgets it
        for r in range(2):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), HELIOS_JOB_SECRET=secret, LP_NUM_THREADS="1",
                       BENCH_MIB=str(a.mib), BENCH_BACKEND=a.backend, BENCH_READY=paths["ready"],
                       BENCH_STOP=paths["stop"], BENCH_OUT=paths["out"])
            procs.append(subprocess.Popen([sys.executable, HERE, "--rank"], env=env, cwd=ROOT))
        try:
            windows, made = _run_windows(a, port, paths, procs)
            open(paths["stop"], "w").close()
            for p in procs:
                p.wait(timeout=120)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise SystemExit(f"store_attack: a rank failed: {[p.returncode for p in procs]}")
        with open(paths["out"]) as f:
            res = json.load(f)
    _report(a, windows, made, res)


def _run_windows(a: argparse.Namespace, port: int, paths: dict, procs: list) -> tuple[list, int]:
    deadline = time.monotonic() + 120
    while not os.path.exists(paths["ready"]):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("store_attack: the ranks did not start")
        time.sleep(0.05)
    windows, made = [], 0
    for _ in range(a.rounds):
        t0 = time.time()
        time.sleep(a.window)
        windows.append(("quiet", t0, time.time()))
        t0 = time.time()
        made += _attack(port, a.window, a.strangers, a.pause)
        windows.append(("attack", t0, time.time()))
    time.sleep(0.5)  # the store counts the last dropped connections
    return windows, made


def _report(a: argparse.Namespace, windows: list, made: int, res: dict) -> None:
    ms = {"quiet": [], "attack": []}
    for end, dur in zip(res["ends"], res["durs"]):
        for kind, t0, t1 in windows:
            if t0 + 0.2 <= end <= t1:
                ms[kind].append(dur * 1e3)
    cpu = time.process_time()
    common = {"ranks": 2, "backend": res["backend"], "mib": a.mib, "strangers": a.strangers}
    for kind in ("quiet", "attack"):
        print(json.dumps({"bench": "store_attack", "window": kind, **common, **_stats(ms[kind])}), flush=True)
    q, t = _stats(ms["quiet"])["median_ms"], _stats(ms["attack"])["median_ms"]
    print(json.dumps({"bench": "store_attack_summary", **common, "attack_over_quiet": round(t / q, 3) if q and t else None,
                      "connections": made, "rejected": res["rejected"], "attacker_cpu_s": round(cpu, 2),
                      "window_s": a.window, "rounds": a.rounds}), flush=True)


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main()
    else:
        main()
