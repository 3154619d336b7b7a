"""helios-train's models: what ``--arch gpt|llama`` builds at the ``--config`` presets' sizes, what
``--init-from`` starts from (a Hugging Face folder or a Helios run), and a finished run's model as
a Hugging Face model (``helios-export``, ``helios-sample``).

A run's checkpoint meta says what it trains in ``"config"``:

* helios.nn.GPTConfig's fields (no ``model_type``): a ``helios.nn.GPT`` made by helios-train, as
  every run of an earlier Helios;
* a transformers config.json dict (it has a ``model_type``): a LLaMA (``--arch llama``, or a llama /
  mistral / qwen2 folder) trained as :class:`helios.models.LlamaForCausalLM`, or a GPT-2 read from a
  Hugging Face folder.  A GPT-2 whose head is tied to its embedding (every GPT-2 checkpoint
  published) trains as its decoder, ``GPT2LMHeadModel.transformer``, a ``helios.nn.GPT``, so every
  parallel layout of the GPT applies; an untied one trains whole, on one device or data-parallel.

The parameters' names are the trained module's own (a GPT's ``wte.weight``, a LLaMA's
``model.layers.0.self_attn.q_proj.weight``), and ``--resume``, ``--init-from RUN_DIR``,
``helios-export`` and ``helios-sample`` rebuild the module from the config alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from helios.errors import CheckpointError
from helios.nn import GPT, GPTConfig
from helios.nn.modules import CausalSelfAttention, Dropout, parse_attention
from helios.train_settings import usage

ARCHS = ("gpt", "llama")

#: The LLaMA form of each --config preset: the GPT preset's layers, heads and width, grouped-query
#: attention with ``n_kv_head`` key/value heads and a SwiGLU MLP of ``intermediate_size`` hidden
#: features (about 8/3 x the width, a multiple of 32: the parameters of GPT's 4 x MLP, as LLaMA sizes
#: it).  RMSNorm eps 1e-5, rope_theta 10000, an untied head.
LLAMA_PRESETS = {
    "nano": dict(n_kv_head=1, intermediate_size=96),
    "tiny": dict(n_kv_head=2, intermediate_size=352),
    "small": dict(n_kv_head=2, intermediate_size=512),
    "gpt2": dict(n_kv_head=4, intermediate_size=2048),
}
LLAMA_RMS_EPS = 1e-5
_HF_ARCH = {"gpt2": "gpt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}


@dataclass
class ModelSpec:
    """What a run trains, known before the data is read (the checks of the layout and of the
    device's limits need its sizes)."""

    arch: str  # "gpt" | "llama"
    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int | None = None  # a LLaMA's key/value heads
    mlp: int | None = None  # the MLP's hidden width where it is not 4 x n_embd
    hf: dict | None = None  # the transformers config the model is built from (None: a helios.nn.GPT of GPTConfig)
    gpt: dict | None = None  # a GPTConfig dict of an earlier run (its vocabulary, block size, bias)
    vocab: int | None = None  # fixed by the source; None: the tokenizer's
    positions: int | None = None  # the most tokens the model takes (None: any)
    init: tuple | None = None  # ("hf", folder) or ("run", checkpoint folder): where the weights come from
    tokenizer_identity: str | None = None  # the tokenizer an --init-from run was trained with
    source: str = ""  # how the banner and the refusals name the source
    notes: list = field(default_factory=list)  # what the banner says about the source

    @property
    def trains_gpt(self) -> bool:
        """Whether the trained module is a helios.nn.GPT (every parallel layout applies)."""
        return self.arch == "gpt" and (self.hf is None or self.hf.get("tie_word_embeddings", True))

    @property
    def head_dim(self) -> int:
        if self.hf is not None and self.arch == "llama" and self.hf.get("head_dim"):
            return int(self.hf["head_dim"])
        return self.n_embd // self.n_head


# ---- the spec, from the flags ------------------------------------------------------------------
def preset_spec(arch: str, config: str, configs: dict) -> ModelSpec:
    """--arch at the --config preset's sizes."""
    c = configs[config]
    if arch == "gpt":
        return ModelSpec("gpt", c["n_layer"], c["n_head"], c["n_embd"])
    lp = LLAMA_PRESETS[config]
    return ModelSpec("llama", c["n_layer"], c["n_head"], c["n_embd"], n_kv_head=lp["n_kv_head"],
                     mlp=lp["intermediate_size"])


def spec_of_config(cfg: dict, source: str = "") -> ModelSpec:
    """The spec of a checkpoint meta's "config" (see the module docstring)."""
    if "model_type" not in cfg:  # a helios.nn.GPT made by helios-train
        return ModelSpec("gpt", cfg["n_layer"], cfg["n_head"], cfg["n_embd"], gpt=dict(cfg),
                         vocab=cfg.get("vocab_size"), positions=cfg.get("block_size"), source=source)
    return _spec_of_hf(cfg, source)


def _spec_of_hf(cfg: dict, source: str) -> ModelSpec:
    from helios.models import GPT2Config, LlamaConfig

    kind = cfg.get("model_type")
    if kind not in _HF_ARCH:
        raise ValueError(f"model_type {kind!r} is not one helios-train trains (gpt2, llama, mistral, qwen2)")
    if _HF_ARCH[kind] == "gpt":
        c = GPT2Config.from_hf(cfg)
        return ModelSpec("gpt", c.n_layer, c.n_head, c.n_embd, mlp=c.n_inner if c.n_inner not in (None, 4 * c.n_embd)
                         else None, hf=c.to_hf(), vocab=c.vocab_size, positions=c.n_positions, source=source)
    c = LlamaConfig.from_hf(cfg)
    return ModelSpec("llama", c.num_hidden_layers, c.num_attention_heads, c.hidden_size,
                     n_kv_head=c.num_key_value_heads, mlp=c.intermediate_size, hf=c.to_hf(), vocab=c.vocab_size,
                     positions=c.sliding_window, source=source)


def init_spec(path: str, args, given: set, configs: dict) -> ModelSpec:
    """The spec of ``--init-from path``: a Hugging Face folder (config.json) or a Helios run
    directory (its newest complete checkpoint); a conflicting --arch / --config, or a path that is
    neither, is refused in one line.  Sets --tokenizer and --block-size to the source's where the
    user gave none (a folder's tokenizer.json, a run's tokenizer and block size)."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        try:
            cfg = json.loads((folder / "config.json").read_text())
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
            spec = _spec_of_hf(cfg, f"the Hugging Face model in {path}")
        except (ValueError, TypeError) as e:
            usage(f"--init-from {path}: {folder / 'config.json'}: {e}")
        spec.init = ("hf", str(folder.resolve()))
        tok = folder / "tokenizer.json"
        if "tokenizer" not in given and tok.is_file():
            args.tokenizer = f"hf:{tok.resolve()}"
            spec.notes.append(f"--tokenizer hf:{tok} (the folder's)")
    elif folder.is_dir():
        found = latest_run_checkpoint(str(folder))
        if found is None:
            usage(f"--init-from {path}: neither a Hugging Face model folder (no config.json) nor a Helios run "
                  "directory with a complete checkpoint (ckpt/step-N); pass one of the two")
        meta = run_meta_of(found)
        spec = spec_of_config(meta["config"], f"the run in {path}")
        spec.init = ("run", found)
        spec.tokenizer_identity = meta.get("train", {}).get("tokenizer")
        cli = meta.get("cli", {})
        if "tokenizer" not in given and cli.get("tokenizer"):
            spec_tok = run_tokenizer_spec(cli["tokenizer"], spec.tokenizer_identity)
            if spec_tok is not None:
                args.tokenizer = spec_tok
                spec.notes.append(f"--tokenizer {spec_tok} (the run's)")
        saved_block = cli.get("block_size", meta["config"].get("block_size"))
        if spec.gpt is not None:  # a GPT's position table has the run's block size of rows
            T = spec.gpt["block_size"]
            if "block_size" in given and args.block_size != T:
                usage(f"--block-size {args.block_size}: the GPT in the run {path} has {T} positions (its position "
                      f"table); drop --block-size to train at {T}")
            args.block_size = T
        elif "block_size" not in given and saved_block:
            args.block_size = int(saved_block)
    else:
        usage(f"--init-from {path}: no such folder; pass a Hugging Face model folder (config.json and "
              "model.safetensors) or a Helios run directory")
    if "arch" in given and args.arch != spec.arch:
        usage(f"--arch {args.arch}: --init-from {path} holds a {spec.arch} model ({spec.source}); drop --arch")
    if "config" in given:
        c = configs[args.config]
        if (c["n_layer"], c["n_head"], c["n_embd"]) != (spec.n_layer, spec.n_head, spec.n_embd):
            usage(f"--config {args.config}: --init-from {path} brings its own model ({spec.n_layer} layers, "
                  f"{spec.n_head} heads, width {spec.n_embd}); drop --config")
    args.arch = spec.arch
    return spec


def check_spec(spec: ModelSpec, args, T: int) -> None:
    """Refuse what this model cannot train, in one line naming the flag."""
    if spec.arch == "llama":
        what = "the LLaMA model"
        for flag, on in (("--pp", args.pp > 1), ("--cp", args.cp > 1), ("--moe-experts", args.moe_experts > 0),
                         ("--ep", args.ep > 1), ("--pp-virtual", args.pp_virtual > 1),
                         ("--sequence-parallel", args.sequence_parallel)):
            if on:
                usage(f"{flag} with --arch llama: {what} trains on one device, data parallel (--dp, --zero) and "
                      f"tensor parallel (--tp) so far; drop {flag}")
        if args.attention != "auto":
            usage(f"--attention {args.attention} with --arch llama: the LLaMA model's attention is "
                  "scaled_dot_product_attention (the flash kernel where its head dim allows); drop --attention")
        if args.dropout:
            usage(f"--dropout {args.dropout} with --arch llama: the LLaMA model has no dropout; drop --dropout")
    elif not spec.trains_gpt:
        for flag, on in (("--tp", args.tp > 1), ("--pp", args.pp > 1), ("--cp", args.cp > 1),
                         ("--moe-experts", args.moe_experts > 0), ("--ep", args.ep > 1)):
            if on:
                usage(f"{flag}: {spec.source} is a GPT-2 with an untied output head, which trains on one device "
                      f"and data parallel (--dp, --zero) only; drop {flag}")
    elif spec.hf is not None and spec.hf.get("activation_function", "gelu_new") not in (
            "gelu_new", "gelu_pytorch_tanh", "gelu_fast") and args.tp > 1:
        usage(f"--tp {args.tp}: {spec.source} uses activation {spec.hf['activation_function']!r}, and tensor "
              "parallelism runs the tanh GELU; drop --tp")
    if args.dropout and args.tp > 1:
        usage(f"--dropout {args.dropout} with --tp {args.tp}: tensor parallelism needs the same dropout mask on "
              "every tensor-parallel rank, which it does not draw yet; drop --dropout or --tp")
    if spec.positions is not None and T > spec.positions:
        usage(f"--block-size {T}: {spec.source or 'the model'} takes at most {spec.positions} positions; use "
              f"--block-size {spec.positions} or less")


def check_vocab(spec: ModelSpec, spec_tok: str, vocab: int | None, identity: str | None = None) -> None:
    """Refuse a tokenizer whose vocabulary is not the model's (``vocab``: the tokenizer's size,
    None when not known yet; ``identity``: its identity, checked against an --init-from run's)."""
    if spec.init is None:
        return
    kind, where = spec.init
    if spec.tokenizer_identity is not None and identity is not None and identity != spec.tokenizer_identity:
        usage(f"--tokenizer {spec_tok}: {spec.source} was trained with another tokenizer ({spec.tokenizer_identity}, "
              f"this one is {identity}); pass the run's own --tokenizer")
    if vocab is None or spec.vocab is None or vocab == spec.vocab:
        return
    if kind == "hf":
        tok = Path(where) / "tokenizer.json"
        hint = (f"pass --tokenizer hf:{tok}" if tok.is_file() else
                f"pass --tokenizer hf:PATH with the tokenizer.json the model was trained with ({spec.vocab} ids)")
    else:
        hint = "pass the run's own --tokenizer"
    usage(f"--tokenizer {spec_tok}: its vocabulary has {vocab} ids and {spec.source} has {spec.vocab}; {hint}")


# ---- the module ----------------------------------------------------------------------------------
@dataclass
class Built:
    """The module a run trains, what the banner shows of it, and its meta config."""

    module: Any
    cfg: Any  # GPTConfig, GPT2Config or LlamaConfig
    meta_config: dict  # the checkpoint meta's "config"
    fpt: float  # training FLOPs per token at the run's block size
    notes: list = field(default_factory=list)


def set_dropout(module, p: float) -> None:
    """Every Dropout of ``module`` drops with probability ``p`` (the trainer's --dropout)."""
    for m in module.modules():
        if isinstance(m, Dropout):
            m.p = p


def set_attention(gpt: GPT, spec: str) -> None:
    """Every attention of a helios.nn.GPT runs ``spec`` (--attention)."""
    gpt.config.attention = spec
    for m in gpt.modules():
        if isinstance(m, CausalSelfAttention):
            m.attention, m.sparse_pattern, m.sparse_block = parse_attention(spec)


def _gpt2_config(spec: ModelSpec, dropout: float, attention: str):
    from helios.models import GPT2Config

    c = GPT2Config.from_hf(spec.hf)
    c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = dropout
    c.attention = attention
    return c


def build(spec: ModelSpec, vocab: int, T: int, args, seed: int, load: bool = True) -> Built:
    """The module ``spec`` describes (seeded by ``seed``), with a Hugging Face folder's weights
    when ``load`` (a run's: :func:`load_run_weights`, once the trainer has added experts);
    --dropout and --attention applied."""
    from helios.models import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    notes = []
    if spec.arch == "gpt" and spec.hf is None:
        g = spec.gpt or {}
        cfg = GPTConfig(vocab_size=vocab, block_size=T, n_layer=spec.n_layer, n_head=spec.n_head, n_embd=spec.n_embd,
                        dropout=args.dropout, bias=g.get("bias", True), attention=args.attention)
        module = GPT(cfg, seed=seed)
        meta = {k: v for k, v in cfg.to_dict().items() if k != "attention"}
        fpt = module.flops_per_token()
    elif spec.arch == "gpt":
        c = _gpt2_config(spec, args.dropout, args.attention)
        if load and spec.init is not None and spec.init[0] == "hf":
            whole = _from_pretrained(spec.init[1])
            set_dropout(whole, args.dropout)
            whole.config = c
            if spec.trains_gpt:
                whole.transformer.config.dropout = args.dropout
                set_attention(whole.transformer, args.attention)
        else:
            whole = GPT2LMHeadModel(c, seed=seed)
        module = whole.transformer if spec.trains_gpt else whole
        cfg = module.config if spec.trains_gpt else c
        meta = c.to_hf()
        # attention FLOPs at the run's block size, not the model's n_positions
        fpt = whole.flops_per_token() - 12 * c.n_layer * (c.n_positions - T) * c.n_embd
    else:
        if spec.hf is None:
            cfg = LlamaConfig(vocab_size=vocab, hidden_size=spec.n_embd, intermediate_size=spec.mlp,
                              num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                              num_key_value_heads=spec.n_kv_head, max_position_embeddings=T,
                              rms_norm_eps=LLAMA_RMS_EPS, tie_word_embeddings=False)
        else:
            cfg = LlamaConfig.from_hf(spec.hf)
        if load and spec.init is not None and spec.init[0] == "hf":
            module = _from_pretrained(spec.init[1])
            cfg = module.config
        else:
            module = LlamaForCausalLM(cfg, seed=seed)
        meta = cfg.to_hf()
        fpt = module.flops_per_token() - 12 * cfg.num_hidden_layers * (
            cfg.max_position_embeddings - T) * cfg.num_attention_heads * cfg.head_dim
    if load and spec.init is not None:
        notes.append(f"weights from {spec.init[1]}" + (" (not its optimizer state or step)"
                                                       if spec.init[0] == "run" else ""))
    module.train()
    return Built(module, cfg, meta, fpt, notes)


def _from_pretrained(folder: str):
    from helios.models import from_pretrained

    return from_pretrained(folder)


def describe_config(cfg) -> str:
    """The banner's line for the model's config (GPTConfig as it prints itself)."""
    from helios.models import GPT2Config, LlamaConfig

    if isinstance(cfg, LlamaConfig):
        return (f"LlamaConfig(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, "
                f"intermediate_size={cfg.intermediate_size}, num_hidden_layers={cfg.num_hidden_layers}, "
                f"num_attention_heads={cfg.num_attention_heads}, num_key_value_heads={cfg.num_key_value_heads}, "
                f"max_position_embeddings={cfg.max_position_embeddings}, rope_theta={cfg.rope_theta:g}, "
                f"tie_word_embeddings={cfg.tie_word_embeddings})")
    if isinstance(cfg, GPT2Config):
        return (f"GPT2Config(vocab_size={cfg.vocab_size}, n_positions={cfg.n_positions}, n_embd={cfg.n_embd}, "
                f"n_layer={cfg.n_layer}, n_head={cfg.n_head}, tie_word_embeddings={cfg.tie_word_embeddings})")
    return str(cfg)


# ---- a run's checkpoint ------------------------------------------------------------------------
def latest_run_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint folder of a run (None: it has none)."""
    import warnings

    from helios.schedule import checkpoint as C

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = C.latest_complete(run_dir)
    return found[1] if found is not None else None


def run_meta_of(ckpt_dir: str) -> dict:
    """A checkpoint's meta (the run's settings)."""
    from helios.schedule import checkpoint as C

    meta = C.metadata(ckpt_dir).get("meta", {})
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{ckpt_dir}: its metadata names no model config")
    return meta


def run_weights(ckpt_dir: str) -> dict[str, np.ndarray]:
    """The parameters of a checkpoint, whole, under the trained module's names."""
    from helios.schedule import checkpoint as C

    shapes = {n: s for n, (s, _) in C.global_shapes(ckpt_dir).items() if n.startswith("model.")}
    arrays, _ = C.load(ckpt_dir, {n: (0, int(np.prod(s))) for n, s in shapes.items()})
    return {n[len("model."):]: np.asarray(arrays[n]).reshape(shapes[n]) for n in shapes}


def load_run_weights(ckpt_dir: str, module) -> None:
    """Load a checkpoint's parameters into ``module`` (strict: a CheckpointError lists what differs)."""
    try:
        module.load_state_dict(run_weights(ckpt_dir))
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt_dir}: its weights do not fit the model: {e}") from e


def run_tokenizer_spec(spec: str, identity: str | None) -> str | None:
    """The --tokenizer that gives a finished run's tokenizer back: its spec, or for ``bpe:N`` (which
    would train a new one on other data) the saved BPE file in the tokenizer cache whose identity
    is the run's (None: not found)."""
    if not spec.startswith("bpe:"):
        return spec
    path = find_bpe(identity)
    return str(path) if path is not None else None


def find_bpe(identity: str | None) -> Path | None:
    """The cached BPE tokenizer file whose identity is ``identity`` (None: none)."""
    from helios.fileio import cache_dir
    from helios.tokenizer import BPETokenizer

    if not identity or not identity.startswith("bpe"):
        return None
    n = identity[3:].split("-", 1)[0]
    for f in sorted(cache_dir("tokenizers").glob(f"bpe{n}-*.json")):
        try:
            if BPETokenizer.load(f).identity == identity:
                return f
        except (ValueError, OSError):
            continue
    return None


def run_tokenizer(meta: dict):
    """(tokenizer, its spec) of a finished run (a DataError / CheckpointError when it cannot be had)."""
    from helios.tokenizer import get_tokenizer

    spec = meta.get("cli", {}).get("tokenizer", "byte")
    identity = meta.get("train", {}).get("tokenizer")
    found = run_tokenizer_spec(spec, identity)
    if found is None:
        raise CheckpointError(f"the run's tokenizer {spec} ({identity}) is not in the tokenizer cache any more; "
                              "train it again on the run's data (helios-train --data ... --tokenizer "
                              f"{spec} --steps 1 --out /tmp/x) or pass --tokenizer")
    return get_tokenizer(found), found


@dataclass
class RunModel:
    """A finished run as a Hugging Face model: ``model`` (GPT2LMHeadModel or LlamaForCausalLM, in
    eval mode) with the run's final weights, the run's ``meta``, and the checkpoint read."""

    model: Any
    meta: dict
    ckpt_dir: str


def hf_model_of_run(run_dir: str, device=None) -> RunModel:
    """The run's newest complete checkpoint as a transformers-shaped model: a GPT made by
    helios-train becomes a GPT-2 (tied head; a bias=False GPT gets zero biases, as GPT-2 always
    has them), a LLaMA or a Hugging Face GPT-2 the model it was.  CheckpointError: no checkpoint,
    or a model without a Hugging Face form (a mixture of experts)."""
    from helios.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    ckpt = latest_run_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir}: no complete checkpoint (ckpt/step-N); pass a helios-train run directory")
    meta = run_meta_of(ckpt)
    cfg = meta["config"]
    if meta.get("train", {}).get("moe_experts"):
        raise CheckpointError(f"{run_dir}: a mixture-of-experts run has no Hugging Face GPT-2 form")
    weights = run_weights(ckpt)
    if "model_type" not in cfg:
        c = GPT2Config(vocab_size=cfg["vocab_size"], n_positions=cfg["block_size"], n_embd=cfg["n_embd"],
                       n_layer=cfg["n_layer"], n_head=cfg["n_head"], resid_pdrop=cfg.get("dropout", 0.0),
                       embd_pdrop=cfg.get("dropout", 0.0), attn_pdrop=cfg.get("dropout", 0.0))
        model = GPT2LMHeadModel(c, device=device)
        target = model.transformer
        if not cfg.get("bias", True):  # GPT-2 always has biases: a bias-free GPT's are zero
            for n, p in target.named_parameters():
                if n not in weights and n.endswith(".bias"):
                    weights[n] = np.zeros(p.shape, np.float32)
    elif cfg["model_type"] == "gpt2":
        c = GPT2Config.from_hf(cfg)
        model = GPT2LMHeadModel(c, device=device)
        target = model.transformer if c.tie_word_embeddings else model
    else:
        model = LlamaForCausalLM(LlamaConfig.from_hf(cfg), device=device)
        target = model
    try:
        target.load_state_dict(weights)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt}: its weights do not fit its config: {e}") from e
    return RunModel(model.eval(), meta, ckpt)


def is_run_dir(path: str) -> bool:
    """Whether ``path`` looks like a helios-train run directory (it has a ckpt/ folder)."""
    return os.path.isdir(os.path.join(path, "ckpt"))
