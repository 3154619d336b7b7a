"""helios-train with helios.models: --arch llama trains (one rank, data parallel, ZeRO, tensor
parallel), --init-from continues from a Hugging Face folder written by transformers (or from a
run), helios-export writes what transformers loads, helios-sample streams what generate gives,
and every refusal is one line."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_dist import _env, final_params, launch, losses  # noqa: E402

pytestmark = pytest.mark.vulkan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--no-progress", "--eval-every", "0", "--ckpt-every", "0", "--batch-size", "4", "--block-size", "16"]


def _run(module: str, args, cache, **kw) -> subprocess.CompletedProcess:
    env = dict(_env(), HELIOS_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, env=env, timeout=600,
                          cwd=ROOT, **kw)


def _text(r) -> str:
    return r.stdout.decode("utf-8", "replace") + r.stderr.decode("utf-8", "replace")


def _db_losses(out) -> list[float]:
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return [r[0] for r in con.execute("SELECT loss FROM step_timing WHERE rank = 0 ORDER BY step")]
    finally:
        con.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A small corpus, a tokenizer.json trained on it (300 ids), and tiny random GPT-2 and LLaMA
    folders written by transformers (the LLaMA with that tokenizer.json beside it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("models")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "self", "value", "print"]
    text = "\n".join(" ".join(rng.choice(words, size=rng.integers(3, 10))) for _ in range(2000))
    (d / "words.txt").write_text(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2,
                                                                 n_head=2, bos_token_id=0, eos_token_id=0))
    gpt2.save_pretrained(d / "gpt2")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None))
    llama.save_pretrained(d / "llama")
    tok.save(str(d / "llama" / "tokenizer.json"))
    return d


# ---- --arch llama ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_run(work):
    out = work / "llama_run"
    r = _run("helios.train", ["--arch", "llama", "--config", "nano", "--steps", "40", "--lr", "1e-2", *BASE,
                              "--batch-size", "8", "--block-size", "32", "--data", work / "words.txt",
                              "--sample-tokens", "8", "--out", out], work)
    assert r.returncode == 0, _text(r)[-3000:]
    return out, r.stdout.decode()


def test_llama_trains_and_its_loss_falls(llama_run):
    out, stdout = llama_run
    assert "LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=96, num_hidden_layers=2, " \
           "num_attention_heads=2, num_key_value_heads=1" in stdout
    summary = json.loads(stdout.strip().splitlines()[-1])
    got = _db_losses(out)
    assert len(got) == 40 and np.mean(got[-5:]) < 0.7 * np.mean(got[:5]), got
    assert summary["final_val_loss"] < summary["unigram_entropy"]
    from helios.train_model import latest_run_checkpoint, run_meta_of

    meta = run_meta_of(latest_run_checkpoint(str(out)))
    assert meta["config"]["model_type"] == "llama" and meta["cli"]["arch"] == "llama"


@pytest.mark.multiproc
def test_llama_on_two_ranks_data_parallel_and_zero_trains_what_one_rank_trains(tmp_path, one_rank_run):
    one = one_rank_run("--arch", "llama", "--steps", "10")
    a, pa = losses(one), final_params(one)
    assert "model.model.layers.0.self_attn.k_proj.weight" in pa and pa["model.model.layers.0.self_attn.k_proj.weight"
                                                                       ].size == 16 * 32  # one key/value head of 16
    for name, extra in (("dp2", ()), ("zero1", ("--zero", "1"))):
        r = launch(2, tmp_path / name, "--arch", "llama", "--steps", "10", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        np.testing.assert_allclose(losses(tmp_path / name), a, rtol=1e-5)
        pb = final_params(tmp_path / name)
        for k, v in pa.items():
            np.testing.assert_allclose(pb[k], v, rtol=1e-5, atol=1e-5, err_msg=f"{name}: {k}")


@pytest.mark.multiproc
def test_llama_tensor_parallel_splits_the_gqa_heads_and_trains_what_one_rank_trains(tmp_path, one_rank_run):
    tiny = ("--arch", "llama", "--config", "tiny", "--steps", "6")  # 4 query heads, 2 key/value heads
    one = one_rank_run(*tiny)
    r = launch(2, tmp_path / "tp2", *tiny, "--tp", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensor parallel 2 x data parallel 1" in r.stdout
    np.testing.assert_allclose(losses(tmp_path / "tp2"), losses(one), rtol=1e-5)
    pa, pb = final_params(one), final_params(tmp_path / "tp2")
    assert sorted(pa) == sorted(pb)
    for k, v in pa.items():
        # atol: AdamW turns the float noise of a near-zero gradient (the split sums in another
        # order) into updates of a few percent of the learning rate (see test_train_dist)
        np.testing.assert_allclose(pb[k], v, rtol=1e-5, atol=5e-5, err_msg=k)


# ---- --init-from ----------------------------------------------------------------------------------
def _transformers_loss(folder, corpus, tokenizer: str, cache) -> float:
    """transformers' loss of the trainer's first batch (seed 1337) on the folder's weights."""
    import torch
    import transformers

    from helios.data import BatchLoader, prepare_dataset

    ds = prepare_dataset(str(corpus), tokenizer, cache_root=cache)
    x, y = BatchLoader(ds.train, 4, 16, seed=1337).next_batch()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(torch.tensor(x)).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(y).reshape(-1)))


@pytest.fixture(scope="module")
def init_from_run(work):
    """``init_from_run(kind)``: (run folder, finished process) of a 3-step helios-train
    ``--init-from`` the transformers folder ``kind``, run once per module (on each worker that asks)."""
    done = {}

    def run(kind: str):
        if kind not in done:
            out = work / f"ft_{kind}"
            tok = ["--tokenizer", "byte"] if kind == "gpt2" else []  # the llama folder's own tokenizer.json by default
            done[kind] = out, _run("helios.train", ["--init-from", work / kind, "--steps", "3", "--lr", "1e-3", *BASE,
                                                    *tok, "--data", work / "words.txt", "--sample-tokens", "4",
                                                    "--out", out], work)
        return done[kind]

    return run


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_init_from_a_transformers_folder_continues_from_its_weights(work, init_from_run, kind):
    out, r = init_from_run(kind)
    assert r.returncode == 0, _text(r)[-3000:]
    stdout = r.stdout.decode()
    assert f"--init-from: weights from {work / kind}" in stdout
    spec = "byte" if kind == "gpt2" else f"hf:{work / kind / 'tokenizer.json'}"
    want = _transformers_loss(work / kind, work / "words.txt", spec, work)
    got = _db_losses(out)
    assert len(got) == 3
    np.testing.assert_allclose(got[0], want, rtol=2e-5)


@pytest.fixture(scope="module")
def gpt_run(work):
    """A GPT trained by helios-train (helios.nn.GPT, byte tokenizer), 2 steps."""
    run_dir = work / "gpt_run"
    r = _run("helios.train", ["--config", "nano", "--steps", "2", *BASE, "--data", work / "words.txt",
                              "--sample-tokens", "0", "--out", run_dir], work)
    assert r.returncode == 0, _text(r)[-3000:]
    return run_dir


def test_init_from_a_run_takes_its_weights_not_its_step(work, gpt_run):
    """--init-from RUN_DIR: the first loss is the run's final weights' on the batch (its block size and
    tokenizer taken too), from step 1 with a fresh optimizer."""
    import helios as hl
    from helios.data import BatchLoader, prepare_dataset
    from helios.nn import GPT, GPTConfig
    from helios.train_model import latest_run_checkpoint, run_meta_of, run_weights

    out = work / "from_run"
    r = _run("helios.train", ["--init-from", gpt_run, "--steps", "2", "--no-progress", "--eval-every", "0",
                              "--batch-size", "4", "--data", work / "words.txt", "--sample-tokens", "0", "--out", out],
             work)
    assert r.returncode == 0, _text(r)[-3000:]
    assert "(not its optimizer state or step)" in r.stdout.decode()
    ckpt = latest_run_checkpoint(str(gpt_run))
    model = GPT(GPTConfig(**run_meta_of(ckpt)["config"]))
    model.load_state_dict(run_weights(ckpt))
    x, y = BatchLoader(prepare_dataset(str(work / "words.txt"), "byte", cache_root=work).train, 4, 16,
                       seed=1337).next_batch()
    with hl.no_grad():
        want = model(x, y)[1].item()
    got = _db_losses(out)
    assert len(got) == 2  # steps 1 and 2: the run's step and optimizer state stay behind
    np.testing.assert_allclose(got[0], want, rtol=1e-5)


# ---- helios-export and helios-sample --------------------------------------------------------------
def _logits_of_run(run_dir, ids) -> np.ndarray:
    """The trained module's logits, rebuilt from the run's checkpoint without helios.export's code."""
    import helios as hl
    from helios.models import LlamaConfig, LlamaForCausalLM
    from helios.nn import GPT, GPTConfig
    from helios.train_model import latest_run_checkpoint, run_meta_of, run_weights

    ckpt = latest_run_checkpoint(str(run_dir))
    cfg = run_meta_of(ckpt)["config"]
    model = LlamaForCausalLM(LlamaConfig.from_hf(cfg)) if "model_type" in cfg else GPT(GPTConfig(**cfg))
    model.load_state_dict(run_weights(ckpt))
    with hl.no_grad():
        return model.eval()(ids)[0].numpy()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_export_loads_in_transformers_with_equal_logits(work, llama_run, gpt_run, arch):
    import torch
    import transformers

    run_dir = gpt_run if arch == "gpt" else llama_run[0]
    out = work / f"export_{arch}"
    r = _run("helios.export", [run_dir, out], work)
    assert r.returncode == 0, _text(r)
    lines = r.stdout.decode().splitlines()
    assert lines[0].startswith(f"exported {run_dir} (step ") and ("gpt2" if arch == "gpt" else "llama") in lines[0]
    assert lines[1].startswith("tokenizer: none written: the run used --tokenizer byte") and len(lines) == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = np.random.default_rng(1).integers(0, 256, (2, 16))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, _logits_of_run(run_dir, ids), rtol=1e-4, atol=1e-4)


def test_export_copies_an_hf_tokenizer_and_sample_streams_greedy_generate(work, init_from_run):
    from helios.models import from_pretrained
    from helios.tokenizer import HFTokenizer

    run_dir, r = init_from_run("llama")  # a run with --tokenizer hf: (the llama folder's tokenizer.json)
    assert r.returncode == 0, _text(r)[-3000:]
    out = work / "export_ft"
    r = _run("helios.export", [run_dir, out], work)
    assert r.returncode == 0 and (out / "tokenizer.json").read_bytes() == (work / "llama" / "tokenizer.json").read_bytes()
    assert "tokenizer: copied tokenizer.json" in r.stdout.decode()
    tok = HFTokenizer(out)
    prompt = "def alpha"
    want_ids = from_pretrained(out).generate(tok.encode(prompt).astype(np.int64), 12, temperature=0)
    want = prompt + tok.decode_text(want_ids)[len(tok.decode_text(tok.encode(prompt))):] + "\n"
    for source in (run_dir, out):  # the run (its settings, checkpoint and tokenizer), and the folder
        r = _run("helios.sample", [source, "--prompt", prompt, "-n", "12", "--temperature", "0"], work)
        assert r.returncode == 0, _text(r)
        assert r.stdout.decode() == want


def test_sample_of_a_byte_run_slides_past_its_context(llama_run, work):
    run_dir = llama_run[0]  # block size 32: 40 tokens slide the window
    r = _run("helios.sample", [run_dir, "--prompt", "def ", "-n", "40", "--seed", "0", "--top-k", "20"], work)
    assert r.returncode == 0, _text(r)
    assert r.stdout.startswith(b"def ") and len(r.stdout) >= 4 + 1


def test_sample_exits_130_on_ctrl_c(llama_run, work):
    import signal
    import time

    env = dict(_env(), HELIOS_CACHE_DIR=str(work))
    p = subprocess.Popen([sys.executable, "-m", "helios.sample", str(llama_run[0]), "--prompt", "def ", "-n", "100000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert p.stdout.read(8)  # the prompt, then tokens as they come
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and b"Traceback" not in err, err.decode()[-2000:]


# ---- refusals ---------------------------------------------------------------------------------------
def _one_line(main, argv, capsys, needle, code=2):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == code and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv,needle", [
    (["--arch", "llama", "--pp", "2"], "--pp with --arch llama: the LLaMA model trains on one device"),
    (["--arch", "llama", "--cp", "2"], "--cp with --arch llama"),
    (["--arch", "llama", "--moe-experts", "4"], "--moe-experts with --arch llama"),
    (["--arch", "llama", "--attention", "dense"], "--attention dense with --arch llama"),
    (["--arch", "llama", "--dropout", "0.1"], "--dropout 0.1 with --arch llama"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    (["--init-from", "{w}/gpt2", "--arch", "llama"], "--arch llama: --init-from {w}/gpt2 holds a gpt model"),
    (["--init-from", "{w}/gpt2", "--config", "tiny"], "--config tiny: --init-from {w}/gpt2 brings its own model"),
    (["--init-from", "{w}/nothing"], "--init-from {w}/nothing: no such folder"),
    (["--init-from", "{w}"], "neither a Hugging Face model folder (no config.json) nor a Helios run directory"),
    (["--init-from", "{w}/gpt2"], "--tokenizer hf:{w}/llama/tokenizer.json: its vocabulary has 300 ids and the "
                                  "Hugging Face model in {w}/gpt2 has 256; pass --tokenizer hf:PATH with the "
                                  "tokenizer.json the model was trained with (256 ids)"),
    (["--init-from", "{w}/llama", "--tokenizer", "byte"], "pass --tokenizer hf:{w}/llama/tokenizer.json"),
    (["--init-from", "{w}/gpt2", "--tokenizer", "byte", "--block-size", "128"],
     "--block-size 128: the Hugging Face model in {w}/gpt2 takes at most 64 positions"),
])
def test_train_refusals_are_one_line(work, capsys, argv, needle, tmp_path):
    from helios.train import main

    argv = [a.replace("{w}", str(work)) for a in argv]
    if argv == ["--init-from", f"{work}/gpt2"]:
        argv += ["--tokenizer", f"hf:{work}/llama/tokenizer.json"]
    _one_line(main, argv + ["--steps", "1", "--out", tmp_path / "x", "--data", work / "words.txt"], capsys,
              needle.replace("{w}", str(work)))


def test_export_and_sample_refusals_are_one_line(work, capsys, tmp_path):
    from helios.export import main as export
    from helios.sample import main as sample

    _one_line(export, [work / "nothing", tmp_path / "o"], capsys, "RUN_DIR")
    _one_line(export, [work / "gpt2", tmp_path / "o"], capsys, "is not a helios-train run directory (no ckpt/ folder)")
    _one_line(sample, [work / "nothing", "--prompt", "x"], capsys, "no such folder")
    _one_line(sample, [work, "--prompt", "x"], capsys, "neither a helios-train run directory")
    _one_line(sample, [work / "gpt2", "--prompt", "x"], capsys, "has no tokenizer.json; pass --tokenizer")
    _one_line(sample, [work / "gpt2", "--prompt", "x", "--top-p", "2"], capsys, "--top-p must be in (0, 1]")
    _one_line(sample, [work / "gpt2", "--prompt", "x", "-n", "-1"], capsys, "-n must be 0 or more")
    _one_line(sample, [work / "gpt2", "--prompt", "x", "--tokenizer", "hf:" + str(work / "llama")], capsys,
              "its vocabulary has 300 ids, more than the model's 256")
