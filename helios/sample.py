"""helios-sample: text from a trained model, printed as the tokens arrive.

    helios-sample runs/default --prompt "def " -n 200                    # a helios-train run (its final weights)
    helios-sample models/gpt2 --prompt "Hello, I'm a language model," -n 40 --temperature 0   # a Hugging Face folder
    helios-sample runs/ft --prompt "import " -n 100 --temperature 0.7 --top-k 50 --top-p 0.95 --seed 0

The source is a helios-train run directory (the model its newest checkpoint holds, rebuilt from
the run's settings, and the run's tokenizer) or a Hugging Face model folder (config.json and
model.safetensors, gpt2 or llama; its tokenizer.json).  The prompt is encoded without special
tokens (as helios-train encodes text; a Hugging Face model whose config names a
``bos_token_id`` gets it in front), the model generates with a key/value cache on the device
(``model.stream``: the prompt runs once, then one captured and replayed decode step per token),
and the text is printed as the tokens arrive.  ``--temperature 0`` is greedy: the tokens
``model.generate(ids, n, temperature=0)`` gives.  A context longer than the model's positions
(a helios-train GPT has as many as its block size) slides: the last 3/4 of the window is run
again and generation goes on from there.  Ctrl-C stops at once (exit status 130); a bad argument
is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys
from collections.abc import Iterator

import numpy as np

from helios.errors import CheckpointError, DataError, HeliosError
from helios.interrupt import StopFlag
from helios.train_settings import set_device_flag


def _fail(message: str, code: int = 2) -> None:
    print(f"helios-sample: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def model_context(model) -> int | None:
    """The most positions ``model`` takes in one generation (None: any): a GPT-2's n_positions,
    a LLaMA's max_position_embeddings (the length it was trained at)."""
    c = model.config
    return getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)


def stream_tokens(model, ids, n: int, context: int | None, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, eos_token_id=None,
                  capture: bool = True) -> Iterator[int]:
    """Up to ``n`` tokens after the prompt ``ids`` (a list of ints), one at a time, from
    ``model.stream`` (one row, a key/value cache).  With ``context`` the prompt and the cache
    never hold more than ``context`` positions: once full, generation starts again from the last
    3/4 of the window (each restart's sampling seeded by ``seed`` and the restart's index).
    Within one window the tokens are ``model.generate``'s."""
    ids = [int(t) for t in ids]
    left, restart = int(n), 0
    while left > 0:
        if context is None:
            prompt, m = ids, left
        else:
            keep = len(ids) if len(ids) < context else max(1, (3 * context) // 4)
            prompt = ids[-keep:]
            m = min(left, context - len(prompt) + 1)
        chunk_seed = None if seed is None else seed + 7919 * restart
        stop = False
        for tok in model.stream(np.asarray(prompt, np.int64), m, temperature, top_k, top_p, eos_token_id, chunk_seed,
                                capture=capture):
            t = int(tok[0])
            ids.append(t)
            left -= 1
            yield t
            if eos_token_id is not None and t in np.atleast_1d(eos_token_id):
                stop = True
                break
        if stop:
            return
        restart += 1


class _Printer:
    """Writes the text of the tokens so far as it grows: the bytes the tokenizer decodes for all
    the new tokens, through an incremental UTF-8 decoder (a character split over two tokens is
    printed once whole)."""

    def __init__(self, tok, out, prompt_ids):
        self.tok, self.out = tok, out
        self.ids: list[int] = list(prompt_ids)  # decoded with the prompt: a piece's spacing can depend on it
        self.sent = self._decode()
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _decode(self) -> bytes:
        # (a row of a padded embedding the tokenizer has no piece for is left out)
        return self.tok.decode(np.asarray([i for i in self.ids if i < self.tok.vocab_size], np.int64))

    def add(self, t: int) -> None:
        self.ids.append(t)
        if t >= self.tok.vocab_size:
            return
        data = self._decode()
        if data.startswith(self.sent):
            new = data[len(self.sent):]
        else:  # the tokenizer re-spelt earlier text (some merge rules do): print what is new from here
            new, self.utf8 = data, codecs.getincrementaldecoder("utf-8")(errors="replace")
            self.out.write("\n")
        self.sent = data
        self._write(self.utf8.decode(new))

    def finish(self) -> None:
        self._write(self.utf8.decode(b"", final=True) + "\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helios-sample", description="Generate text from a helios-train run or a "
                                "Hugging Face model folder, printed as the tokens arrive.")
    p.add_argument("source", metavar="RUN_DIR|MODEL_DIR",
                   help="a helios-train run directory, or a Hugging Face model folder (config.json + model.safetensors)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("-n", "--max-new-tokens", type=int, default=100, dest="n", help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens whose probability "
                   "reaches p only (nucleus sampling)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: a new draw each time)")
    p.add_argument("--tokenizer", default=None, help="byte | hf:PATH | a saved BPE .json (default: the run's, or the "
                   "folder's tokenizer.json)")
    p.add_argument("--device", default=None, help="vulkan:N or cuda:N (default: HELIOS_DEVICE or the best device)")
    p.add_argument("--no-capture", action="store_true", help="run every decode step eagerly (the same tokens)")
    return p


def _check_args(a) -> None:
    if a.n < 0:
        _fail(f"-n must be 0 or more tokens, got {a.n}")
    if not (a.temperature >= 0 and np.isfinite(a.temperature)):
        _fail(f"--temperature must be a finite number >= 0 (0: greedy), got {a.temperature}")
    if a.top_k is not None and a.top_k < 1:
        _fail(f"--top-k must be at least 1, got {a.top_k}")
    if a.top_p is not None and not 0 < a.top_p <= 1:
        _fail(f"--top-p must be in (0, 1], got {a.top_p}")


def load_source(source: str, tokenizer: str | None = None):
    """(model, tokenizer, prompt prefix ids, eos ids, what it is) of a run directory or a Hugging Face folder."""
    from helios.models import from_pretrained
    from helios.tokenizer import get_tokenizer
    from helios.train_model import hf_model_of_run, is_run_dir, run_tokenizer

    if os.path.isfile(os.path.join(source, "config.json")):
        model = from_pretrained(source)
        if tokenizer is None:
            if not os.path.isfile(os.path.join(source, "tokenizer.json")):
                _fail(f"{source} has no tokenizer.json; pass --tokenizer hf:PATH (the tokenizer.json the model was "
                      "trained with) or --tokenizer byte")
            tokenizer = "hf:" + os.path.join(source, "tokenizer.json")
        bos = getattr(model.config, "bos_token_id", None)
        prefix = [bos] if isinstance(bos, int) else []
        eos = getattr(model.config, "eos_token_id", None)
        what = f"{model.config.to_hf()['model_type']} model in {source}"
    elif is_run_dir(source):
        rm = hf_model_of_run(source)
        model, prefix, eos = rm.model, [], None
        if tokenizer is None:
            tokenizer = run_tokenizer(rm.meta)[1]
        what = f"run {source} ({os.path.basename(rm.ckpt_dir)})"
    elif os.path.isdir(source):
        _fail(f"{source} is neither a helios-train run directory (no ckpt/) nor a Hugging Face model folder (no "
              "config.json)")
    else:
        _fail(f"{source}: no such folder; pass a helios-train run directory or a Hugging Face model folder")
    tok = get_tokenizer(tokenizer)
    vocab = model.config.vocab_size
    if tok.vocab_size > vocab:
        _fail(f"--tokenizer {tokenizer}: its vocabulary has {tok.vocab_size} ids, more than the model's {vocab}; "
              "pass the tokenizer the model was trained with")
    return model, tok, prefix, eos, what


def main(argv=None) -> int:
    """Entry point of helios-sample; returns the exit status."""
    a = build_parser().parse_args(argv)
    _check_args(a)
    ctrl_c = StopFlag("stopping after this token")
    try:
        set_device_flag(a.device, _fail)
        model, tok, prefix, eos, _ = load_source(a.source, a.tokenizer)
        if ctrl_c.stop:  # pressed while the model loaded
            raise KeyboardInterrupt
        text_ids = [int(t) for t in tok.encode(a.prompt)]
        ids = prefix + text_ids
        if not ids:
            _fail("--prompt encodes to no tokens; give some text")
        printer = _Printer(tok, sys.stdout, text_ids)
        printer._write(a.prompt)
        for t in stream_tokens(model, ids, a.n, model_context(model), a.temperature, a.top_k, a.top_p, a.seed,
                               eos_token_id=eos, capture=not a.no_capture):
            if ctrl_c.stop:
                raise KeyboardInterrupt
            printer.add(t)
        printer.finish()
        return 0
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 130
    except (DataError, ValueError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except (CheckpointError, HeliosError) as e:
        _fail(f"{type(e).__name__}: {e}", code=1)
    finally:
        ctrl_c.restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
