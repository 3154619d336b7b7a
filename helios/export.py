"""helios-export: a helios-train run's final weights as a Hugging Face model folder.

    helios-export runs/default exported/        # config.json + model.safetensors (+ tokenizer.json)
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('exported')"

The newest complete checkpoint of RUN_DIR is read (its weights only) and written by
``save_pretrained``: a GPT trained by helios-train as a ``gpt2`` model (its head tied to the
embedding, as GPT-2's; a GPT trained without biases gets zero biases, since GPT-2 always has
them), a LLaMA as a ``llama`` model, a model started from a Hugging Face folder
(``--init-from``) as the model it was.  A run that used ``--tokenizer hf:PATH`` gets that
``tokenizer.json`` (and a ``tokenizer_config.json`` lying beside it) copied in; the byte tokenizer
and Helios' own BPE have no Hugging Face form, which is said in one line.  Every file is written
to a temporary name, fsynced and renamed.
"""

from __future__ import annotations

import argparse
import os
import sys

from helios.errors import CheckpointError, HeliosError
from helios.fileio import atomic_write_bytes
from helios.train_settings import set_device_flag


def _fail(message: str, code: int = 2) -> None:
    print(f"helios-export: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helios-export", description="Write a helios-train run's final weights as a "
                                "Hugging Face model folder (config.json + model.safetensors), loadable by transformers.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a helios-train run directory (its newest complete checkpoint)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (created if needed)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="the weights' dtype (default fp32)")
    p.add_argument("--max-shard-size", default=None, help="split the weights into shards of at most this size, "
                   "e.g. 500MB (default: one file)")
    p.add_argument("--device", default=None, help="vulkan:N or cuda:N (default: HELIOS_DEVICE or the best device)")
    return p


def copy_tokenizer(spec: str, out_dir: str) -> list[str]:
    """Copy an ``hf:PATH`` tokenizer's tokenizer.json (and a tokenizer_config.json beside it) into
    ``out_dir``; the names copied."""
    from helios.tokenizer import hf_tokenizer_file

    src = hf_tokenizer_file(spec[3:])
    if not src.is_file():
        raise CheckpointError(f"the run's tokenizer {src} is not there any more; copy its tokenizer.json into "
                              f"{out_dir} yourself")
    copied = []
    for f, name in ((src, "tokenizer.json"), (src.parent / "tokenizer_config.json", "tokenizer_config.json")):
        if f.is_file():
            atomic_write_bytes(os.path.join(out_dir, name), f.read_bytes())
            copied.append(name)
    return copied


def export(run_dir: str, out_dir: str, dtype: str = "fp32", max_shard_size=None, say=print) -> str:
    """Write ``run_dir``'s final weights into ``out_dir`` as a Hugging Face folder; returns the
    model_type written."""
    from helios.train_model import hf_model_of_run

    rm = hf_model_of_run(run_dir)
    model = rm.model
    if dtype != "fp32":
        import helios as hl

        model.to(dtype=hl.bfloat16 if dtype == "bf16" else hl.float16)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        _fail(f"OUT_DIR {out_dir} is a file; give a folder")
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    kind = model.config.to_hf()["model_type"]
    spec = rm.meta.get("cli", {}).get("tokenizer", "byte")
    n = sum(p.numel() for p in model.parameters())
    step = int(rm.meta.get("step", 0))
    say(f"exported {run_dir} (step {step}) to {out_dir}: {kind}, {n / 1e6:.2f}M parameters, {dtype}")
    if spec.startswith("hf:"):
        say(f"tokenizer: copied {', '.join(copy_tokenizer(spec, out_dir))} from {spec[3:]}")
    elif spec == "byte":
        say("tokenizer: none written: the run used --tokenizer byte (ids are the text's UTF-8 bytes, 0-255), which "
            "has no Hugging Face tokenizer.json")
    else:
        say(f"tokenizer: none written: the run used --tokenizer {spec}, Helios' own BPE, which has no Hugging Face "
            "tokenizer.json form")
    return kind


def main(argv=None) -> int:
    """Entry point of helios-export; returns the exit status."""
    a = build_parser().parse_args(argv)
    if not os.path.isdir(a.run_dir):
        _fail(f"RUN_DIR {a.run_dir}: no such folder; pass a helios-train run directory (its --out)")
    if not os.path.isdir(os.path.join(a.run_dir, "ckpt")):
        _fail(f"RUN_DIR {a.run_dir} is not a helios-train run directory (no ckpt/ folder)")
    try:
        set_device_flag(a.device, _fail)
        export(a.run_dir, a.out_dir, a.dtype, a.max_shard_size)
    except ValueError as e:  # a --max-shard-size that is not a size
        _fail(str(e))
    except (CheckpointError, HeliosError, OSError) as e:
        _fail(f"{type(e).__name__}: {e}", code=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
