"""helios-train's command line checked as a user's input: every bad value is one line naming
its flag (exit 2, no traceback), and ``--resume`` takes the run's settings from its checkpoint.

The settings that define a run (model size, batch, schedule, seed, data, tokenizer) are saved
in every checkpoint.  ``--resume`` with only ``--out`` continues the run with them; a
setting given again must agree with the checkpoint, else it is refused by name.  Flags that
do not change what is trained (evaluation, sampling, checkpoint cadence, profiling, device,
data-parallel choices) may change on resume.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from helios import _kernels as K
from helios import legacy_checkpoint as single
from helios.errors import DataError, DeviceError
from helios.fileio import read_checkpoint_meta
from helios.runtime import set_device
from helios.schedule import checkpoint as sharded
from helios.tokenizer import HFTokenizer, normalize_spec

_UNSET = object()


def usage(message: str) -> None:
    """A user's mistake on the command line: one line, exit status 2 (as argparse does)."""
    print(f"helios-train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def set_device_flag(spec: str | None, fail: Callable[[str], None]) -> None:
    """A command-line program's ``--device``: make ``spec`` ("vulkan:N", "cuda:N") the current
    device; nothing when it was not given.  A device that cannot open here is the user's flag to
    change: ``fail("--device SPEC: why")`` (one line; ``usage`` here, the program's own elsewhere)."""
    if not spec:
        return
    try:
        set_device(spec)
    except DeviceError as e:
        fail(f"--device {spec}: {e}")


def explicit_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The destinations of the options the user actually gave (argparse leaves an attribute it
    finds already on the namespace alone unless the option appears)."""
    dests = vars(parser.parse_args([]))
    ns = parser.parse_args(argv, namespace=argparse.Namespace(**{k: _UNSET for k in dests}))
    return {k for k, v in vars(ns).items() if v is not _UNSET}


@dataclass(frozen=True)
class Bound:
    """A flag's valid values: ``ok(value)`` is True, else ``need`` says what is expected."""

    dest: str
    flag: str
    ok: Callable[[Any], bool]
    need: str


def _at_least(n):
    return lambda v: v >= n


def _positive(v) -> bool:
    return v > 0 and math.isfinite(v)


def _finite_non_negative(v) -> bool:
    return v >= 0 and math.isfinite(v)


BOUNDS = (
    Bound("steps", "--steps", _at_least(1), "at least 1"),
    Bound("batch_size", "--batch-size", _at_least(1), "at least 1"),
    Bound("block_size", "--block-size", _at_least(2), "at least 2"),
    Bound("grad_accum", "--grad-accum", _at_least(1), "at least 1"),
    Bound("lr", "--lr", _positive, "a positive number"),
    Bound("warmup", "--warmup", _at_least(0), "0 or more steps"),
    Bound("weight_decay", "--weight-decay", _finite_non_negative, "0 or more"),
    Bound("grad_clip", "--grad-clip", _finite_non_negative, "0 (off) or a positive norm"),
    Bound("eval_every", "--eval-every", _at_least(0), "0 (only at the end) or more steps"),
    Bound("eval_batches", "--eval-batches", _at_least(1), "at least 1"),
    Bound("sample_every", "--sample-every", _at_least(0), "0 (only at the end) or more steps"),
    Bound("sample_tokens", "--sample-tokens", _at_least(0), "0 or more"),
    Bound("ckpt_every", "--ckpt-every", _at_least(0), "0 (only at the end) or more steps"),
    Bound("peak_tflops", "--peak-tflops", _positive, "a positive number"),
    Bound("bucket_cap_mb", "--bucket-cap-mb", _positive, "a positive number of MiB"),
    Bound("comm_timeout", "--comm-timeout", _positive, "a positive number of seconds"),
    Bound("stop_after", "--stop-after", _at_least(1), "at least 1"),
    Bound("tp", "--tp", _at_least(1), "at least 1"),
    Bound("pp", "--pp", _at_least(1), "at least 1"),
    Bound("pp_virtual", "--pp-virtual", _at_least(1), "at least 1 (1: the 1F1B schedule)"),
    Bound("microbatches", "--microbatches", _at_least(1), "at least 1"),
    Bound("moe_experts", "--moe-experts", _at_least(0), "0 (a dense MLP) or more experts"),
    Bound("moe_top_k", "--moe-top-k", _at_least(1), "at least 1"),
    Bound("moe_capacity", "--moe-capacity", _positive, "a positive factor"),
    Bound("moe_aux_alpha", "--moe-aux-alpha", _finite_non_negative, "0 or more"),
    Bound("ep", "--ep", _at_least(1), "at least 1"),
    Bound("dp", "--dp", _at_least(1), "at least 1"),
    Bound("cp", "--cp", _at_least(1), "at least 1 (1: off)"),
    Bound("dropout", "--dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
)


def check_bounds(values: dict) -> None:
    """Refuse the first value outside its flag's range (None: not given, nothing to check)."""
    for b in BOUNDS:
        v = values.get(b.dest)
        if v is not None and not b.ok(v):
            usage(f"{b.flag} must be {b.need}, got {v}")


# ---- the process grid: tensor x pipeline x data parallel -----------------------------------
@dataclass(frozen=True)
class Layout:
    """How the ranks split the work: ``tp`` x ``pp`` x ``dp`` ranks, ``microbatches`` per batch
    of each data-parallel replica (the pipeline's micro-batches, or gradient accumulation
    within the batch without a pipeline), ``virtual`` chunks per pipeline rank (above 1: the
    interleaved schedule)."""

    tp: int
    pp: int
    dp: int
    microbatches: int
    virtual: int = 1

    def describe(self) -> str:
        """The layout as the trainer's banner says it, e.g. ``pipeline parallel 2 (4 micro-batches)
        x tensor parallel 2 x data parallel 1``."""
        parts = []
        if self.pp > 1 and self.virtual > 1:
            parts.append(f"pipeline parallel {self.pp} x {self.virtual} virtual stages (interleaved, "
                         f"{self.microbatches} micro-batches)")
        elif self.pp > 1:
            parts.append(f"pipeline parallel {self.pp} ({self.microbatches} micro-batches)")
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}")
        if not parts:
            return "data parallel"
        return " x ".join(parts + [f"data parallel {self.dp}"])


def check_layout(world: int, tp: int, pp: int, microbatches: int | None, zero: int, batch: int, n_layer: int,
                 n_head: int, n_embd: int, virtual: int = 1, n_kv_head: int | None = None,
                 mlp: int | None = None) -> Layout:
    """The layout of ``world`` ranks for --tp, --pp, --microbatches (default: --pp, or 1 without
    a pipeline) and --pp-virtual (``virtual``); a layout that cannot work is refused in one line
    naming its flag.  Every rank runs this before any rank waits for another, so every rank
    refuses alike.  ``n_kv_head`` and ``mlp``: a LLaMA's key/value heads and MLP width (its
    intermediate_size), which --tp splits too (a GPT: its heads, and 4 x n_embd)."""
    if world % tp:
        usage(f"--tp {tp} must divide the number of ranks ({world}): the ranks left over, world / tp, are the "
              "data-parallel replicas")
    split = [("heads (n_head)", n_head)]
    if n_kv_head is not None:
        split.append(("key/value heads (n_kv_head)", n_kv_head))
    split.append(("MLP width (4 x n_embd)", 4 * n_embd) if mlp is None else ("MLP width (intermediate_size)", mlp))
    for what, n in split:
        if n % tp:
            usage(f"--tp {tp} must divide the model's {what}, {n}")
    if (world // tp) % pp:
        left = f"the number of ranks ({world})" if tp == 1 else f"the ranks left by --tp {tp} ({world} / {tp} = {world // tp})"
        usage(f"--pp {pp} must divide {left}: the ranks left over, world / (tp x pp), are the data-parallel replicas")
    if pp > n_layer:
        usage(f"--pp {pp} is more pipeline stages than the model has transformer layers ({n_layer}); use at most "
              f"{n_layer}")
    if virtual > 1:
        check_pipeline_virtual(virtual, pp, n_layer)
    if pp > 1 and zero and world // (tp * pp) < 2:
        usage(f"--zero {zero} with --pp {pp} shards each stage over its data-parallel ranks, and {world} ranks / "
              f"(tp {tp} x pp {pp}) leave one replica: start 2 or more replicas (dp x tp x pp ranks), or use --zero 0")
    if tp > 1 and zero and world // (tp * pp) < 2:
        what = "parameters" if zero == 3 else "optimizer states"
        usage(f"--zero {zero} with --tp {tp} shards each tensor-parallel rank's {what} over its data-parallel "
              f"ranks, and {world} ranks / tp {tp} leave one replica: start 2 or more replicas (dp x tp ranks), or "
              "use --zero 0")
    dp = world // (tp * pp)
    if batch % dp:
        split = " x ".join(f"{flag} {n}" for flag, n in (("--tp", tp), ("--pp", pp)) if n > 1)
        over = f"{dp} ranks" if tp * pp == 1 else f"{dp} data-parallel replicas ({world} ranks / {split})"
        usage(f"--batch-size {batch} does not split evenly over {over}; use a multiple of {dp}")
    m = microbatches if microbatches is not None else pp
    per = batch // dp
    if per % m:
        given = "" if microbatches is not None else f" (the default: --pp {pp})"
        of = f"--batch-size {batch}" if dp == 1 else f"--batch-size {batch} / {dp} data-parallel replicas"
        usage(f"--microbatches {m}{given} must divide the batch of each data-parallel replica, {per} sequences "
              f"({of})")
    if virtual > 1 and m % pp:
        usage(f"--microbatches {m} must be a multiple of --pp {pp} with --pp-virtual {virtual}: the interleaved "
              "schedule runs the micro-batches in groups of --pp (Megatron-LM's rule)")
    return Layout(tp, pp, dp, m, virtual)


def check_pipeline_virtual(virtual: int, pp: int, n_layer: int) -> None:
    """Refuse a --pp-virtual above 1 that helios-train cannot run, naming the flags: it needs a
    pipeline and one transformer layer at least per virtual stage."""
    if pp < 2:
        usage(f"--pp-virtual {virtual} interleaves the stages of a pipeline: give --pp 2 or more")
    if pp * virtual > n_layer:
        usage(f"--pp {pp} x --pp-virtual {virtual} = {pp * virtual} virtual stages, more than the model's "
              f"{n_layer} transformer layers; use --pp-virtual {max(1, n_layer // pp)} or less")


# ---- --resume: the run's own settings ------------------------------------------------------
@dataclass(frozen=True)
class Saved:
    """A setting saved in the checkpoint: its flag, and where the checkpoint's meta keeps it."""

    dest: str
    flag: str
    section: str  # "train" | "config" | "cli"
    key: str


SAVED = (
    Saved("arch", "--arch", "cli", "arch"),
    Saved("init_from", "--init-from", "cli", "init_from"),
    Saved("dropout", "--dropout", "cli", "dropout"),
    Saved("config", "--config", "cli", "config"),
    Saved("data", "--data", "cli", "data"),
    Saved("tokenizer", "--tokenizer", "cli", "tokenizer"),
    Saved("steps", "--steps", "train", "steps"),
    Saved("batch_size", "--batch-size", "train", "batch_size"),
    Saved("block_size", "--block-size", "config", "block_size"),
    Saved("block_size", "--block-size", "cli", "block_size"),  # (a LLaMA's or Hugging Face model's config has none)
    Saved("lr", "--lr", "train", "lr"),
    Saved("warmup", "--warmup", "train", "warmup"),
    Saved("grad_accum", "--grad-accum", "train", "grad_accum"),
    Saved("seed", "--seed", "train", "seed"),
    Saved("weight_decay", "--weight-decay", "train", "weight_decay"),
    Saved("grad_clip", "--grad-clip", "train", "grad_clip"),
    Saved("moe_experts", "--moe-experts", "train", "moe_experts"),
    Saved("moe_top_k", "--moe-top-k", "train", "moe_top_k"),
    Saved("moe_capacity", "--moe-capacity", "train", "moe_capacity"),
    Saved("moe_aux_alpha", "--moe-aux-alpha", "train", "moe_aux_alpha"),
    Saved("dtype", "--dtype", "cli", "dtype"),
)


PP_BALANCE = ("params", "time")


def check_pp_balance(balance: str, pp: int) -> None:
    """Refuse a --pp-balance helios-train cannot use, naming the flag: ``params`` (parameter
    counts, the default) or ``time`` (each layer's measured forward and backward), and only with
    a pipeline to balance."""
    if balance not in PP_BALANCE:
        usage(f"--pp-balance must be {' or '.join(PP_BALANCE)}, got {balance!r}")
    if balance != "params" and pp < 2:
        usage(f"--pp-balance {balance} balances the stages of a pipeline: give --pp 2 or more")


def check_experts(experts: int, top_k: int, ep: int, tp: int, pp: int, world: int = 1, zero: int = 0) -> None:
    """Refuse a mixture-of-experts setting helios-train cannot run, naming the flag.  ``--ep``
    splits each layer's experts over that many data-parallel ranks (it must divide them; with
    --pp, the data-parallel ranks of each stage).  With --tp each expert's MLP is split over
    the tensor-parallel ranks as the dense MLP is (also with --sequence-parallel).  --zero 1|2|3
    with --ep shards the expert parameters over the ranks that hold the same experts (the
    data-parallel ranks / ep) and the dense ones over every data-parallel rank, as
    DeepSpeed-MoE does (stage 3 gathers each over its own ranks); with --tp too, each
    tensor-parallel rank's shards over the data-parallel ranks of that tensor-parallel rank
    (its experts' shards over those holding the same experts)."""
    if ep > 1:
        if not experts:
            usage(f"--ep {ep} splits the experts of a mixture-of-experts model over ranks: give --moe-experts too")
        if experts % ep:
            usage(f"--ep {ep} must divide --moe-experts {experts} (each rank holds the same number of experts)")
        dp = world // max(1, tp * pp)
        if dp % ep:
            usage(f"--ep {ep} must divide the data-parallel ranks ({dp}): expert parallelism splits them, as "
                  "DeepSpeed-MoE and Megatron-LM do")
    if not experts:
        return
    if top_k > experts:
        usage(f"--moe-top-k {top_k} is more than --moe-experts {experts}: a token cannot go to more experts than exist")


def check_sequence_parallel(tp: int, block_size: int) -> None:
    """Refuse --sequence-parallel where it cannot apply, naming the flag.  (With --pp the stages
    pass each tensor-parallel rank's block-size / tp positions.)"""
    if tp < 2:
        usage("--sequence-parallel splits the sequence over tensor-parallel ranks: give --tp 2 or more")
    if block_size % tp:
        usage(f"--sequence-parallel: --block-size {block_size} must be a multiple of --tp {tp} (each rank holds "
              "block-size / tp positions)")


def check_data_parallel(dp: int | None, world: int, tp: int, pp: int, cp: int) -> None:
    """Refuse a --dp that does not match the ranks: dp x tp x pp x cp must be the world size
    (--dp only confirms what the launcher's world gives; its default is world / (tp x pp x cp))."""
    if dp is None:
        return
    if dp * tp * pp * cp != world:
        parts = " x ".join(f"{flag} {n}" for flag, n in (("--dp", dp), ("--tp", tp), ("--pp", pp), ("--cp", cp))
                           if n > 1 or flag == "--dp")
        n = dp * tp * pp * cp
        ranks = f"{n} rank{'s' if n != 1 else ''}"
        usage(f"{parts} = {ranks}, but the job has {world}: start {ranks} (helios-run --nproc-per-node) or drop "
              "--dp (it defaults to the ranks left over)")


def check_context_parallel(cp: int, layout: str, world: int, block_size: int, n_head: int, n_embd: int, args) -> None:
    """Refuse a --cp setting helios-train cannot run, naming the flag: context parallelism splits
    each sequence over --cp ranks (ring attention) and composes with data parallel only."""
    if cp == 1:
        return
    if world % cp:
        usage(f"--cp {cp} must divide the number of ranks ({world}): the ranks left over, world / cp, are the "
              "data-parallel replicas")
    for flag, n in (("--tp", args.tp), ("--pp", args.pp), ("--zero", args.zero), ("--moe-experts", args.moe_experts)):
        if n and (flag in ("--zero", "--moe-experts") or n > 1):
            usage(f"--cp {cp} with {flag} {n}: context parallelism composes with data parallel only so far "
                  f"(drop {flag})")
    if args.dtype != "fp32":
        usage(f"--cp {cp} with --dtype {args.dtype}: ring attention trains in fp32 only so far (use --dtype fp32)")
    if args.attention not in ("auto", "flash"):
        usage(f"--cp {cp} with --attention {args.attention}: ring attention runs the flash kernel on each block "
              "(drop --attention)")
    head_dim = n_embd // n_head
    if head_dim not in K.FLASH_HEAD_DIMS:
        usage(f"--cp {cp}: ring attention needs a head dim of {', '.join(map(str, K.FLASH_HEAD_DIMS))}; this model's "
              f"n_embd / n_head is {n_embd} / {n_head} = {head_dim}")
    chunks = 2 * cp if layout == "zigzag" else cp
    if block_size % chunks:
        usage(f"--block-size {block_size} must be a multiple of {chunks} for --cp {cp} --cp-layout {layout} (each "
              f"rank holds {'two' if layout == 'zigzag' else 'one'} of {chunks} equal chunks of every sequence)")


def cli_settings(args, block_size: int) -> dict:
    """What the checkpoint keeps of the command line besides the model and training settings."""
    return {"config": args.config, "data": os.path.abspath(args.data) if args.data is not None else None,
            "tokenizer": normalize_spec(args.tokenizer), "dtype": args.dtype, "arch": args.arch,
            "init_from": os.path.abspath(args.init_from) if args.init_from is not None else None,
            "dropout": args.dropout, "block_size": block_size}


def checkpoint_meta(run_dir: str) -> dict | None:
    """The meta of the checkpoint ``--resume`` would continue from (None when there is none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a newer incomplete one: the trainer reports it when it loads
        found = sharded.latest_complete(run_dir)
    if found is not None:
        return sharded.metadata(found[1]).get("meta", {})
    if single.has_checkpoint(run_dir):
        return read_checkpoint_meta(single.checkpoint_path(run_dir))
    return None


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and float(a) == float(b)
    return a == b


def adopt_saved_settings(args, given: set[str], meta: dict, run_dir: str) -> dict | None:
    """Set ``args`` to the checkpoint's settings; a flag the user gave that disagrees is
    refused by name.  Returns the checkpoint's model config (None when it has none)."""
    for s in SAVED:
        section = meta.get(s.section)
        if not isinstance(section, dict) or s.key not in section:
            continue  # a checkpoint of an earlier Helios: the flag (or its default) stands
        value = section[s.key]
        mine = getattr(args, s.dest)
        if s.dest in ("data", "init_from") and mine is not None:
            mine = os.path.abspath(mine)
        if s.dest == "tokenizer":  # hf:PATH is saved with an absolute path
            mine = normalize_spec(mine)
        if s.dest in given and not _same(mine, value):
            shown = "the standard library" if s.dest == "data" and value is None else value
            usage(f"{s.flag} {getattr(args, s.dest)}: the run in {run_dir} was trained with {s.flag} {shown}; "
                  f"--resume continues a run with its own settings: drop {s.flag}, or train a new run in another --out")
        setattr(args, s.dest, value)
    cfg = meta.get("config")
    return cfg if isinstance(cfg, dict) else None


# ---- what the device can hold --------------------------------------------------------------
def largest_activation(batch: int, block: int, n_head: int, n_embd: int, vocab: int,
                       dense_attention: bool = True, mlp: int | None = None) -> tuple[int, str]:
    """Bytes and name of the largest fp32 tensor one micro-batch's forward makes (each must fit
    one storage-buffer binding): attention scores B·H·T² (only on the dense attention path:
    the flash kernel keeps none), logits B·T·V, MLP hidden B·T·4C (``mlp``: another MLP width,
    a LLaMA's intermediate_size)."""
    width = "4 x embedding" if mlp is None else "intermediate size"
    sizes = {"logits (batch x block x vocabulary)": batch * block * vocab * 4,
             f"MLP activations (batch x block x {width})": batch * block * (4 * n_embd if mlp is None else mlp) * 4}
    if dense_attention:
        sizes["attention scores (batch x heads x block x block)"] = batch * n_head * block * block * 4
    name = max(sizes, key=sizes.get)
    return sizes[name], name


def largest_block_that_fits(limit: int, batch: int, n_head: int, n_embd: int, vocab: int,
                            dense_attention: bool = True, mlp: int | None = None) -> int:
    """The largest block size whose activations each fit ``limit`` bytes."""
    t = int(math.isqrt(limit // (4 * batch * n_head))) if dense_attention else limit
    return min(t, limit // (4 * batch * vocab), limit // (4 * batch * (4 * n_embd if mlp is None else mlp)))


def check_fits(limit: int, batch: int, block: int, n_head: int, n_embd: int, vocab: int | None,
               dense_attention: bool = True, cp: int = 1, mlp: int | None = None) -> None:
    """Refuse a --block-size / --batch-size whose activations exceed the device's largest binding
    (with --cp N a rank holds block / N tokens of each sequence)."""
    v = vocab or 256
    need, what = largest_activation(batch, block // cp, n_head, n_embd, v, dense_attention, mlp)
    if need > limit:
        best = largest_block_that_fits(limit, batch, n_head, n_embd, v, dense_attention, mlp) * cp
        hint = " or --attention flash" if dense_attention else ""
        usage(f"--block-size {block}: one micro-batch of {batch} sequences makes {what} of {need:,} bytes, more than "
              f"this device binds at once ({limit:,} bytes, its maxStorageBufferRange); the largest block size that "
              f"fits is {best} (or lower --batch-size{hint})")


def vocab_of_spec(spec: str) -> int | None:
    """The vocabulary a --tokenizer spec gives, when known without training it (a Hugging Face
    tokenizer.json is read: it takes milliseconds)."""
    if spec == "byte":
        return 256
    if spec.startswith("bpe:") and spec[4:].isdigit():
        return int(spec[4:])
    if spec.startswith("hf:"):
        try:
            return HFTokenizer(spec[3:]).vocab_size
        except DataError:
            return None  # said when the data is loaded
    return None
