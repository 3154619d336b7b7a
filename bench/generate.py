"""Generation with the KV cache against full-context sampling and transformers' generate, same run.

    python bench/generate.py [--arch gpt2|llama] [--context 512] [--new 32] [--layers 4] [--width 256]
                             [--heads 4] [--vocab 2048] [--rounds 3] [--smoke]

One tiny random model, written once as a Hugging Face folder by transformers (PyTorch's CPU
build: the peer) and read by ``helios.models.from_pretrained`` on the default device, so both
sides decode the same weights.  From a ``--context``-token random prompt, ``--new`` tokens are
generated greedily three ways:

* ``kv``: ``model.generate(..., temperature=0)``: one prefill, then one-token decode steps with
  the KV cache on the device, the decode step captured once and replayed;
* ``full``: what sampling did before the cache: each new token from a forward over the whole
  context so far (``model(ids)``, the last position's argmax) -- the same tokens;
* ``peer``: transformers' ``generate(do_sample=False, use_cache=True)`` on PyTorch CPU.

Each figure is the median over ``--rounds`` of new tokens per second (prefill included: the
time from the prompt to the last token), after one warm-up call of each; ``kv_decode_tok_s``
is the cache's decode rate alone (the time of ``--new`` tokens less that of the prompt and one
token, over ``--new`` - 1 tokens: the first decode step, which captures the graph, included),
``kv_decode_over_full`` its ratio to full-context sampling.  ``kv_step_ms`` is the median time
of one replayed decode step (the replay, the logits read back, the token chosen: the time
between two tokens of ``model.stream`` after the captured one) over every round.  One JSON
line: {"bench": "generate", "arch", "context", "new", "kv_tok_s", "full_tok_s", "peer_tok_s",
"kv_over_full", "kv_decode_tok_s", "kv_decode_over_full", "kv_step_ms", "kv_over_peer",
"same_tokens", "load"}; ``same_tokens`` says the three agreed token for token, ``load`` is the
1-minute load average at the start and at the end (the machine may be shared).  ``--smoke``:
a 2-layer model, 32-token context, 4 new tokens, one round (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def _hf_folder(args, folder: str):
    """A random transformers model of the asked shape, saved as safetensors in ``folder``."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if args.arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=args.vocab, n_positions=args.context + args.new, n_embd=args.width,
                            n_layer=args.layers, n_head=args.heads, bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 3,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=max(1, args.heads // 2),
                             max_position_embeddings=args.context + args.new, bos_token_id=0, eos_token_id=0)
        model = tf.LlamaForCausalLM(cfg)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return model


def _timed(fn, rounds: int) -> tuple[float, object]:
    """(median seconds of ``fn()`` over ``rounds`` calls after one warm-up call, its last result)."""
    out = fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _stream_steps(model, prompt: np.ndarray, n: int) -> tuple[np.ndarray, list[float]]:
    """(greedy tokens from ``model.stream``, the seconds between consecutive tokens after the
    first two: the replayed decode steps, the first one being the capture)."""
    stamps, toks = [], []
    for tok in model.stream(prompt, n, temperature=0.0):
        stamps.append(time.perf_counter())
        toks.append(tok)
    return np.concatenate([prompt, np.stack(toks, 1)], axis=1), list(np.diff(stamps)[1:])


def _full_context(model, prompt: np.ndarray, n: int) -> np.ndarray:
    """Greedy tokens from a forward over the whole context at every step (no cache)."""
    import helios as hl

    ids = prompt.copy()
    with hl.no_grad():
        for _ in range(n):
            logits, _ = model(hl.tensor(ids))
            last = logits[:, -1, :].float().numpy()
            ids = np.concatenate([ids, last.argmax(-1)[:, None]], axis=1)
    return ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny: 2 layers, 32-token context, 4 new tokens, 1 round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.heads, args.vocab, args.context, args.new, args.rounds = 2, 64, 2, 256, 32, 4, 1
    import torch

    from helios.models import from_pretrained

    load0 = round(os.getloadavg()[0], 2)
    prompt = np.random.default_rng(0).integers(0, args.vocab, (1, args.context)).astype(np.int64)
    with tempfile.TemporaryDirectory() as folder:
        peer = _hf_folder(args, folder)
        model = from_pretrained(folder)
    t_kv, kv = _timed(lambda: model.generate(prompt, args.new, temperature=0.0), args.rounds)
    t_prefill, _ = _timed(lambda: model.generate(prompt, 1, temperature=0.0), args.rounds)  # the prompt + 1 token
    steps = []
    for _ in range(args.rounds):
        streamed, s = _stream_steps(model, prompt, args.new)
        steps += s
    t_full, full = _timed(lambda: _full_context(model, prompt, args.new), args.rounds)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    def peer_generate():
        with torch.no_grad():
            return peer.generate(torch.from_numpy(prompt), max_new_tokens=args.new, min_new_tokens=args.new,
                                 do_sample=False, use_cache=True, pad_token_id=0).numpy()

    t_peer, ref = _timed(peer_generate, args.rounds)
    row = {"bench": "generate", "arch": args.arch, "layers": args.layers, "width": args.width, "context": args.context,
           "new": args.new, "kv_tok_s": round(args.new / t_kv, 2), "full_tok_s": round(args.new / t_full, 2),
           "peer_tok_s": round(args.new / t_peer, 2), "kv_over_full": round(t_full / t_kv, 2),
           "kv_decode_tok_s": round((args.new - 1) / max(t_kv - t_prefill, 1e-9), 2),
           "kv_decode_over_full": round((args.new - 1) / max(t_kv - t_prefill, 1e-9) / (args.new / t_full), 2),
           "kv_step_ms": round(statistics.median(steps) * 1e3, 2) if steps else None,
           "kv_over_peer": round(t_peer / t_kv, 3),
           "same_tokens": bool(np.array_equal(kv, full) and np.array_equal(kv, ref) and np.array_equal(kv, streamed)),
           "load": [load0, round(os.getloadavg()[0], 2)]}
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
