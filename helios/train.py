"""helios-train: train a GPT (or a LLaMA: --arch llama) on the default device, from scratch or from
a Hugging Face folder or another run (--init-from DIR).

    helios-train                          # the `tiny` config on the Python standard library's source
    helios-train --arch llama --config small
    helios-train --init-from models/gpt2 --data notes.txt --steps 200 --lr 1e-4   # fine-tune (models/gpt2/tokenizer.json)
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
import sys

import helios as hl
from helios.data import BatchLoader
from helios.errors import CheckpointError, CommError, DataError, DeviceError, ShapeError
from helios.nn.modules import ATTENTION_KINDS, FLASH_MIN_TRAIN_T, parse_attention
from helios.train_checkpoint import Checkpointer, resume
from helios.train_loop import TrainLoop
from helios.train_model import ARCHS
from helios.train_report import describe_run, open_run_db
from helios.train_settings import explicit_flags, usage
from helios.train_setup import build_model, load_data, open_job, resolve_settings
from helios.train_step import capture_refusal


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
    """helios-train's command line: its flags in one group a topic, as ``--help`` lists them."""
    p = argparse.ArgumentParser(prog="helios-train", description="Train a GPT or a LLaMA with Helios, from scratch "
                                "or from a Hugging Face folder or another run (--init-from).")
    _model_flags(p.add_argument_group("model"))
    _data_flags(p.add_argument_group("data"))
    _optimizer_flags(p.add_argument_group("optimization"))
    _parallel_flags(p.add_argument_group("device and parallelism"))
    _run_flags(p.add_argument_group("run directory, evaluation and output"))
    _profile_flags(p.add_argument_group("profiling"))
    return p


def _model_flags(g) -> None:
    """What is trained: the model's size and architecture, where its weights start, its attention and experts."""
    g.add_argument("--config", default="tiny", choices=sorted(CONFIGS), help="named model/training size (default tiny)")
    g.add_argument("--arch", default="gpt", choices=ARCHS,
                   help="gpt: a GPT-2 style model (LayerNorm, learned positions, GELU MLP, tied head); llama: a "
                        "LLaMA-style one (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, untied head) "
                        "at the --config preset's layers, heads and width (default gpt)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a Hugging Face model folder (config.json + model.safetensors: gpt2, llama, mistral, "
                        "qwen2; its tokenizer.json by default) or a helios-train run directory (its newest checkpoint's "
                        "weights, not its optimizer state or step): fine-tuning")
    g.add_argument("--dropout", type=float, default=0.0,
                   help="dropout probability of the GPT (also of a GPT-2 loaded by --init-from, whatever its config "
                        "says); default 0")
    g.add_argument("--attention", default="auto", type=_attention_spec, metavar="|".join(ATTENTION_KINDS),
                   help="attention kernel: flash (memory linear in the context), dense (T x T scores), auto "
                        "(flash where it is faster: from a context of %d tokens on, and when not training), or "
                        "block_sparse:local=256,global=64 (also dilated=N, random=N, block=64: only the key blocks "
                        "the pattern allows), or dilated:segments=256/512,dilations=1/2 (LongNet)" % FLASH_MIN_TRAIN_T)
    g.add_argument("--moe-experts", type=int, default=0,
                   help="replace every block's MLP by this many experts behind a top-k router (0: dense MLP)")
    g.add_argument("--moe-top-k", type=int, default=2, help="experts per token (1: Switch, 2: GShard)")
    g.add_argument("--moe-capacity", type=float, default=1.25,
                   help="capacity factor: places per expert = factor x top-k x tokens / experts")
    g.add_argument("--moe-aux-alpha", type=float, default=0.01, help="weight of the load-balancing loss")


def _data_flags(g) -> None:
    """What it reads: the corpus, the tokenizer, the batch and the seed."""
    g.add_argument("--data", default=None,
                   help="text files (a file, folder or glob), jsonl with a 'text' field, or token shards (llm.c's or "
                        "nanoGPT's .bin, a file or glob); default: this Python's standard library source")
    g.add_argument("--tokenizer", default="byte", help="byte | bpe:N | hf:PATH (a tokenizer.json or its folder)")
    g.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    g.add_argument("--block-size", type=int, help="context length in tokens")
    g.add_argument("--seed", type=int, default=1337,
                   help="seed of the weights' initialisation, dropout and the batches' order (default 1337)")


def _optimizer_flags(g) -> None:
    """How it steps: the schedule, the optimizer, the precision."""
    g.add_argument("--steps", type=int, help="optimizer steps (default: the config's)")
    g.add_argument("--lr", type=float, help="peak learning rate (cosine schedule with linear warmup)")
    g.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of steps)")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW's decoupled weight decay of every matrix, embeddings included (not of biases or norms); "
                        "default 0.1")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="compute precision: bf16 / fp16 run the matmuls in 16 bits under hl.autocast (float32 "
                        "master weights, softmax, norms and loss); fp16 scales the loss (hl.amp.GradScaler, "
                        "skipping a step whose gradients overflow)")
    g.add_argument("--no-capture", action="store_true",
                   help="run every step through Python and autograd; by default a one-rank fp32/bf16 step (all its "
                        "micro-batches) is captured once (hl.graph) and its device work replayed (same losses)")


def _parallel_flags(g) -> None:
    """Where it runs: the device and the split of the job's ranks."""
    g.add_argument("--device", default=None, help="vulkan:N or cuda:N (default: HELIOS_DEVICE or the best Vulkan device; "
                   "cuda:N needs NVIDIA's driver, or HELIOS_CUDA_DEVICE=emulator for the slow CPU emulator)")
    g.add_argument("--dp", type=int, default=None,
                   help="data-parallel replicas (default: the ranks left over, world / (tp x pp x cp); given, it "
                        "must match the job's ranks)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per model replica (Megatron-style: heads, MLP and vocabulary split); "
                        "the ranks left over are data parallel")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline stages per model replica (the layers split by parameter count, or by measured time "
                        "with --pp-balance time, trained with the 1F1B schedule); the ranks left over are data parallel")
    g.add_argument("--pp-virtual", type=int, default=1,
                   help="with --pp: model chunks (virtual stages) per pipeline rank, the layers round-robin over the "
                        "ranks, trained with Megatron-LM's interleaved 1F1B (bubble (pp-1)/(v*m+pp-1); --microbatches "
                        "a multiple of --pp); 1: plain 1F1B")
    g.add_argument("--pp-balance", default="params", metavar="params|time",
                   help="with --pp: split the layers into stages by parameter count (params), or by each layer's "
                        "forward + backward time measured on this device with the run's micro-batch before training "
                        "(time: the output layer and the loss weigh what they cost)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches each replica's batch is split into (default: --pp): the pipeline's, or "
                        "gradient accumulation within the batch without --pp")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorms and the residual stream hold 1/tp of the sequence per rank "
                        "(all-gather/reduce-scatter instead of all-reduce; less activation memory)")
    g.add_argument("--cp", type=int, default=1,
                   help="context parallel: split every sequence over this many ranks, attention by ring attention "
                        "(composes with data parallel: the ranks left over)")
    g.add_argument("--cp-layout", default="zigzag", choices=("contiguous", "zigzag", "stripe"),
                   help="which tokens a context-parallel rank holds (zigzag balances the causal work)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: each layer's experts split over this many data-parallel ranks, "
                        "tokens exchanged by all_to_all (1: every rank holds every expert)")
    g.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage across data-parallel ranks: 0 plain DDP, 1 shard AdamW moments, "
                        "2 also gradients, 3 also parameters")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size for data parallel (MiB)")
    g.add_argument("--grad-compression", default="none", metavar="SPEC",
                   help="compress data-parallel gradients: none | fp16 | bf16 | onebit[:warmup=N] | topk:FRACTION | "
                        "powersgd:rank=R[,start=S] (see schedule/README.md)")
    g.add_argument("--comm-timeout", type=float, default=300.0,
                   help="seconds any wait for other ranks may take before the run stops with an error")


def _run_flags(g) -> None:
    """What it keeps and says: checkpoints, evaluation, samples, progress."""
    g.add_argument("--out", default="runs/default", help="run directory: checkpoint, run database, trace")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    g.add_argument("--ckpt-every", type=int, default=200, help="checkpoint every N steps (and at the end)")
    g.add_argument("--stop-after", type=int, default=None,
                   help="leave after this many steps of this invocation (checkpoint saved; continue with --resume)")
    g.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=int, default=8, help="validation batches in each evaluation (default 8)")
    g.add_argument("--sample-every", type=int, default=0, help="print a text sample every N steps (0: only at the end)")
    g.add_argument("--sample-tokens", type=int, default=120, help="tokens in each text sample (default 120; 0: none)")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")


def _profile_flags(g) -> None:
    """What it measures: the trace, the profiled steps, the peak for MFU."""
    g.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps to this path")
    g.add_argument("--profile-steps", default=None, help="steps to profile per dispatch, e.g. 10:20")
    g.add_argument("--profile-host-only", action="store_true",
                   help="profile without per-dispatch device timestamps (which serialise lavapipe's queue and "
                        "hide the overlap of backward and gradient communication)")
    g.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: from the device table)")


def main(argv=None) -> int:
    """Entry point of helios-train; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _train(args, explicit_flags(parser, argv))
    except DataError as e:  # the corpus or tokenizer the user named cannot be used
        usage(str(e))
    except (CheckpointError, DeviceError, CommError, ShapeError) as e:
        print(f"helios-train: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _train(args: argparse.Namespace, given: set[str]) -> int:
    """The run, step by step: settings (every check before any rank waits for another), the job
    (process group, device), the data, the model in its parallel layout with its optimizer and
    precision, a resumed run's state, the banner and run database, then the loop."""
    s = resolve_settings(args, given, CONFIGS)
    job = open_job(args, s)
    ds = load_data(args, job, s)
    summ = ds.summary(entropy=job.run.is_main)  # rank 0 logs it
    m = build_model(args, s, job, ds)
    # fp16 on a split model or sharded gradients: every rank holds other gradients, so the ranks
    # agree on inf/nan.  (_mixed_precision is looked up here at call time: tests/test_amp.py replaces it.)
    m.autocast, m.scaler = _mixed_precision(args.dtype, split=args.tp > 1 or args.pp > 1 or m.zero > 0 or args.ep > 1)
    loader = BatchLoader(ds.train, s.bs, s.T, seed=args.seed)
    val_loader = BatchLoader(ds.val, s.bs, s.T, seed=args.seed + 1)
    start_step = resume(args, s, job, m, loader)
    m.whole = None  # a stage keeps its own layers only
    capture_reason = capture_refusal(args, job.run, s.pipeline, m.zero)
    peak, peak_label = describe_run(args, s, job, m, summ, capture_reason)
    db = open_run_db(args, s, job, m, peak, peak_label)
    saver = Checkpointer(args, s, job, m, loader)
    loop = TrainLoop(args, s, job, m, ds, summ, loader, val_loader, saver, db, start_step, peak,
                     capture=capture_reason is None)
    return loop.run_to_end()


def _mixed_precision(dtype: str, split: bool = False):
    """--dtype's autocast context (a factory: one per forward) and loss scaler: float32 runs get
    a no-op context and a disabled scaler (every method a pass-through), bf16 autocast without
    scaling (its range is float32's), fp16 autocast with dynamic loss scaling (``split``: the
    model is split over the ranks, whose inf/nan findings the scaler combines)."""
    if dtype == "fp32":
        return contextlib.nullcontext, hl.amp.GradScaler(enabled=False)
    low = "bfloat16" if dtype == "bf16" else "float16"
    return (lambda: hl.autocast(low)), hl.amp.GradScaler(enabled=dtype == "fp16",
                                                         process_group="world" if split else None)


if __name__ == "__main__":
    sys.exit(main())
