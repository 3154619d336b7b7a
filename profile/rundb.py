"""The run database: one SQLite file per run folder, ``RUN_DIR/run.db``.

Written incrementally in WAL mode, one transaction per step, so a run killed
at any moment (SIGKILL included) leaves a database that opens and holds every
step committed before the kill. ``synchronous=NORMAL``: in WAL mode a commit
is in the operating system's hands when it returns, which survives the death of
the process; only a power cut can lose the last few commits (never corrupt the
file). SQLite's journal does for this file what temp-file-and-rename does for
the others.

Schema (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)
-------------------------------------------------------
``runs`` -- one row per training run written into this folder::

    run_id INTEGER PRIMARY KEY    rowid
    name TEXT                     label (the folder name unless given)
    started_at REAL               unix time, s
    ended_at REAL                 unix time, s; NULL while running or after a kill
    status TEXT                   'running' | 'finished' | 'failed' | 'interrupted'
    host TEXT, pid INTEGER        where it ran
    device TEXT                   device name as the backend reports it
    dtype TEXT                    compute dtype ('bf16', 'fp32', ...)
    n_devices INTEGER             devices the run spans (MFU divides by it)
    peak_flops REAL               per-device peak FLOP/s used for MFU; NULL = unknown
    peak_label TEXT               where the peak came from ("estimate: ..." for CPUs)
    flops_per_token REAL          model FLOPs per token (6N + 12LTC)
    hw_flops_per_token REAL       hardware FLOPs per token (with recompute)
    n_params INTEGER
    config_json TEXT              the run's configuration, JSON

``step_timing`` -- one row per step and rank (phase columns are ns; they sum to wall_ns)::

    run_id, step, rank            PRIMARY KEY (rank 0 on a one-rank run; a data-parallel run
                                  gathers every rank's row to rank 0, which writes them all;
                                  loss, lr, tokens and MFU are the job's, on rank 0's row)
    start_ns INTEGER              host CLOCK_MONOTONIC at start_step
    wall_ns INTEGER
    data_load_ns, host_to_device_ns, forward_ns, backward_ns, grad_clip_ns, optimizer_ns,
    replay_ns, comm_ns, device_to_host_ns, checkpoint_ns, sample_gen_ns, idle_ns   INTEGER
                                  (replay: a captured step run again, hl.graph: forward to
                                  optimizer in one; 0 on a step that ran its phases)
    tokens INTEGER, tokens_per_s REAL
    loss REAL, lr REAL            NULL when not given
    dispatches INTEGER            kernel launches in the step; NULL when not counted
    mfu REAL, hfu REAL            0..1; NULL = n/a
    comm_bytes INTEGER            bytes this rank sent to its peers in the step (helios.comm's
                                  counters: the gradients' collectives and the trainer's own);
                                  NULL on a one-rank run
    comm_payload_bytes INTEGER    the summed operand sizes of this rank's collectives in the step
                                  (what they were asked to move, before any algorithm's factor)
    val_loss REAL                 validation loss measured after the step (rank 0's row); NULL when
                                  none was

``op_profile`` -- per-op totals of a profiled window (``step`` = the window's last step)::

    run_id, step, name, shape     PRIMARY KEY (shape '' when not grouped by shape)
    calls INTEGER, dispatches INTEGER
    host_ns INTEGER, device_ns INTEGER
    flops INTEGER, bytes INTEGER

``gpu_timeline`` -- one row per device dispatch of a profiled window::

    run_id, session, dispatch_seq PRIMARY KEY (session: 0, 1, ... per profiling session of the
                                  run; dispatch_seq restarts at 0 in each session)
    step INTEGER                  the step the dispatch belongs to (NULL if unknown)
    name TEXT, op TEXT            kernel name, recording host op (NULL if none)
    queue INTEGER, submit INTEGER
    start_ns, end_ns INTEGER      device interval on the host clock
    host_record_ns INTEGER
    flops INTEGER, bytes INTEGER
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from helios.profile.errors import ProfileError
from helios.profile.timers import ALL_PHASES, StepRecord

if TYPE_CHECKING:
    from helios.profile.events import DeviceEvent
    from helios.profile.profiler import Collector, KeyAverages

DB_FILENAME = "run.db"
SCHEMA_VERSION = 4
_PHASE_COLS = [f"{p}_ns" for p in ALL_PHASES]

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY,
    name TEXT, started_at REAL NOT NULL, ended_at REAL, status TEXT NOT NULL,
    host TEXT, pid INTEGER, device TEXT, dtype TEXT, n_devices INTEGER NOT NULL DEFAULT 1,
    peak_flops REAL, peak_label TEXT, flops_per_token REAL, hw_flops_per_token REAL,
    n_params INTEGER, config_json TEXT
);
CREATE TABLE IF NOT EXISTS step_timing (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), step INTEGER NOT NULL, rank INTEGER NOT NULL DEFAULT 0,
    start_ns INTEGER NOT NULL, wall_ns INTEGER NOT NULL,
    {", ".join(c + " INTEGER NOT NULL DEFAULT 0" for c in _PHASE_COLS)},
    tokens INTEGER NOT NULL, tokens_per_s REAL, loss REAL, lr REAL, dispatches INTEGER, mfu REAL, hfu REAL,
    comm_bytes INTEGER, comm_payload_bytes INTEGER, val_loss REAL,
    PRIMARY KEY (run_id, step, rank)
);
CREATE TABLE IF NOT EXISTS op_profile (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), step INTEGER NOT NULL, name TEXT NOT NULL,
    shape TEXT NOT NULL DEFAULT '', calls INTEGER NOT NULL, dispatches INTEGER NOT NULL,
    host_ns INTEGER NOT NULL, device_ns INTEGER NOT NULL, flops INTEGER NOT NULL, bytes INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, name, shape)
);
CREATE TABLE IF NOT EXISTS gpu_timeline (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), session INTEGER NOT NULL, dispatch_seq INTEGER NOT NULL,
    step INTEGER,
    name TEXT NOT NULL, op TEXT, queue INTEGER NOT NULL, submit INTEGER,
    start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, host_record_ns INTEGER,
    flops INTEGER NOT NULL, bytes INTEGER NOT NULL,
    PRIMARY KEY (run_id, session, dispatch_seq)
);
"""


def db_path(run_dir: str | os.PathLike[str]) -> str:
    """The database file of a run folder."""
    return os.path.join(os.fspath(run_dir), DB_FILENAME)


def connect(path: str, timeout_s: float = 10.0) -> sqlite3.Connection:
    """Open (creating if needed) a run database in WAL mode with the schema in place."""
    con = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)  # autocommit; we open transactions
    con.row_factory = sqlite3.Row
    mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        con.close()
        raise ProfileError(f"{path}: SQLite refused WAL mode (got {mode!r}); put RUN_DIR on a local filesystem")
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute("PRAGMA foreign_keys=ON")
    ver = con.execute("PRAGMA user_version").fetchone()[0]
    if ver == 1:
        _migrate_v1(con)
        ver = SCHEMA_VERSION
    if ver == 2:
        _migrate_v2(con)
        ver = 3
    if ver == 3:
        _migrate_v3(con)
        ver = SCHEMA_VERSION
    if ver not in (0, SCHEMA_VERSION):
        con.close()
        raise ProfileError(f"{path}: schema version {ver}, this Helios reads {SCHEMA_VERSION}; use a new RUN_DIR")
    con.executescript("BEGIN;" + _SCHEMA + f"PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
    return con


def _migrate_v1(con: sqlite3.Connection) -> None:
    """Version 1 had no rank column: its rows become rank 0's (one transaction)."""
    cols = [r[1] for r in con.execute("PRAGMA table_info(step_timing)").fetchall()]
    con.executescript("BEGIN; ALTER TABLE step_timing RENAME TO step_timing_v1;" + _SCHEMA +
                      f"INSERT INTO step_timing ({', '.join(cols)}) SELECT {', '.join(cols)} FROM step_timing_v1;"
                      f"DROP TABLE step_timing_v1; PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")


def _migrate_v2(con: sqlite3.Connection) -> None:
    """Version 2 had no byte counts or validation loss: they are NULL on its rows (one transaction)."""
    con.executescript("BEGIN; ALTER TABLE step_timing ADD COLUMN comm_bytes INTEGER;"
                      "ALTER TABLE step_timing ADD COLUMN comm_payload_bytes INTEGER;"
                      "ALTER TABLE step_timing ADD COLUMN val_loss REAL;"
                      "PRAGMA user_version=3; COMMIT;")


def _migrate_v3(con: sqlite3.Connection) -> None:
    """Version 3 had no replay phase: 0 on its rows (one transaction)."""
    con.executescript("BEGIN; ALTER TABLE step_timing ADD COLUMN replay_ns INTEGER NOT NULL DEFAULT 0;"
                      f"PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")


class RunDB:
    """Writer of one run's rows. Every method commits before it returns (one transaction per call)."""

    def __init__(self, run_dir: str | os.PathLike[str], name: str | None = None, device: str | None = None,
                 dtype: str | None = None, n_devices: int = 1, peak_flops: float | None = None,
                 peak_label: str | None = None, flops_per_token: float | None = None,
                 hw_flops_per_token: float | None = None, n_params: int | None = None,
                 config: dict[str, Any] | None = None) -> None:
        run_dir = os.fspath(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        self.path = db_path(run_dir)
        self.con = connect(self.path)
        with self._tx():
            cur = self.con.execute(
                "INSERT INTO runs (name, started_at, status, host, pid, device, dtype, n_devices, peak_flops, "
                "peak_label, flops_per_token, hw_flops_per_token, n_params, config_json) "
                "VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (name or os.path.basename(os.path.abspath(run_dir)), time.time(), socket.gethostname(), os.getpid(),
                 device, dtype, int(n_devices), peak_flops, peak_label, flops_per_token, hw_flops_per_token,
                 n_params, json.dumps(config, sort_keys=True, default=str) if config is not None else None))
        self.run_id: int = int(cur.lastrowid)
        self.session = 0  # profiling sessions logged so far; tags gpu_timeline rows

    def _tx(self) -> _Tx:
        return _Tx(self.con)

    def log_step(self, rec: StepRecord, mfu: float | None = None, hfu: float | None = None, rank: int = 0,
                 comm_bytes: int | None = None, comm_payload_bytes: int | None = None,
                 val_loss: float | None = None) -> None:
        """Store one step's timing on ``rank`` (commits); ``comm_bytes`` / ``comm_payload_bytes``: what
        the rank's collectives sent and were given in the step (see the schema); ``val_loss``: the
        validation loss measured after it."""
        cols = ["run_id", "step", "rank", "start_ns", "wall_ns", *_PHASE_COLS, "tokens", "tokens_per_s", "loss", "lr",
                "dispatches", "mfu", "hfu", "comm_bytes", "comm_payload_bytes", "val_loss"]
        vals = [self.run_id, rec.step, rank, rec.start_ns, rec.wall_ns, *(rec.phases_ns.get(p, 0) for p in ALL_PHASES),
                rec.tokens, rec.tokens_per_s, rec.loss, rec.lr, rec.dispatches, mfu, hfu, comm_bytes,
                comm_payload_bytes, val_loss]
        with self._tx():
            self.con.execute(f"INSERT OR REPLACE INTO step_timing ({', '.join(cols)}) "
                             f"VALUES ({', '.join('?' * len(cols))})", vals)

    def set_val_loss(self, step: int, val_loss: float, rank: int = 0) -> None:
        """Record the validation loss measured after ``step`` (on its existing row; commits)."""
        with self._tx():
            self.con.execute("UPDATE step_timing SET val_loss = ? WHERE run_id = ? AND step = ? AND rank = ?",
                             (float(val_loss), self.run_id, int(step), int(rank)))

    def log_ops(self, step: int, averages: KeyAverages) -> None:
        """Store per-op totals of a profiled window ending at ``step`` (commits)."""
        with self._tx():
            self.con.executemany(
                "INSERT OR REPLACE INTO op_profile (run_id, step, name, shape, calls, dispatches, host_ns, device_ns, "
                "flops, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(self.run_id, step, r.name, r.shape, r.calls, r.dispatches, r.host_time_ns, r.device_time_ns,
                  r.flops, r.bytes) for r in averages])

    def log_gpu_events(self, events: Iterable[DeviceEvent], step: int | None = None,
                       op_names: dict[int, str] | None = None, session: int | None = None) -> None:
        """Store device dispatches (commits). ``op_names`` maps dispatch_seq -> recording op."""
        op_names = op_names or {}
        session = self.session if session is None else session
        with self._tx():
            self.con.executemany(
                "INSERT OR REPLACE INTO gpu_timeline (run_id, session, dispatch_seq, step, name, op, queue, submit, "
                "start_ns, end_ns, host_record_ns, flops, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(self.run_id, session, e.dispatch_seq, step, e.name, op_names.get(e.dispatch_seq), e.queue, e.submit,
                  e.start_ns, e.end_ns, e.host_record_ns, e.flops, e.bytes) for e in events])

    def log_profile(self, col: Collector, step: int) -> None:
        """Store a whole profiling session: its op totals and its dispatches, each step-tagged where known."""
        from helios.profile.profiler import key_averages

        self.log_ops(step, key_averages(col))
        owner = {seq: op.name for seq, op in col.op_of_dispatch().items()}
        # A dispatch belongs to the step whose wall window holds the moment it was recorded.
        windows = [(r.start_ns, r.end_ns, r.step) for r in col.steps]
        by_step: dict[int | None, list] = {}
        for e in col.events:
            st = next((s for a, b, s in windows if a <= e.host_record_ns <= b), None)
            by_step.setdefault(st, []).append(e)
        for st, evs in by_step.items():
            self.log_gpu_events(evs, st, owner, self.session)
        self.session += 1

    def finish(self, status: str = "finished") -> None:
        """Mark the run ended (``finished``, ``failed`` or ``interrupted``) and close the database."""
        if status not in ("finished", "failed", "interrupted"):
            raise ProfileError(f"status must be finished, failed or interrupted, got {status!r}")
        with self._tx():
            self.con.execute("UPDATE runs SET ended_at = ?, status = ? WHERE run_id = ?",
                             (time.time(), status, self.run_id))
        self.close()

    def close(self) -> None:
        """Close the connection (folds the WAL back into the main file when we are the last user)."""
        self.con.close()

    def __enter__(self) -> RunDB:  # noqa: PYI034 (typing.Self needs Python 3.11; we support 3.10)
        """Use as ``with RunDB(dir) as db:``; the run is finished (or marked failed) on exit."""
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("finished")
        else:
            self.finish("interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed")


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error)."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self.con = con

    def __enter__(self) -> None:
        self.con.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self.con.execute("ROLLBACK" if exc_type else "COMMIT")


def read_run(run_dir: str | os.PathLike[str], run_id: int | None = None) -> dict[str, Any]:
    """Everything about one run of a folder (the latest when ``run_id`` is None), as plain Python data.

    Keys: ``run`` (dict), ``steps`` (list of dicts, by step), ``ops`` (list of dicts), ``timeline``
    (list of dicts, by dispatch_seq). Opens the file without changing it (a killed run's WAL is read as is).
    """
    path = db_path(run_dir)
    if not os.path.exists(path):
        raise ProfileError(f"no run database at {path}: pass the folder given to helios-train --out")
    con = sqlite3.connect(path, timeout=10.0)
    con.row_factory = sqlite3.Row
    try:
        try:
            if run_id is None:
                row = con.execute("SELECT * FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
            else:
                row = con.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise ProfileError(f"{path} is not a readable Helios run database: {e}") from None
        if row is None:
            raise ProfileError(f"{path} holds no run" + (f" with run_id {run_id}" if run_id is not None else ""))
        rid = row["run_id"]
        q = lambda sql: [dict(r) for r in con.execute(sql, (rid,)).fetchall()]
        return {
            "run": dict(row),
            "steps": q("SELECT * FROM step_timing WHERE run_id = ? AND rank = 0 ORDER BY step"),
            "rank_steps": q("SELECT * FROM step_timing WHERE run_id = ? ORDER BY step, rank"),
            "ops": q("SELECT * FROM op_profile WHERE run_id = ? ORDER BY step, device_ns DESC"),
            "timeline": q("SELECT * FROM gpu_timeline WHERE run_id = ? ORDER BY session, dispatch_seq"),
        }
    finally:
        con.close()
