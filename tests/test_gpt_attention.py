"""The GPT's attention kinds (dense T x T scores, the flash kernel, auto) give the same model:
the same loss and gradients, training that learns, and helios-train runs that agree."""

import json
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

import helios as hl
from helios.nn import GPT, GPTConfig
from helios.nn.modules import FLASH_MIN_TRAIN_T
from helios.optim import AdamW

pytestmark = pytest.mark.vulkan


def _model(attention: str, dropout: float = 0.0, block_size: int = 24) -> GPT:
    # head dim 32: one of the flash kernel's compiled head dims
    cfg = GPTConfig(vocab_size=41, block_size=block_size, n_layer=2, n_head=2, n_embd=64, dropout=dropout,
                    attention=attention)
    return GPT(cfg, seed=7)


def _batch(T: int = 23):
    rng = np.random.default_rng(1)
    return rng.integers(0, 41, (3, T)), rng.integers(0, 41, (3, T))


def _loss_and_grads(model: GPT, x, y):
    _, loss = model(x, y)
    loss.backward()
    return float(loss.item()), {n: p.grad.numpy() for n, p in model.named_parameters()}


def test_flash_and_dense_gpts_give_the_same_loss_and_gradients():
    x, y = _batch()  # T = 23: a ragged last tile
    lf, gf = _loss_and_grads(_model("flash"), x, y)
    ld, gd = _loss_and_grads(_model("dense"), x, y)
    assert abs(lf - ld) <= 1e-5 * abs(ld)
    for n in gd:
        scale = np.abs(gd[n]).max() + 1e-12
        assert np.abs(gf[n] - gd[n]).max() <= 1e-4 * scale, n


def _train_steps(model: GPT, x, y, steps: int) -> list[float]:
    """The losses of ``steps`` AdamW steps on one batch."""
    opt = AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


def test_a_flash_gpt_learns():
    x, y = _batch()
    losses = _train_steps(_model("flash"), x, y, 15)
    assert losses[-1] < 0.7 * losses[0]


def _q(T: int):
    """A [1, 2, T, 32] query: what the attention's flash choice looks at (its length, dtype, head dim)."""
    return hl.zeros((1, 2, T, 32))


def test_auto_takes_flash_only_where_it_is_faster():
    attn = _model("auto").h[0].attn
    assert not attn._flash(_q(64)) and attn._flash(_q(FLASH_MIN_TRAIN_T))  # training: by context length
    with hl.no_grad():
        assert attn._flash(_q(64))  # the forward alone is faster with flash at every length
    assert not _model("dense").h[0].attn._flash(_q(4096))
    dropped = _model("flash", dropout=0.1).h[0].attn
    assert not dropped._flash(_q(64))  # attention dropout needs the dense weights
    dropped.eval()
    assert dropped._flash(_q(64))


def test_an_unknown_attention_kind_is_refused():
    with pytest.raises(ValueError, match="attention must be one of"):
        _model("sparse")
    for spec, needle in (("block_sparse:", "attention must be one of"), ("block_sparse:local=0", "KEY=N"),
                         ("block_sparse:width=64", "KEY=N"), ("block_sparse:block=64", "at least one pattern"),
                         ("block_sparse:local=128,block=96", "multiple of 64"),
                         ("block_sparse:local=32", "under the block size"),
                         ("dilated:segments=8/16,dilations=2/4", "dilation 1"),
                         ("dilated:segments=8,dilations=1/2", "as many of each"),
                         ("dilated:segments=8/x,dilations=1/2", "positive integers")):
        with pytest.raises(ValueError, match=needle):
            _model(spec)


def test_a_dilated_gpt_equals_dense_with_one_whole_segment_and_learns():
    x, y = _batch()
    whole = _loss_and_grads(_model("dilated:segments=24,dilations=1"), x, y)[0]  # (w >= T, r = 1): full attention
    dense = _loss_and_grads(_model("dense"), x, y)[0]
    assert abs(whole - dense) <= 1e-5 * dense
    model = _model("dilated:segments=8/16,dilations=1/2")
    losses = _train_steps(model, x, y, 8)
    assert losses[-1] < 0.85 * losses[0], losses


def test_a_block_sparse_gpt_equals_dense_where_the_pattern_covers_everything_and_learns():
    x, y = _batch(130)  # three blocks of 64, the last one ragged
    everything = _loss_and_grads(_model("block_sparse:local=192", block_size=130), x, y)[0]
    dense = _loss_and_grads(_model("dense", block_size=130), x, y)[0]
    assert abs(everything - dense) <= 1e-5 * dense
    model = _model("block_sparse:local=64,global=64", block_size=130)  # the diagonal block and the first one
    losses = _train_steps(model, x, y, 8)
    assert losses[-1] < 0.85 * losses[0], losses


# ---------------------------------------------------------------------------- helios-train
def _train(args, tmp_path):
    env = dict(os.environ, HELIOS_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "helios.train", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _losses(run_dir) -> dict:
    con = sqlite3.connect(os.path.join(run_dir, "run.db"))
    try:
        return dict(con.execute("SELECT step, loss FROM step_timing ORDER BY run_id, step").fetchall())
    finally:
        con.close()


def test_helios_train_attention_flag(tmp_path):
    data = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    data.write_text("\n".join(" ".join(rng.choice(["def", "self", "return", "value"], 6)) for _ in range(400)))
    base = ["--config", "tiny", "--batch-size", "2", "--block-size", "32", "--steps", "3", "--eval-every", "0",
            "--sample-tokens", "0", "--no-progress", "--ckpt-every", "0", "--data", str(data)]
    runs = {}
    for kind in ("flash", "dense", "block_sparse:local=64,global=64"):  # (one block of 64 holds every token)
        r = _train(base + ["--attention", kind, "--out", str(tmp_path / kind)], tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[kind] = _losses(tmp_path / kind)
        assert json.loads(r.stdout.strip().splitlines()[-1])["final_val_loss"] > 0
    assert sorted(runs["flash"]) == [1, 2, 3]
    for s in (1, 2, 3):
        for other in ("dense", "block_sparse:local=64,global=64"):
            assert abs(runs["flash"][s] - runs[other][s]) <= 1e-4 * runs[other][s], (s, runs)
    # The kernel changes no weight: a run resumes with the other kind.
    split = str(tmp_path / "split")
    r = _train(base + ["--attention", "flash", "--stop-after", "1", "--out", split], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _train(base + ["--attention", "dense", "--resume", "--out", split], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = _losses(split)
    assert sorted(resumed) == [1, 2, 3] and resumed[1] == runs["flash"][1]
    assert abs(resumed[3] - runs["flash"][3]) <= 1e-4 * runs["flash"][3]
    bad = _train(base + ["--attention", "sparse", "--out", str(tmp_path / "bad")], tmp_path)
    assert bad.returncode == 2 and "--attention" in bad.stderr and "Traceback" not in bad.stderr


def test_the_binding_check_counts_scores_only_on_the_dense_path(capsys):
    from helios.train_settings import check_fits

    limit = 128 << 20  # lavapipe's maxStorageBufferRange
    check_fits(limit, 16, 1024, 4, 128, 256, dense_attention=False)  # the tiny model at 1024 tokens, flash
    with pytest.raises(SystemExit):
        check_fits(limit, 16, 1024, 4, 128, 256, dense_attention=True)  # 16 x 4 x 1024^2 x 4 bytes = 256 MiB
    assert "attention scores" in capsys.readouterr().err
