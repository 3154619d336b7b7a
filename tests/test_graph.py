"""hl.graph: a captured step replayed gives what running the step again gives, and what a replay
could not repeat is refused while capturing."""

import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

import helios as hl
import helios.functional as F
from helios import nn
from helios.graph import GraphCaptureError
from helios.nn import GPT, GPTConfig
from helios.optim import SGD, AdamW, clip_grad_norm_, cosine_lr
from helios.runtime import get_runtime

pytestmark = pytest.mark.vulkan

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
B = 4


def _batches(n, seed=0, cfg=CFG):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, cfg.vocab_size, (B, cfg.block_size)), rng.integers(0, cfg.vocab_size, (B, cfg.block_size)))
            for _ in range(n)]


def _train_gpt(batches, replay: bool, autocast=None, cfg=CFG):
    """Losses and final parameters of len(batches) AdamW steps (cosine learning rate, clipping):
    every step through Python, or the first captured and the others replayed."""
    model = GPT(cfg, seed=3)
    opt = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    x, y = hl.tensor(batches[0][0]), hl.tensor(batches[0][1])

    def step(i):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(i, 1e-2, 3, len(batches))
        with hl.autocast(autocast or "bfloat16", enabled=autocast is not None):
            _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    if replay:
        with hl.graph.capture(inputs=(x, y)) as g:
            loss = step(0)
        losses.append(loss.item())
        for i, (xb, yb) in enumerate(batches[1:], 1):
            for group in opt.param_groups:
                group["lr"] = cosine_lr(i, 1e-2, 3, len(batches))
            g.replay(xb, yb)
            losses.append(loss.item())
        assert g.replays == len(batches) - 1
    else:
        for i, (xb, yb) in enumerate(batches):
            if i:
                x.copy_(hl.tensor(xb))
                y.copy_(hl.tensor(yb))
            losses.append(step(i).item())
    return losses, {n: p.numpy() for n, p in model.named_parameters()}, opt.step_count


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_gpt_replay_equals_running_the_step_for_20_steps(autocast):
    batches = _batches(20)
    eager, p_eager, n_eager = _train_gpt(batches, replay=False, autocast=autocast)
    replayed, p_replay, n_replay = _train_gpt(batches, replay=True, autocast=autocast)
    assert replayed == eager  # bit for bit: the same commands on the same bytes
    assert n_replay == n_eager == 20
    for name in p_eager:
        np.testing.assert_array_equal(p_replay[name], p_eager[name], err_msg=name)
    assert len(set(eager)) > 10  # the batches differ: the replays saw their own inputs


def test_gpt_replay_on_the_emulated_cuda_device_equals_running_the_step(emulated_cuda):
    # CudaRuntime replays through launches prepared once per command list; AdamW's step count is
    # a dynamic push constant, so its commands are prepared again each replay.
    from helios.runtime import set_device

    set_device("cuda:0")
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)  # small: the emulator is slow
    batches = _batches(3, cfg=cfg)
    eager, p_eager, _ = _train_gpt(batches, replay=False, cfg=cfg)
    replayed, p_replay, _ = _train_gpt(batches, replay=True, cfg=cfg)
    assert replayed == eager
    for name in p_eager:
        np.testing.assert_array_equal(p_replay[name], p_eager[name], err_msg=name)
    assert get_runtime()._prepared  # the replays went through the prepared launches


def test_replay_issues_the_captured_commands_only():
    rt = get_runtime()
    x = hl.tensor(np.arange(8, dtype=np.float32))
    with hl.graph.capture(inputs=(x,)) as g:
        y = (x * 2.0 + 1.0).sum()
    n = len(g.ops)
    d0 = rt.stats()["dispatches"]
    g.replay(np.ones(8, np.float32))
    assert rt.stats()["dispatches"] - d0 == n
    assert y.item() == 24.0
    assert "1 replays" in repr(g)


def test_a_read_back_inside_the_capture_is_refused():
    x = hl.tensor(np.ones(4, np.float32))
    with pytest.raises(GraphCaptureError, match="read-back to the host"):
        with hl.graph.capture(inputs=(x,)) as g:
            (x + 1.0).sum().item()
    with pytest.raises(GraphCaptureError, match="failed"):
        g.replay()
    assert "free" not in vars(get_runtime())  # nothing held any more: the runtime's own free again


def test_uploading_user_data_inside_the_capture_is_refused():
    x = hl.tensor(np.ones(4, np.float32))
    with pytest.raises(GraphCaptureError, match="capture\\(inputs=...\\)"):
        with hl.graph.capture(inputs=(x,)):
            x + hl.tensor(np.ones(4, np.float32))
    with pytest.raises(GraphCaptureError, match="capture\\(inputs=...\\)"):
        with hl.graph.capture():
            x.copy_(hl.tensor(np.zeros(4, np.float32), device="cpu"))


def test_random_numbers_inside_the_capture_are_refused():
    x = hl.tensor(np.ones((4, 4), np.float32))
    with pytest.raises(GraphCaptureError, match="random numbers"):
        with hl.graph.capture(inputs=(x,)):
            F.dropout(x, 0.5, training=True)


def test_captures_do_not_nest():
    with hl.graph.capture():
        with pytest.raises(GraphCaptureError, match="do not nest"):
            with hl.graph.capture():
                pass


def test_replay_refuses_other_shapes_dtypes_and_counts():
    x = hl.tensor(np.ones((2, 3), np.float32))
    with hl.graph.capture(inputs=(x,)) as g:
        x * 3.0
    with pytest.raises(hl.ShapeError, match="captured for \\(2, 3\\)"):
        g.replay(np.ones((3, 2), np.float32))
    with pytest.raises(GraphCaptureError, match="got 2 inputs"):
        g.replay(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))
    with pytest.raises(GraphCaptureError, match="int64 array"):
        g.replay(np.ones((2, 3), np.int64))
    g.release()
    with pytest.raises(GraphCaptureError, match="released"):
        g.replay()


def test_the_graph_holds_memory_its_owners_dropped_and_release_gives_it_back():
    rt = get_runtime()

    def f(x):
        return ((x * 2.0).exp() * 0.0 + x).sum()  # temporaries freed inside the capture

    f(hl.tensor(np.ones(1024, np.float32))).item()  # the op's cached scalar constants exist from here on
    rt.synchronize()
    before = rt.pool_stats()["activations"]["in_use_bytes"]
    x = hl.tensor(np.arange(1024, dtype=np.float32))
    with hl.graph.capture(inputs=(x,)) as g:
        out = f(x)
    kept = out  # the output stays the user's
    del x  # the input's owner drops it: the graph keeps its bytes
    junk = [hl.tensor(np.full(1024, 7.0, np.float32)) for _ in range(8)]  # would reuse freed ranges
    g.replay(np.ones(1024, np.float32))
    assert kept.item() == 1024.0
    del junk, kept, out
    g.release()
    rt.synchronize()
    hl.tensor(np.zeros(1, np.float32)).numpy()  # an alloc reclaims the finished frees
    assert rt.pool_stats()["activations"]["in_use_bytes"] <= before + 256


def test_sgd_refuses_a_learning_rate_it_baked_in():
    lin = nn.Linear(4, 2)
    opt = SGD(lin.parameters(), lr=0.1, momentum=0.0)
    x = hl.tensor(np.ones((3, 4), np.float32))
    with hl.graph.capture(inputs=(x,)) as g:
        lin(x).sum().backward()
        opt.step()
        opt.zero_grad()
    g.replay()
    assert opt.step_count == 2
    opt.param_groups[0]["lr"] = 0.05
    with pytest.raises(GraphCaptureError, match="SGD's \\(lr, momentum, weight_decay\\) changed"):
        g.replay()


def test_cross_entropy_refuses_a_replay_with_another_count_of_targets():
    logits = hl.tensor(np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32))
    t = hl.tensor(np.array([1, 2, 3, 4, 1, 2]))
    with hl.graph.capture(inputs=(t,)) as g:
        loss = F.cross_entropy(logits, t, ignore_index=0)
    g.replay(np.array([4, 3, 2, 1, 4, 3]))
    want = F.cross_entropy(logits, hl.tensor(np.array([4, 3, 2, 1, 4, 3])), ignore_index=0).item()
    assert loss.item() == want
    with pytest.raises(GraphCaptureError, match="counts 5 valid targets"):
        g.replay(np.array([0, 3, 2, 1, 4, 3]))
    with pytest.raises(IndexError, match="target 9 is out of range"):
        g.replay(np.array([9, 3, 2, 1, 4, 3]))


def test_embedding_indices_computed_inside_the_step_are_refused():
    w = hl.tensor(np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32), requires_grad=True)
    scores = hl.tensor(np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32))
    with pytest.raises(GraphCaptureError, match="embedding backward"):
        with hl.graph.capture(inputs=(scores,)):
            idx = F.argmax(scores, dim=1)
            F.embedding(idx, w).sum().backward()


TRAIN = [sys.executable, "-m", "helios.train", "--config", "nano", "--steps", "12", "--eval-every", "4",
         "--sample-tokens", "0", "--no-progress", "--ckpt-every", "0", "--block-size", "16", "--batch-size", "4"]


def _run_losses(tmp_path, name, extra):
    out = tmp_path / name
    env = dict(os.environ, HELIOS_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run(TRAIN + ["--out", str(out)] + extra, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    con = sqlite3.connect(out / "run.db")
    rows = con.execute("SELECT step, loss, val_loss, replay_ns FROM step_timing ORDER BY step").fetchall()
    con.close()
    return r.stdout, rows


@pytest.mark.parametrize("extra", [[], ["--grad-accum", "2", "--microbatches", "2"]], ids=["one", "accumulated"])
def test_helios_train_replays_by_default_with_the_losses_of_running_every_step(tmp_path, extra):
    out, captured = _run_losses(tmp_path, "captured", extra)
    assert "graph capture: on" in out
    out_plain, plain = _run_losses(tmp_path, "plain", extra + ["--no-capture"])
    assert "graph capture" not in out_plain
    assert [r[:3] for r in captured] == [r[:3] for r in plain]  # train and validation losses, bit for bit
    assert all(r[3] > 0 for r in captured[1:]) and captured[0][3] == 0  # step 1 captured, the rest replayed
    assert all(r[3] == 0 for r in plain)


def test_capture_and_replay_on_the_emulated_cuda_device():
    code = ("import numpy as np, helios as hl\n"
            "x = hl.tensor(np.arange(8, dtype=np.float32))\n"
            "with hl.graph.capture(inputs=(x,)) as g:\n"
            "    y = (x * 2.0 + 1.0).sum()\n"
            "first = y.item()\n"
            "g.replay(np.ones(8, np.float32))\n"
            "print(hl.current_device(), first, y.item())\n")
    env = dict(os.environ, HELIOS_CUDA_DEVICE="emulator", HELIOS_DEVICE="cuda:0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cuda:0", "64.0", "24.0"]


def test_helios_train_goes_on_without_capture_when_a_capture_is_refused(tmp_path, monkeypatch, capsys):
    from helios import train
    from helios.graph import Graph

    def refuse(self, *args):
        raise GraphCaptureError("hl.graph.capture: refused for the test")

    monkeypatch.setenv("HELIOS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(Graph, "_dispatch", refuse)
    args = TRAIN[3:] + ["--out", str(tmp_path / "refused")]
    assert train.main(args) == 0
    assert "graph capture refused, training without it: hl.graph.capture: refused for the test" in capsys.readouterr().out
    monkeypatch.undo()
    _, plain = _run_losses(tmp_path, "plain", ["--no-capture"])
    con = sqlite3.connect(tmp_path / "refused" / "run.db")
    refused = con.execute("SELECT step, loss, val_loss, replay_ns FROM step_timing ORDER BY step").fetchall()
    con.close()
    assert refused == plain  # the refused step ran again on the same batch: nothing skipped, nothing replayed


def test_a_tensor_made_before_the_capture_and_freed_inside_it_stays_for_the_replays():
    """A captured step may drop a tensor that existed before it (zero_grad dropping an eager step's
    gradients, a temporary): its bytes stay with the graph, which the replays still read."""
    import gc

    x = hl.tensor(np.arange(8, dtype=np.float32))
    keep = x * 1  # touched before the capture only through x's own storage
    with hl.graph.capture() as g:
        y = x * 2
        del x
        gc.collect()
    g.replay()
    np.testing.assert_array_equal(y.numpy(), keep.numpy() * 2)
    for _ in range(3):  # the freed storage was not handed out to new tensors in between
        hl.tensor(np.full(8, 7.0, np.float32)) * 3
    g.replay()
    np.testing.assert_array_equal(y.numpy(), keep.numpy() * 2)
