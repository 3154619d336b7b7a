"""helios-train: train a GPT from scratch on the default device.

    helios-train                          # the `tiny` config on the Python standard library's source
    helios-train --steps 50 --out runs/a --trace runs/a/trace.json --profile-steps 10:20
    helios-train --out runs/a --resume    # continue bit-exactly from runs/a's checkpoint
    helios-run --nproc-per-node 2 -m helios.train --out runs/dp2   # data parallel over 2 ranks
    helios-run --nproc-per-node 4 -m helios.train --tp 2 --pp 2 --microbatches 8 --out runs/3d
    helios-run --nproc-per-node 2 -m helios.train --pp 2 --pp-virtual 2 --microbatches 4   # interleaved

Each step is split into timed phases (forward, backward, grad_clip, optimizer, replay,
data_load, host->device, device->host, checkpoint, sample_gen; idle is the rest).
Execution is deferred: the device phases are timed by device timestamps written into the
command stream at their start and end (helios.profile.timers), so no phase waits, and on a
GPU a step's loss is read once the next step's work is recorded: the host records step
k+1 (and uploads its batch) while the device runs step k.  The log line and run.db row of
a step then come one step later in wall time, with the same values; steps that evaluate,
sample, checkpoint or end the run are read at once.  On a CPU device (lavapipe), where
that overlap measured slower, each step is read before the next is recorded
(HELIOS_DEFER_STEPS=1 / 0 forces either way).  Where the device writes no timestamps,
with several ranks, --pp, --zero, --moe-experts, --dtype fp16, inside the --profile-steps
window, or with HELIOS_PHASE_SYNC=1, each device phase ends with a device synchronisation
instead (the phase then owns the device time of the work it recorded).  Ctrl-C finishes
the step, saves a checkpoint and exits with status 130.

Started by a launcher (helios-run, srun, mpirun), every rank joins the process group
and trains a replica with DistributedDataParallel: the global batch (--batch-size x
--grad-accum sequences) is split across the ranks, rank r taking its contiguous slice of
every global batch, so N ranks see exactly the data one rank would.  Only rank 0 prints,
samples and writes the run database (which holds every rank's step timing).

--tp splits each layer over tensor-parallel ranks and --pp the layers into pipeline stages
trained with the 1F1B schedule over --microbatches micro-batches of each replica's batch
(--pp-virtual v: each rank holds v chunks of layers, Megatron-LM's interleaved schedule);
the ranks left over are data parallel.  --sequence-parallel with --tp splits the residual
stream along the sequence (with --pp too: the stages pass each tensor-parallel rank's
positions).  --zero 1|2|3 with --pp shards each stage over its
data-parallel ranks (--zero 3 with --pp-virtual too: each chunk's backward reduces that chunk's
gradients), --zero 1|2|3 with --tp each tensor-parallel rank's shards, --zero 1|2|3 with --ep
the experts over the ranks holding the same experts and the rest over every replica (with --tp too:
each TP rank's shards, its experts over its ranks holding the same experts).  --moe-experts with
--tp splits each expert's MLP over the tensor-parallel ranks as the dense MLP is.  --dtype bf16 and
fp16 run with every layout but --cp (a pipeline's stages forward under the same autocast; fp16's
loss scaler agrees on inf/nan over the ranks whose gradients differ).  Checkpoints
always hold the whole model's tensors under one device's names, so a run resumes on any layout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time

import numpy as np

from helios import train_settings as settings
from helios.nn.modules import ATTENTION_KINDS, FLASH_MIN_TRAIN_T, parse_attention
from helios.train_settings import check_bounds, explicit_flags, usage

def _attention_spec(text: str) -> str:
    """argparse type of --attention: the spec itself, checked by parse_attention."""
    try:
        parse_attention(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


CONFIGS = {
    "nano": dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, steps=200, lr=3e-3),
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16, steps=1200, lr=2e-3),
    "small": dict(n_layer=6, n_head=6, n_embd=192, block_size=128, batch_size=16, steps=2000, lr=1e-3),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=8, steps=20000, lr=6e-4),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helios-train", description="Train a GPT from scratch with Helios.")
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS), help="named model/training size (default tiny)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the config's)")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--block-size", type=int, help="context length in tokens")
    p.add_argument("--lr", type=float, help="peak learning rate (cosine schedule with linear warmup)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="compute precision: bf16 / fp16 run the matmuls in 16 bits under hl.autocast (float32 "
                        "master weights, softmax, norms and loss); fp16 scales the loss (hl.amp.GradScaler, "
                        "skipping a step whose gradients overflow)")
    p.add_argument("--device", default=None, help="vulkan:N or cuda:N (default: HELIOS_DEVICE or the best Vulkan device; "
                   "cuda:N needs NVIDIA's driver, or HELIOS_CUDA_DEVICE=emulator for the slow CPU emulator)")
    p.add_argument("--data", default=None, help="a text file or folder (default: this Python's standard library source)")
    p.add_argument("--tokenizer", default="byte", help="byte | bpe:N")
    p.add_argument("--out", default="runs/default", help="run directory: checkpoint, run database, trace")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--sample-every", type=int, default=0, help="print a text sample every N steps (0: only at the end)")
    p.add_argument("--sample-tokens", type=int, default=120)
    p.add_argument("--ckpt-every", type=int, default=200, help="checkpoint every N steps (and at the end)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: from the device table)")
    p.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps to this path")
    p.add_argument("--profile-steps", default=None, help="steps to profile per dispatch, e.g. 10:20")
    p.add_argument("--profile-host-only", action="store_true",
                   help="profile without per-dispatch device timestamps (which serialise lavapipe's queue and "
                        "hide the overlap of backward and gradient communication)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--no-capture", action="store_true",
                   help="run every step through Python and autograd; by default a one-rank fp32/bf16 step (all its "
                        "micro-batches) is captured once (hl.graph) and its device work replayed (same losses)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage across data-parallel ranks: 0 plain DDP, 1 shard AdamW moments, "
                        "2 also gradients, 3 also parameters")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size for data parallel (MiB)")
    p.add_argument("--attention", default="auto", type=_attention_spec, metavar="|".join(ATTENTION_KINDS),
                   help="attention kernel: flash (memory linear in the context), dense (T x T scores), auto "
                        "(flash where it is faster: from a context of %d tokens on, and when not training), or "
                        "block_sparse:local=256,global=64 (also dilated=N, random=N, block=64: only the key blocks "
                        "the pattern allows), or dilated:segments=256/512,dilations=1/2 (LongNet)" % FLASH_MIN_TRAIN_T)
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel replicas (default: the ranks left over, world / (tp x pp x cp); given, it "
                        "must match the job's ranks)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallel: split every sequence over this many ranks, attention by ring attention "
                        "(composes with data parallel: the ranks left over)")
    p.add_argument("--cp-layout", default="zigzag", choices=("contiguous", "zigzag", "stripe"),
                   help="which tokens a context-parallel rank holds (zigzag balances the causal work)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per model replica (Megatron-style: heads, MLP and vocabulary split); "
                        "the ranks left over are data parallel")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages per model replica (the layers split by parameter count, or by measured time "
                        "with --pp-balance time, trained with the 1F1B schedule); the ranks left over are data parallel")
    p.add_argument("--pp-virtual", type=int, default=1,
                   help="with --pp: model chunks (virtual stages) per pipeline rank, the layers round-robin over the "
                        "ranks, trained with Megatron-LM's interleaved 1F1B (bubble (pp-1)/(v*m+pp-1); --microbatches "
                        "a multiple of --pp); 1: plain 1F1B")
    p.add_argument("--pp-balance", default="params", metavar="params|time",
                   help="with --pp: split the layers into stages by parameter count (params), or by each layer's "
                        "forward + backward time measured on this device with the run's micro-batch before training "
                        "(time: the output layer and the loss weigh what they cost)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches each replica's batch is split into (default: --pp): the pipeline's, or "
                        "gradient accumulation within the batch without --pp")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorms and the residual stream hold 1/tp of the sequence per rank "
                        "(all-gather/reduce-scatter instead of all-reduce; less activation memory)")
    p.add_argument("--moe-experts", type=int, default=0,
                   help="replace every block's MLP by this many experts behind a top-k router (0: dense MLP)")
    p.add_argument("--moe-top-k", type=int, default=2, help="experts per token (1: Switch, 2: GShard)")
    p.add_argument("--moe-capacity", type=float, default=1.25,
                   help="capacity factor: places per expert = factor x top-k x tokens / experts")
    p.add_argument("--moe-aux-alpha", type=float, default=0.01, help="weight of the load-balancing loss")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: each layer's experts split over this many data-parallel ranks, "
                        "tokens exchanged by all_to_all (1: every rank holds every expert)")
    p.add_argument("--grad-compression", default="none", metavar="SPEC",
                   help="compress data-parallel gradients: none | fp16 | bf16 | onebit[:warmup=N] | topk:FRACTION | "
                        "powersgd:rank=R[,start=S] (see schedule/README.md)")
    p.add_argument("--comm-timeout", type=float, default=300.0,
                   help="seconds any wait for other ranks may take before the run stops with an error")
    p.add_argument("--stop-after", type=int, default=None,
                   help="leave after this many steps of this invocation (checkpoint saved; continue with --resume)")
    return p


class _StopFlag:
    """Ctrl-C sets the flag; the loop finishes the step, saves and exits 130."""

    def __init__(self):
        self.stop = False
        self._prev = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame):
        if self.stop:  # a second Ctrl-C: give up at once
            signal.signal(signal.SIGINT, self._prev)
            raise KeyboardInterrupt
        self.stop = True
        print("\ninterrupt: finishing the step, saving a checkpoint, then exiting (Ctrl-C again to abort)", file=sys.stderr)

    def restore(self):
        signal.signal(signal.SIGINT, self._prev)


def main(argv=None) -> int:
    """Entry point of helios-train; returns the exit status."""
    from helios.errors import CheckpointError, CommError, DataError, DeviceError, ShapeError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _train(args, explicit_flags(parser, argv))
    except DataError as e:  # the corpus or tokenizer the user named cannot be used
        usage(str(e))
    except (CheckpointError, DeviceError, CommError, ShapeError) as e:
        print(f"helios-train: {type(e).__name__}: {e}", file=sys.stderr)
        return 1



def _train(args, given: set[str]) -> int:
    import helios as hl
    from helios import checkpoint as ckpt
    from helios.data import BatchLoader, prepare_dataset
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW, clip_grad_norm_, cosine_lr
    from helios.profile.mfu import compute_mfu, format_mfu, peak_flops
    from helios.profile.rundb import RunDB
    from helios.profile.timers import StepTimer, device_phase_ns
    from helios.runtime import get_runtime
    from helios.errors import CheckpointError
    from helios.schedule import checkpoint as sharded
    from helios.schedule import train_state
    from helios.schedule.dist_run import DistRun

    from helios.data import open_corpus
    from helios.tokenizer import check_spec

    # Every check below runs on every rank before any rank waits for another.
    check_bounds(vars(args))
    saved_cfg = None
    if args.resume:
        meta = settings.checkpoint_meta(args.out)
        if meta is not None:  # continue the run with its own settings (a flag given again must agree)
            saved_cfg = settings.adopt_saved_settings(args, given, meta, args.out)
    cfgd = dict(CONFIGS[args.config])
    if saved_cfg is not None:
        cfgd.update({k: saved_cfg[k] for k in ("n_layer", "n_head", "n_embd") if k in saved_cfg})
    steps = args.steps if args.steps is not None else cfgd["steps"]
    bs = args.batch_size if args.batch_size is not None else cfgd["batch_size"]
    T = args.block_size if args.block_size is not None else cfgd["block_size"]
    lr_max = args.lr if args.lr is not None else cfgd["lr"]
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    check_bounds({"steps": steps, "batch_size": bs, "block_size": T})
    _profile_window(args, int(meta.get("step", 0)) if saved_cfg is not None else 0, steps, _quiet)  # checked early
    if args.data is not None:
        try:
            open_corpus(args.data)  # exists and is not empty (a DataError names what is wrong)
        except FileNotFoundError as e:
            usage(str(e))
    check_spec(args.tokenizer)
    from helios.schedule.compression import parse_spec

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
                                   cfgd["n_layer"], cfgd["n_head"], cfgd["n_embd"], virtual=args.pp_virtual)
    pipeline = layout.pp > 1
    settings.check_pp_balance(args.pp_balance, args.pp)
    settings.check_experts(args.moe_experts, args.moe_top_k, args.ep, args.tp, args.pp, world, args.zero)
    if args.sequence_parallel:
        settings.check_sequence_parallel(args.tp, T)
    if pipeline and comm_hook is not None:
        usage(f"--grad-compression {args.grad_compression} compresses DistributedDataParallel's buckets; with --pp "
              f"{args.pp} a stage's gradients are all-reduced once after the pipeline flushes, uncompressed (use "
              "--grad-compression none)")
    run = DistRun.from_env(timeout=args.comm_timeout)
    if args.zero and not run.active:
        print("helios-train: --zero shards across data-parallel ranks; alone it changes nothing", file=sys.stderr)
    if comm_hook is not None and not run.active:
        print("helios-train: --grad-compression compresses what data-parallel ranks exchange; alone it changes nothing",
              file=sys.stderr)
        comm_hook = None
    say = print if run.is_main else _quiet
    if args.device:
        try:
            hl.set_device(args.device)
        except hl.DeviceError as e:  # a device the user named that cannot open here: their flag to change
            usage(f"--device {args.device}: {e}")
    rt = get_runtime()
    # Before the data is read: a block or batch the device cannot hold is the user's to change.
    head_dim = cfgd["n_embd"] // cfgd["n_head"]
    dense_attention = args.cp == 1 and (args.attention == "dense" or head_dim not in hl._kernels.FLASH_HEAD_DIMS
                                        or (args.attention == "auto" and T < FLASH_MIN_TRAIN_T))
    settings.check_fits(rt.max_range, max(1, bs // (world // args.cp // layout.pp) // layout.microbatches), T,
                        cfgd["n_head"], cfgd["n_embd"], settings.vocab_of_spec(args.tokenizer), dense_attention, args.cp)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.monotonic()

    # Rank 0 tokenizes first (and fills the cache); the others then read it.
    if not run.is_main:
        run.barrier()
    ds = prepare_dataset(args.data, args.tokenizer, progress=not args.no_progress and run.is_main)
    if run.is_main:
        run.barrier()
    summ = ds.summary()
    V = ds.tokenizer.vocab_size
    if V % args.tp:
        usage(f"--tp {args.tp} must divide the vocabulary size, {V} (--tokenizer {args.tokenizer})")
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=cfgd["n_layer"], n_head=cfgd["n_head"], n_embd=cfgd["n_embd"],
                    attention=args.attention)
    # The attention kernel changes no weight: a run may resume with another one.
    model_config = {k: v for k, v in cfg.to_dict().items() if k != "attention"}
    run_meta = {"config": model_config, "train": {"steps": steps, "batch_size": bs, "lr": lr_max, "warmup": warmup,
                "grad_accum": args.grad_accum, "seed": args.seed, "tokenizer": ds.tokenizer.identity,
                "weight_decay": args.weight_decay, "grad_clip": args.grad_clip},
                "data": ds.corpus.fingerprint, "cli": settings.cli_settings(args)}
    if args.moe_experts:  # only then: a dense run's checkpoint meta stays as it was
        run_meta["train"].update(moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                                 moe_capacity=args.moe_capacity, moe_aux_alpha=args.moe_aux_alpha)
    run.check_same({**run_meta, "zero": args.zero, "bucket_cap_mb": args.bucket_cap_mb, "resume": args.resume,
                    "out": os.path.abspath(args.out), "grad_compression": comm_hook.spec if comm_hook else "none",
                    "tp": args.tp, "pp": args.pp, "pp_virtual": args.pp_virtual, "microbatches": layout.microbatches,
                    "sequence_parallel": args.sequence_parallel, "pp_balance": args.pp_balance})
    hl.manual_seed(args.seed)
    gpt = GPT(cfg, seed=args.seed)
    n_params, fpt = gpt.num_parameters(), gpt.flops_per_token()  # the whole model's, whatever the split
    ep_group = edp_group = expert_group = None
    if args.moe_experts:
        from helios.schedule.moe import expert_groups, expert_tp_group, use_experts

        if args.ep > 1:  # each rank holds 1/ep of every layer's experts
            # over each stage's data-parallel ranks (with --tp, those of this rank's tensor-parallel place)
            ep_group, edp_group = expert_groups(args.ep, pp=args.pp, tp=args.tp)
            if args.tp > 1:  # the ranks that hold the pieces of one replica's experts
                expert_group = expert_tp_group(args.ep, args.tp, pp=args.pp)
        use_experts(gpt, args.moe_experts, args.moe_top_k, args.moe_capacity, args.moe_aux_alpha, ep_group=ep_group)
        # a token runs top-k experts (each the size of the dense MLP) and the router
        mlp_weights = 8 * cfg.n_embd * cfg.n_embd * cfg.n_layer
        fpt += 6 * ((args.moe_top_k - 1) * mlp_weights + cfg.n_embd * args.moe_experts * cfg.n_layer)
        from helios.schedule.tensor_parallel import full_shape

        n_params = sum(int(np.prod(full_shape(p))) for p in gpt.parameters())  # every expert, wherever it lives
    grid = cp = None
    if run.active:
        from helios.schedule.grid import ParallelGrid

        grid = ParallelGrid(tp=args.tp, pp=args.pp)
        run.use_data_parallel_coords(grid.dp_rank, grid.dp)
        if args.cp > 1:  # (with tp = pp = 1) context-parallel peers are neighbouring ranks, as Megatron-LM puts them
            from helios.schedule.context_parallel import context_parallel_group, use_context_parallel

            cp = use_context_parallel(gpt, context_parallel_group(args.cp), args.cp_layout)
            run.use_data_parallel_coords(run.rank // args.cp, run.world // args.cp)
        if args.tp > 1:
            from helios.schedule.tensor_parallel import TensorParallelGPT

            gpt = TensorParallelGPT(gpt, grid.tp_group, sequence_parallel=args.sequence_parallel,
                                    expert_group=expert_group)  # this rank's shards (experts' hidden features too)
    whole = gpt  # the whole model (a resumed run loads it by name; then only the stage's layers stay)
    if pipeline:
        from helios.schedule.pipeline import InterleavedPipelineStage, PipelineStage, describe_stages, layer_times

        times = None
        if args.pp_balance == "time":  # rank 0 measures (with the others if its layers need them), all take its figures
            micro = (bs // layout.dp // layout.microbatches, T)
            times = layer_times(whole, np.random.default_rng(args.seed).integers(0, V, micro), reps=5, warmup=1)
            say(f"pipeline balance: each layer's forward + backward measured on this device (rank 0's figures, shared "
                f"with every rank), one micro-batch of {micro[0]} x {micro[1]} tokens, median of 5 after 1 warm-up: "
                f"embeddings {times[0] * 1e3:.1f} ms, blocks {', '.join(f'{v * 1e3:.1f}' for v in times[1:-1])} ms, "
                f"final LayerNorm + output layer + loss {times[-1] * 1e3:.1f} ms")
        # this rank's layers (its chunks under --pp-virtual), under the whole model's names
        gpt = (InterleavedPipelineStage(whole, grid, layout.virtual, weights=times) if layout.virtual > 1
               else PipelineStage(whole, grid, weights=times))
    tensor_parallel = grid is not None and args.tp > 1
    tp_group = grid.tp_group if tensor_parallel else None  # (None is also the world's group: test the flag)
    tp_rank = grid.tp_rank if tensor_parallel else 0
    if ep_group is not None and args.tp == 1:
        # Expert tensors are sharded over the expert-parallel group the way tensor-parallel ones
        # are over theirs: checkpoints gather them whole, the norm sums each shard once.  (With
        # --tp their layouts name the group they are sharded over themselves.)
        import helios.comm as dist

        tensor_parallel, tp_group, tp_rank = True, ep_group, dist.get_rank(ep_group)
    decay = [p for n, p in gpt.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in gpt.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    model = gpt
    zero = args.zero if run.active else 0
    if zero:
        from helios.schedule.zero import ZeroDataParallel

        # Model wrapper and optimizer in one: it owns the parameters' flat buffer and the shards.
        # (With --tp or --pp, over the data-parallel ranks that hold the same shards of the same stage.)
        replicas = None
        if ep_group is not None:
            # Each rank's experts are replicated over the ranks holding the same experts only: sharded
            # over that group (DeepSpeed-MoE's expert-data-parallel group), the rest over every replica.
            from helios.schedule.moe import expert_parameter_names

            replicas = {n: edp_group for n in expert_parameter_names(gpt)}
        model = opt = ZeroDataParallel(gpt, zero, groups, lr=lr_max, betas=(0.9, 0.95), bucket_cap_mb=args.bucket_cap_mb,
                                       group=grid.dp_group if args.tp > 1 or pipeline else None,
                                       param_replicas=replicas)
        if pipeline and zero == 3:  # the stage runs its blocks itself: each pass in the optimizer's forward scope
            gpt.pass_scope, gpt.sum_tied_locally = opt.forward_scope, False
            # (interleaved: each backward runs one chunk, and reduces that chunk's gradients only)
            gpt.chunk_scope = opt.chunk_scope
    else:
        if run.active and grid.dp > 1 and not pipeline:  # a pipeline averages after its flush (below)
            from helios.schedule import DistributedDataParallel

            experts = []
            if ep_group is not None:  # each rank's own experts: averaged over their replicas after backward
                from helios.schedule.moe import expert_parameter_names

                experts = expert_parameter_names(gpt)
            model = DistributedDataParallel(gpt, bucket_cap_mb=args.bucket_cap_mb, comm_hook=comm_hook,
                                            group=grid.dp_group, params_to_ignore=experts)
        opt = AdamW(groups, lr=lr_max, betas=(0.9, 0.95))
    # fp16 on a split model or sharded gradients: every rank holds other gradients, so the ranks
    # agree on inf/nan
    autocast, scaler = _mixed_precision(args.dtype, split=args.tp > 1 or args.pp > 1 or zero > 0 or args.ep > 1)
    loader = BatchLoader(ds.train, bs, T, seed=args.seed)
    val_loader = BatchLoader(ds.val, bs, T, seed=args.seed + 1)

    start_step = 0
    # A job that helios-run --max-restarts relaunched after a lost rank continues from its last checkpoint.
    restarted = int(os.environ.get("HELIOS_RESTART_COUNT") or 0) > 0
    if restarted and not args.resume and (_latest_checkpoint(sharded, args.out, _quiet) or ckpt.has_checkpoint(args.out)):
        say(f"restart {os.environ['HELIOS_RESTART_COUNT']} of the job: resuming from the last complete checkpoint")
        args.resume = True
    if args.resume:
        found = _latest_checkpoint(sharded, args.out, say)
        if found is not None:
            # A stage's parameters are the whole model's own objects: loading the whole model by
            # name fills the stage's parameters (and, through the optimizer, their moments).
            meta = train_state.load_training(found[1], whole, opt, loader, tp_rank)
            resumed_from = found[1]
            afresh = train_state.load_comm_hook(found[1], meta, comm_hook, run.rank, run.world)
            if afresh:
                say(f"--grad-compression: {afresh}")
        elif ckpt.has_checkpoint(args.out):  # a single-file checkpoint of an earlier Helios
            if zero or pipeline:
                flag = "--zero" if zero else "--pp"
                raise CheckpointError(f"{ckpt.checkpoint_path(args.out)} is a single-file checkpoint of an earlier "
                                      f"Helios: resume it without {flag} once, then go on with {flag}")
            meta = ckpt.load_training_state(args.out, gpt, opt, loader)
            resumed_from = ckpt.checkpoint_path(args.out)
        else:
            raise CheckpointError(f"--resume: no complete checkpoint in {os.path.join(args.out, 'ckpt')}; start "
                                  "without --resume or point --out at an earlier run")
        if meta["config"] != run_meta["config"] or meta["train"] != run_meta["train"]:
            raise SystemExit(f"helios-train: --resume with different settings than the checkpoint in {args.out}:\n"
                             f"  checkpoint: {json.dumps(meta['config'])} {json.dumps(meta['train'])}\n"
                             f"  now:        {json.dumps(run_meta['config'])} {json.dumps(run_meta['train'])}")
        start_step = int(meta["step"])
        if scaler.is_enabled() and meta.get("grad_scaler"):
            scaler.load_state_dict(meta["grad_scaler"])  # the loss scale goes on where it was
        n = meta.get("world_size")
        saved_grid = "".join(f", {k.replace('_', ' ')} {v}" for k, v in meta.get("grid", {}).items()
                             if k in ("tp", "pp", "pp_virtual") and v > 1)
        was = f" (saved by {n} rank{'s' if n != 1 else ''}{saved_grid}, ZeRO-{meta.get('zero', 0)})" if n else ""
        say(f"resumed from {resumed_from} at step {start_step}{was}")
        # Once every rank has read it, drop what a dead attempt left after it: a stray shard of
        # a later step could otherwise complete, with this run's files, a checkpoint of two runs.
        run.barrier()
        if run.is_main:
            sharded.discard_newer(args.out, start_step)
    whole = None  # a stage keeps its own layers only

    dev = rt.info
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
        peak_label = f"{args.peak_tflops} TFLOP/s (--peak-tflops)"
    else:
        pk = peak_flops(dev["name"], "fp32", dev["type"])
        peak, peak_label = (pk.flops, pk.label) if pk else (None, "n/a (unknown device: pass --peak-tflops)")
    extras = (", sequence parallel" if args.sequence_parallel else "") + (f", ZeRO-{args.zero}" if args.zero else "")
    if cp is not None:
        extras += f", context parallel {cp.world} ({cp.layout}: {T // cp.world} tokens of each sequence a rank)"
    ranks = f" x {run.world} ranks ({layout.describe()}{extras})" if run.active else ""
    say(f"device: {rt.name} {dev['name']} ({dev['type']}){ranks}; peak for MFU: {peak_label}")
    say(f"model: {n_params / 1e6:.2f}M parameters, {cfg}")
    if args.dtype != "fp32":
        say(f"mixed precision: --dtype {args.dtype}, matmuls in {'bfloat16' if args.dtype == 'bf16' else 'float16'}, "
            "float32 master weights" + (f", loss scale {scaler.get_scale():g}" if scaler.is_enabled() else ""))
    capture_reason = _capture_refusal(args, run, pipeline, zero)
    if capture_reason is None:
        say("graph capture: on (the first step is captured, the others replay it; --no-capture turns it off)")
    elif not args.no_capture:
        say(f"graph capture: off ({capture_reason})")
    if args.moe_experts:
        say(f"mixture of experts: {args.moe_experts} experts per block, top-{args.moe_top_k}, capacity factor "
            f"{args.moe_capacity}, load-balancing loss x {args.moe_aux_alpha} (logged as aux)")
    if pipeline:
        stages = f"pipeline stages: {describe_stages(gpt.bounds, cfg.n_layer, layout.pp, times)}"
        # Balanced by time, every rank says the split it built (they must not disagree).
        (print if times is not None else say)(stages)
    say(f"data: {summ['corpus']}, {summ['train_tokens']:,} train / {summ['val_tokens']:,} val tokens, "
        f"tokenizer {summ['tokenizer']}; unigram entropy {summ['unigram_entropy_nats']:.3f} nats "
        f"(uniform {summ['uniform_loss_nats']:.3f})")

    db = None
    if run.is_main:
        db = RunDB(args.out, device=dev["name"], dtype=args.dtype, n_devices=run.world, peak_flops=peak,
                   peak_label=peak_label, flops_per_token=fpt, n_params=n_params,
                   config={**run_meta, "steps": steps, "world_size": run.world, "zero": zero, "tp": args.tp,
                           "pp": args.pp, "pp_virtual": layout.virtual, "microbatches": layout.microbatches,
                           "memory": _model_state_bytes(model, opt, rt, run.world, zero)})
    writer = sharded.AsyncCheckpointer(args.out, run.rank, run.world)

    def save_checkpoint(at_step: int) -> str:
        """Snapshot this rank's shard now; the background thread writes it while training goes on."""
        shards = {**_training_shards(train_state, gpt, opt, run, grid if pipeline else None, tp_group),
                  **train_state.comm_hook_shards(comm_hook, run.rank)}
        meta = train_state.training_meta(opt, loader, at_step, run_meta, run.world, zero)
        if scaler.is_enabled():
            meta["grad_scaler"] = scaler.state_dict()
        meta["grid"] = {"tp": layout.tp, "pp": layout.pp, "pp_virtual": layout.virtual, "dp": layout.dp,
                        "microbatches": layout.microbatches}
        if comm_hook is not None:
            meta["comm_hook"] = train_state.comm_hook_meta(comm_hook, run.world)
        # The shards were just read from the device (or copied from the hook) into fresh arrays:
        # they are the snapshot.
        writer.save(at_step, shards, meta, copy=False)
        return sharded.step_dir(args.out, at_step)

    # Phase timing: device marks (no wait per phase; where deferring, a step is read once the next
    # is recorded) or, where refused, a device synchronisation at the end of every device phase.
    marks_reason = _phase_marks_refusal(args, run, pipeline, zero, rt)
    marks_on = marks_reason is None
    defer_steps = marks_on and _defer_steps(rt)
    timer = StepTimer(mark=rt.mark if marks_on else None)
    if defer_steps:
        say("phase timing: device timestamps (no wait per phase; a step is read once the next is recorded)")
    elif marks_on:
        say("phase timing: device timestamps (no wait per phase; each step read before the next is recorded: "
            "on a CPU device the overlap measured slower; HELIOS_DEFER_STEPS=1 turns it on)")
    else:
        say(f"phase timing: each phase ends with a device synchronisation ({marks_reason})")

    def phase_sync():
        """The end of a device phase timed on the host: wait for its work (marks need no wait)."""
        if not timer.device_marks:
            rt.synchronize()

    if pipeline:  # the whole model's norm: every stage's squares, each shard and the tied table once
        from helios.schedule.pipeline import clip_grad_norm_ as pp_clip

        def clip(params, max_norm):
            return pp_clip(gpt, max_norm)  # (each shard summed over the group its layout names)
    elif tensor_parallel:  # the global norm sums every shard once, over the tensor-parallel group
        from helios.schedule.tensor_parallel import clip_grad_norm_ as tp_clip

        def clip(params, max_norm):
            return tp_clip(params, max_norm, tp_group)
    else:
        clip = clip_grad_norm_
    # A forward that gathers parameters (ZeRO-3), splits them (tensor parallel) or passes
    # through the stages (pipeline) is a collective: then every rank samples alike.
    collective = zero == 3 or tensor_parallel or pipeline
    micro_rows = bs // layout.dp // layout.microbatches  # sequences per micro-batch on each replica
    if model is not gpt:  # a data-parallel wrapper: time its end-of-backward wait as "comm"
        model.wait_context = lambda: timer.phase("comm")
    stopper = _StopFlag()
    profile_window = _profile_window(args, start_step, steps, say)
    prof = None
    tokens_per_step = bs * T * args.grad_accum  # the global batch, over every rank
    job_peak = peak * run.world if peak else None

    def evaluate() -> float:
        # Each rank takes every world-th validation batch; the mean is the one rank's mean.  Under
        # ZeRO-3 a forward gathers parameters (collective), so every rank runs every batch.
        # A pipeline's stages pass each batch through in micro-batches of the training size;
        # its loss is on the last stage only (the others count nothing in the mean).
        model.eval()
        total, count = 0.0, 0
        # (Expert parallelism exchanges tokens in every forward: every rank runs every batch too.)
        share = 1 if zero == 3 or ep_group is not None else run.data_world  # TP peers run the same batches
        with hl.no_grad():
            for i, (x, y) in enumerate(val_loader.iter_eval(args.eval_batches)):
                if i % share != run.data_rank % share:
                    continue
                if pipeline:
                    parts = len(x) // micro_rows
                    loss = gpt.evaluate(np.split(x, parts), np.split(y, parts), autocast=autocast)
                else:
                    if cp is not None:
                        x, y = cp.shard(x), cp.shard(y)
                    with autocast():
                        loss = gpt(x, y)[1].item()
                if loss is not None:
                    total += loss
                    count += 1
        model.train()
        return run.all_mean(total, count) if share > 1 or pipeline else total / count

    n_micro = args.grad_accum * layout.microbatches  # micro-batches per step on each replica
    zero_experts = bool(zero) and ep_group is not None
    # ZeRO-1/2 reduce the experts (and the rest) after backward, each over its own ranks; ZeRO-3
    # reduces every unit's gradients during backward, as they complete.
    reduce_after = zero_experts and zero < 3

    def micro_batches():
        """This replica's micro-batches of the step: the --microbatches slices of each of the
        --grad-accum batches, in order."""
        for _ in range(args.grad_accum):
            with timer.phase("data_load"):
                x, y = loader.next_batch()
                x, y = run.shard(x), run.shard(y)
                if cp is not None:  # this rank's tokens of each sequence
                    x, y = cp.shard(x), cp.shard(y)
            yield from zip(np.split(x, layout.microbatches), np.split(y, layout.microbatches))

    if args.moe_experts:
        from helios.schedule.moe import aux_loss, average_expert_gradients, dropped_pairs
    # The step's load-balancing loss and dropped (token, choice) pairs, logged next to the loss.
    moe_step = None

    def plain_step(tensors=None):
        """Forward and backward of each micro-batch (``tensors``: the step's (x, y) device tensors,
        else the loader's next micro-batches), gradients accumulated; the step's mean loss (a device
        scalar)."""
        nonlocal moe_step
        loss_dev = None
        for i, (x, y) in enumerate(micro_batches() if tensors is None else tensors):
            if tensors is None:
                with timer.phase("host_to_device"):
                    xt = hl.tensor(x, dtype=hl.int64)
                    yt = hl.tensor(y, dtype=hl.int64)
            else:
                xt, yt = x, y
            # Gradient accumulation: only the last micro-batch's backward communicates (ZeRO-1/2 with
            # experts: none, the optimizer reduces each group over its own ranks afterwards).
            local = (i < n_micro - 1 or reduce_after) and run.active
            with model.no_sync() if local and model is not gpt else contextlib.nullcontext():
                with timer.phase("forward"):
                    with autocast():
                        _, loss = model(xt, yt)
                    aux = aux_loss(gpt) if args.moe_experts else None
                    if n_micro > 1:
                        loss = loss * (1.0 / n_micro)
                        aux = aux * (1.0 / n_micro) if aux is not None else None
                    phase_sync()
                with timer.phase("backward"):
                    scaler.scale(loss + aux if aux is not None else loss).backward()
                    phase_sync()
            loss_dev = loss if loss_dev is None else loss_dev + loss.detach()
            if aux is not None:
                drop = dropped_pairs(gpt)
                moe_step = (aux.detach(), drop) if moe_step is None else (moe_step[0] + aux.detach(), moe_step[1] + drop)
        return loss_dev

    def pipeline_step() -> float | None:
        """The step's micro-batches through this stage in 1F1B (or interleaved) order, then the stage's gradients
        averaged over the data-parallel replicas; the mean loss on the last stage, None elsewhere."""
        xs, ys = zip(*micro_batches())
        if zero == 3:
            # ZeRO-3 gathers each block around its forward and again for its backward, so every
            # micro-batch's backward reduce-scatters the stage's gradients into the shards (adding
            # to the earlier ones); the tied table's two halves are then summed shard by shard.
            loss = gpt.train_step(list(xs), list(ys), phase=timer.phase, autocast=autocast,
                                  loss_scale=scaler.get_scale())
            if gpt.embedding_group is not None:
                with timer.phase("comm"):
                    opt.all_reduce_gradient("wte.weight", gpt.embedding_group)
            return loss
        if zero:
            # The stage runs backward itself: its gradients accumulate locally (the tied table's
            # two summed between the first and the last stage), then ZeRO reduces them over the
            # stage's data-parallel ranks (stage 1 all-reduces, stage 2 reduce-scatters).
            with model.no_sync():
                loss = gpt.train_step(list(xs), list(ys), phase=timer.phase, autocast=autocast,
                                      loss_scale=scaler.get_scale())
            with timer.phase("comm"):
                opt.reduce_gradients()
            return loss
        loss = gpt.train_step(list(xs), list(ys), phase=timer.phase, autocast=autocast,
                              loss_scale=scaler.get_scale())
        if grid.dp > 1:
            with timer.phase("comm"):
                if ep_group is not None:  # the experts differ between ranks: averaged apart, below
                    from helios.schedule.moe import expert_gradient_copies, restore_expert_gradients

                    experts = expert_gradient_copies(gpt)
                _average_gradients(opt, grid.dp_group)
                if ep_group is not None:
                    restore_expert_gradients(experts)
                    average_expert_gradients(gpt, edp_group, grid.dp)
        return loss

    def update():
        """The clip and optimizer phases of a step (its gradients are complete)."""
        with timer.phase("grad_clip"):
            scaler.unscale_(opt)  # fp16: the true gradients, for the norm and the inf/nan test
            if args.grad_clip > 0:
                if zero:
                    # the global norm over every rank's shard (and every tensor-parallel part, and
                    # every pipeline stage: the tied table counted once, by the first stage)
                    opt.clip_grad_norm_(args.grad_clip, tp_group=tp_group if args.tp > 1 else None,
                                        pp_group=gpt.group if pipeline else None,
                                        counted=gpt.owns if pipeline else None)
                else:
                    clip(gpt.parameters(), args.grad_clip)
            phase_sync()
        with timer.phase("optimizer"):
            scaler.step(opt)  # fp16: skipped when a gradient is inf or nan
            scaler.update()
            opt.zero_grad()
            phase_sync()

    # Step capture (hl.graph): the first step runs under capture, later ones replay its device work
    # with the next batch in its input tensors.  None: every step runs through Python.
    capture = {} if capture_reason is None else None

    def captured_step():
        """One step by capture or replay (clip and optimizer included): the first call runs the
        step under capture with its micro-batches in new input tensors, later calls refill them
        and replay.  A refused capture is said once; the step then runs again the plain way on
        the same micro-batches, and so do all later steps."""
        nonlocal capture
        batches = list(micro_batches())
        g = capture.get("graph")
        if g is not None:
            with timer.phase("replay"):
                # The refill does not wait for the previous replay (graph.upload).
                g.replay(*(a for xy in batches for a in xy), flush=not hold_submit)
                phase_sync()
            return capture["loss"]
        with timer.phase("host_to_device"):
            tensors = [(hl.tensor(x, dtype=hl.int64), hl.tensor(y, dtype=hl.int64)) for x, y in batches]
        try:
            with hl.graph.capture(inputs=[t for xy in tensors for t in xy]) as g:
                loss = plain_step(tensors)
                update()
        except hl.graph.GraphCaptureError as e:
            say(f"graph capture refused, training without it: {e}", flush=True)
            capture = None
            opt.zero_grad()
            loss = plain_step(tensors)
            update()
            return loss
        capture.update(graph=g, loss=loss)
        return loss

    from tqdm import tqdm

    # A log file (stderr not a terminal) gets plain lines, not a carriage-return progress bar.
    plain = args.no_progress or not sys.stderr.isatty()
    bar = tqdm(total=steps, initial=start_step, disable=plain or not run.is_main, dynamic_ncols=True,
               unit="step")
    val_loss = None
    last = {}
    step = start_step  # steps recorded
    exit_code = 0
    # lavapipe (Mesa 22.3) makes a submission's completion visible only once the submissions
    # queued behind it have run too (measured: waiting for the first of two 150-200 ms
    # submissions returned after both), so reading step k after step k+1 was submitted would
    # wait for k+1 as well.  On a CPU device step k+1 is therefore recorded while the device
    # runs step k but submitted once step k is read; a GPU gets it at once.
    hold_submit = defer_steps and rt.info.get("type") == "cpu"
    mark_times: dict = {}  # resolved device marks not yet used: {id: device ns}
    # A replay writes the captured loss tensor again: a step read after the next one is recorded
    # keeps its loss in one of two small buffers (a recorded copy).
    loss_hold = [hl.zeros(()), hl.zeros(())] if defer_steps and capture is not None else None

    def must_read(s: int) -> bool:
        """Whether step ``s`` is read before the next step is recorded: every step when steps are not
        deferred, and those that evaluate, sample, checkpoint, stop or end the run, or are profiled."""
        return (not defer_steps or prof is not None or stopper.stop or s >= steps
                or bool(args.eval_every and s % args.eval_every == 0)
                or bool(args.sample_every and s % args.sample_every == 0)
                or bool(args.ckpt_every and s % args.ckpt_every == 0)
                or (args.stop_after is not None and s - start_step >= args.stop_after)
                or bool(profile_window and s == profile_window[0]))

    def record_step(deferred: bool) -> dict:
        """Record the device work of the next step (read nothing back); what read_step needs."""
        nonlocal moe_step
        lr = cosine_lr(step, lr_max, warmup, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        d0 = rt.stats()["dispatches"]
        p = {"step": step + 1, "lr": lr, "bytes0": run.comm_bytes(), "loss_dev": None, "stage_loss": None}
        # A profiled step runs through Python (its trace shows the ops and phases); replays go on after.
        if capture is not None and prof is None:
            p["loss_dev"] = captured_step()
            if deferred and capture is not None and capture.get("graph") is not None:  # (None: refused)
                hold = loss_hold[step % 2]
                with hl.no_grad():
                    hold.copy_(p["loss_dev"])
                p["loss_dev"] = hold
        elif pipeline:
            p["stage_loss"] = pipeline_step()
            if args.moe_experts:
                moe_step = gpt.moe_totals()  # summed over the stages, as one device has them
            update()
        else:
            p["loss_dev"] = plain_step()
            if reduce_after:
                with timer.phase("comm"):
                    opt.reduce_gradients()  # dense over every replica, experts over their own replicas
            elif ep_group is not None and not zero_experts:
                with timer.phase("comm"):
                    average_expert_gradients(gpt, edp_group, run.data_world)
            update()
        p["marks"] = timer.take_marks()
        if timer.device_marks:
            p["end_mark"] = rt.mark()  # after everything the step recorded
            if not hold_submit:
                rt.flush()  # the device starts on it now, while the host goes on
        p["dispatches"] = rt.stats()["dispatches"] - d0
        return p

    def read_step(p: dict, newer: bool = False) -> bool:
        """Read step p's results back, evaluate / sample / checkpoint when due, log it (run.db, the
        progress line); True when the run leaves after it.  ``newer``: the next step is recorded
        already; then step p's window ends when the host sees p's work finished (the next window
        opens there: the device goes on with the next step), and p cannot be the step a Ctrl-C
        stops at (its parameters are moving on) nor one that evaluates."""
        nonlocal prof, val_loss, last, moe_step
        if not timer.in_step:
            timer.start_step()
        s = p["step"]
        device_ns = None
        if "end_mark" in p:
            rt.wait_mark(p["end_mark"])  # the step's work only; a later step's may still run
            if hold_submit:
                rt.flush()  # the next step's work, recorded meanwhile (hold_submit above)
            mark_times.update(rt.take_marks())
            device_ns = device_phase_ns(p["marks"], mark_times)
            for _, a, b in p["marks"]:
                mark_times.pop(a, None)
                mark_times.pop(b, None)
            mark_times.pop(p["end_mark"], None)
        closed = None
        if newer:
            closed = timer.end_step(s, tokens_per_step, lr=p["lr"], dispatches=p["dispatches"], complete=False)
            timer.start_step()
        d0 = rt.stats()["dispatches"]
        with timer.phase("device_to_host"):
            if pipeline:
                # Only the last stage has the loss: counted pp times there and 0 elsewhere, the
                # mean over every rank below is the mean over the replicas.
                stage_loss = p["stage_loss"]
                loss_val = stage_loss * layout.pp if stage_loss is not None else 0.0
            else:
                loss_val = p["loss_dev"].item()
        if run.active:
            # One small collective per step: the mean loss, and whether any rank was asked to stop
            # (a Ctrl-C reaches the ranks at slightly different times: they must leave together).
            with timer.phase("comm"):
                loss_val, stop_any = run.agree(loss_val, stopper.stop)
            stopper.stop = stopper.stop or stop_any
        if scaler.last_step_skipped:
            say(f"step {s}: inf/nan in the fp16 gradients, step skipped ({scaler.skipped_steps} so far); "
                f"loss scale now {scaler.get_scale():g}", flush=True)
        elif not math.isfinite(loss_val):
            raise FloatingPointError(f"loss became {loss_val} at step {s}; lower --lr or check the data")
        evaluated = None
        if args.eval_every and s % args.eval_every == 0 and s < steps:
            with timer.phase("sample_gen"):
                val_loss = evaluated = evaluate()
        if args.sample_every and s % args.sample_every == 0 and s < steps and (run.is_main or collective):
            with timer.phase("sample_gen"):  # ZeRO-3: every rank samples alike (its forwards gather)
                text = _sample(gpt, ds.tokenizer, T, args.sample_tokens, s)
                if run.is_main:
                    bar.write(f"--- sample at step {s} ---\n{text}\n---")
        leaving = (stopper.stop and not newer) or (args.stop_after is not None and s - start_step >= args.stop_after
                                                   and s < steps)
        if (args.ckpt_every and s % args.ckpt_every == 0) or leaving:
            with timer.phase("checkpoint"):
                save_checkpoint(s)
        if closed is None:
            rec = timer.end_step(s, tokens_per_step, loss=loss_val, lr=p["lr"],
                                 dispatches=p["dispatches"] + rt.stats()["dispatches"] - d0, device_ns=device_ns)
        else:
            rec = timer.complete_step(closed, device_ns, loss=loss_val)
        sent = [b1 - b0 for b1, b0 in zip(run.comm_bytes(), p["bytes0"])]  # before the gather: its bytes are not the step's
        rows = run.gather_step({**_timing_row(rec), "comm_bytes": sent[0], "comm_payload_bytes": sent[1]})
        mfu = compute_mfu(fpt, rec.tokens_per_s, job_peak)
        if db is not None:
            for r in range(run.world):
                nbytes = {"comm_bytes": int(rows[r][-2]), "comm_payload_bytes": int(rows[r][-1])} if run.active else {}
                if r == 0:
                    db.log_step(rec, mfu=mfu, val_loss=evaluated, **nbytes)
                else:
                    db.log_step(_record_of_row(rec, rows[r]), rank=r, **nbytes)
        last = {"loss": loss_val, "lr": p["lr"], "tok_s": rec.tokens_per_s, "mfu": mfu}
        post = {"loss": f"{loss_val:.4f}", "lr": f"{p['lr']:.2e}", "tok/s": f"{rec.tokens_per_s:,.0f}", "MFU": format_mfu(mfu)}
        if scaler.is_enabled():
            post["scale"] = f"{scaler.get_scale():g}"
            post["skipped"] = str(scaler.skipped_steps)
        if moe_step is not None:  # rank 0's replica's load-balancing loss (the loss above leaves it out)
            post["aux"] = f"{float(moe_step[0]):.4f}"
            post["dropped"] = str(int(moe_step[1]))
            moe_step = None
        if val_loss is not None:
            post["val"] = f"{val_loss:.4f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)
        if plain and (s % 10 == 0 or s == steps):
            say(f"step {s}/{steps} " + " ".join(f"{k} {v}" for k, v in post.items()), flush=True)
        if prof is not None and profile_window and s >= profile_window[1]:
            _finish_profile(prof, args, db, s, run, bar.write if not bar.disable else print)
            prof = None
        return leaving

    pending = None  # a recorded step not read yet (device marks on)
    try:
        while step < steps or pending is not None:
            if pending is not None and (step >= steps or must_read(step + 1)):
                # The next step evaluates, checkpoints, stops (...): read this one before recording it.
                left, pending = read_step(pending), None
                if left:
                    exit_code = 130 if stopper.stop else 3
                    break
                continue
            if profile_window and step == profile_window[0]:
                session = hl.profile.profile(device_timestamps=not args.profile_host_only)
                prof = (session, session.__enter__())
            if not timer.in_step:
                timer.start_step()
            timer.device_marks = marks_on and prof is None
            deferred = not must_read(step + 1)
            cur = record_step(deferred)
            step += 1
            if pending is not None:
                read_step(pending, newer=True)  # step k, read once the host has recorded step k+1
                pending = None
            if deferred and not stopper.stop:
                pending = cur
            elif read_step(cur):
                exit_code = 130 if stopper.stop else 3
                break
    finally:
        bar.close()
        stopper.restore()
        writer.wait()  # a checkpoint being written is finished, also when training failed
        if prof is not None and sys.exc_info()[0] is None:
            _finish_profile(prof, args, db, step, run)
    if exit_code:
        say(f"stopped at step {step}; checkpoint saved in {sharded.step_dir(args.out, step)} (continue with --resume)")
        if db is not None:
            db.finish(status="interrupted")
        run.close()
        return 130 if exit_code == 130 else 0
    final_ckpt = save_checkpoint(step)
    val_loss = evaluate()
    writer.wait()
    if db is not None:
        db.set_val_loss(step, val_loss)
    say(f"step {step}/{steps} loss {last.get('loss', float('nan')):.4f} val {val_loss:.4f} (final)", flush=True)
    wall = time.monotonic() - t_start
    sample = _sample(gpt, ds.tokenizer, T, args.sample_tokens, step) if run.is_main or collective else ""
    if run.is_main:
        print(_breakdown(timer.records))
        print(f"--- sample ---\n{sample}\n---")
        summary = {"steps": step, "wall_s": round(wall, 1), "final_train_loss": round(last.get("loss", float('nan')), 4),
                   "final_val_loss": round(val_loss, 4), "unigram_entropy": round(summ["unigram_entropy_nats"], 4),
                   "tok_per_s": round(last.get("tok_s") or 0, 1), "mfu": format_mfu(last.get("mfu")),
                   "world_size": run.world, "checkpoint": final_ckpt, "run_db": db.path, "dtype": args.dtype}
        if scaler.is_enabled():
            summary.update(loss_scale=scaler.get_scale(), skipped_steps=scaler.skipped_steps)
        print(json.dumps(summary))
        db.finish(status="finished")
    run.close()
    return 0


def _defer_steps(rt) -> bool:
    """Whether a step is read only once the next one is recorded (the host records step k+1 while
    the device runs step k).  HELIOS_DEFER_STEPS=1 / 0 decides; by default yes, but not on a CPU
    device (lavapipe): there the host and the "device" share the cores and the device's own time
    per step grew with the overlap (nano: 12.5 -> 15-16 ms), so the default captured step got
    slower (nano 13.2-14.1 -> 15.6-16.8 ms, tiny within noise); only a host-heavy --no-capture
    step gained (nano 17.9-19.2 -> 15.5-16.5 ms).  Figures: bench/README.md."""
    v = os.environ.get("HELIOS_DEFER_STEPS", "")
    if v:
        return v != "0"
    return rt.info.get("type") != "cpu"


def _phase_marks_refusal(args, run, pipeline: bool, zero: int, rt) -> str | None:
    """Why helios-train times its device phases by synchronising rather than by device marks
    (None: marks)."""
    if os.environ.get("HELIOS_PHASE_SYNC", "") not in ("", "0"):
        return "HELIOS_PHASE_SYNC is set"
    if run.world > 1:
        return "several ranks: their collectives wait on the host"
    if pipeline:
        return "--pp"
    if zero:
        return "--zero"
    if args.dtype == "fp16":
        return "--dtype fp16 reads its inf/nan check back each step"
    if args.moe_experts:
        return "mixture of experts counts dropped tokens on the host"
    if not rt.has_marks:
        return f"{rt.name} writes no device timestamps"
    return None


def _capture_refusal(args, run, pipeline: bool, zero: int) -> str | None:
    """Why helios-train does not capture the step (None: it does).  A replay repeats one device's
    commands: collectives and host-side loss scaling are not a static stream of them."""
    if args.no_capture:
        return "--no-capture"
    if run.world > 1:
        return "several ranks exchange data through the host"
    if args.dtype == "fp16":
        return "--dtype fp16 checks for inf/nan on the host each step"
    if pipeline:
        return "--pp"
    if args.moe_experts:
        return "mixture of experts counts dropped tokens on the host"
    if zero:
        return "--zero"
    return None


def _mixed_precision(dtype: str, split: bool = False):
    """--dtype's autocast context (a factory: one per forward) and loss scaler: float32 runs get
    a no-op context and a disabled scaler (every method a pass-through), bf16 autocast without
    scaling (its range is float32's), fp16 autocast with dynamic loss scaling (``split``: the
    model is split over the ranks, whose inf/nan findings the scaler combines)."""
    import helios as hl

    if dtype == "fp32":
        return contextlib.nullcontext, hl.amp.GradScaler(enabled=False)
    low = "bfloat16" if dtype == "bf16" else "float16"
    return (lambda: hl.autocast(low)), hl.amp.GradScaler(enabled=dtype == "fp16",
                                                         process_group="world" if split else None)


def _average_gradients(opt, group) -> None:
    """Average a pipeline stage's gradients over its data-parallel replicas once the pipeline has
    flushed (as Megatron-LM does): one all-reduce per flat gradient buffer of the optimizer."""
    import helios.comm as dist
    from helios import _kernels as K

    for fg in opt.flat:
        for p in fg.params:
            if p.grad is not None and p.grad._st is not fg.g._st:
                K.copy_into(p._grad_slot, p.grad)  # a gradient outside its slot: put it in place first
                p.grad = p._grad_slot
        dist.all_reduce(fg.g, op="avg", group=group)


def _training_shards(train_state, gpt, opt, run, grid, tp_group) -> dict:
    """The training-state tensors this rank writes.  With a pipeline grid, a stage's tensors are
    written by the stage's ranks (its tensor x data-parallel ranks), each an even share, under the
    whole model's names; the tied table once, by the first stage."""
    if grid is None:
        return train_state.training_shards(gpt, opt, run.rank, run.world, tp_group)
    writer = grid.dp_rank * grid.tp + grid.tp_rank
    shards = train_state.training_shards(gpt, opt, writer, grid.dp * grid.tp, tp_group)
    return {k: v for k, v in shards.items() if gpt.owns(_param_of(k))}


def _param_of(key: str) -> str:
    """The parameter a checkpoint tensor belongs to: ``model.<name>`` or ``optim.<moment>.<name>``."""
    return key.split(".", 1)[1] if key.startswith("model.") else key.split(".", 2)[2]


def _model_state_bytes(model, opt, rt, world: int, zero: int) -> dict:
    """Bytes of model states this rank holds (the weights pool, where parameters, gradients and
    moments live) and what the ZeRO formula says for them."""
    rt.synchronize()
    held = rt.pool_stats()["weights"]["in_use_bytes"]
    if zero:
        expected, psi = opt.expected_memory(), opt.optimizer.padded_numel
    else:
        psi = sum(fg.n for fg in opt.flat)
        expected = {"params": 4 * psi, "grads": 4 * psi, "moments": 8 * psi}
    return {"weights_pool_in_use": held, "psi": psi, "expected": expected, "expected_total": sum(expected.values())}


def _latest_checkpoint(sharded, run_dir: str, say):
    """The newest complete sharded checkpoint; a newer unusable one is reported in one line
    through ``say`` (``_quiet`` to ignore it)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = sharded.latest_complete(run_dir)
    for w in caught:
        say(f"helios-train: warning: {w.message}", file=sys.stderr)
    return found


def _quiet(*args, **kwargs) -> None:
    """print() on ranks other than 0."""


def _timing_row(rec) -> dict:
    from helios.profile.timers import ALL_PHASES

    return {"wall_ns": rec.wall_ns, **{f"{p}_ns": rec.phases_ns.get(p, 0) for p in ALL_PHASES}}


def _record_of_row(rec, row):
    """Another rank's StepRecord, rebuilt on rank 0 from its gathered timing row."""
    from helios.profile.timers import ALL_PHASES, StepRecord

    phases = {p: int(row[1 + i]) for i, p in enumerate(ALL_PHASES)}
    return StepRecord(rec.step, rec.start_ns, rec.start_ns + int(row[0]), phases, rec.tokens, rec.loss, rec.lr)


def _profile_window(args, start_step: int, steps: int, say) -> tuple[int, int] | None:
    """The steps [start, stop) to profile: --profile-steps, or with --trace alone a default
    window of 5 steps after a few warm-up steps; a window outside the run is refused."""
    from helios.profile.profiler import parse_profile_steps

    if not args.profile_steps:
        if not args.trace:
            return None
        if steps - start_step < 2:
            usage(f"--trace {args.trace}: the run has {steps - start_step} step(s) left, too few to profile one after a "
                  "warm-up step; give more --steps or --profile-steps")
        lo = start_step + min(10, (steps - start_step) // 2)
        window = (lo, min(steps, lo + 5))
        say(f"--trace without --profile-steps: profiling steps {window[0]}:{window[1]}")
        return window
    try:
        r = parse_profile_steps(args.profile_steps)
    except ValueError as e:
        usage(f"--profile-steps {args.profile_steps}: {e}")
    if r.start >= steps or r.start < start_step:
        usage(f"--profile-steps {args.profile_steps}: the run trains steps {start_step}..{steps - 1}; profile "
              "steps inside it")
    return (r.start, r.stop)


def _finish_profile(prof, args, db, step, run, write=print) -> None:
    """Close the profiling window; rank 0 logs it and writes one trace with a process per rank."""
    session, profiler = prof
    session.__exit__(None, None, None)
    if db is not None:
        db.log_profile(profiler.collector, step)
    if not args.trace:
        return
    from helios.profile.trace import build_trace, write_trace
    from helios.schedule.dist_run import merge_rank_traces

    mine = json.dumps(build_trace(profiler.collector, process_name=f"helios rank {run.rank}")).encode()
    every = run.gather_bytes(mine)
    if every is not None:
        traces = [json.loads(b) for b in every]
        write_trace(args.trace, traces[0] if len(traces) == 1 else merge_rank_traces(traces))
        write(f"trace written to {args.trace}")


def _sample(model, tok, T: int, n: int, step: int) -> str:
    """Text continued from a fixed prompt with temperature 0.8 (numpy RNG seeded by step: deterministic)."""
    import helios as hl

    rng = np.random.default_rng(step)
    ids = list(tok.encode(b"def "))
    model.eval()
    whole = contextlib.nullcontext()
    if getattr(model, "context_parallel", None) is not None:  # one rank continues whole sequences
        from helios.schedule.context_parallel import context_parallel_off

        whole = context_parallel_off(model)
    with hl.no_grad(), whole:
        for _ in range(n):
            ids.append(_next_token(model, np.array([ids[-T:]], np.int64), rng))
    model.train()
    return tok.decode(np.array(ids)).decode("utf-8", errors="replace")


def _next_token(model, ctx: np.ndarray, rng) -> int:
    """A token drawn from the model's last-position logits at temperature 0.8.  A pipeline stage
    runs its part of the forward, and every stage gets the token the last stage drew."""
    stage = hasattr(model, "from_last_stage")
    logits = model.infer(ctx) if stage else model(ctx)[0]
    token = -1
    if logits is not None:
        # A tensor-parallel model holds a slice of the vocabulary: gather the whole row.
        whole = model.full_logits(logits) if hasattr(model, "full_logits") else logits.numpy()
        last = whole[0, -1].astype(np.float64) / 0.8
        p = np.exp(last - last.max())
        p /= p.sum()
        token = int(rng.choice(len(p), p=p))
    return model.from_last_stage(token) if stage else token


def _breakdown(records) -> str:
    """A table of the mean time per phase over the run's steps."""
    from helios.profile.timers import ALL_PHASES

    if not records:
        return "no steps timed"
    n = len(records)
    wall = sum(r.wall_ns for r in records) / n
    lines = [f"step time breakdown (mean over {n} steps, {wall / 1e6:.1f} ms/step):"]
    for ph in ALL_PHASES:
        v = sum(r.phases_ns.get(ph, 0) for r in records) / n
        if v:
            lines.append(f"  {ph:<16} {v / 1e6:9.2f} ms  {100 * v / wall:5.1f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
