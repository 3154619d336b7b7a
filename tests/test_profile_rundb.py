"""Run database: schema, WAL, incremental commits, and survival of a SIGKILL mid-run."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from helios.profile import ALL_PHASES, ProfileError, RunDB, profile, read_run
from helios.profile.rundb import SCHEMA_VERSION, db_path
from test_profile_synth import FakeClock, simulate_training


def test_steps_profile_and_run_roundtrip(tmp_path) -> None:
    clock = FakeClock()
    db = RunDB(tmp_path, device="NVIDIA H100 80GB HBM3", dtype="bf16", peak_flops=989.4e12, peak_label="x",
               flops_per_token=1e9, n_params=10, config={"steps": 6})
    with profile(clock=clock) as prof:
        _, rt, timer = simulate_training(6, clock=clock)
    for rec in timer.records:
        db.log_step(rec, mfu=0.25, hfu=0.3)
    db.log_profile(prof.collector, step=5)
    db.finish()

    con = sqlite3.connect(db_path(tmp_path))
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "step_timing", "op_profile", "gpu_timeline"} <= tables
    con.close()

    data = read_run(tmp_path)
    run = data["run"]
    assert run["status"] == "finished" and run["ended_at"] >= run["started_at"]
    assert run["device"] == "NVIDIA H100 80GB HBM3" and run["config_json"] == '{"steps": 6}'
    assert [s["step"] for s in data["steps"]] == list(range(6))
    for s, rec in zip(data["steps"], timer.records):
        assert sum(s[f"{p}_ns"] for p in ALL_PHASES) == s["wall_ns"] == rec.wall_ns
        assert s["dispatches"] == rec.dispatches and s["mfu"] == 0.25 and s["loss"] == pytest.approx(rec.loss)
    # op_profile holds the same totals as key_averages; gpu_timeline one row per dispatch, each tagged with its step.
    ka = {r.name: r for r in prof.key_averages()}
    assert {o["name"]: o["device_ns"] for o in data["ops"]} == {n: r.device_time_ns for n, r in ka.items()}
    assert len(data["timeline"]) == rt.dispatches_total
    per_step: dict[int, int] = {}
    for r in data["timeline"]:
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    assert per_step == {rec.step: rec.dispatches for rec in timer.records}
    assert {r["op"] for r in data["timeline"]} >= {"matmul", "adamw"}


def test_two_runs_in_one_folder_and_failure_status(tmp_path) -> None:
    RunDB(tmp_path, name="first").finish("interrupted")
    with pytest.raises(RuntimeError), RunDB(tmp_path, name="second"):
        raise RuntimeError("boom")
    assert read_run(tmp_path)["run"]["name"] == "second"
    assert read_run(tmp_path)["run"]["status"] == "failed"
    assert read_run(tmp_path, run_id=1)["run"]["status"] == "interrupted"
    with pytest.raises(ProfileError, match="no run with run_id 9"):
        read_run(tmp_path, run_id=9)
    with pytest.raises(ProfileError, match="status must be"):
        RunDB(tmp_path).finish("weird")


def test_bad_folders_are_reported(tmp_path) -> None:
    with pytest.raises(ProfileError, match="no run database"):
        read_run(tmp_path / "missing")
    (tmp_path / "run.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ProfileError, match="not a readable Helios run database"):
        read_run(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    con = sqlite3.connect(other / "run.db")
    con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 5}")
    con.close()
    with pytest.raises(ProfileError, match="schema version"):
        RunDB(other)


def test_reader_sees_committed_steps_while_writer_is_open(tmp_path) -> None:
    db = RunDB(tmp_path)
    _, _, timer = simulate_training(3)
    for rec in timer.records[:2]:
        db.log_step(rec)
    assert len(read_run(tmp_path)["steps"]) == 2  # each log_step committed
    db.log_step(timer.records[2])
    assert len(read_run(tmp_path)["steps"]) == 3
    db.close()


CHILD = textwrap.dedent("""
    import sys, time
    from helios.profile import RunDB, StepTimer, profile
    db = RunDB(sys.argv[1], device="test-device", dtype="fp32")
    timer = StepTimer()
    step = 0
    while True:
        timer.start_step()
        with timer.phase("forward"):
            x = sum(i * i for i in range(2000))
        with timer.phase("optimizer"):
            time.sleep(0.0005)
        rec = timer.end_step(step, tokens=128, loss=1.0 / (step + 1), dispatches=7)
        db.log_step(rec)
        if step % 5 == 0:  # a profiled window now and then: op_profile and gpu_timeline grow too
            with profile() as prof:
                prof.collector.record_op("matmul", (4, 4), "f32", 0, 10, [0])
                prof.collector.add_device_events({"events": [
                    {"name": "mm", "flops": 128, "bytes": 192, "start_ns": 20, "end_ns": 40, "submit": 0,
                     "host_record_ns": 5}], "submits": []})
            db.log_profile(prof.collector, step)
        print(step, flush=True)  # printed after the commit returned
        step += 1
""")


def test_database_survives_sigkill_mid_run(tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    last = -1
    deadline = time.monotonic() + 30
    try:
        while last < 40 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            last = int(line)
        assert last >= 40, f"child did not get going: {proc.stderr.read() if proc.poll() is not None else ''}"
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: the child is in its write loop
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.exists(db_path(run_dir) + "-wal")  # killed with its WAL not folded back

    con = sqlite3.connect(db_path(run_dir))
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    data = read_run(run_dir)
    steps = [s["step"] for s in data["steps"]]
    assert len(steps) >= last + 1 and steps == list(range(len(steps)))  # every step it reported, no gaps
    assert data["run"]["status"] == "running" and data["run"]["ended_at"] is None
    assert all(s["dispatches"] == 7 and s["wall_ns"] > 0 for s in data["steps"])
    assert len(data["timeline"]) >= last // 5 + 1 and len(data["ops"]) >= last // 5 + 1


def test_rank_rows_and_a_version_1_database_is_migrated(tmp_path) -> None:
    clock = FakeClock()
    _, _, timer = simulate_training(2, clock=clock)
    # A database written by schema version 1 (no rank column): its rows become rank 0's.
    con = sqlite3.connect(db_path(tmp_path))
    con.executescript("""
        CREATE TABLE runs (run_id INTEGER PRIMARY KEY, name TEXT, started_at REAL NOT NULL, ended_at REAL,
            status TEXT NOT NULL, host TEXT, pid INTEGER, device TEXT, dtype TEXT, n_devices INTEGER NOT NULL DEFAULT 1,
            peak_flops REAL, peak_label TEXT, flops_per_token REAL, hw_flops_per_token REAL, n_params INTEGER,
            config_json TEXT);
        INSERT INTO runs (run_id, started_at, status) VALUES (1, 0, 'finished');
    """ + "CREATE TABLE step_timing (run_id INTEGER NOT NULL, step INTEGER NOT NULL, start_ns INTEGER NOT NULL, "
        "wall_ns INTEGER NOT NULL, " + ", ".join(f"{p}_ns INTEGER NOT NULL" for p in ALL_PHASES) +
        ", tokens INTEGER NOT NULL, tokens_per_s REAL, loss REAL, lr REAL, dispatches INTEGER, mfu REAL, hfu REAL, "
        "PRIMARY KEY (run_id, step));"
        "INSERT INTO step_timing VALUES (1, 0, 0, 10, " + ", ".join("0" for _ in ALL_PHASES) +
        ", 5, 1.0, 2.5, 0.1, 3, NULL, NULL); PRAGMA user_version=1;")
    con.close()
    db = RunDB(tmp_path, n_devices=2)
    for rec in timer.records:
        db.log_step(rec)
        db.log_step(rec, rank=1)
    db.finish()
    con = sqlite3.connect(db_path(tmp_path))
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert con.execute("SELECT rank, loss FROM step_timing WHERE run_id = 1").fetchall() == [(0, 2.5)]
    assert con.execute("SELECT COUNT(*) FROM step_timing WHERE run_id = ? AND rank = 1",
                       (db.run_id,)).fetchone()[0] == 2
    con.close()
    data = read_run(tmp_path)
    assert len(data["steps"]) == 2 and len(data["rank_steps"]) == 4 and data["run"]["n_devices"] == 2


def test_a_version_2_database_gains_the_byte_columns_and_keeps_its_rows(tmp_path):
    _, _, timer = simulate_training(2, clock=FakeClock())
    db = RunDB(tmp_path)
    db.log_step(timer.records[0])
    db.close()
    con = sqlite3.connect(db_path(tmp_path))  # make it a version-2 file: no byte columns (nor replay phase)
    con.executescript("ALTER TABLE step_timing DROP COLUMN comm_bytes; ALTER TABLE step_timing DROP COLUMN "
                      "comm_payload_bytes; ALTER TABLE step_timing DROP COLUMN val_loss; "
                      "ALTER TABLE step_timing DROP COLUMN replay_ns; PRAGMA user_version=2;")
    con.close()
    db = RunDB(tmp_path)
    db.log_step(timer.records[1], rank=1, comm_bytes=1000, comm_payload_bytes=2000)
    db.set_val_loss(timer.records[1].step, 2.5, rank=1)
    db.close()
    con = sqlite3.connect(db_path(tmp_path))
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert con.execute("SELECT rank, comm_bytes, comm_payload_bytes, val_loss FROM step_timing ORDER BY run_id"
                       ).fetchall() == [(0, None, None, None), (1, 1000, 2000, 2.5)]
    con.close()


def test_a_version_3_database_gains_the_replay_phase_and_keeps_its_rows(tmp_path):
    _, _, timer = simulate_training(2, clock=FakeClock())
    db = RunDB(tmp_path)
    db.log_step(timer.records[0])
    db.close()
    con = sqlite3.connect(db_path(tmp_path))  # make it a version-3 file: no replay column
    con.executescript("ALTER TABLE step_timing DROP COLUMN replay_ns; PRAGMA user_version=3;")
    con.close()
    db = RunDB(tmp_path)
    db.log_step(timer.records[1])
    db.close()
    con = sqlite3.connect(db_path(tmp_path))
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    rows = con.execute("SELECT step, replay_ns, forward_ns FROM step_timing ORDER BY step").fetchall()
    assert [r[:2] for r in rows] == [(timer.records[0].step, 0), (timer.records[1].step, 0)]
    assert rows[0][2] == timer.records[0].phases_ns["forward"]
    con.close()
