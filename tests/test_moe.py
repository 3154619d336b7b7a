"""Mixture of experts: the routed layer against a plain loop over experts in PyTorch (float64,
same weights, same routing rules), the load-balancing loss, the dropped-pair count, and
expert parallelism over 2 real ranks against one device holding every expert."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

C_EMBD, E = 16, 4


def _reference(m, x: np.ndarray, upstream: np.ndarray):
    """The MoE layer written as a loop over tokens and experts, in torch float64: output,
    aux loss, dropped pairs and the gradients of sum(output * upstream) + aux."""
    import torch

    def t(a):
        return torch.tensor(np.asarray(a, np.float64), requires_grad=True)

    xs = t(x.reshape(-1, m.n_embd))
    wr, w1, b1, w2, b2 = (t(p.numpy()) for p in (m.router.weight, m.w_fc, m.b_fc, m.w_proj, m.b_proj))
    n, k = xs.shape[0], m.top_k
    cap = m.capacity(n)
    probs = torch.softmax(xs @ wr.T, -1)
    gate, choice = probs.topk(k)
    if k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    used = [0] * m.n_experts
    out = [torch.zeros(m.n_embd, dtype=torch.float64) for _ in range(n)]
    dropped = 0
    for j in range(k):  # every first choice before any second choice
        for i in range(n):
            e = int(choice[i, j])
            if used[e] >= cap:
                dropped += 1
                continue
            used[e] += 1
            h = torch.nn.functional.gelu(xs[i] @ w1[e] + b1[e, 0], approximate="tanh")
            out[i] = out[i] + gate[i, j] * (h @ w2[e] + b2[e, 0])
    y = torch.stack(out)
    f = torch.bincount(choice[:, 0], minlength=m.n_experts).double() / n
    aux = m.aux_alpha * m.n_experts * (f * probs.mean(0)).sum()
    (y * torch.tensor(upstream.reshape(n, -1), dtype=torch.float64)).sum().add(aux).backward()
    grads = {"x": xs.grad, "router": wr.grad, "w_fc": w1.grad, "b_fc": b1.grad, "w_proj": w2.grad, "b_proj": b2.grad}
    return y.detach().numpy(), float(aux.detach()), dropped, {k_: v.numpy() for k_, v in grads.items()}


def _helios_grads(m, x):
    return {"x": x.grad.numpy(), "router": m.router.weight.grad.numpy(), "w_fc": m.w_fc.grad.numpy(),
            "b_fc": m.b_fc.grad.numpy(), "w_proj": m.w_proj.grad.numpy(), "b_proj": m.b_proj.grad.numpy()}


def _close(a, b, what):
    scale = max(float(np.abs(b).max()), 1e-6)
    assert float(np.abs(np.asarray(a, np.float64) - b).max()) / scale < 2e-5, what


@pytest.mark.vulkan
@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 1.25), (2, 0.5), (2, None)])
def test_routed_layer_equals_a_loop_over_experts(top_k, capacity_factor):
    import helios as hl
    from helios.schedule.moe import MoEMLP

    m = MoEMLP(C_EMBD, E, top_k=top_k, capacity_factor=capacity_factor, aux_alpha=0.01, seed=5)
    rng = np.random.default_rng(top_k)
    xn = rng.standard_normal((3, 8, C_EMBD)).astype(np.float32)
    up = rng.standard_normal((3, 8, C_EMBD)).astype(np.float32)
    x = hl.tensor(xn, requires_grad=True)
    y = m(x)
    (y * hl.tensor(up)).sum().add(m.aux_loss).backward()
    ry, raux, rdropped, rgrads = _reference(m, xn, up)
    _close(y.numpy().reshape(ry.shape), ry, "output")
    assert abs(m.aux_loss.item() - raux) < 1e-6
    assert m.dropped.item() == rdropped  # pairs past capacity, counted the same way
    if capacity_factor == 0.5:
        assert rdropped > 0, "the case meant to overflow the capacity dropped nothing"
    if capacity_factor is None:
        assert rdropped == 0
    for name, g in _helios_grads(m, x).items():
        _close(g.reshape(rgrads[name].shape), rgrads[name], name)


@pytest.mark.vulkan
def test_a_uniform_router_gives_aux_alpha_exactly():
    import helios as hl
    from helios.schedule.moe import MoEMLP

    for n_experts, alpha in [(4, 0.01), (8, 0.1)]:
        m = MoEMLP(C_EMBD, n_experts, top_k=2, aux_alpha=alpha, seed=1)
        with hl.no_grad():
            m.router.weight.zero_()
        m(hl.randn(2, 16, C_EMBD, seed=3))
        assert m.aux_loss.item() == np.float32(alpha)


def test_bad_settings_are_refused_by_name():
    from helios.schedule.moe import MoEMLP

    with pytest.raises(ValueError, match="top_k must be between 1 and n_experts"):
        MoEMLP(C_EMBD, 4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoEMLP(C_EMBD, 4, capacity_factor=0)
    with pytest.raises(ValueError, match="n_experts must be >= 1"):
        MoEMLP(C_EMBD, 0)


@pytest.mark.vulkan
def test_a_gpt_with_experts_learns_and_reports_its_balance():
    import helios as hl
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW
    from helios.schedule.moe import MoEMLP, aux_loss, use_experts

    cfg = GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    model = use_experts(GPT(cfg, seed=0), n_experts=4, top_k=2)
    assert all(isinstance(b.mlp, MoEMLP) for b in model.h)
    names = [n for n, _ in model.named_parameters()]
    assert "h.1.mlp.w_fc" in names and "h.0.mlp.router.weight" in names and not any("c_fc" in n for n in names)
    opt = AdamW(model.parameters(), lr=1e-2)
    idx = hl.tensor(np.random.default_rng(0).integers(0, 32, (4, 16)))
    losses = []
    for _ in range(8):
        _, loss = model(idx, idx)
        total = loss + aux_loss(model)
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    assert 0.0 < aux_loss(model).item() < 0.1  # two layers, alpha 0.01 each, near balance: about 0.02
    assert all(b.mlp.router.weight.grad is not None for b in model.h)


# -- expert parallelism on 2 ranks -------------------------------------------------------------------

def _rank_main(out_dir: str) -> None:
    """Each rank runs its own tokens through ep=2 (half the experts here) and through a local
    layer with every expert; the outputs must match, and each expert's gradient under ep=2 must
    be the sum over ranks of the local layers' gradients (its tokens came from both ranks)."""
    import helios as hl
    import helios.comm as dist
    from helios.schedule.moe import MoEMLP

    dist.init_process_group(backend="tcp")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_group = dist.new_group(list(range(world)))
    rng = np.random.default_rng(10 + rank)  # every rank has its own tokens
    xn = rng.standard_normal((2, 8, C_EMBD)).astype(np.float32)
    up = rng.standard_normal((2, 8, C_EMBD)).astype(np.float32)
    res = {}
    for name, group in (("ep", ep_group), ("local", None)):
        m = MoEMLP(C_EMBD, E, top_k=2, capacity_factor=1.0, seed=7, ep_group=group)
        x = hl.tensor(xn, requires_grad=True)
        y = m(x)
        (y * hl.tensor(up)).sum().add(m.aux_loss).backward()
        res[name] = {"y": y.numpy(), "aux": m.aux_loss.item(), "dropped": m.dropped.item(), **_helios_grads(m, x)}
    worst = {}
    for key in ("y", "x", "router"):
        a, b = res["ep"][key], res["local"][key]
        worst[key] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))
    El = E // world
    for key in ("w_fc", "b_fc", "w_proj", "b_proj"):
        summed = hl.tensor(res["local"][key])
        dist.all_reduce(summed)  # the local layers' gradients, summed over the ranks' tokens
        want = summed.numpy()[rank * El:(rank + 1) * El]
        worst[key] = float(np.abs(res["ep"][key] - want).max() / max(np.abs(want).max(), 1e-6))
    same = res["ep"]["aux"] == res["local"]["aux"] and res["ep"]["dropped"] == res["local"]["dropped"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"worst": worst, "same_aux_and_dropped": same}, f)
    dist.destroy_process_group()


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_expert_parallel_equals_every_expert_on_one_device(tmp_path):
    check_ok(run_ranks([__file__, str(tmp_path)], 2, timeout=240))
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            res = json.load(f)
        assert res["same_aux_and_dropped"]
        bad = {k: v for k, v in res["worst"].items() if v > 1e-5}
        assert not bad, (r, bad)
        assert len(res["worst"]) == 7


if __name__ == "__main__":
    _rank_main(sys.argv[1])
