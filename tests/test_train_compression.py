"""helios-train --grad-compression on two ranks: a run stopped and resumed is bit for bit the
uninterrupted run (the hooks' error feedback and PowerSGD's Q travel in the checkpoint),
run.db counts the bytes each rank sent, and a bad spec is one line."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_dist import BIN, _env, final_params, launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]


def _bytes(out) -> list[tuple[int, int, int]]:
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return con.execute("SELECT step, comm_bytes, comm_payload_bytes FROM step_timing WHERE rank = 1 "
                           "ORDER BY step").fetchall()
    finally:
        con.close()


@pytest.mark.parametrize("spec", ["powersgd:rank=2,start=3", "topk:0.05", "onebit:warmup=2"])
def test_stopped_and_resumed_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, spec):
    full, split = tmp_path / "full", tmp_path / "split"
    a = launch(2, full, "--steps", "10", "--grad-compression", spec)
    assert a.returncode == 0, a.stderr[-3000:]
    first = launch(2, split, "--steps", "10", "--stop-after", "5", "--grad-compression", spec)
    assert first.returncode == 0 and "stopped at step 5" in first.stdout, first.stderr[-2000:]
    second = launch(2, split, "--steps", "10", "--resume", "--grad-compression", spec)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "afresh" not in second.stdout
    np.testing.assert_array_equal(losses(split), losses(full))
    fa, fb = final_params(full), final_params(split)
    assert any(k.startswith("comm_hook.rank1.") for k in fa), sorted(fa)[:5]
    for k in fa:
        np.testing.assert_array_equal(fb[k], fa[k], err_msg=k)


def test_compressed_steps_send_fewer_bytes_and_another_world_size_starts_the_hook_afresh(tmp_path):
    plain, comp = tmp_path / "plain", tmp_path / "comp"
    assert launch(2, plain, "--steps", "6").returncode == 0
    r = launch(2, comp, "--steps", "8", "--stop-after", "6", "--grad-compression", "powersgd:rank=1,start=2")
    assert r.returncode == 0, r.stderr[-3000:]
    base = _bytes(plain)
    rows = _bytes(comp)
    assert len(rows) == 6 and all(b > 0 and p > 0 for _, b, p in rows)
    # The first two steps are plain all-reduces (start=2); then PowerSGD sends a fraction.
    assert rows[0][1] == base[0][1]
    assert all(b < 0.5 * base[0][1] for _, b, _ in rows[2:]), (rows, base[0])
    # Resumed by four ranks: the two ranks' error feedback does not apply; said in one line.
    again = launch(4, comp, "--steps", "8", "--resume", "--grad-compression", "powersgd:rank=1,start=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "belongs to 2 ranks, this run has 4; it starts afresh" in again.stdout


@pytest.mark.parametrize("args,needle", [
    (["--grad-compression", "topk:2"], "--grad-compression topk:2: topk: the fraction of entries kept must be in (0, 1)"),
    (["--grad-compression", "powersgd:rank=0"], "powersgd: rank must be >= 1"),
    (["--grad-compression", "bf16", "--zero", "1"], "does not combine with --zero 1"),
])
def test_bad_compression_flag_is_one_line_and_exit_2(args, needle):
    r = subprocess.run([os.path.join(BIN, "helios-train"), *args], capture_output=True, text=True, timeout=60,
                       env=_env())
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
