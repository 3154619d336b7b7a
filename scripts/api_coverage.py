#!/usr/bin/env python
"""Which of PyTorch's everyday APIs Helios has, measured.

The list below is what the reference GPT/LLaMA code bases call: nanoGPT (``model.py``,
``train.py``, ``sample.py``), minGPT (``mingpt/model.py``, ``mingpt/trainer.py``), llm.c's
``train_gpt2.py``, torchtitan's llama (``torchtitan/models/llama*/model.py``) and Hugging
Face transformers' GPT-2 and LLaMA (``modeling_gpt2.py``, ``modeling_llama.py``, with the
loss in ``loss/loss_utils.py`` and top-p/top-k sampling in ``generation/logits_process.py``),
plus the idioms issue 20 names (source "issue 20").  Each entry names its source files.

Four categories, as PyTorch spells them:

* ``tensor``: ``torch.Tensor`` methods and attributes, and indexing idioms (probed by running
  them on a small tensor);
* ``torch``: ``torch.*`` functions;
* ``nn``: ``torch.nn`` modules and classes, ``torch.nn.init`` and ``torch.nn.utils``;
* ``F``: ``torch.nn.functional``.

Not counted: runtime features that are not ops (``torch.compile``, ``torch.autocast``,
``torch.cuda.*``, ``torch.distributed.*``, ``torch.backends.*``, ``set_float32_matmul_precision``),
optimizers (``torch.optim``) and data loading (``torch.utils.data``).

Helios' side is found by introspection: ``helios.<name>``, ``helios.Tensor.<name>``,
``helios.nn.<name>`` and ``helios.nn.functional.<name>`` (looked up by name, whatever the
layout of those modules).  Usage::

    .venv/bin/python scripts/api_coverage.py             # the table and the figures
    .venv/bin/python scripts/api_coverage.py --missing   # only what Helios lacks
    .venv/bin/python scripts/api_coverage.py --markdown docs/api_coverage.md   # rewrite the docs page

``tests/test_api_coverage.py`` runs a parity test (forward and backward against PyTorch CPU)
for every entry present, parametrised from ``ENTRIES``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from dataclasses import dataclass

# -- the sources ----------------------------------------------------------------------------------
NANO_M = "nanoGPT model.py"
NANO_T = "nanoGPT train.py"
NANO_S = "nanoGPT sample.py"
MIN_M = "minGPT mingpt/model.py"
MIN_T = "minGPT mingpt/trainer.py"
LLMC = "llm.c train_gpt2.py"
TITAN = "torchtitan llama model.py"
HF_GPT2 = "HF modeling_gpt2.py"
HF_LLAMA = "HF modeling_llama.py"
HF_LOSS = "HF loss/loss_utils.py"
HF_GEN = "HF generation/logits_process.py"
HF_ACT = "HF activations.py"
ISSUE = "issue 20"

CATEGORIES = ("tensor", "torch", "nn", "F")
CATEGORY_TITLES = {"tensor": "torch.Tensor methods and indexing", "torch": "torch.* functions",
                   "nn": "torch.nn modules, init and utils", "F": "torch.nn.functional"}


@dataclass(frozen=True)
class Entry:
    """One API: its category, PyTorch's name, the files that call it, and for indexing idioms a
    probe (Python source run with ``hl`` = helios and ``x`` a float tensor of shape (3, 4))."""

    category: str
    name: str
    sources: tuple
    probe: str | None = None

    @property
    def key(self) -> str:
        return f"{self.category}:{self.name}"

    @property
    def torch_name(self) -> str:
        prefix = {"tensor": "Tensor.", "torch": "torch.", "nn": "nn.", "F": "F."}[self.category]
        return self.name if self.probe else prefix + self.name


def _e(category: str, name: str, *sources: str, probe: str | None = None) -> Entry:
    return Entry(category, name, tuple(sources), probe)


ENTRIES: list[Entry] = [
    # -- Tensor methods and attributes ----------------------------------------------------------
    _e("tensor", "view", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2, HF_LLAMA),
    _e("tensor", "transpose", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2, HF_LLAMA),
    _e("tensor", "contiguous", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2, HF_LLAMA, HF_LOSS),
    _e("tensor", "size", NANO_M, MIN_M, LLMC, HF_GPT2, HF_LLAMA),
    _e("tensor", "shape", TITAN, HF_GPT2, HF_LLAMA),
    _e("tensor", "dtype", HF_GPT2, HF_LLAMA),
    _e("tensor", "device", NANO_M, MIN_M, LLMC, HF_GPT2, HF_LLAMA),
    _e("tensor", "split", NANO_M, MIN_M, LLMC, HF_GPT2),
    _e("tensor", "chunk", TITAN),
    _e("tensor", "masked_fill", NANO_M, MIN_M),
    _e("tensor", "numel", NANO_M, MIN_M, LLMC),
    _e("tensor", "dim", NANO_M, MIN_M, LLMC),
    _e("tensor", "to", NANO_M, NANO_T, LLMC, TITAN, HF_LLAMA),
    _e("tensor", "float", TITAN, HF_LLAMA, HF_LOSS),
    _e("tensor", "long", HF_GPT2),
    _e("tensor", "int", HF_GPT2),
    _e("tensor", "bool", HF_GPT2),
    _e("tensor", "type_as", TITAN),
    _e("tensor", "item", NANO_T, MIN_T, LLMC),
    _e("tensor", "tolist", NANO_S, LLMC),
    _e("tensor", "numpy", LLMC),
    _e("tensor", "cpu", LLMC),
    _e("tensor", "detach", LLMC, HF_GPT2),
    _e("tensor", "clone", HF_LLAMA),
    _e("tensor", "backward", NANO_T, MIN_T, LLMC),
    _e("tensor", "unsqueeze", MIN_M, HF_GPT2, HF_LLAMA),
    _e("tensor", "squeeze", HF_GPT2),
    _e("tensor", "reshape", TITAN, HF_LLAMA),
    _e("tensor", "permute", HF_GPT2),
    _e("tensor", "flatten", TITAN),
    _e("tensor", "expand", TITAN, HF_GPT2, HF_LLAMA),
    _e("tensor", "pow", TITAN, HF_LLAMA),
    _e("tensor", "mean", NANO_T, TITAN, HF_LLAMA),
    _e("tensor", "sum", NANO_M, HF_LOSS),
    _e("tensor", "cos", HF_LLAMA),
    _e("tensor", "sin", HF_LLAMA),
    _e("tensor", "softmax", HF_GEN),
    _e("tensor", "argmax", HF_GPT2),
    _e("tensor", "gather", HF_GPT2),
    _e("tensor", "scatter", HF_GEN),
    _e("tensor", "eq", HF_GPT2),
    _e("tensor", "ne", HF_GPT2),
    _e("tensor", "t", NANO_M, MIN_M),
    _e("tensor", "copy_", NANO_M, MIN_M),
    _e("tensor", "zero_", ISSUE),
    _e("tensor", "masked_fill_", HF_GEN),
    _e("tensor", "requires_grad_", NANO_M),
    _e("tensor", "topk", ISSUE),
    _e("tensor", "sort", ISSUE),
    _e("tensor", "argsort", ISSUE),
    _e("tensor", "cumsum", HF_GEN, ISSUE),
    _e("tensor", "cumprod", ISSUE),
    _e("tensor", "repeat", ISSUE),
    _e("tensor", "flip", ISSUE),
    _e("tensor", "roll", ISSUE),
    _e("tensor", "tile", ISSUE),
    _e("tensor", "norm", ISSUE),
    _e("tensor", "index_add", ISSUE),
    _e("tensor", "scatter_add", ISSUE),
    _e("tensor", "index_select", ISSUE),
    _e("tensor", "pin_memory", NANO_T),
    _e("tensor", "x[:, -1, :]", NANO_M, MIN_M, LLMC, probe="x[:, -1]"),
    _e("tensor", "x[:, [-1]] (integer list)", NANO_M, MIN_M, LLMC, probe="x[:, [-1]]"),
    _e("tensor", "x[:, [0, 2]] (integer list)", ISSUE, probe="x[:, [0, 2]]"),
    _e("tensor", "x[idx_tensor] (integer tensor)", HF_GPT2, probe="x[hl.tensor([2, 0])]"),
    _e("tensor", "x[arange, idx] (integer tensors)", HF_GPT2, probe="x[hl.arange(3), hl.tensor([1, 3, 0])]"),
    _e("tensor", "x[mask] (boolean mask)", ISSUE, probe="x[x > 0]"),
    _e("tensor", "x[mask] = v (boolean mask write)", NANO_M, MIN_M, LLMC, probe="x[x < 0] = -float('inf')"),
    _e("tensor", "x[idx] = v (integer index write)", ISSUE, probe="x[hl.tensor([0, 2])] = hl.zeros(2, 4)"),
    # -- torch.* ---------------------------------------------------------------------------------
    _e("torch", "tensor", NANO_T, LLMC),
    _e("torch", "from_numpy", NANO_T),
    _e("torch", "zeros", NANO_T, HF_GPT2),
    _e("torch", "ones", NANO_M, MIN_M, LLMC),
    _e("torch", "empty", HF_GPT2),
    _e("torch", "full", HF_GPT2),
    _e("torch", "zeros_like", ISSUE),
    _e("torch", "ones_like", TITAN),
    _e("torch", "full_like", HF_GPT2),
    _e("torch", "arange", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2, HF_LLAMA),
    _e("torch", "randn", ISSUE),
    _e("torch", "randint", NANO_T),
    _e("torch", "manual_seed", NANO_T, NANO_S, LLMC),
    _e("torch", "no_grad", NANO_M, NANO_T, MIN_M, LLMC, HF_LLAMA),
    _e("torch", "tril", NANO_M, MIN_M),
    _e("torch", "triu", HF_LLAMA),
    _e("torch", "cat", NANO_M, MIN_M, LLMC, HF_LLAMA),
    _e("torch", "stack", NANO_T),
    _e("torch", "where", HF_GPT2),
    _e("torch", "matmul", HF_GPT2, HF_LLAMA),
    _e("torch", "addmm", HF_GPT2),
    _e("torch", "baddbmm", HF_GPT2),
    _e("torch", "bmm", ISSUE),
    _e("torch", "einsum", ISSUE),
    _e("torch", "outer", TITAN),
    _e("torch", "rsqrt", TITAN, HF_LLAMA),
    _e("torch", "tanh", MIN_M, LLMC, HF_ACT),
    _e("torch", "pow", MIN_M, LLMC, HF_ACT),
    _e("torch", "topk", NANO_M, MIN_M, LLMC, HF_GEN),
    _e("torch", "multinomial", NANO_M, MIN_M, LLMC),
    _e("torch", "sort", HF_GEN),
    _e("torch", "argsort", ISSUE),
    _e("torch", "cumsum", ISSUE),
    _e("torch", "cumprod", ISSUE),
    _e("torch", "gather", ISSUE),
    _e("torch", "scatter", ISSUE),
    _e("torch", "scatter_add", ISSUE),
    _e("torch", "index_add", ISSUE),
    _e("torch", "index_select", ISSUE),
    _e("torch", "flip", ISSUE),
    _e("torch", "roll", ISSUE),
    _e("torch", "tile", ISSUE),
    _e("torch", "norm", ISSUE),
    _e("torch", "repeat_interleave", TITAN),
    _e("torch", "save", NANO_T, LLMC),
    _e("torch", "load", NANO_T, NANO_S),
    _e("torch", "finfo", HF_GPT2, HF_LLAMA),
    _e("torch", "long", NANO_M, MIN_M, LLMC, HF_GPT2),
    _e("torch", "float32", NANO_T, LLMC, HF_LLAMA),
    _e("torch", "bfloat16", NANO_T, LLMC),
    _e("torch", "float16", NANO_T, LLMC),
    _e("torch", "polar", TITAN),
    _e("torch", "view_as_complex", TITAN),
    _e("torch", "view_as_real", TITAN),
    # -- torch.nn --------------------------------------------------------------------------------
    _e("nn", "Module", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2, HF_LLAMA),
    _e("nn", "Parameter", NANO_M, HF_GPT2, HF_LLAMA),
    _e("nn", "Linear", NANO_M, MIN_M, LLMC, TITAN, HF_LLAMA),
    _e("nn", "Embedding", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2, HF_LLAMA),
    _e("nn", "LayerNorm", MIN_M, LLMC, HF_GPT2),
    _e("nn", "RMSNorm", TITAN, ISSUE),
    _e("nn", "Dropout", NANO_M, MIN_M, HF_GPT2),
    _e("nn", "GELU", NANO_M),
    _e("nn", "ReLU", ISSUE),
    _e("nn", "SiLU", HF_ACT, HF_LLAMA),
    _e("nn", "Tanh", ISSUE),
    _e("nn", "Identity", ISSUE),
    _e("nn", "Sequential", ISSUE),
    _e("nn", "ModuleList", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2, HF_LLAMA),
    _e("nn", "ModuleDict", NANO_M, MIN_M, LLMC, TITAN),
    _e("nn", "CrossEntropyLoss", HF_GPT2),
    _e("nn", "MSELoss", HF_GPT2),
    _e("nn", "init.normal_", NANO_M, MIN_M, LLMC, TITAN, HF_GPT2),
    _e("nn", "init.zeros_", NANO_M, MIN_M, LLMC),
    _e("nn", "init.ones_", MIN_M, TITAN),
    _e("nn", "init.trunc_normal_", TITAN),
    _e("nn", "utils.clip_grad_norm_", NANO_T, MIN_T, LLMC),
    # -- torch.nn.functional ---------------------------------------------------------------------
    _e("F", "layer_norm", NANO_M),
    _e("F", "softmax", NANO_M, MIN_M, LLMC, HF_GPT2, HF_LLAMA),
    _e("F", "log_softmax", ISSUE),
    _e("F", "cross_entropy", NANO_M, MIN_M, LLMC, HF_LOSS),
    _e("F", "scaled_dot_product_attention", NANO_M, LLMC, TITAN, HF_LLAMA),
    _e("F", "dropout", HF_LLAMA),
    _e("F", "linear", ISSUE),
    _e("F", "embedding", ISSUE),
    _e("F", "gelu", HF_ACT, ISSUE),
    _e("F", "silu", TITAN, HF_ACT),
    _e("F", "relu", ISSUE),
    _e("F", "leaky_relu", ISSUE),
    _e("F", "rms_norm", ISSUE),
    _e("F", "pad", HF_LOSS, ISSUE),
    _e("F", "one_hot", ISSUE),
    _e("F", "mse_loss", ISSUE),
    _e("F", "l1_loss", ISSUE),
    _e("F", "nll_loss", ISSUE),
]


# Notes shown in the docs table (semantics worth knowing, or why an entry is missing).
NOTES = {
    "tensor:sort": "always stable: ties keep their order (PyTorch's `stable=True`)",
    "tensor:topk": "ties in their original order",
    "torch:multinomial": "Gumbel top-k on the device, seeded by `helios.manual_seed`",
    "torch:randint": "48 random bits from two Philox draws",
    "torch:polar": "pair of real tensors (`helios.complex.ComplexTensor`), rotary embeddings only",
    "torch:view_as_complex": "pair of real tensors, rotary embeddings only (see `torch.polar`)",
    "torch:view_as_real": "pair of real tensors, rotary embeddings only; a new tensor, not a view",
    "tensor:x[mask] = v (boolean mask write)": "one value: a `where` on the device, no host read",
    "tensor:x[mask] (boolean mask)": "reads the mask on the host to size the result, as PyTorch does",
    "nn:CrossEntropyLoss": "`label_smoothing` as PyTorch, on index and probability targets",
    "nn:init.normal_": "Philox on the device, seeded by `helios.manual_seed` or `generator=`",
    "nn:init.trunc_normal_": "PyTorch's inverse-CDF method: every value in [a, b], no rejection loop",
    "nn:utils.clip_grad_norm_": "`norm_type` 2.0 or inf; the L2 case is `helios.optim.clip_grad_norm_` (no host read)",
}


# -- what Helios has ------------------------------------------------------------------------------
def _resolve(root, dotted: str):
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _probe(entry: Entry, hl) -> bool:
    import numpy as np

    x = hl.tensor(np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5)
    try:
        r = eval(compile(entry.probe, entry.name, "exec" if "=" in entry.probe.replace("==", "") else "eval"),
                 {"hl": hl, "x": x})
        (r if r is not None else x).numpy()
    except Exception:  # noqa: BLE001 - any failure means the idiom does not work
        return False
    return True


def helios_object(entry: Entry, hl=None):
    """What Helios has under ``entry``'s name (None if nothing), or True for a working probe."""
    if hl is None:
        import helios as hl
    if entry.probe is not None:
        return True if _probe(entry, hl) else None
    if entry.category == "tensor":
        return getattr(hl.Tensor, entry.name, None)
    if entry.category == "torch":
        return _resolve(hl, entry.name)
    nn = getattr(hl, "nn", None)
    if nn is None:
        return None
    if entry.category == "nn":
        return _resolve(nn, entry.name)
    return _resolve(getattr(nn, "functional", None), entry.name) if getattr(nn, "functional", None) else None


def has(entry: Entry, hl=None) -> bool:
    return helios_object(entry, hl) is not None


def coverage(hl=None) -> dict:
    """{category: (have, total)} and "all"."""
    out = {c: [0, 0] for c in CATEGORIES}
    for e in ENTRIES:
        out[e.category][1] += 1
        out[e.category][0] += has(e, hl)
    out["all"] = [sum(v[0] for v in out.values()), sum(v[1] for v in out.values())]
    return {k: tuple(v) for k, v in out.items()}


def _pct(have: int, total: int) -> str:
    return f"{have}/{total} ({100.0 * have / total:.0f} %)" if total else "0/0"


def markdown(hl=None) -> str:
    """The docs page: the figures, then one table per category."""
    present = {e.key: has(e, hl) for e in ENTRIES}
    cov = collections.OrderedDict()
    for c in CATEGORIES:
        es = [e for e in ENTRIES if e.category == c]
        cov[c] = (sum(present[e.key] for e in es), len(es))
    total = (sum(v[0] for v in cov.values()), sum(v[1] for v in cov.values()))
    lines = [
        "# PyTorch API coverage",
        "",
        "Written by `.venv/bin/python scripts/api_coverage.py --markdown docs/api_coverage.md`; the list,",
        "with the source of each entry, lives in `scripts/api_coverage.py` and `tests/test_api_coverage.py`",
        "runs a parity test (forward, and backward where differentiable, against PyTorch CPU) for",
        "every entry Helios has.  Sources: nanoGPT, minGPT, llm.c's `train_gpt2.py`, torchtitan's",
        "llama, Hugging Face's GPT-2 and LLaMA modelling code (with its loss and sampling helpers),",
        "and the idioms issue 20 names.  Runtime features that are not ops (`torch.compile`,",
        "`torch.autocast`, `torch.cuda.*`, `torch.distributed.*`), optimizers and data loaders are",
        "not counted.",
        "",
        f"**Coverage: {_pct(*total)}**",
        "",
        "| category | have |",
        "| --- | ---: |",
    ]
    for c, v in cov.items():
        lines.append(f"| {CATEGORY_TITLES[c]} | {_pct(*v)} |")
    for c in CATEGORIES:
        lines += ["", f"## {CATEGORY_TITLES[c]}", "", "| PyTorch | Helios | called by | note |", "| --- | :---: | --- | --- |"]
        for e in ENTRIES:
            if e.category == c:
                lines.append(f"| `{e.torch_name}` | {'yes' if present[e.key] else '**no**'} | {', '.join(e.sources)} | "
                             f"{NOTES.get(e.key, '')} |")
    return "\n".join(lines) + "\n"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--missing", action="store_true", help="list only the entries Helios lacks")
    ap.add_argument("--markdown", metavar="PATH", help="write the coverage table as Markdown to PATH")
    args = ap.parse_args(argv)
    import helios as hl

    present = {e.key: has(e, hl) for e in ENTRIES}
    width = max(len(e.torch_name) for e in ENTRIES)
    for c in CATEGORIES:
        print(f"== {CATEGORY_TITLES[c]}")
        for e in ENTRIES:
            if e.category == c and (not args.missing or not present[e.key]):
                print(f"  {'have' if present[e.key] else 'MISS'}  {e.torch_name:<{width}}  {', '.join(e.sources)}")
    cov = coverage(hl)
    print()
    for c in CATEGORIES:
        print(f"{CATEGORY_TITLES[c]:<36} {_pct(*cov[c])}")
    print(f"{'overall':<36} {_pct(*cov['all'])}")
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        _write_atomic(args.markdown, markdown(hl))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
