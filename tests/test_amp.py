"""Mixed precision: hl.autocast against PyTorch's autocast on CPU (the GPT's loss, logits and
every gradient within bfloat16 / float16 tolerance), the op lists, the nesting rules, and
hl.amp.GradScaler (an injected inf skips the step and backs the scale off; the run recovers;
the scale schedule equals torch.amp.GradScaler's)."""

from __future__ import annotations

import math
import os
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import helios as hl
import helios.functional as F
from helios.nn import GPT, GPTConfig
from helios.optim import AdamW, clip_grad_norm_

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.vulkan

TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_gpt(params: dict, cfg: GPTConfig, x, y):
    """helios.nn.GPT's forward (the dense attention path it trains with) in PyTorch, through
    TF.linear as Helios' Linear does: under autocast a fused linear rounds once where
    test_gpt_parity's ``@`` + bias transcription would round twice."""
    B, T = x.shape
    C, H = cfg.n_embd, cfg.n_head
    h = params["wte.weight"][x] + params["wpe.weight"][torch.arange(T)]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg.n_layer):
        p = lambda n: params[f"h.{i}.{n}"]  # noqa: E731
        a = TF.layer_norm(h, (C,), p("ln_1.weight"), p("ln_1.bias"))
        qkv = TF.linear(a, p("attn.c_attn.weight"), p("attn.c_attn.bias"))
        q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
        att = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        yy = torch.matmul(att, v).transpose(1, 2).reshape(B, T, C)
        h = h + TF.linear(yy, p("attn.c_proj.weight"), p("attn.c_proj.bias"))
        m = TF.layer_norm(h, (C,), p("ln_2.weight"), p("ln_2.bias"))
        m = TF.gelu(TF.linear(m, p("mlp.c_fc.weight"), p("mlp.c_fc.bias")), approximate="tanh")
        h = h + TF.linear(m, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"))
    h = TF.layer_norm(h, (C,), params["ln_f.weight"], params["ln_f.bias"])
    logits = torch.matmul(h, params["wte.weight"].T)
    return logits, TF.cross_entropy(logits.reshape(B * T, -1), y.reshape(-1))


def rel(a, b) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_gpt_forward_backward_matches_pytorch_autocast(low):
    cfg = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=64)
    model = GPT(cfg, seed=4)
    rng = np.random.default_rng(1)
    x = rng.integers(0, cfg.vocab_size, (3, 16))
    y = rng.integers(0, cfg.vocab_size, (3, 16))
    with hl.autocast(low):
        logits, loss = model(x, y)
    loss.backward()
    # The matmuls ran in the low dtype, the loss in float32; the master weights are float32
    # and so are all their gradients.
    assert logits.dtype is getattr(hl, low) and loss.dtype is hl.float32
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(p.dtype is hl.float32 and grads[n].dtype is hl.float32 for n, p in model.named_parameters())

    tp = {n: torch.tensor(p.numpy(), requires_grad=True) for n, p in model.named_parameters()}
    xt, yt = torch.tensor(x), torch.tensor(y)
    with torch.autocast("cpu", dtype=TORCH_DTYPE[low]):
        t_logits, t_loss = torch_gpt(tp, cfg, xt, yt)
    t_loss.backward()
    assert t_logits.dtype is TORCH_DTYPE[low]
    # The float32 reference shows how far the low dtype itself moves the results: Helios must
    # be as close to PyTorch's autocast as a 16-bit rounding, and each of them far from exact.
    ref = {n: torch.tensor(p.numpy(), requires_grad=True) for n, p in model.named_parameters()}
    f_logits, f_loss = torch_gpt(ref, cfg, xt, yt)
    f_loss.backward()

    eps = 2.0 ** -8 if low == "bfloat16" else 2.0 ** -11  # unit roundoff of the dtype
    assert abs(loss.item() - t_loss.item()) <= 4 * eps * abs(t_loss.item())
    assert rel(logits.float().numpy(), t_logits.float().detach().numpy()) <= 3 * eps
    for n in tp:
        g, tg = grads[n].numpy(), tp[n].grad.numpy()
        assert rel(g, tg) <= 6 * eps, (n, rel(g, tg))
    # Helios's low-precision result is not the float32 one in disguise.
    assert rel(logits.float().numpy(), f_logits.detach().numpy()) > eps / 16


def test_op_lists_follow_pytorch_cuda_autocast():
    a = hl.randn(8, 16, seed=0)
    b = hl.randn(16, 32, seed=1)
    bias = hl.randn(32, seed=2)
    with hl.autocast("bfloat16"):
        assert F.matmul(a, b).dtype is hl.bfloat16
        assert F.linear(a, F.transpose(b, 0, 1), bias).dtype is hl.bfloat16
        assert hl.bmm(a.reshape(2, 4, 16), hl.randn(2, 16, 8, seed=4)).dtype is hl.bfloat16
        assert hl.baddbmm(hl.zeros(2, 4, 4), a.reshape(2, 4, 16), F.transpose(a.reshape(2, 4, 16), 1, 2)).dtype \
            is hl.bfloat16
        assert hl.addmm(hl.zeros(8, 32), a, b).dtype is hl.bfloat16
        q = hl.randn(1, 2, 8, 32, seed=3)
        assert F.scaled_dot_product_attention(q, q, q, is_causal=True).dtype is hl.bfloat16
        s = F.matmul(a, b)  # bfloat16
        for out in (F.softmax(s, -1), F.log_softmax(s, -1), F.attention_softmax(s[:, :8], 0.5, causal=True),
                    F.layer_norm(s, (32,)), F.sum(s), F.norm(s), F.rms_norm(s, (32,)),
                    F.cross_entropy(s, hl.tensor(np.zeros(8, np.int64)))):
            assert out.dtype is hl.float32
        assert (s + hl.zeros(8, 32)).dtype is hl.float32  # other ops: ordinary promotion
        assert F.gelu(s).dtype is hl.bfloat16
        assert F.softmax(s, -1, dtype=hl.bfloat16).dtype is hl.bfloat16  # an explicit dtype stands
    assert F.matmul(a, b).dtype is hl.float32  # outside: nothing changes


def test_autocast_nests_decorates_and_is_per_thread():
    a = hl.randn(4, 4, seed=0)
    with hl.autocast("bfloat16"):
        with hl.autocast(enabled=False):
            assert F.matmul(a, a).dtype is hl.float32
        with hl.autocast("float16"):
            assert F.matmul(a, a).dtype is hl.float16
        assert F.matmul(a, a).dtype is hl.bfloat16
        seen = []
        t = threading.Thread(target=lambda: seen.append(hl.amp.is_autocast_enabled()))
        t.start()
        t.join()
        assert seen == [False]
    assert not hl.amp.is_autocast_enabled() and hl.amp.get_autocast_dtype() is None

    @hl.autocast("fp16")
    def f(x):
        return F.matmul(x, x)

    assert f(a).dtype is hl.float16 and F.matmul(a, a).dtype is hl.float32
    assert hl.autocast(torch.bfloat16).dtype is hl.bfloat16
    with pytest.raises(ValueError, match="autocast: dtype must be bfloat16 or float16, got 'int8'"):
        hl.autocast("int8")


def test_backward_inside_the_context_keeps_float32_gradients():
    w = hl.randn(16, 16, seed=0).requires_grad_()
    x = hl.randn(4, 16, seed=1)
    with hl.autocast("bfloat16"):
        y = F.linear(x, w)
        F.sum(y * y).backward()  # the backward ops are not cast
    assert w.grad.dtype is hl.float32
    wt = torch.tensor(w.numpy(), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yt = TF.linear(torch.tensor(x.numpy()), wt)
        (yt * yt).sum().backward()
    assert rel(w.grad.numpy(), wt.grad.numpy()) < 2 ** -6


def _tiny():
    cfg = GPTConfig(vocab_size=29, block_size=8, n_layer=1, n_head=2, n_embd=32)
    model = GPT(cfg, seed=2)
    rng = np.random.default_rng(3)
    x = rng.integers(0, cfg.vocab_size, (4, 8))
    return model, x, np.roll(x, -1, 1)


def test_grad_scaler_skips_a_step_with_an_injected_inf_and_recovers():
    model, x, y = _tiny()
    opt = AdamW(model.parameters(), lr=1e-2)
    scaler = hl.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=2)
    params = list(model.parameters())
    history = []
    for step in range(5):
        with hl.autocast("float16"):
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        if step == 1:  # an overflow in one gradient, as a too-large scale makes
            g = params[3].grad
            F.copy_(g, F.where(hl.tensor(np.arange(g.numel()).reshape(g.shape) == 0), math.inf, g))
        before = [p.numpy().copy() for p in params]
        scaler.unscale_(opt)
        clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not np.array_equal(b, p.numpy()) for b, p in zip(before, params))
        history.append((scaler.last_step_skipped, changed, scaler.get_scale(), loss.item()))
        assert all(np.isfinite(p.numpy()).all() for p in params)
    skipped, changed, scales, losses = zip(*history)
    assert skipped == (False, True, False, False, False) and scaler.skipped_steps == 1
    assert changed == (True, False, True, True, True)  # the skipped step left every parameter alone
    # 1024 -> grow after 2 good steps... the inf resets the count: 1024, 512, 512, 1024, 1024
    assert scales == (1024.0, 512.0, 512.0, 1024.0, 1024.0)
    assert losses[-1] < losses[0]  # training went on after the skip
    sd = scaler.state_dict()
    again = hl.amp.GradScaler()
    again.load_state_dict(sd)
    assert again.get_scale() == 1024.0 and again.state_dict() == sd


def test_unscale_gives_the_unscaled_gradients():
    model, x, y = _tiny()
    opt = AdamW(model.parameters(), lr=1e-3)
    _, loss = model(x, y)
    loss.backward()
    plain = [p.grad.numpy().copy() for p in model.parameters()]
    opt.zero_grad()
    scaler = hl.amp.GradScaler(init_scale=2.0 ** 12)
    _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    for g, p in zip(plain, model.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), g, rtol=1e-5, atol=1e-9)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)


def test_scale_schedule_equals_torch_grad_scaler():
    # The same sequence of overflowing and clean steps through both scalers.
    pattern = [False, False, True, False, False, False, True, True, False, False, False]
    ours = hl.amp.GradScaler(init_scale=256.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    w = hl.nn.Parameter(hl.zeros(4))
    tw = torch.zeros(4, requires_grad=True)
    opt, topt = AdamW([w], lr=0.1), torch.optim.AdamW([tw], lr=0.1)
    for bad in pattern:
        v = float("inf") if bad else 1.0
        ours.scale(F.sum(w * v)).backward()
        theirs.scale((tw * v).sum()).backward()
        ours.step(opt)
        theirs.step(topt)
        ours.update()
        theirs.update()
        opt.zero_grad()
        topt.zero_grad()
        assert ours.get_scale() == theirs.get_scale()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5)


def test_disabled_scaler_passes_through():
    s = hl.amp.GradScaler(enabled=False)
    t = hl.ones(2)
    assert s.scale(t) is t and s.get_scale() == 1.0 and s.state_dict() == {}
    with pytest.raises(ValueError, match="GradScaler: backoff_factor must be in"):
        hl.amp.GradScaler(backoff_factor=1.5)


# ---- helios-train --dtype ---------------------------------------------------------------------
from test_train import BASE, corpus, losses, run  # noqa: E402, F401  (corpus: a fixture)


def test_train_dtype_flag_is_checked(tmp_path):
    r = run(BASE + ["--steps", "2", "--out", str(tmp_path / "x"), "--dtype", "fp64"], tmp_path)
    assert r.returncode == 2 and "argument --dtype: invalid choice: 'fp64'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_train_fp16_saves_the_scaler_and_resumes_bit_exactly(corpus, tmp_path):  # noqa: F811
    import json

    from helios.profile.mfu import peak_flops
    from helios.runtime import get_runtime
    from helios.train_settings import checkpoint_meta

    own = ["--steps", "6", "--batch-size", "4", "--block-size", "16", "--seed", "2", "--data", corpus, "--dtype", "fp16"]
    full, split = tmp_path / "full", tmp_path / "split"
    r = run(BASE + own + ["--out", str(full)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mixed precision: --dtype fp16, matmuls in float16, float32 master weights, loss scale 65536" in r.stdout
    info = get_runtime().info  # MFU against the fp16 products' peak, not fp32's
    peak = peak_flops(info["name"], "fp16", info["type"])
    assert f"peak for MFU: {peak.label if peak else 'n/a'}" in r.stdout, r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["dtype"] == "fp16" and summary["loss_scale"] == 65536.0 and summary["skipped_steps"] == 0
    first = run(BASE + own + ["--out", str(split), "--stop-after", "3"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    meta = checkpoint_meta(str(split))
    assert meta["grad_scaler"]["scale"] == 65536.0 and meta["grad_scaler"]["_growth_tracker"] == 3
    assert meta["cli"]["dtype"] == "fp16"
    again = run(["--out", str(split), "--resume", "--no-progress"], tmp_path)  # --dtype comes from the checkpoint
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(split) == losses(full)
    r = run(["--out", str(split), "--resume", "--dtype", "bf16"], tmp_path)
    assert r.returncode == 2 and "--dtype bf16: the run in" in r.stderr and "was trained with --dtype fp16" in r.stderr


def test_train_fp16_logs_skipped_steps_and_backs_off(corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    import json

    import helios.train as train

    # A scale far too large: every scaled gradient overflows float16, so each step is skipped,
    # logged, and the scale halves (the run finishes: a skipped step is not a failed run).
    plain = train._mixed_precision

    def too_large(dtype, split=False):
        ctx, _ = plain(dtype, split)
        return ctx, hl.amp.GradScaler(init_scale=2.0 ** 40)

    monkeypatch.setattr(train, "_mixed_precision", too_large)
    monkeypatch.setenv("HELIOS_CACHE_DIR", str(tmp_path))
    rc = train.main(BASE + ["--steps", "3", "--batch-size", "4", "--block-size", "16", "--data", corpus,
                            "--dtype", "fp16", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert rc == 0
    for step, scale in ((1, "5.49756e+11"), (2, "2.74878e+11"), (3, "1.37439e+11")):
        assert f"step {step}: inf/nan in the fp16 gradients, step skipped ({step} so far); loss scale now {scale}" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["skipped_steps"] == 3 and summary["loss_scale"] == 2.0 ** 37
