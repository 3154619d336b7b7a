"""helios-train's setup, in the order a run makes it: the settings (the flags, the named config, a
resumed run's own settings, every check that needs no other rank), the job (the process group and
the device), the data, and the model in its parallel layout (experts, tensor / context / pipeline
parallel, then ZeRO or DistributedDataParallel and the optimizer).

Every check in :func:`resolve_settings` runs on every rank before any rank waits for another, so
every rank refuses a bad command line alike (one line naming the flag, exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import helios as hl
import helios.comm as dist
from helios import train_settings as settings
from helios.data import ShardSet, check_token_data, open_data, prepare_dataset, shard_tokenizer
from helios.nn import GPT, GPTConfig
from helios.nn.modules import FLASH_MIN_TRAIN_T
from helios.optim import AdamW
from helios.runtime import get_runtime
from helios.schedule import DistributedDataParallel
from helios.schedule.compression import parse_spec
from helios.schedule.context_parallel import use_context_parallel
from helios.schedule.dist_run import DistRun
from helios.schedule.grid import ParallelGrid
from helios.schedule.moe import expert_parameter_names, use_experts
from helios.schedule.pipeline import InterleavedPipelineStage, PipelineStage, layer_times
from helios.schedule.tensor_parallel import TensorParallelGPT, TensorParallelLlama, full_shape
from helios.schedule.zero import ZeroDataParallel
from helios import train_model
from helios.tokenizer import check_spec
from helios.train_report import profile_window, quiet
from helios.train_settings import check_bounds, set_device_flag, usage


# ---- settings ------------------------------------------------------------------------------
@dataclass
class Settings:
    """What the command line (and a resumed run's checkpoint) asks for, checked."""

    cfgd: dict  # the named config (a resumed run's model sizes)
    steps: int  # the run's last step
    bs: int  # sequences per global batch (over every replica)
    T: int  # context length
    lr_max: float
    warmup: int
    comm_hook: Any  # --grad-compression's hook; None: uncompressed (also on one rank)
    world: int  # ranks the launcher started
    layout: settings.Layout  # tensor x pipeline x data parallel, micro-batches
    spec: train_model.ModelSpec = None  # what the run trains (--arch, --config, --init-from, a resumed run's)

    @property
    def pipeline(self) -> bool:
        return self.layout.pp > 1

    @property
    def micro_rows(self) -> int:
        """Sequences per micro-batch on each replica."""
        return self.bs // self.layout.dp // self.layout.microbatches


def resolve_settings(args: argparse.Namespace, given: set[str], configs: dict) -> Settings:
    """The run's settings from the flags (``given``: those the user typed), ``configs[args.config]``
    and, with --resume, the checkpoint's; a bad value or combination exits 2 naming its flag."""
    check_bounds(vars(args))
    saved_cfg = None
    if args.resume:
        meta = settings.checkpoint_meta(args.out)
        if meta is not None:  # continue the run with its own settings (a flag given again must agree)
            saved_cfg = settings.adopt_saved_settings(args, given, meta, args.out)
    cfgd = dict(configs[args.config])
    if saved_cfg is not None:
        if "model_type" in saved_cfg:  # a LLaMA's, or a Hugging Face GPT-2's: rebuilt from its config
            spec = train_model.spec_of_config(saved_cfg, f"the run in {args.out}")
        else:
            cfgd.update({k: saved_cfg[k] for k in ("n_layer", "n_head", "n_embd") if k in saved_cfg})
            spec = train_model.preset_spec("gpt", args.config, {args.config: cfgd})
    elif args.init_from is not None:
        spec = train_model.init_spec(args.init_from, args, given, configs)
    else:
        spec = train_model.preset_spec(args.arch, args.config, configs)
    cfgd.update(n_layer=spec.n_layer, n_head=spec.n_head, n_embd=spec.n_embd)
    steps = args.steps if args.steps is not None else cfgd["steps"]
    bs = args.batch_size if args.batch_size is not None else cfgd["batch_size"]
    T = args.block_size if args.block_size is not None else cfgd["block_size"]
    lr_max = args.lr if args.lr is not None else cfgd["lr"]
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    check_bounds({"steps": steps, "batch_size": bs, "block_size": T})
    train_model.check_spec(spec, args, T)
    train_model.check_vocab(spec, args.tokenizer, settings.vocab_of_spec(args.tokenizer))
    profile_window(args, int(meta.get("step", 0)) if saved_cfg is not None else 0, steps, quiet)  # checked early
    _check_data(args, T)
    try:
        comm_hook = parse_spec(args.grad_compression)
    except ValueError as e:
        usage(str(e))
    if comm_hook is not None and args.zero:
        usage(f"--grad-compression {args.grad_compression} compresses plain data parallel's all-reduce; it does not "
              f"combine with --zero {args.zero} (use --zero 0)")

    world = DistRun.launch_world()
    settings.check_context_parallel(args.cp, args.cp_layout, world, T, cfgd["n_head"], cfgd["n_embd"], args)
    settings.check_data_parallel(args.dp, world, args.tp, args.pp, args.cp)
    # Context-parallel peers hold one replica's sequences between them: to the layout, one rank.
    layout = settings.check_layout(world // args.cp, args.tp, args.pp, args.microbatches, args.zero, bs,
                                   cfgd["n_layer"], cfgd["n_head"], cfgd["n_embd"], virtual=args.pp_virtual,
                                   n_kv_head=spec.n_kv_head, mlp=spec.mlp)
    settings.check_pp_balance(args.pp_balance, args.pp)
    settings.check_experts(args.moe_experts, args.moe_top_k, args.ep, args.tp, args.pp, world, args.zero)
    if args.sequence_parallel:
        settings.check_sequence_parallel(args.tp, T)
    if layout.pp > 1 and comm_hook is not None:
        usage(f"--grad-compression {args.grad_compression} compresses DistributedDataParallel's buckets; with --pp "
              f"{args.pp} a stage's gradients are all-reduced once after the pipeline flushes, uncompressed (use "
              "--grad-compression none)")
    return Settings(cfgd, steps, bs, T, lr_max, warmup, comm_hook, world, layout, spec)


def _check_data(args: argparse.Namespace, T: int) -> None:
    """--data exists and is not empty, and --tokenizer is a spec (a DataError names what is
    wrong); token shards' headers are read, and their ids checked against the tokenizer's
    vocabulary and their lengths against the block size, here on every rank (cheap after the
    first run: the largest id of a shard set is cached)."""
    source = None
    if args.data is not None:
        try:
            source = open_data(args.data)
        except FileNotFoundError as e:
            usage(str(e))
    check_spec(args.tokenizer)
    if isinstance(source, ShardSet):
        check_token_data(source, shard_tokenizer(source, args.tokenizer), T, spec=args.tokenizer,
                         progress=not args.no_progress)


# ---- the job: process group and device -----------------------------------------------------
@dataclass
class Job:
    """This process's place in the run: the process group, the device runtime, and ``say``
    (print on rank 0, nothing elsewhere)."""

    run: DistRun
    rt: Any
    say: Callable
    t_start: float  # when training setup began (the summary's wall time counts from here)


def open_job(args: argparse.Namespace, s: Settings) -> Job:
    """Join the process group (when a launcher started this rank), open the device, and refuse
    a block or batch the device cannot hold, before the data is read."""
    run = DistRun.from_env(timeout=args.comm_timeout)
    if args.zero and not run.active:
        print("helios-train: --zero shards across data-parallel ranks; alone it changes nothing", file=sys.stderr)
    if s.comm_hook is not None and not run.active:
        print("helios-train: --grad-compression compresses what data-parallel ranks exchange; alone it changes nothing",
              file=sys.stderr)
        s.comm_hook = None
    say = print if run.is_main else quiet
    set_device_flag(args.device, usage)
    rt = get_runtime()
    # Before the data is read: a block or batch the device cannot hold is the user's to change.
    cfgd, T, layout, world = s.cfgd, s.T, s.layout, s.world
    head_dim = s.spec.head_dim
    if s.spec.arch == "llama":  # scaled_dot_product_attention: flash where it takes the head dim
        dense_attention = head_dim not in hl._kernels.FLASH_HEAD_DIMS
    else:
        dense_attention = args.cp == 1 and (args.attention == "dense" or head_dim not in hl._kernels.FLASH_HEAD_DIMS
                                            or (args.attention == "auto" and T < FLASH_MIN_TRAIN_T))
    settings.check_fits(rt.max_range, max(1, s.bs // (world // args.cp // layout.pp) // layout.microbatches), T,
                        cfgd["n_head"], cfgd["n_embd"], s.spec.vocab or settings.vocab_of_spec(args.tokenizer),
                        dense_attention, args.cp, mlp=s.spec.mlp)
    os.makedirs(args.out, exist_ok=True)
    return Job(run, rt, say, time.monotonic())


# ---- data ----------------------------------------------------------------------------------
def load_data(args: argparse.Namespace, job: Job, s: Settings | None = None):
    """The tokenized corpus (helios.data.Dataset).  Rank 0 tokenizes first (and fills the cache);
    the others then read it.  An --init-from model's vocabulary must be the tokenizer's."""
    run = job.run
    if not run.is_main:
        run.barrier()
    ds = prepare_dataset(args.data, args.tokenizer, progress=not args.no_progress and run.is_main)
    if run.is_main:
        run.barrier()
    if s is not None and not args.resume:
        train_model.check_vocab(s.spec, args.tokenizer, ds.tokenizer.vocab_size, ds.tokenizer.identity)
    V = ds.tokenizer.vocab_size
    if V % args.tp:
        usage(f"--tp {args.tp} must divide the vocabulary size, {V} (--tokenizer {args.tokenizer})")
    return ds


# ---- the model in its parallel layout ------------------------------------------------------
@dataclass
class Model:
    """The model as this rank trains it, and the groups its layout spans."""

    cfg: GPTConfig
    run_meta: dict  # the settings a checkpoint saves and --resume compares
    gpt: Any  # this rank's part: the GPT, its tensor-parallel shards or its pipeline stage
    n_params: int  # the whole model's, wherever its parameters live
    fpt: float  # FLOPs per token, the whole model's
    zero: int  # the ZeRO stage in effect (0 on one rank)
    whole: Any = None  # the whole model (a resumed run loads it by name); None once resumed
    model: Any = None  # what runs forward and backward: gpt, or its data-parallel wrapper
    opt: Any = None  # AdamW, or ZeroDataParallel (model wrapper and optimizer in one)
    grid: Any = None  # the ParallelGrid, with several ranks
    cp: Any = None  # the context-parallel state, with --cp
    times: Any = None  # each layer's measured time (--pp-balance time)
    tensor_parallel: bool = False  # tensors sharded over tp_group (tensor or expert parallel)
    tp_group: Any = None  # (None is also the world's group: test tensor_parallel)
    tp_rank: int = 0
    ep_group: Any = None  # the expert-parallel group (--ep)
    edp_group: Any = None  # the ranks holding the same experts
    autocast: Callable = None  # --dtype's autocast context factory
    scaler: Any = None  # --dtype's loss scaler (a pass-through but for fp16)


def build_model(args: argparse.Namespace, s: Settings, job: Job, ds) -> Model:
    """The GPT (seeded by --seed), split over the ranks as the layout says and wrapped for data
    parallelism, with its optimizer; every rank first checks that all agree on the run."""
    run = job.run
    built = None
    if s.spec.arch != "gpt" or s.spec.hf is not None or s.spec.init is not None or s.spec.gpt is not None:
        # a LLaMA, a Hugging Face model, or a GPT of another run: helios.train_model builds it
        built = train_model.build(s.spec, ds.tokenizer.vocab_size, s.T, args, args.seed)
        cfg = built.cfg
        run_meta = _run_meta(args, s, built.meta_config, ds)
    else:
        cfgd = s.cfgd
        cfg = GPTConfig(vocab_size=ds.tokenizer.vocab_size, block_size=s.T, n_layer=cfgd["n_layer"],
                        n_head=cfgd["n_head"], n_embd=cfgd["n_embd"], dropout=args.dropout, attention=args.attention)
        # The attention kernel changes no weight: a run may resume with another one.
        run_meta = _run_meta(args, s, {k: v for k, v in cfg.to_dict().items() if k != "attention"}, ds)
    run.check_same({**run_meta, "zero": args.zero, "bucket_cap_mb": args.bucket_cap_mb, "resume": args.resume,
                    "out": os.path.abspath(args.out),
                    "grad_compression": s.comm_hook.spec if s.comm_hook else "none",
                    "tp": args.tp, "pp": args.pp, "pp_virtual": args.pp_virtual, "microbatches": s.layout.microbatches,
                    "sequence_parallel": args.sequence_parallel, "pp_balance": args.pp_balance})
    hl.manual_seed(args.seed)
    if built is None:
        gpt = GPT(cfg, seed=args.seed)
        fpt = gpt.flops_per_token()
    else:
        gpt, fpt = built.module, built.fpt
        for note in s.spec.notes + built.notes:  # the tokenizer and weights it brings
            job.say(f"--init-from: {note}")
    m = Model(cfg, run_meta, gpt, gpt.num_parameters(), fpt,  # the whole model's, whatever the split
              zero=args.zero if run.active else 0)
    _split_model(args, s, job, m)
    _wrap_data_parallel(args, s, job, m)
    return m


def _run_meta(args: argparse.Namespace, s: Settings, model_config: dict, ds) -> dict:
    """The settings that define the run, as every checkpoint saves them (``model_config``: the
    model's, see helios.train_model)."""
    run_meta = {"config": model_config, "train": {"steps": s.steps, "batch_size": s.bs, "lr": s.lr_max,
                "warmup": s.warmup, "grad_accum": args.grad_accum, "seed": args.seed,
                "tokenizer": ds.tokenizer.identity, "weight_decay": args.weight_decay, "grad_clip": args.grad_clip},
                "data": ds.corpus.fingerprint, "cli": settings.cli_settings(args, s.T)}
    if args.moe_experts:  # only then: a dense run's checkpoint meta stays as it was
        run_meta["train"].update(moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                                 moe_capacity=args.moe_capacity, moe_aux_alpha=args.moe_aux_alpha)
    return run_meta


def _split_model(args: argparse.Namespace, s: Settings, job: Job, m: Model) -> None:
    """Experts, then tensor / context parallel, then this rank's pipeline stage; sets ``m.gpt`` to
    this rank's part and the groups its tensors are sharded over."""
    run, cfg, layout = job.run, m.cfg, s.layout
    expert_group = None
    if run.active:  # every group of the job, in one place (TP innermost, then CP, DP, PP)
        m.grid = ParallelGrid(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep if args.moe_experts else 1)
        run.use_data_parallel_coords(m.grid.dp_rank, m.grid.dp)  # context-parallel peers read the same rows
    if args.moe_experts:
        if args.ep > 1:  # each rank holds 1/ep of every layer's experts
            # over each stage's data-parallel ranks (with --tp, those of this rank's tensor-parallel place)
            m.ep_group, m.edp_group = m.grid.ep_group, m.grid.edp_group
            if args.tp > 1:  # the ranks that hold the pieces of one replica's experts
                expert_group = m.grid.expert_tp_group
        use_experts(m.gpt, args.moe_experts, args.moe_top_k, args.moe_capacity, args.moe_aux_alpha,
                    ep_group=m.ep_group)
        # a token runs top-k experts (each the size of the dense MLP) and the router
        mlp_weights = 8 * cfg.n_embd * cfg.n_embd * cfg.n_layer
        m.fpt += 6 * ((args.moe_top_k - 1) * mlp_weights + cfg.n_embd * args.moe_experts * cfg.n_layer)
        m.n_params = sum(int(np.prod(full_shape(p))) for p in m.gpt.parameters())  # every expert, wherever it lives
    init = s.spec.init
    if init is not None and init[0] == "run" and not args.resume:
        # another run's weights (with its experts, if it had them), before they are split over the ranks
        train_model.load_run_weights(init[1], m.gpt)
    if run.active:
        if args.cp > 1:  # (with tp = pp = 1) context-parallel peers are neighbouring ranks, as Megatron-LM puts them
            m.cp = use_context_parallel(m.gpt, m.grid.cp_group, args.cp_layout)
        if args.tp > 1 and s.spec.arch == "llama":  # this rank's heads, MLP features and vocabulary rows
            m.gpt = TensorParallelLlama(m.gpt, m.grid.tp_group)
        elif args.tp > 1:
            m.gpt = TensorParallelGPT(m.gpt, m.grid.tp_group, sequence_parallel=args.sequence_parallel,
                                      expert_group=expert_group)  # this rank's shards (experts' hidden features too)
    m.whole = m.gpt  # the whole model (a resumed run loads it by name; then only the stage's layers stay)
    if s.pipeline:
        if args.pp_balance == "time":  # rank 0 measures (with the others if its layers need them), all take its figures
            micro = (s.micro_rows, s.T)
            m.times = times = layer_times(m.whole, np.random.default_rng(args.seed).integers(0, cfg.vocab_size, micro),
                                          reps=5, warmup=1)
            job.say(f"pipeline balance: each layer's forward + backward measured on this device (rank 0's figures, "
                    f"shared with every rank), one micro-batch of {micro[0]} x {micro[1]} tokens, median of 5 after 1 "
                    f"warm-up: embeddings {times[0] * 1e3:.1f} ms, blocks "
                    f"{', '.join(f'{v * 1e3:.1f}' for v in times[1:-1])} ms, "
                    f"final LayerNorm + output layer + loss {times[-1] * 1e3:.1f} ms")
        # this rank's layers (its chunks under --pp-virtual), under the whole model's names
        m.gpt = (InterleavedPipelineStage(m.whole, m.grid, layout.virtual, weights=m.times) if layout.virtual > 1
                 else PipelineStage(m.whole, m.grid, weights=m.times))
    m.tensor_parallel = m.grid is not None and args.tp > 1
    m.tp_group = m.grid.tp_group if m.tensor_parallel else None  # (None is also the world's group: test the flag)
    m.tp_rank = m.grid.tp_rank if m.tensor_parallel else 0
    if m.ep_group is not None and args.tp == 1:
        # Expert tensors are sharded over the expert-parallel group the way tensor-parallel ones
        # are over theirs: checkpoints gather them whole, the norm sums each shard once.  (With
        # --tp their layouts name the group they are sharded over themselves.)
        m.tensor_parallel, m.tp_group, m.tp_rank = True, m.ep_group, dist.get_rank(m.ep_group)


def _wrap_data_parallel(args: argparse.Namespace, s: Settings, job: Job, m: Model) -> None:
    """The optimizer over two groups (matrices decayed, the rest not) and the data-parallel
    wrapper: ZeroDataParallel (wrapper and optimizer in one) with --zero, else DistributedDataParallel
    over the replicas (a pipeline averages its stage's gradients itself) and AdamW."""
    run, gpt, pipeline = job.run, m.gpt, s.pipeline
    decay = [p for n, p in gpt.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in gpt.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    m.model = gpt
    if m.zero:
        # Model wrapper and optimizer in one: it owns the parameters' flat buffer and the shards.
        # (With --tp or --pp, over the data-parallel ranks that hold the same shards of the same stage.)
        replicas = None
        if m.ep_group is not None:
            # Each rank's experts are replicated over the ranks holding the same experts only: sharded
            # over that group (DeepSpeed-MoE's expert-data-parallel group), the rest over every replica.
            replicas = {n: m.edp_group for n in expert_parameter_names(gpt)}
        m.model = m.opt = ZeroDataParallel(gpt, m.zero, groups, lr=s.lr_max, betas=(0.9, 0.95),
                                           bucket_cap_mb=args.bucket_cap_mb,
                                           group=m.grid.dp_cp_group if args.tp > 1 or pipeline else None,
                                           param_replicas=replicas)
        if pipeline and m.zero == 3:  # the stage runs its blocks itself: each pass in the optimizer's forward scope
            gpt.pass_scope, gpt.sum_tied_locally = m.opt.forward_scope, False
            # (interleaved: each backward runs one chunk, and reduces that chunk's gradients only)
            gpt.chunk_scope = m.opt.chunk_scope
        return
    if run.active and m.grid.dp * m.grid.cp > 1 and not pipeline:  # a pipeline averages after its flush (train_step)
        experts = []
        if m.ep_group is not None:  # each rank's own experts: averaged over their replicas after backward
            experts = expert_parameter_names(gpt)
        m.model = DistributedDataParallel(gpt, bucket_cap_mb=args.bucket_cap_mb, comm_hook=s.comm_hook,
                                          group=m.grid.dp_cp_group, params_to_ignore=experts)
    m.opt = AdamW(groups, lr=s.lr_max, betas=(0.9, 0.95))
