"""helios-train end to end: learning, bit-exact resume, Ctrl-C, corrupt checkpoints."""

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.vulkan

TRAIN = [sys.executable, "-m", "helios.train"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small deterministic corpus with learnable structure (words from a fixed list)."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "self", "value", "print"]
    lines = [" ".join(rng.choice(words, size=rng.integers(3, 10))) for _ in range(3000)]
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text("\n".join(lines))
    return str(path)


def run(args, cache, **kw):
    env = dict(os.environ, HELIOS_CACHE_DIR=str(cache))
    return subprocess.run(TRAIN + args, capture_output=True, text=True, env=env, timeout=600, **kw)


def losses(run_dir):
    """step -> loss from the run database ({} while the trainer is still creating it)."""
    con = sqlite3.connect(os.path.join(run_dir, "run.db"))
    try:
        rows = con.execute("SELECT step, loss FROM step_timing ORDER BY run_id, step").fetchall()
    except sqlite3.OperationalError:  # schema not created yet
        rows = []
    finally:
        con.close()
    return dict(rows)  # a resumed run's steps replace nothing: steps are unique across its runs


BASE = ["--config", "nano", "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--ckpt-every", "0"]


def test_short_run_learns(corpus, tmp_path):
    # Measured on this corpus: the unigram entropy is 2.74 nats and 60 steps of the nano
    # model reach a validation loss of about 2.44; 2.6 leaves room for noise while still
    # proving the model learned more than letter frequencies.
    r = run(BASE + ["--steps", "60", "--data", corpus, "--out", str(tmp_path / "a")], tmp_path)
    assert r.returncode == 0, r.stderr
    import json

    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["final_val_loss"] < 2.6 < summary["unigram_entropy"], summary
    assert "step time breakdown" in r.stdout


def test_resume_is_bit_exact(corpus, tmp_path):
    args = BASE + ["--steps", "8", "--data", corpus, "--seed", "5"]
    full = run(args + ["--out", str(tmp_path / "full")], tmp_path)
    assert full.returncode == 0, full.stderr
    first = run(args + ["--out", str(tmp_path / "split"), "--stop-after", "3"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "stopped at step 3" in first.stdout
    second = run(args + ["--out", str(tmp_path / "split"), "--resume"], tmp_path)
    assert second.returncode == 0, second.stderr
    a, b = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert [a[s] for s in range(1, 9)] == [b[s] for s in range(1, 9)]  # exact float equality


def test_corrupt_checkpoint_is_refused_and_left_untouched(corpus, tmp_path):
    out = tmp_path / "c"
    r = run(BASE + ["--steps", "2", "--data", corpus, "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr
    ck = out / "ckpt" / "step-00000002" / "shard-00000-of-00001.helios"
    data = bytearray(ck.read_bytes())
    data[len(data) // 2] ^= 0x40
    ck.write_bytes(bytes(data))
    before = hashlib.sha256(ck.read_bytes()).hexdigest()
    r = run(BASE + ["--steps", "4", "--data", corpus, "--out", str(out), "--resume"], tmp_path)
    assert r.returncode == 1
    # The damaged shard is named (a warning), nothing complete is left to resume from, and the file is untouched.
    assert "shard-00000-of-00001.helios" in r.stderr and "CheckpointError" in r.stderr and "Traceback" not in r.stderr
    assert hashlib.sha256(ck.read_bytes()).hexdigest() == before


def test_ctrl_c_finishes_step_saves_and_exits_130(corpus, tmp_path):
    out = tmp_path / "i"
    env = dict(os.environ, HELIOS_CACHE_DIR=str(tmp_path))
    p = subprocess.Popen(TRAIN + BASE + ["--steps", "100000", "--data", corpus, "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if (out / "run.db").exists() and len(losses(out)) >= 2:
                break
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, stderr
    saved_step = int(stdout.split("stopped at step ")[1].split(";")[0])
    assert saved_step == max(losses(out))
    assert (out / "ckpt" / f"step-{saved_step:08d}" / "metadata.json").exists()


def test_run_database_survives_sigkill_of_training(corpus, tmp_path):
    out = tmp_path / "k"
    env = dict(os.environ, HELIOS_CACHE_DIR=str(tmp_path))
    p = subprocess.Popen(TRAIN + BASE + ["--steps", "100000", "--data", corpus, "--out", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not ((out / "run.db").exists() and len(losses(out)) >= 3):
            time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        p.kill()
    con = sqlite3.connect(out / "run.db")
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    steps = [s for (s,) in con.execute("SELECT step FROM step_timing ORDER BY step")]
    assert len(steps) >= 3 and steps == list(range(1, len(steps) + 1))
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "running"


@pytest.mark.parametrize("bad,needle", [(["--data", "/nonexistent/corpus.txt"], "--data"),
                                        (["--batch-size", "0"], "--batch-size must be at least 1"),
                                        (["--block-size", "1"], "--block-size must be at least 2"),
                                        (["--comm-timeout", "0"], "--comm-timeout")])
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path, bad, needle):
    r = run(BASE + ["--steps", "1", "--out", str(tmp_path / "x"), *bad], tmp_path)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_single_file_checkpoint_of_an_earlier_helios_still_resumes_bit_exactly(corpus, tmp_path):
    import shutil

    from helios.fileio import save_checkpoint
    from helios.schedule import checkpoint as C

    args = BASE + ["--steps", "6", "--data", corpus, "--seed", "3"]
    assert run(args + ["--out", str(tmp_path / "full")], tmp_path).returncode == 0
    out = tmp_path / "old"
    assert run(args + ["--out", str(out), "--stop-after", "3"], tmp_path).returncode == 0
    # Rewrite the step-3 checkpoint in the earlier single-file layout (ckpt.helios), then drop ckpt/.
    _, d = C.latest_complete(str(out))
    shapes = C.global_shapes(d)
    arrays, meta = C.load(d, {n: (0, int(np.prod(s))) for n, (s, _) in shapes.items()})
    names = [n[len("model."):] for n in shapes if n.startswith("model.")]
    from helios.nn import GPT, GPTConfig

    order = [n for n, _ in GPT(GPTConfig(**meta["config"])).named_parameters()]  # registration order
    assert sorted(order) == sorted(names)
    # AdamW's two groups, as helios-train makes them: matrices (decayed), then the rest.
    groups = [[n for n in order if len(shapes[f"model.{n}"][0]) >= 2],
              [n for n in order if len(shapes[f"model.{n}"][0]) < 2]]
    old = {f"model.{n}": arrays[f"model.{n}"].reshape(shapes[f"model.{n}"][0]) for n in order}
    for gi, group in enumerate(groups):
        for pi, n in enumerate(group):
            for m in ("exp_avg", "exp_avg_sq"):
                old[f"optim.{gi}.{pi}.{m}"] = arrays[f"optim.{m}.{n}"].reshape(shapes[f"model.{n}"][0])
    save_checkpoint(out / "ckpt.helios", old, {k: meta[k] for k in ("config", "train", "data", "step", "optimizer",
                                                                     "rng", "loader")})
    shutil.rmtree(out / "ckpt")
    r = run(args + ["--out", str(out), "--resume"], tmp_path)
    assert r.returncode == 0 and "resumed from" in r.stdout and "ckpt.helios" in r.stdout, r.stderr[-2000:]
    a, b = losses(tmp_path / "full"), losses(out)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # exact float equality
