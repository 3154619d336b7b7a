"""Training-step throughput: the same GPT in PyTorch (eager, CPU or --peer cuda) and in Helios (default device or --device).

Prints one JSON line per config: tokens/s of each, their ratio, and MFU of each against
the device peak of helios.profile.mfu (a labelled estimate on CPUs; lavapipe runs on the
same CPU cores, so both use the CPU's fp32 peak).  Helios runs twice: every step through
Python and autograd (``helios_*``), and the first step captured with ``hl.graph`` and the
others replayed (``replay_*``, what helios-train does by default on one device).
``host_ms_*`` is the host's time to issue one step (recording and submitting, up to the
flush; not the wait for the loss), median over the timed steps.

    python bench/train_step.py [--config tiny] [--steps 5] [--device cuda:0 --peer cuda] [--dtype bf16]
                               [--vocab 256] [--compile | --no-compile] [--smoke]

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): the nano config, 2 timed steps
after 1 warm-up, one round of each side instead of the best of two, no torch.compile peer
unless ``--compile``, and ``--kernels 3``; the same lines, their figures meaningless.

``--dtype bf16`` runs both sides under autocast (Helios' ``hl.autocast``, PyTorch's
``torch.autocast``): the matmuls in bfloat16 (on ``cuda:N`` Helios' tensor-core kernel, on
``--peer cuda`` cuBLAS's), the rest in float32.

The PyTorch twin (bench/torch_twin.py's ``torch_loss_fn``) is the same GPT over Helios' initial
weights, eager.  With ``--peer cuda`` its attention goes through ``scaled_dot_product_attention`` (PyTorch's flash
kernel; ``peer_attention: "sdpa"``), on the CPU it is written out (scores, mask, softmax;
``"explicit"``), as the CPU figures in bench/README.md were measured.  With ``--peer cuda``
(or ``--compile``) a second peer times the same step with the forward through
``torch.compile`` (default mode; the backward is the compiled graph's, clip and AdamW eager):
``compile_tok_s``, ``compile_ms_per_step``, ``compile_mfu``, ``ratio_vs_compile`` (Helios every
step through Python over it), ``replay_ratio_vs_compile``, and ``compile_first_step_s`` (the
step that compiled).  Where torch.compile fails (no Triton, an unsupported op) the line has
``"compile_failed": "<type: first line>"`` instead and the rest runs as before; a step
capture that fails likewise gives ``replay_failed``.  ``*_mfu`` (``helios``, ``replay``,
``peer``, ``compile``): the GPT's model FLOPs a token (``flops_per_token``, 6N + 12LTC, see
helios.profile.mfu) times tokens/s over the device's peak for ``--dtype`` from
``helios.profile.mfu.peak_flops`` (``peak``; an H200 SXM: 989.4 TFLOP/s bf16, 66.9 fp32), the
same peak for every side.

On ``cuda:N`` the ``replay_*`` fields time the prepared launches issued one by one
(``HELIOS_CUDA_GRAPHS=0``); ``--cuda-graphs-ab`` also times the replayed step with each run of
launches as one CUDA graph (cuda_ptx/replay_graphs.py: what helios-train does there by default),
interleaved with the one-by-one replays: ``replay_graphs_tok_s``, ``graphs_over_launches`` (> 1:
graphs are faster) and ``host_ms_replay_graphs``.

``--kernels N`` adds a second line, ``"bench": "train_step_kernels"``: one more Helios step, every
step through Python, under ``helios.profile`` with device timestamps, and its N kernels of the most
device time (name, dispatches, ms, share of the step's device time, GFLOP/s and GB/s where the
kernel reports its work): where a step's time goes, to fix the largest first.  ``--dispatches PATH``
also writes that step's every dispatch to PATH as tab-separated lines (its order, kernel, the op
that recorded it with the op's shape and dtype, bytes moved, device microseconds): which copies,
which reductions (implies ``--kernels 20`` when ``--kernels`` is not given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from torch_twin import torch_loss_fn  # bench/torch_twin.py, beside this script

def torch_step_fn(cfg, B, T, params, opt, dtype: str = "fp32", sdpa: bool = False, compiled: bool = False):
    """One PyTorch training step (forward under autocast with ``dtype`` bf16, backward, clip,
    AdamW), the loss read back; ``compiled``: the forward (the loss) through ``torch.compile``."""
    import contextlib

    import torch

    inner = torch_loss_fn(cfg, B, T, params, sdpa)
    dev = next(iter(params.values())).device.type

    def loss_fn(x, y):
        with (torch.autocast(dev, torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()):
            return inner(x, y)

    if compiled:
        loss_fn = torch.compile(loss_fn)

    def step(x, y):
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def time_steps(step, batches, warmup: int) -> float:
    for x, y in batches[:warmup]:
        step(x, y)
    t0 = time.perf_counter()
    for x, y in batches[warmup:]:
        step(x, y)
    return (time.perf_counter() - t0) / (len(batches) - warmup)


def _parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser (for errors only the device can tell) and the command line, with --smoke's defaults filled in."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="helios-train config (default tiny; --smoke nano)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --smoke 1)")
    ap.add_argument("--device", default=None, help="Helios device (default: HELIOS_DEVICE or the best one), e.g. cuda:0")
    ap.add_argument("--peer", choices=("cpu", "cuda"), default="cpu",
                    help="PyTorch eager on the host's CPU threads, or on the GPU (cuda, TF32 off: fp32 as Helios)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: both sides under autocast (matmuls in bfloat16, as helios-train --dtype bf16)")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None,
                    help="also time the PyTorch twin through torch.compile (default: with --peer cuda)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="leave the torch.compile peer out")
    ap.add_argument("--cuda-graphs-ab", action="store_true",
                    help="cuda:N: also time the replayed step with its launches as CUDA graphs (HELIOS_CUDA_GRAPHS), "
                         "interleaved with the one-by-one replays")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also profile one step and print its N kernels of the most device time (a second JSON line)")
    ap.add_argument("--dispatches", default=None, metavar="PATH",
                    help="also write the profiled step's every dispatch to PATH (tab-separated; implies --kernels 20)")
    ap.add_argument("--vocab", type=int, default=256, metavar="V",
                    help="the GPT's vocabulary (default 256, the byte tokenizer's; 50257: GPT-2's, a tied head of V x C)")
    ap.add_argument("--smoke", action="store_true",
                    help="CI's quick run: nano, 2 steps after 1 warm-up, one round, no torch.compile unless --compile")
    args = ap.parse_args()
    if args.vocab < 2:
        ap.error(f"--vocab {args.vocab}: a vocabulary has at least 2 tokens")
    args.config = args.config or ("nano" if args.smoke else "tiny")
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    args.kernels = args.kernels or (3 if args.smoke else 20 if args.dispatches else 0)
    if args.compile is None:
        args.compile = args.peer == "cuda" and not args.smoke
    return ap, args


def _check_fits(ap, args, B: int, T: int, c: dict, rt) -> None:
    """A usage error where one step's largest activation (the logits, at a large --vocab) is more
    than the device binds at once: helios.train_settings.largest_activation's sizes, as helios-train
    checks them, except that bf16 logits count their 2 bytes an element (helios-train counts 4 in
    every dtype, so it refuses some bf16 runs this benchmark takes)."""
    from helios.train_settings import largest_activation

    need, what = largest_activation(B, T, c["n_head"], c["n_embd"], args.vocab)
    if args.dtype == "bf16" and what.startswith("logits"):
        need //= 2  # autocast's logits are bfloat16
    if need > rt.max_range:
        ap.error(f"--vocab {args.vocab}: the {args.config} config's {what} is {need:,} bytes in {args.dtype}, more than "
                 f"{rt.name} binds at once ({rt.max_range:,} bytes); take a smaller --vocab or config")


class HeliosSide:
    """The Helios model twice from one seed: ``eager`` runs every step through Python and
    autograd; ``replay`` captures its first step with ``hl.graph`` and replays the others (what
    helios-train does on one device), optionally as CUDA graphs.  ``host`` keeps each timed call's
    time to issue the step (up to the flush), by mode."""

    def __init__(self, cfg, dtype: str):
        import helios as hl
        from helios.nn import GPT
        from helios.optim import AdamW, clip_grad_norm_
        from helios.runtime import get_runtime

        self.hl, self.clip, self.dtype, self.rt = hl, clip_grad_norm_, dtype, get_runtime()
        self.model = GPT(cfg, seed=0)
        self.opt = AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        self.model_r = GPT(cfg, seed=0)
        self.opt_r = AdamW(self.model_r.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        self.captured = {}
        self.host = {"eager": [], "replay": [], "replay_graphs": []}

    def _step(self, m, o, x, y):
        """One training step of model ``m`` with optimizer ``o`` on device tensors; the loss."""
        if self.dtype == "bf16":
            with self.hl.autocast("bfloat16"):
                _, loss = m(x, y)
        else:
            _, loss = m(x, y)
        loss.backward()
        self.clip(m.parameters(), 1.0)
        o.step()
        o.zero_grad()
        return loss

    def eager(self, x, y) -> float:
        """One step of the eager model on host batches ``x``, ``y``; the loss."""
        t0 = time.perf_counter()
        loss = self._step(self.model, self.opt, self.hl.tensor(x), self.hl.tensor(y))
        self.rt.flush()
        self.host["eager"].append(time.perf_counter() - t0)
        return loss.item()

    def replay(self, x, y, graphs: bool = False) -> float:
        """One step of the replayed model: captured on the first call, replayed after.  On ``cuda:N``
        its launches go one by one, or with ``graphs`` each run of them as one CUDA graph; its host
        time is kept under "replay" or "replay_graphs"."""
        key = "replay_graphs" if graphs else "replay"
        if hasattr(self.rt, "use_cuda_graphs"):
            self.rt.use_cuda_graphs(graphs)
        if not self.captured:
            xt, yt = self.hl.tensor(x), self.hl.tensor(y)
            with self.hl.graph.capture(inputs=(xt, yt)) as g:
                loss = self._step(self.model_r, self.opt_r, xt, yt)
            self.captured.update(graph=g, loss=loss)
            return loss.item()
        t0 = time.perf_counter()
        self.captured["graph"].replay(x, y)
        self.host[key].append(time.perf_counter() - t0)
        return self.captured["loss"].item()

    def replay_as_graphs(self, x, y) -> float:
        """:meth:`replay` with each run of launches issued as one CUDA graph."""
        return self.replay(x, y, graphs=True)


def _torch_peers(args, cfg, B: int, T: int, model, tbatches, failed: dict) -> tuple:
    """(eager step, compiled step or None, seconds the compiled step's first call took or None)
    of the PyTorch twin from ``model``'s weights; a torch.compile that fails (on its first batch of
    ``tbatches``) is recorded in ``failed``."""
    import torch

    tdev = torch.device(args.peer)
    sdpa = args.peer == "cuda"  # on the GPU the twin's attention goes through SDPA (the flash kernel)

    def twin(compiled: bool):
        tparams = {n: torch.tensor(p.numpy(), device=tdev, requires_grad=True) for n, p in model.named_parameters()}
        topt = torch.optim.AdamW(list(tparams.values()), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        return torch_step_fn(cfg, B, T, tparams, topt, args.dtype, sdpa=sdpa, compiled=compiled)

    tstep, cstep, compile_s = twin(False), None, None
    if args.compile:  # a second peer: the same step with its forward through torch.compile, where that works
        try:
            cstep = twin(True)
            t0 = time.perf_counter()
            cstep(*tbatches[0])  # compiles (forward and backward graphs)
            compile_s = time.perf_counter() - t0
        except Exception as e:
            failed["compile"], cstep = _one_line(e), None
    return tstep, cstep, compile_s


def _timed_rounds(args, side: HeliosSide, tstep, cstep, batches, tbatches, failed: dict) -> dict:
    """Each side's seconds a step, by name, in rounds that interleave them (helios, replay, graphs,
    torch eager, compiled) to share the machine's noise: one round with --smoke, else two."""
    times = {"helios": [], "replay": [], "replay_graphs": [], "peer": [], "compile": []}

    def attempt(key: str, step, data, fail_key: str) -> None:
        if fail_key in failed:
            return
        try:
            times[key].append(time_steps(step, data, args.warmup))
        except Exception as e:  # e.g. a capture that fails on this device: its line says so, the rest still runs
            failed[fail_key] = _one_line(e)

    for _ in range(1 if args.smoke else 2):
        times["helios"].append(time_steps(side.eager, batches, args.warmup))
        attempt("replay", side.replay, batches, "replay")
        if args.cuda_graphs_ab and "replay" not in failed:  # the same replays, each run of launches one graph
            times["replay_graphs"].append(time_steps(side.replay_as_graphs, batches, args.warmup))
        times["peer"].append(time_steps(tstep, tbatches, args.warmup))
        if cstep is not None:
            attempt("compile", cstep, tbatches, "compile")
    return {k: min(v) for k, v in times.items() if v and k not in failed}


def _result_line(args, side: HeliosSide, best: dict, failed: dict, compile_s, per_step: int, tokens: int) -> dict:
    """The benchmark's JSON line: tokens/s, ratios, host times and MFU of each side that ran."""
    import torch

    from helios.profile.mfu import compute_mfu, peak_flops

    rt, model, host = side.rt, side.model, side.host
    fpt = model.flops_per_token()
    peak = peak_flops(rt.info["name"], args.dtype, rt.info["type"])
    tps = {k: tokens / v for k, v in best.items()}
    host_eager = statistics.median(host["eager"][args.warmup:])
    out = {
        "bench": "train_step", "config": args.config, "vocab": args.vocab, "dtype": args.dtype, "params": model.num_parameters(),
        "tokens_per_step": tokens,
        "device": rt.name, "device_name": rt.info["name"], "helios_tok_s": round(tps["helios"], 1),
        "peer": f"torch_{args.peer}", "peer_attention": "sdpa" if args.peer == "cuda" else "explicit",
        "peer_tok_s": round(tps["peer"], 1),
        "ratio": round(tps["helios"] / tps["peer"], 4), "helios_ms_per_step": round(best["helios"] * 1e3, 1),
        "peer_ms_per_step": round(best["peer"] * 1e3, 1),
    }
    if "replay_graphs" in tps:
        out.update(replay_graphs_tok_s=round(tps["replay_graphs"], 1),
                   graphs_over_launches=round(tps["replay_graphs"] / tps["replay"], 4),
                   host_ms_replay_graphs=round(statistics.median(host["replay_graphs"]) * 1e3, 3))
    if "replay" in tps:
        out.update(replay_tok_s=round(tps["replay"], 1), replay_ratio=round(tps["replay"] / tps["peer"], 4),
                   replay_ms_per_step=round(best["replay"] * 1e3, 1))
    else:
        out["replay_failed"] = failed["replay"]
    out.update(dispatches_per_step=per_step, host_ms_eager=round(host_eager * 1e3, 3))
    if "replay" in tps:
        host_replay = statistics.median(host["replay"])
        out.update(host_ms_replay=round(host_replay * 1e3, 3), host_replay_share=round(host_replay / host_eager, 4))
    if "compile" in tps:
        out.update(compile_peer=f"torch_compile_{args.peer}", compile_tok_s=round(tps["compile"], 1),
                   compile_ms_per_step=round(best["compile"] * 1e3, 1), compile_first_step_s=round(compile_s, 1),
                   ratio_vs_compile=round(tps["helios"] / tps["compile"], 4))
        if "replay" in tps:
            out["replay_ratio_vs_compile"] = round(tps["replay"] / tps["compile"], 4)
    elif "compile" in failed:
        out["compile_failed"] = failed["compile"]
    # MFU of each against the device's peak (helios.profile.mfu: 6N + 12LTC FLOPs a token)
    for k in ("helios", "replay", "peer", "compile"):
        if k in tps:
            mfu = compute_mfu(fpt, tps[k], peak)
            out[f"{k}_mfu"] = round(mfu, 5) if mfu is not None else None
    out.update(flops_per_token=fpt, peak=peak.label if peak else None, torch_threads=torch.get_num_threads())
    return out


def main() -> None:
    ap, args = _parse_args()

    import torch

    from helios.nn import GPTConfig
    from helios.runtime import get_runtime, set_device
    from helios.train import CONFIGS

    if args.device:
        set_device(args.device)
    if args.cuda_graphs_ab and not hasattr(get_runtime(), "use_cuda_graphs"):
        ap.error(f"--cuda-graphs-ab times CUDA graphs: it needs a cuda:N --device, not {get_runtime().name}")
    if args.peer == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    c = CONFIGS[args.config]
    B, T = c["batch_size"], c["block_size"]
    V = args.vocab
    _check_fits(ap, args, B, T, c, get_runtime())
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"])
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))) for _ in range(args.steps + args.warmup)]
    tbatches = [(torch.tensor(x, device=args.peer), torch.tensor(y, device=args.peer)) for x, y in batches]

    side = HeliosSide(cfg, args.dtype)
    failed = {}
    tstep, cstep, compile_s = _torch_peers(args, cfg, B, T, side.model, tbatches, failed)
    best = _timed_rounds(args, side, tstep, cstep, batches, tbatches, failed)
    d0 = side.rt.stats()["dispatches"]
    side.eager(*batches[0])
    per_step = side.rt.stats()["dispatches"] - d0  # kernel launches in one step (copies and fills not counted)
    print(json.dumps(_result_line(args, side, best, failed, compile_s, per_step, B * T)))
    if args.kernels > 0:
        print(json.dumps(kernel_profile(lambda: side.eager(*batches[0]), args.kernels, args.config, args.dtype,
                                        side.rt.name, args.dispatches)))


def write_dispatches(path: str, collector) -> None:
    """Every dispatch the profiler ``collector`` holds, in order, as tab-separated lines at ``path``
    (written to a temporary name, then renamed)."""
    from helios.fileio import atomic_open

    op_of = collector.op_of_dispatch()
    with atomic_open(path, "w") as f:
        f.write("seq\tkernel\top\tshape\tdtype\tbytes\tdevice_us\n")
        for ev in sorted(collector.events, key=lambda e: e.dispatch_seq):
            op = op_of.get(ev.dispatch_seq)
            name, shape, dtype = (op.name, op.shape, op.dtype) if op is not None else ("", "", "")
            f.write(f"{ev.dispatch_seq}\t{ev.name}\t{name}\t{shape}\t{dtype}\t{ev.bytes}\t{ev.device_ns / 1e3:.2f}\n")


def kernel_profile(run_step, top: int, config: str, dtype: str, device: str, dispatches: str | None = None) -> dict:
    """One step under helios.profile: its ``top`` kernels (dispatch names) by device time, and the
    ops (autograd's forward and backward names) they ran for, as one JSON-able dict; with
    ``dispatches`` (a path), every dispatch of the step written there too (write_dispatches)."""
    from collections import defaultdict

    from helios.profile import profile

    with profile() as prof:
        run_step()
    kernels = defaultdict(lambda: [0, 0, 0, 0])  # name -> dispatches, device ns, flops, bytes
    for ev in prof.collector.events:
        k = kernels[ev.name]
        k[0] += 1
        k[1] += ev.device_ns
        k[2] += ev.flops
        k[3] += ev.bytes
    total = sum(k[1] for k in kernels.values())

    def line(name: str, dispatches: int, ns: int, flops: int, nbytes: int) -> dict:
        k = {"name": name, "dispatches": dispatches, "ms": round(ns / 1e6, 3), "share": round(ns / total, 4) if total else None}
        if ns > 0 and flops:
            k["gflop_s"] = round(flops / ns, 1)
        if ns > 0 and nbytes:
            k["gb_s"] = round(nbytes / ns, 1)
        return k

    if dispatches:
        write_dispatches(dispatches, prof.collector)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    ops = prof.key_averages().sorted_by("device_time")[:top]
    return {"bench": "train_step_kernels", "config": config, "dtype": dtype, "device": device,
            "device_ms": round(total / 1e6, 3), "dispatches": sum(k[0] for k in kernels.values()),
            "kernels": [line(n, *k) for n, k in ranked],
            "ops": [line(r.name, r.dispatches, r.device_time_ns, r.flops, r.bytes) for r in ops]}


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


if __name__ == "__main__":
    main()
