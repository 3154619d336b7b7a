"""helios.models against transformers (the oracle, test extra only): tiny random GPT-2 and
LLaMA-style models made and saved by transformers load through from_pretrained with the same
logits (fp32); save_pretrained folders load in transformers with the same logits; sharded
folders load; tied and untied state dicts load both ways; greedy generation with the KV cache
equals full-context recomputation and transformers' greedy generate; refusals are one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import helios as hl  # noqa: E402
import helios.nn as nn  # noqa: E402
from switches import count_dispatches, switched  # noqa: E402
from helios import fused_kernels  # noqa: E402
from helios.errors import CheckpointError  # noqa: E402
from helios.models import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, from_pretrained,  # noqa: E402
                           read_safetensors)

pytestmark = pytest.mark.vulkan

VOCAB = 96
RTOL = 1e-4


def _hf_gpt2(**kw):
    cfg = dict(vocab_size=VOCAB, n_positions=48, n_embd=64, n_layer=2, n_head=2, initializer_range=0.1,
               bos_token_id=1, eos_token_id=1)
    cfg.update(kw)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()


# name -> (transformers class, config): GQA, head dims off the flash kernels' (80, 96) and on
# them (32), rope_theta != 10000, a llama3 frequency scaling, a tied head, Qwen2's q/k/v biases
LLAMAS = {
    "llama_d80_gqa": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=160, intermediate_size=200, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        rope_theta=5000.0)),
    "llama_d96_llama3_rope": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=192, intermediate_size=160, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        rope_theta=20000.0, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 2.0, "original_max_position_embeddings": 8})),
    "qwen2_d32_gqa_tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=1e6, tie_word_embeddings=True)),
}


def _hf_llama(name):
    cls, cfg_cls, kw = LLAMAS[name]
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.1,
                                         bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    return getattr(transformers, cls)(cfg).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder written by transformers, the transformers model)."""
    out = {}
    torch.manual_seed(0)
    made = {"gpt2": _hf_gpt2(),
            "gpt2_untied_gelu": _hf_gpt2(tie_word_embeddings=False, activation_function="gelu", n_inner=80,
                                         layer_norm_epsilon=1e-4),
            **{n: _hf_llama(n) for n in LLAMAS}}
    for name, m in made.items():
        path = tmp_path_factory.mktemp(name)
        m.save_pretrained(path, safe_serialization=True)
        out[name] = (path, m)
    return out


def _ids(B=2, T=9, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (B, T))


def _torch_logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor(ids)).logits.numpy()


def _helios_logits(m, ids):
    with hl.no_grad():
        return m(ids)[0].numpy()


def _close(a, b):
    scale = float(np.abs(b).max())
    err = float(np.abs(a - b).max())
    assert err <= RTOL * scale, f"max abs difference {err:.3g} vs logits up to {scale:.3g}"


@pytest.mark.parametrize("name", ["gpt2", "gpt2_untied_gelu", *LLAMAS])
def test_from_pretrained_logits_equal_transformers(folders, name):
    path, ref = folders[name]
    model = from_pretrained(path)
    assert isinstance(model, GPT2LMHeadModel if name.startswith("gpt2") else LlamaForCausalLM)
    assert not model.training
    ids = _ids()
    _close(_helios_logits(model, ids), _torch_logits(ref, ids))
    if name == "gpt2_untied_gelu":
        assert model.lm_head.weight is not model.transformer.wte.weight
    if not name.startswith("gpt2"):  # the config's shape came through
        c = model.config
        rc = ref.config
        assert c.head_dim == (getattr(rc, "head_dim", None) or rc.hidden_size // rc.num_attention_heads)
        assert c.num_key_value_heads == rc.num_key_value_heads
        assert c.tie_word_embeddings == bool(ref.config.tie_word_embeddings)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == c.tie_word_embeddings


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_save_pretrained_loads_in_transformers_and_round_trips(tmp_path, kind):
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                           bos_token_id=1, eos_token_id=1), seed=3)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             rope_theta=500.0, max_position_embeddings=64, initializer_range=0.1,
                                             bos_token_id=1, eos_token_id=2), seed=3)
    model.eval()
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temp file left
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(T=7)
    _close(_helios_logits(model, ids), _torch_logits(ref, ids))
    back = from_pretrained(tmp_path)
    for (n, a), (n2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == n2 and np.array_equal(a.numpy(), b.numpy()), n  # bit-exact


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1), seed=1, dtype=hl.bfloat16)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["model_type"] == "llama"
    back = from_pretrained(tmp_path, dtype="auto")
    assert back.lm_head.weight.dtype is hl.bfloat16
    for (n, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert np.array_equal(a.numpy(), b.numpy()), n
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert ref.model.embed_tokens.weight.dtype == torch.bfloat16
    assert np.array_equal(ref.model.embed_tokens.weight.detach().float().numpy(), model.model.embed_tokens.weight.numpy())


def test_sharded_folders_load_both_ways(folders, tmp_path):
    path, ref = folders["llama_d80_gqa"]
    sharded = tmp_path / "hf_sharded"
    ref.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    model = from_pretrained(sharded)
    ids = _ids()
    _close(_helios_logits(model, ids), _torch_logits(ref, ids))
    # Helios' own shards, loaded by transformers; a later unsharded save removes them
    mine = tmp_path / "helios_sharded"
    model.save_pretrained(mine, max_shard_size="100KB")
    index = json.loads((mine / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _close(_torch_logits(transformers.AutoModelForCausalLM.from_pretrained(mine), ids), _torch_logits(ref, ids))
    model.save_pretrained(mine)
    assert sorted(os.listdir(mine)) == ["config.json", "model.safetensors"]


class _NanoGPT(nn.Module):
    """nanoGPT's head: ``transformer.wte`` and ``lm_head`` share one weight (tied) or not."""

    def __init__(self, tied: bool):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, 16), "ln_f": nn.LayerNorm(16)})
        self.lm_head = nn.Linear(16, VOCAB, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight


class _TorchNanoGPT(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.transformer = torch.nn.ModuleDict({"wte": torch.nn.Embedding(VOCAB, 16), "ln_f": torch.nn.LayerNorm(16)})
        self.lm_head = torch.nn.Linear(16, VOCAB, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_tied_weights_follow_pytorch(tied):
    tm, hm = _TorchNanoGPT(tied), _NanoGPT(tied)
    # PyTorch lists a tied weight under both names; so does Helios now
    assert list(hm.state_dict()) == list(tm.state_dict())
    assert len(list(hm.parameters())) == len(list(tm.parameters()))
    hm.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})  # strict, PyTorch's form
    for k, v in tm.state_dict().items():
        assert np.array_equal(hm.state_dict()[k].numpy(), v.numpy()), k
    back = _TorchNanoGPT(tied)
    back.load_state_dict({k: torch.tensor(v.numpy()) for k, v in hm.state_dict().items()})  # torch, strict
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), tm.state_dict().values()))
    one = {k: v.numpy() for k, v in tm.state_dict().items() if k != "lm_head.weight"}
    if tied:  # either name alone loads a tied weight strictly
        fresh = _NanoGPT(True)
        fresh.load_state_dict(one)
        assert np.array_equal(fresh.lm_head.weight.numpy(), tm.lm_head.weight.detach().numpy())
        other = {k: v.numpy() for k, v in tm.state_dict().items() if k != "transformer.wte.weight"}
        fresh = _NanoGPT(True)
        fresh.load_state_dict(other)
        assert np.array_equal(fresh.transformer.wte.weight.numpy(), tm.lm_head.weight.detach().numpy())
        none = {k: v for k, v in one.items() if k != "transformer.wte.weight"}
        with pytest.raises(CheckpointError, match="missing keys: transformer.wte.weight, lm_head.weight"):
            _NanoGPT(True).load_state_dict(none)
    else:  # untied: each name is its own tensor and must be there
        with pytest.raises(CheckpointError, match="missing keys: lm_head.weight$"):
            _NanoGPT(False).load_state_dict(one)


def _recompute_greedy(model, ids, n):
    seq = ids
    with hl.no_grad():
        for _ in range(n):
            logits = model(seq)[0].numpy()[:, -1]
            seq = np.concatenate([seq, logits.argmax(-1)[:, None]], axis=1)
    return seq


@pytest.mark.parametrize("name", ["gpt2", "llama_d80_gqa", "qwen2_d32_gqa_tied"])
def test_greedy_generate_equals_recomputation_and_transformers(folders, name):
    path, ref = folders[name]
    model = from_pretrained(path)
    ids, n = _ids(T=5, seed=1), 10
    out = model.generate(ids, n, temperature=0)
    assert model.generation_eager_reason is None  # the decode step was captured and replayed
    assert out.shape == (2, 5 + n) and np.array_equal(out[:, :5], ids)
    assert np.array_equal(out, _recompute_greedy(model, ids, n))
    assert np.array_equal(model.generate(ids, n, temperature=0, capture=False), out)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    with torch.no_grad():
        want = ref.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                            max_new_tokens=n, do_sample=False).numpy()
    assert np.array_equal(out, want)


def test_generate_sampling_eos_and_arguments(folders):
    model = from_pretrained(folders["gpt2"][0])
    ids = _ids(T=4, seed=2)
    a = model.generate(ids, 6, temperature=0.9, top_k=20, top_p=0.8, seed=7)
    assert np.array_equal(a, model.generate(ids, 6, temperature=0.9, top_k=20, top_p=0.8, seed=7, capture=False))
    assert np.array_equal(model.generate(ids, 6, top_k=1, seed=3), model.generate(ids, 6, temperature=0))
    greedy = model.generate(ids, 6, temperature=0)
    new = greedy[:, 4:]
    for eos in (int(new[0, 1]), [int(new[0, 1]), int(new[1, 0])]):  # one id, a list
        ids_eos = np.asarray([eos] if isinstance(eos, int) else eos)
        hit = [np.flatnonzero(np.isin(row, ids_eos)) for row in new]
        steps = max(h[0] + 1 for h in hit) if all(len(h) for h in hit) else 6
        want = new[:, :steps].copy()
        for r, h in enumerate(hit):  # a finished row is padded with the (first) eos id
            if len(h):
                want[r, h[0] + 1:] = ids_eos[0]
        got = model.generate(ids, 6, temperature=0, eos_token_id=eos)
        assert np.array_equal(got[:, 4:], want), (got, want)
    one = model.generate(ids[:1], 6, temperature=0, eos_token_id=int(new[0, 1]))
    assert one.shape[1] < 4 + 6  # a single row stops early at its eos
    t = model.generate(hl.tensor(ids[0]), 3, temperature=0)  # a Tensor in, a Tensor out; 1-D stays 1-D
    assert isinstance(t, hl.Tensor) and np.array_equal(t.numpy(), greedy[0, :7])
    with pytest.raises(ValueError, match="positions"):
        model.generate(ids, 100)


def _attention_upto(q, keys, vals, pos):
    """numpy reference: each query head's softmax attention over the keys 0..pos of its group's head."""
    B, Hq, _, D = q.shape
    group = Hq // keys.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            s = keys[b, h // group, :pos + 1] @ q[b, h, 0] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[b, h, 0] = (p / p.sum()) @ vals[b, h // group, :pos + 1]
    return out


def test_captured_decode_step_writes_one_row_and_attends_up_to_its_position():
    """KVCache's captured decode step (what generate replays for every token): each layer's new
    keys and values land in the position's row of each (batch, head) pair and nowhere else (no
    command rewrites a whole cache), the rows after the position stay zero, and the attention
    (grouped-query here) counts only the keys up to the position, replay after replay."""
    from helios.backend import DISPATCH
    from helios.models.generation import KVCache

    rng = np.random.default_rng(3)
    B, Hq, Hk, S, D, T0 = 2, 4, 2, 7, 8, 3

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    kv = KVCache(1, B, Hk, S, D, hl.float32, None)
    keys, vals = np.zeros((B, Hk, S, D), np.float32), np.zeros((B, Hk, S, D), np.float32)
    keys[:, :, :T0], vals[:, :, :T0] = rand(B, Hk, T0, D), rand(B, Hk, T0, D)
    new = [rand(B, Hq, 1, D), rand(B, Hk, 1, D), rand(B, Hk, 1, D), np.array([T0])]
    with hl.no_grad():
        kv.attend(0, hl.tensor(rand(B, Hq, T0, D)), hl.tensor(keys[:, :, :T0]), hl.tensor(vals[:, :, :T0]))  # prefill
        inputs = [hl.tensor(a) for a in new]
        with hl.graph.capture(inputs=inputs) as g:  # the step at T0 runs, then replays at T0 + 1 ...
            kv.begin_step(inputs[3])
            y = kv.attend(0, *inputs[:3])
        kv.end_step()
    cache = {kv.k[0]._st.handle, kv.v[0]._st.handle}
    writes = [args for kind, args in g.ops if kind == DISPATCH and any(b[0] in cache and b[3] for b in args[1])]
    assert len(writes) == 2 and all(args[6] < kv.k[0].numel() * 4 // 2 for args in writes), \
        [(a[4], a[6]) for a in writes]  # two row writes, each moving less than half a cache's bytes
    for pos in range(T0, S):
        if pos > T0:
            new = [rand(B, Hq, 1, D), rand(B, Hk, 1, D), rand(B, Hk, 1, D), np.array([pos])]
            g.replay(*new)
        keys[:, :, pos], vals[:, :, pos] = new[1][:, :, 0], new[2][:, :, 0]
        assert np.array_equal(kv.k[0].numpy(), keys) and np.array_equal(kv.v[0].numpy(), vals), pos
        np.testing.assert_allclose(y.numpy(), _attention_upto(new[0], keys, vals, pos), rtol=1e-5, atol=1e-6)
    g.release()


def test_refusals_are_one_line(tmp_path, folders):
    with pytest.raises(CheckpointError) as e:
        from_pretrained("gpt2")
    assert "download" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(CheckpointError) as e:
        from_pretrained(tmp_path)
    assert "'bert'" in str(e.value) and "\n" not in str(e.value)
    # weights that do not match the config: named, nothing half-loaded handed back
    path = folders["gpt2"][0]
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    os.link(path / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing keys: transformer.h.2"):
        from_pretrained(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        from_pretrained(bad)
    assert read_safetensors(path / "model.safetensors")["transformer.wte.weight"].shape == (VOCAB, 64)


@pytest.mark.parametrize("name", ["gpt2_untied_gelu", "llama_d80_gqa"])
def test_training_gradients_equal_transformers_and_a_captured_step_replays(folders, name):
    path, ref = folders[name]
    ids = _ids(T=10, seed=4)
    x, y = ids[:, :-1], ids[:, 1:]
    tm = transformers.AutoModelForCausalLM.from_pretrained(path)
    tm.train()
    for m in tm.modules():  # dropout off on both sides (Helios' models load with the config's)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    tl = torch.nn.functional.cross_entropy(tm(torch.tensor(x)).logits.reshape(-1, VOCAB), torch.tensor(y).reshape(-1))
    tl.backward()
    grads = {n: p.grad.numpy() for n, p in tm.named_parameters()}

    def fresh():
        m = from_pretrained(path)
        for mod in m.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
        return m.train()

    model = fresh()
    _, loss = model(x, y)
    loss.backward()
    assert abs(loss.item() - tl.item()) <= 1e-5 * abs(tl.item())
    for n, p in model.named_parameters():
        want = grads[n].T if name.startswith("gpt2") and n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) \
            else grads[n]
        _close(p.grad.numpy(), want)
    # the training step captured once and replayed gives the eager steps' losses
    eager, captured = fresh(), fresh()
    opt_e = hl.optim.AdamW(eager.parameters(), lr=1e-2)
    want = []
    for _ in range(3):
        _, loss = eager(x, y)
        loss.backward()
        opt_e.step()
        opt_e.zero_grad()
        want.append(loss.item())
    opt_c = hl.optim.AdamW(captured.parameters(), lr=1e-2)
    xt, yt = hl.tensor(x), hl.tensor(y)
    with hl.graph.capture(inputs=(xt, yt)) as g:
        _, loss = captured(xt, yt)
        loss.backward()
        opt_c.step()
        opt_c.zero_grad()
    got = [loss.item()]
    for _ in range(2):
        g.replay(x, y)
        got.append(loss.item())
    g.release()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[2] < got[0]


def test_llama_residual_adds_ride_in_the_output_projections():
    """LlamaDecoderLayer adds the residual stream in o_proj's and down_proj's matmuls
    (helios.nn.modules.project_residual: "linear+residual"), no add kernel of their own, and
    trains to the same bits as the adds one by one (fused kernels switched off)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    ids = _ids(T=10, seed=5)

    def step():
        model = LlamaForCausalLM(cfg, seed=3)
        with count_dispatches() as names:
            _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        return loss.numpy().tobytes(), [p.grad.numpy().tobytes() for p in model.parameters()], names

    fused = step()
    with switched(fused_kernels, "ENABLED", False):
        separate = step()
    assert fused[2]["linear+residual"] == 2 * cfg.num_hidden_layers and separate[2]["linear+residual"] == 0
    assert fused[0] == separate[0] and fused[1] == separate[1]


def test_llama_grouped_query_attention_costs_no_dispatch_more_than_one_kv_head_each():
    """Head dim 32 (the flash kernels): a LLaMA whose two query heads share one K/V head dispatches
    exactly what one with a K/V head each does (the kernels read the shared head in place and sum
    its gradients themselves: no repeated K and V, no reductions), and neither copies v's gradient
    to reach v_proj (the flash backward writes it in v's layout)."""
    ids = _ids(T=20, seed=7)

    def dispatches(kv_heads):
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=kv_heads)
        model = LlamaForCausalLM(cfg, seed=4)
        with count_dispatches() as names:
            _, loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
        return dict(names)

    gqa, mha = dispatches(1), dispatches(2)
    assert gqa == mha
    assert gqa["flash_attn_bwd_dkv"] == 2 and "copy" not in gqa, gqa
