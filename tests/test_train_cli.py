"""helios-train as a user meets it: every mistake is one line naming its flag (exit 2, no
traceback), --resume continues a run from its folder alone, and a log file gets plain lines."""

from __future__ import annotations

import os
import sqlite3
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import BASE, corpus, losses, run  # noqa: E402, F401  (corpus: a fixture)

pytestmark = pytest.mark.vulkan


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_bytes(b"")
    (d / "blob.dat").write_bytes(bytes(range(256)) * 40)  # NUL bytes: skipped as binary
    (d / "folder").mkdir()
    return d


@pytest.mark.parametrize("bad,needle", [
    (["--data", "{d}/empty.txt"], "--data '{d}/empty.txt': the file is empty"),
    (["--data", "{d}/blob.dat"], "no text found (1 files, 1 skipped as binary); pass --data"),
    (["--data", "{d}/folder"], "the folder holds no non-empty regular files"),
    (["--tokenizer", "bpe:12"], "--tokenizer bpe:12: N must be an integer >= 256"),
    (["--tokenizer", "wordpiece"], "--tokenizer wordpiece: unknown tokenizer spec"),
    (["--block-size", "100000"], "--block-size 100000: one micro-batch of 8 sequences makes attention scores"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--eval-batches", "0"], "--eval-batches must be at least 1"),
    (["--grad-clip", "-1"], "--grad-clip must be 0 (off) or a positive norm"),
    (["--warmup", "-2"], "--warmup must be 0 or more steps"),
    (["--ckpt-every", "-1"], "--ckpt-every must be 0"),
    (["--profile-steps", "50:60"], "--profile-steps 50:60: the run trains steps 0..1"),
    (["--profile-steps", "x"], "--profile-steps x: --profile-steps expects START:STOP"),
    (["--trace", "{d}/t.json", "--steps", "1"], "too few to profile"),
])
def test_every_mistake_is_one_line_naming_the_flag(bad_data, tmp_path, bad, needle):
    args = [a.replace("{d}", str(bad_data)) for a in bad]
    r = run(BASE + ["--steps", "2", "--out", str(tmp_path / "x"), *args], tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert needle.replace("{d}", str(bad_data)) in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_block_size_error_names_the_largest_that_fits(tmp_path):
    from helios.runtime import get_runtime
    from helios.train_settings import largest_activation, largest_block_that_fits

    limit = get_runtime().max_range
    best = largest_block_that_fits(limit, 8, 2, 32, 256)
    assert largest_activation(8, best, 2, 32, 256)[0] <= limit < largest_activation(8, best + 1, 2, 32, 256)[0]
    r = run(BASE + ["--steps", "1", "--out", str(tmp_path / "x"), "--block-size", str(best + 1)], tmp_path)
    assert r.returncode == 2 and f"the largest block size that fits is {best}" in r.stderr, r.stderr


def test_resume_from_the_folder_alone_continues_the_run_bit_exactly(corpus, tmp_path):  # noqa: F811
    own = ["--steps", "8", "--lr", "0.004", "--batch-size", "4", "--block-size", "16", "--seed", "5", "--data", corpus]
    full, split = tmp_path / "full", tmp_path / "split"
    assert run(BASE + own + ["--out", str(full)], tmp_path).returncode == 0
    first = run(BASE + own + ["--out", str(split), "--stop-after", "3"], tmp_path)
    assert first.returncode == 0 and "stopped at step 3" in first.stdout, first.stderr
    # Only the folder: model size, data, schedule and seed come from the checkpoint.
    again = run(["--out", str(split), "--resume", "--no-progress"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "saved by 1 rank," in again.stdout
    assert losses(split) == losses(full)
    # A setting given again must agree with the checkpoint's.
    r = run(["--out", str(split), "--resume", "--lr", "0.001"], tmp_path)
    assert r.returncode == 2 and "--lr 0.001: the run in" in r.stderr and "was trained with --lr 0.004" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    ok = run(["--out", str(split), "--resume", "--lr", "0.004", "--block-size", "16", "--steps", "8"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_a_log_file_gets_plain_lines_and_the_final_validation_loss(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    log = tmp_path / "log.txt"
    with open(log, "w") as f:  # stdout and stderr a file, not a terminal: no progress bar
        import subprocess

        r = subprocess.run([sys.executable, "-m", "helios.train", "--config", "nano", "--steps", "20", "--data", corpus,
                            "--eval-every", "10", "--sample-tokens", "0", "--out", str(out),
                            "--trace", str(tmp_path / "t.json")],
                           stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, HELIOS_CACHE_DIR=str(tmp_path)),
                           timeout=600)
    assert r.returncode == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "\r" not in text
    lines = text.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert steps[:2] == [s for s in steps if s.startswith(("step 10/20", "step 20/20"))][:2]
    assert "trace written to " + str(tmp_path / "t.json") in lines  # on a line of its own
    assert any(ln.startswith("--trace without --profile-steps: profiling steps 10:15") for ln in lines)
    final = [ln for ln in steps if ln.endswith("(final)")]
    assert len(final) == 1 and " val " in final[0]
    con = sqlite3.connect(out / "run.db")
    vals = con.execute("SELECT step FROM step_timing WHERE val_loss IS NOT NULL ORDER BY step").fetchall()
    con.close()
    assert vals == [(10,), (20,)]
    from helios.profile.report import render
    from helios.profile.rundb import read_run

    html = render(read_run(str(out)))
    assert "validation" in html and "last validation loss" in html


def test_help_lists_every_flag_with_a_help_text_under_its_topic():
    from helios.train import build_parser

    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert [a.option_strings[0] for a in flags if not a.help] == []
    # Every flag sits in a topic group (model, data, ...), none in argparse's catch-all "options".
    grouped = {a.dest for g in parser._action_groups[2:] for a in g._group_actions}
    assert [a.option_strings[0] for a in flags if a.dest not in grouped] == []
    text = parser.format_help()
    for title in ("model:", "data:", "optimization:", "device and parallelism:", "profiling:"):
        assert "\n" + title in text
