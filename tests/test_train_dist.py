"""helios-train on several ranks: N ranks train exactly what one rank trains, and a user's
mistake stops every rank with one line, never a hang."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
STEPS = 20

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]


def _env() -> dict:
    e = dict(os.environ)
    e["LP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HELIOS_LAUNCHER", "HELIOS_JOB_ID"):
        e.pop(k, None)
    return e


def _train_args(out, *extra) -> list[str]:
    # 2 validation batches, not the default 8: the final evaluation still runs on every layout
    # (on 2 data-parallel ranks one batch each, their mean gathered) at a quarter of the forwards.
    return ["--config", "nano", "--steps", str(STEPS), "--batch-size", "8", "--block-size", "16", "--no-progress",
            "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "4", "--ckpt-every", "0", "--out", str(out), *extra]


def launch(world: int, out, *extra, timeout: float = 240) -> subprocess.CompletedProcess:
    """helios-run --nproc-per-node world -m helios.train ... (the user's command)."""
    cmd = [os.path.join(BIN, "helios-run"), "--nproc-per-node", str(world), "-m", "helios.train",
           *_train_args(out, *extra)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def losses(out) -> list[float]:
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return [r[0] for r in con.execute("SELECT loss FROM step_timing WHERE rank = 0 ORDER BY step")]
    finally:
        con.close()


def final_params(out) -> dict:
    """Every tensor of the newest checkpoint (parameters and moments), whole."""
    from helios.schedule import checkpoint as C

    _, d = C.latest_complete(str(out))
    shapes = C.global_shapes(d)
    arrays, _ = C.load(d, {n: (0, int(np.prod(s))) for n, (s, _) in shapes.items()})
    return arrays


def test_two_and_four_ranks_train_what_one_rank_trains(tmp_path, one_rank_run):
    one = one_rank_run()
    runs = {1: (losses(one), final_params(one))}
    for world in (2, 4):
        r = launch(world, tmp_path / f"w{world}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[world] = (losses(tmp_path / f"w{world}"), final_params(tmp_path / f"w{world}"))
    for world in (1, 2, 4):
        assert len(runs[world][0]) == STEPS
    for world in (2, 4):
        np.testing.assert_allclose(runs[world][0], runs[1][0], rtol=1e-5)
        for k, v in runs[1][1].items():
            np.testing.assert_allclose(runs[world][1][k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    # Only rank 0 prints the progress and the summary; run.db holds every rank's timing.
    out = launch(2, tmp_path / "again", "--steps", "3")
    assert out.stdout.count('"world_size": 2') == 1 and "[rank 1] step" not in out.stdout
    con = sqlite3.connect(tmp_path / "again" / "run.db")
    assert con.execute("SELECT n_devices FROM runs").fetchone()[0] == 2
    assert con.execute("SELECT COUNT(*), COUNT(DISTINCT rank) FROM step_timing").fetchone() == (6, 2)
    con.close()


@pytest.fixture(scope="module")
def stopped_two_rank_run(shared_dir):
    """A 2-rank, 10-step run stopped after step 5 (each resuming test copies it)."""
    def make(split):
        first = launch(2, split, "--steps", "10", "--stop-after", "5")
        assert first.returncode == 0 and "stopped at step 5" in first.stdout, first.stderr[-2000:]
        assert sorted(os.listdir(split / "ckpt" / "step-00000005")) == [
            "metadata.json", "shard-00000-of-00002.helios", "shard-00001-of-00002.helios"]

    return shared_dir("dist-stopped_two_rank_run", make)


@pytest.mark.parametrize("resume_world", [1, 2, 4])
def test_checkpoint_of_two_ranks_resumes_on_any_world_size_and_continues_the_same_run(
        tmp_path, resume_world, one_rank_run, stopped_two_rank_run):
    full = one_rank_run("--steps", "10")
    split = tmp_path / "split"
    shutil.copytree(stopped_two_rank_run, split, symlinks=True)
    second = launch(resume_world, split, "--steps", "10", "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "saved by 2 ranks" in second.stdout
    a, b = losses(full), losses(split)
    assert len(b) == 10
    np.testing.assert_allclose(b, a, rtol=1e-5)
    fa, fb = final_params(full), final_params(split)
    for k in fa:
        # atol: the attention key bias has an exactly-zero true gradient; its float noise, which
        # depends on the reduction order, AdamW turns into updates of ~1e-6 (see test_ddp.py).
        np.testing.assert_allclose(fb[k], fa[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_resume_with_another_model_size_is_refused_by_flag_on_every_rank(tmp_path):
    assert launch(1, tmp_path, "--steps", "2").returncode == 0
    r = launch(2, tmp_path, "--steps", "2", "--resume", "--block-size", "8")
    assert r.returncode == 2 and "--block-size 8: the run in" in r.stderr and "trained with --block-size 16" in r.stderr
    assert "Traceback" not in r.stderr


def test_gradient_accumulation_over_ranks_matches_one_rank(tmp_path):
    one = launch(1, tmp_path / "a", "--grad-accum", "2", "--steps", "8")
    two = launch(2, tmp_path / "b", "--grad-accum", "2", "--steps", "8")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "b"), losses(tmp_path / "a"), rtol=1e-5)


def _one_line_error(results, needle: str) -> None:
    for r in results:
        assert r.code not in (0, None), f"rank {r.rank} exited 0"
        assert "Traceback" not in r.err, r.err[-3000:]
        assert needle in r.err, f"rank {r.rank}: {r.err[-2000:]}"


def test_batch_size_that_does_not_split_over_the_ranks_is_refused_on_every_rank(tmp_path):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, "--batch-size", "6")], 4, timeout=120)
    _one_line_error(res, "--batch-size 6 does not split evenly over 4 ranks")


def test_ranks_started_with_different_seeds_stop_at_once(tmp_path):
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, "--seed", "$RANK")], 2, timeout=120,
                    argv_per_rank=lambda r, argv: [a.replace("$RANK", str(r)) for a in argv])
    _one_line_error(res, "the ranks disagree on their settings")


def test_zero_stage_out_of_range_is_a_usage_error():
    r = subprocess.run([os.path.join(BIN, "helios-train"), "--zero", "5"], capture_output=True, text=True, timeout=60,
                       env=_env())
    assert r.returncode == 2 and "--zero" in r.stderr and "Traceback" not in r.stderr


def test_world_size_larger_than_the_ranks_that_show_up_times_out_with_one_line(tmp_path):
    t0 = time.monotonic()
    res = run_ranks(["-m", "helios.train", *_train_args(tmp_path, "--comm-timeout", "4")], 1, timeout=90,
                    env={"WORLD_SIZE": "2"})
    assert time.monotonic() - t0 < 60
    _one_line_error(res, "CommError")


def _wait_for_steps(out, n: int, procs, deadline_s: float = 120) -> None:
    t_end = time.monotonic() + deadline_s
    db = os.path.join(out, "run.db")
    while time.monotonic() < t_end:
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank ended early: " + " | ".join(p.stderr.read()[-1500:] for p in procs))
        if os.path.exists(db):
            try:
                con = sqlite3.connect(db)
                k = con.execute("SELECT COUNT(*) FROM step_timing WHERE rank = 0").fetchone()[0]
                con.close()
                if k >= n:
                    return
            except sqlite3.OperationalError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps within {deadline_s} s")


def test_sigkill_of_one_rank_stops_the_others_with_an_error_naming_it(tmp_path):
    from ranks import kill_all, start_ranks

    timeout = 6.0
    procs = start_ranks(["-m", "helios.train", *_train_args(tmp_path, "--steps", "100000", "--comm-timeout",
                                                            str(timeout))], 2)
    try:
        _wait_for_steps(tmp_path, 3, procs)
        t0 = time.monotonic()
        os.killpg(procs[1].pid, 9)
        procs[0].wait(timeout=4 * timeout)
        elapsed = time.monotonic() - t0
        err = procs[0].stderr.read()
    finally:
        kill_all(procs)
    assert procs[0].returncode not in (0, None)
    assert elapsed < 2 * timeout, elapsed
    assert "CommError" in err and "rank 1" in err and "Traceback" not in err, err[-2000:]


def test_ctrl_c_stops_every_rank_after_the_same_step_saves_and_exits_130(tmp_path):
    cmd = [os.path.join(BIN, "helios-run"), "--nproc-per-node", "2", "-m", "helios.train",
           *_train_args(tmp_path, "--steps", "100000")]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _wait_for_steps(tmp_path, 3, [p])
        p.send_signal(2)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "stopped at step" in out and "Traceback" not in err, out[-2000:] + err[-3000:]
    con = sqlite3.connect(tmp_path / "run.db")
    steps = con.execute("SELECT MAX(step) FROM step_timing WHERE rank = 0").fetchone()[0]
    # Both ranks logged the same last step (they agreed), and the checkpoint holds it.
    assert con.execute("SELECT MAX(step) FROM step_timing WHERE rank = 1").fetchone()[0] == steps
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "interrupted"
    con.close()
    assert f"stopped at step {steps}" in out


def test_trace_has_every_rank_and_a_bucket_reduced_while_backward_computes(tmp_path):
    trace = tmp_path / "trace.json"
    r = launch(2, tmp_path, "--steps", "6", "--profile-steps", "2:6", "--trace", str(trace), "--profile-host-only",
               "--bucket-cap-mb", "0.02")
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    events = json.loads(trace.read_text())["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert {n for _, n in names} >= {"helios rank 0 host", "helios rank 1 host"}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert (1, "collectives") in tracks and (101, "collectives") in tracks
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from data_parallel import overlap_share

    # A bucket's all-reduce ran before backward's last gradient existed: overlap, read from the trace.
    share = overlap_share(str(trace))
    assert share["all_reduces"] > 0 and share["hidden_ms"] > 0, share


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the process of ``rank`` that helios-run started (from /proc)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"RANK") == str(rank).encode():
            return int(d)
    return None


def test_a_lost_rank_restarts_the_job_from_its_checkpoint_and_it_ends_as_the_uninterrupted_run(tmp_path):
    steps = ["--steps", "16", "--ckpt-every", "4"]
    assert launch(2, tmp_path / "whole", *steps).returncode == 0
    out = tmp_path / "lossy"
    cmd = [os.path.join(BIN, "helios-run"), "--nproc-per-node", "2", "--max-restarts", "1", "-m", "helios.train",
           *_train_args(out, *steps)]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _wait_for_steps(out, 6, [p])
        pid = _rank_pid(p.pid, 1)
        assert pid is not None
        os.kill(pid, 9)
        stdout, stderr = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, stderr[-3000:]
    assert "restarting the job (restart 1 of 1)" in stderr and "resuming from the last complete checkpoint" in stdout
    a, b = final_params(tmp_path / "whole"), final_params(out)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5, err_msg=k)
    con = sqlite3.connect(out / "run.db")
    last = con.execute("SELECT loss FROM step_timing WHERE rank = 0 AND step = 16 ORDER BY run_id DESC").fetchone()[0]
    con.close()
    assert last == pytest.approx(losses(tmp_path / "whole")[-1], rel=1e-5)
