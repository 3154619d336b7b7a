"""Model parallelism: the same GPT on 1 rank, data parallel over 2 and tensor parallel over 2.

helios-train runs the tiny config (global batch 16 x 64) for ``--steps`` steps, one thread
per rank, over the tcp backend (so the bytes are bytes on the wire), in one run of this
script:

* ``step_ms``: median wall time of rank 0's steps after ``--warmup``;
* ``weights_pool_bytes``: what rank 0's weights pool holds (parameters, gradients, AdamW
  moments: the model states), from the run's config in run.db;
* ``payload_bytes_per_step`` / ``wire_bytes_per_step``: rank 0's collectives in a step, as
  helios.comm counts them (operand sizes / bytes sent);
* for tp 2, ``megatron_payload_bytes``: the formula's volume, 4 all-reduces of b·s·h fp32
  values per block (2 forward, 2 backward, Korthikanti et al.) plus what the vocabulary
  split adds (the embedding's all-reduce forward and the head input's backward: 2 more of
  b·s·h; the cross entropy's 3 of b·s), and the measured share of it.

The peers are the formula and, for tp 2, PyTorch's ``torch.distributed.tensor.parallel``
on gloo (2 processes, one thread each, the same GPT: the tied table split by vocabulary
rows as the embedding's ``RowwiseParallel`` and the head's ``ColwiseParallel`` with
``loss_parallel``, q/k/v and the MLP's first layer column-wise, the projections row-wise,
LayerNorms and positions replicated; AdamW and a clip of the whole model's norm, the same
global batch), printed next to Helios' rows as ``layout: "torch tp 2"`` (and ``"torch 1
rank"``, the same module unsplit): ``step_ms`` the median step after ``--warmup``,
``model_state_bytes`` rank 0's local parameters, gradients and AdamW moments (Helios'
weights pool holds the same), ``max_rss_bytes`` rank 0's peak resident memory.

Then the pipeline (``helios.schedule.pipeline``, helios-train's ``--pp``): the same
GPT in 2 stages on 2 ranks, 1F1B with m = 1, 4, 8 micro-batches of 2 sequences, 6 steps;
``idle_fraction`` per stage (median of steps 3-6: the share of the step, from the ranks'
common start to the end of the last stage, outside the stage's own work,
``PipelineStage.last_busy_seconds``) against the bubble formula (p - 1) / (m + p - 1);
``idle_fraction_own_step`` the share of the stage's own step spent waiting on a neighbour
(``PipelineStage.last_idle_fraction``: that step ends with the stage's last send, so the
last stage's drain, the first stage's last backward, is not in it); ``step_ms`` the median
step of those.  Then the interleaved schedule
(``--pp-virtual 2``: 2 chunks per rank, 4 virtual stages) with m = 4, 8 in the same run,
against (p - 1) / (v m + p - 1).

Then the stages balanced by measured time (helios-train's ``--pp-balance time``) next to
those balanced by parameter count, 1F1B on 2 ranks with m = 4, 8, for the tiny GPT with the
byte tokenizer's 256-token vocabulary and with a 4096-token one (``--tokenizer bpe:4096``'s
size: the tied table makes the embeddings heavy by parameter count and the output layer and
the loss slow): each row adds ``balance``, ``vocab``, the stage's layers' measured forward +
backward (``stage_measured_ms``, from ``layer_times``: rank 0's figures, measured in this run
on both ranks before training, median of 5 after 1 warm-up) and its ``blocks``.

Then sequence parallelism's activation memory: the same GPT's forward on 1 rank, on tp 2
and on tp 2 with ``sequence_parallel=True`` (one batch of the config, rank 0): the
activation pool's in-use bytes after the forward minus before it (what the tape keeps for
the backward), against Korthikanti et al.'s per-layer formula, s·b·h·(10 + 24/t + 5·a·s/(h·t))
without and s·b·h·(34/t + 5·a·s/(h·t)) with sequence parallelism, as a ratio to t = 1 (the
formula counts fp16 activations and dropout masks, Helios keeps fp32 and has no dropout
here, so only the ratios compare).

    python bench/model_parallel.py [--steps 30] [--warmup 5] [--skip-train] [--skip-torch] [--skip-pipeline]
                                   [--skip-balance] [--skip-activations] [--config tiny] [--smoke]

``--smoke`` (CI's seconds-long run, tests/test_bench_smoke.py): the nano config (2 layers), 4
steps (the first left out of the medians), Helios' rows for 1 rank and tp 2 (no dp 2) and
PyTorch's for tp 2 (no 1 rank), the pipeline with m = 2 only (1F1B: nano's 2 layers make no
interleaved stages), no balance or activation rows; every line as above, its figures
meaningless.  PyTorch's GPT is bench/torch_twin.py's ``tp_gpt_module``.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_parallel import ROOT, helios_run  # noqa: E402

sys.path.insert(0, ROOT)
from helios.train import CONFIGS  # noqa: E402


def _rank0(run_dir: str, warmup: int) -> dict:
    """Medians of rank 0's step time and collective bytes after ``warmup``, and its weights pool."""
    con = sqlite3.connect(os.path.join(run_dir, "run.db"))
    try:
        rows = con.execute("SELECT wall_ns, comm_bytes, comm_payload_bytes FROM step_timing WHERE rank = 0 AND "
                           "step > ? ORDER BY step", (warmup,)).fetchall()
        config = json.loads(con.execute("SELECT config_json FROM runs").fetchone()[0])
    finally:
        con.close()
    med = lambda i: statistics.median(r[i] for r in rows) if rows and rows[0][i] is not None else None  # noqa: E731
    return {"step_ms": round(med(0) / 1e6, 2), "wire_bytes_per_step": med(1), "payload_bytes_per_step": med(2),
            "weights_pool_bytes": config["memory"]["weights_pool_in_use"]}


def megatron_payload(cfg: dict, batch: int, block: int, tp: int) -> int:
    """Operand bytes of a tensor-parallel step's all-reduces on one rank (fp32, see the module docstring)."""
    if tp == 1:
        return 0
    bsh = batch * block * cfg["n_embd"]
    return 4 * (4 * cfg["n_layer"] * bsh + 2 * bsh + 3 * batch * block)


def _gpt_config(config: str, vocab: int = 256):
    """The helios-train config's GPT with a ``vocab``-token vocabulary (256: the byte tokenizer's)."""
    from helios.nn import GPTConfig

    c = CONFIGS[config]
    return GPTConfig(vocab_size=vocab, block_size=c["block_size"], n_layer=c["n_layer"], n_head=c["n_head"],
                     n_embd=c["n_embd"])


def _ranks_of_this_script(world: int, *args: str) -> list[str]:
    """Start ``world`` ranks of this script with helios-run; the JSON lines they printed."""
    import subprocess

    from data_parallel import BIN, _env

    cmd = [os.path.join(BIN, "helios-run"), "--nproc-per-node", str(world), __file__, *args]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=ROOT, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: the run failed: {r.stderr[-2000:]}")
    return [ln[ln.index("{"):] for ln in r.stdout.splitlines() if '"bench"' in ln]


def pipeline_rank(m: int, config: str, virtual: int = 1, balance: str | None = None, vocab: int = 256) -> None:
    """One rank of the pipeline measurement (started by helios-run): prints its stage's idle
    share and step time (``virtual`` chunks per rank: the interleaved schedule above 1).  With
    ``balance`` ("params" or "time"), the layers' times are measured first and the stages split
    by parameter count or by those times; the row also says the stage's measured time."""
    import time

    import numpy as np

    import helios.comm as dist
    from helios.nn import GPT
    from helios.schedule.grid import ParallelGrid
    from helios.schedule.pipeline import InterleavedPipelineStage, PipelineStage, bubble_fraction, layer_times

    dist.init_process_group()
    pp = dist.get_world_size()
    cfg = _gpt_config(config, vocab)
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, vocab, (2, cfg.block_size)) for _ in range(m)]
    grid = ParallelGrid(pp=pp)
    gpt = GPT(cfg, seed=1)
    measured = layer_times(gpt, xs[0], reps=5, warmup=1) if balance else None  # rank 0's, on every rank
    weights = measured if balance == "time" else None
    stage = (InterleavedPipelineStage(gpt, grid, virtual, weights=weights) if virtual > 1
             else PipelineStage(gpt, grid, weights=weights))
    shares, own_shares, times = [], [], []
    for step in range(6):
        dist.barrier()  # the ranks start each step together, as after helios-train's per-step collective
        t0 = time.perf_counter()
        stage.train_step(xs, xs)
        # The step ends when the last stage ends (helios-train's next collective waits for it): a
        # stage done earlier idles until then.  The last stage's own step ends before the first
        # stage's last backward (it then waits in the tied table's gradient sum), so its drain
        # bubble is only in this common window.
        dist.barrier()
        t2 = time.perf_counter()
        times.append(t2 - t0)
        for p in stage.parameters():
            p.grad = None
        if step >= 2:
            own_shares.append(stage.last_idle_fraction)
            shares.append(1.0 - stage.last_busy_seconds / (t2 - t0))
    layout = f"pp {pp}" + (f" x virtual {virtual}" if virtual > 1 else "")
    row = {"bench": "model_parallel", "layout": layout, "microbatches": m, "stage": stage.stage,
           "blocks": stage.block_ids, "idle_fraction": round(float(np.median(shares)), 3),
           "idle_fraction_own_step": round(float(np.median(own_shares)), 3),
           "bubble_formula": round(bubble_fraction(pp, virtual, m), 3),
           "step_ms": round(1e3 * float(np.median(times[2:])), 1)}
    if balance:
        lo, hi = stage.bounds[stage.stage]
        row.update(balance=balance, vocab=vocab, stage_measured_ms=round(1e3 * sum(measured[lo:hi]), 1),
                   layers_measured_ms=[round(1e3 * t, 1) for t in measured])
    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def activations_rank(config: str, sequence_parallel: bool) -> None:
    """One rank of the activation-memory measurement (started by helios-run)."""
    import numpy as np

    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT
    from helios.runtime import get_runtime
    from helios.schedule.grid import ParallelGrid
    from helios.schedule.tensor_parallel import TensorParallelGPT

    dist.init_process_group()
    tp = dist.get_world_size()
    c = CONFIGS[config]
    cfg = _gpt_config(config)
    x = hl.tensor(np.random.default_rng(0).integers(0, 256, (c["batch_size"], cfg.block_size)), dtype=hl.int64)
    model = GPT(cfg, seed=1)
    if tp > 1:
        model = TensorParallelGPT(model, ParallelGrid(tp=tp).tp_group, sequence_parallel=sequence_parallel)
    pool = get_runtime().dev
    hl.synchronize()
    before = pool.pool_stats()["activations"]["in_use_bytes"]
    _, loss = model(x, x)
    hl.synchronize()
    kept = pool.pool_stats()["activations"]["in_use_bytes"] - before
    loss.backward()
    s, b, h, a, layers = cfg.block_size, c["batch_size"], cfg.n_embd, cfg.n_head, cfg.n_layer

    def formula(t: int, sp: bool) -> float:
        return s * b * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))

    if dist.get_rank() == 0:
        name = "1 rank" if tp == 1 else f"tp {tp}" + (" + sequence parallel" if sequence_parallel else "")
        print(json.dumps({"bench": "model_parallel", "measure": "activations", "config": config, "layout": name,
                          "activation_bytes": kept, "layers": layers,
                          "formula_x_one_rank": round(formula(tp, sequence_parallel) / formula(1, False), 3)}),
              flush=True)
    dist.destroy_process_group()


def activations(config: str) -> None:
    """The activation rows: 1 rank, tp 2, tp 2 with sequence parallelism; measured over 1 rank."""
    base = None
    for world, sp in ((1, False), (2, False), (2, True)):
        lines = _ranks_of_this_script(world, "--activations-rank", "sp" if sp else "plain", "--config", config)
        line = json.loads(lines[0])
        base = base or line["activation_bytes"]
        line["measured_x_one_rank"] = round(line["activation_bytes"] / base, 3)
        print(json.dumps(line), flush=True)


def pipeline(config: str, smoke: bool = False) -> None:
    """The pipeline rows: 2 ranks of this script per micro-batch count, 1F1B then interleaved
    with 2 chunks per rank (m a multiple of the 2 ranks); ``smoke``: 1F1B with m = 2 only."""
    for virtual, ms in ((1, (2,)),) if smoke else ((1, (1, 4, 8)), (2, (4, 8))):
        for m in ms:
            for line in sorted(_ranks_of_this_script(2, "--pipeline-rank", str(m), "--pipeline-virtual", str(virtual),
                                                     "--config", config)):
                print(line, flush=True)


def pipeline_balance(config: str) -> None:
    """The balance rows: 1F1B on 2 ranks, m = 4 and 8, the stages split by parameter count and by
    measured time, for the 256- and the 4096-token vocabulary."""
    for vocab in (256, 4096):
        for m in (4, 8):
            for balance in ("params", "time"):
                for line in sorted(_ranks_of_this_script(2, "--pipeline-rank", str(m), "--pipeline-balance", balance,
                                                         "--pipeline-vocab", str(vocab), "--config", config)):
                    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="helios-train config (default tiny; --smoke nano)")
    ap.add_argument("--steps", type=int, default=None, help="steps of each training run (default 30; --smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps left out of the medians (default 5; --smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="CI's quick run (see the docstring)")
    ap.add_argument("--skip-pipeline", action="store_true")
    ap.add_argument("--skip-activations", action="store_true")
    ap.add_argument("--skip-train", action="store_true", help="leave out the helios-train rows (1 rank, dp 2, tp 2)")
    ap.add_argument("--pipeline-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip-balance", action="store_true",
                    help="leave out the rows balanced by parameter count and by measured time")
    ap.add_argument("--pipeline-virtual", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pipeline-balance", choices=["params", "time"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pipeline-vocab", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--activations-rank", choices=["sp", "plain"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip-torch", action="store_true", help="leave out PyTorch's rows (run after the helios-train rows)")
    ap.add_argument("--torch-tp-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.config = a.config or ("nano" if a.smoke else "tiny")
    a.steps = a.steps if a.steps is not None else (4 if a.smoke else 30)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 5)
    if a.torch_tp_rank is not None:
        torch_tp_rank(a.torch_tp_rank, a.world, a.port, a.config, a.steps, a.warmup)
        return
    if a.pipeline_rank is not None:
        pipeline_rank(a.pipeline_rank, a.config, a.pipeline_virtual, a.pipeline_balance, a.pipeline_vocab)
        return
    if a.activations_rank is not None:
        activations_rank(a.config, a.activations_rank == "sp")
        return
    if not a.skip_train:
        train_rows(a)
    if not a.skip_pipeline:
        pipeline(a.config, a.smoke)
    if not a.skip_balance and not a.smoke:
        pipeline_balance(a.config)
    if not a.skip_activations and not a.smoke:
        activations(a.config)


def train_rows(a) -> None:
    """The helios-train rows: 1 rank, dp 2 and tp 2 on the same global batch."""
    cfg = CONFIGS[a.config]
    os.environ["HELIOS_COMM_BACKEND"] = "tcp"
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = {"1 rank": (1, ()), "dp 2": (2, ()), "tp 2": (2, ("--tp", "2"))}
        if a.smoke:  # the layouts PyTorch's rows have (data parallel: bench/data_parallel.py's smoke)
            del runs["dp 2"]
        base, helios = None, {}
        for name, (world, extra) in runs.items():
            out = os.path.join(tmp, name.replace(" ", ""))
            helios_run(world, cfg["batch_size"] // world, a.config, a.steps, out, *extra)  # the same global batch
            res = helios[name] = _rank0(out, a.warmup)
            tp = 2 if "--tp" in extra else 1
            line = {"bench": "model_parallel", "config": a.config, "layout": name, "ranks": world, **res}
            if tp > 1:
                f = megatron_payload(cfg, cfg["batch_size"], cfg["block_size"], tp)
                line["megatron_payload_bytes"] = f
                line["measured_over_formula"] = round(res["payload_bytes_per_step"] / f, 4)
            if base is None:
                base = res
            line["step_x_one_rank"] = round(res["step_ms"] / base["step_ms"], 3)
            line["weights_pool_x_one_rank"] = round(res["weights_pool_bytes"] / base["weights_pool_bytes"], 3)
            print(json.dumps(line), flush=True)
    if not a.skip_torch:
        torch_rows(a, helios)


def torch_rows(a, helios: dict) -> None:
    """PyTorch's rows: the same GPT on 1 process and tensor parallel over 2 (gloo), each with
    Helios' step time and weights pool of the same layout from this run (``--smoke``: tp 2 only,
    its own base)."""
    torch_one = None
    for world, name in ((2, "tp 2"),) if a.smoke else ((1, "1 rank"), (2, "tp 2")):
        res = torch_tp(world, a.config, a.steps, a.warmup)
        torch_one = torch_one or res
        line = {"bench": "model_parallel", "config": a.config, "layout": f"torch {name}", "ranks": world, **res,
                "step_x_one_rank": round(res["step_ms"] / torch_one["step_ms"], 3),
                "model_state_x_one_rank": round(res["model_state_bytes"] / torch_one["model_state_bytes"], 3)}
        if name in helios:
            line["helios_step_ms"] = helios[name]["step_ms"]
            line["helios_weights_pool_bytes"] = helios[name]["weights_pool_bytes"]
        print(json.dumps(line), flush=True)


def torch_tp(world: int, config: str, steps: int, warmup: int) -> dict:
    """Start ``world`` processes of :func:`torch_tp_rank`; rank 0's measurements."""
    import socket
    import subprocess

    from data_parallel import _env

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, __file__, "--torch-tp-rank", str(r), "--world", str(world), "--port",
                               str(port), "--config", config, "--steps", str(steps), "--warmup", str(warmup)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r in range(world)]
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"torch tensor-parallel run failed: {[e[-2000:] for _, e in outs]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _torch_tp_model(config: str, rank: int, world: int, port: int):
    """PyTorch's GPT (bench/torch_twin.py: q, k and v apart, what parallelize_module splits),
    split Megatron-style over ``world`` gloo ranks; (model, the loss's context: loss_parallel
    under tp, so the vocabulary-sharded logits are never gathered)."""
    import contextlib

    import torch.distributed as tdist

    from torch_twin import tp_gpt_module

    c = CONFIGS[config]
    model = tp_gpt_module(_gpt_config(config, 256))
    loss_ctx = contextlib.nullcontext
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                       parallelize_module)

        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(c["n_layer"]):
            plan.update({f"h.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "c_fc")})
            plan.update({f"h.{i}.{n}": RowwiseParallel() for n in ("c_proj", "mlp_proj")})
        parallelize_module(model, mesh, plan)
        loss_ctx = loss_parallel
    model.lm_head.weight = model.wte.weight  # tied: both [V, C], rows split the same way under tp
    return model, loss_ctx


def _local(t):
    """A rank's part of a split (DTensor) tensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _torch_clip_(params: list, world: int, max_norm: float) -> None:
    """Clip by the whole model's norm: the split tensors' squares summed over the ranks, the
    replicated ones counted once."""
    import math

    import torch
    import torch.distributed as tdist

    split = sum(float(_local(p.grad).pow(2).sum()) for p in params if hasattr(p.grad, "to_local"))
    if world > 1:
        buf = torch.tensor([split], dtype=torch.float64)
        tdist.all_reduce(buf)
        split = float(buf[0])
    whole = split + sum(float(p.grad.pow(2).sum()) for p in params if not hasattr(p.grad, "to_local"))
    coef = min(1.0, max_norm / (math.sqrt(whole) + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)


def torch_tp_rank(rank: int, world: int, port: int, config: str, steps: int, warmup: int) -> None:
    """One process of PyTorch's tensor-parallel GPT (see the module docstring); rank 0 prints
    its median step time, model-state bytes and peak resident memory."""
    import math
    import resource
    import time

    import numpy as np
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as TF

    torch.set_num_threads(1)
    c = CONFIGS[config]
    T, V, B = c["block_size"], 256, c["batch_size"]
    torch.manual_seed(0)
    model, loss_ctx = _torch_tp_model(config, rank, world, port)
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    # foreach=False: the per-tensor loop takes split (DTensor) and replicated tensors alike
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=False)
    rng = np.random.default_rng(0)  # the same batch on both tensor-parallel ranks
    batches = [(torch.tensor(rng.integers(0, V, (B, T))), torch.tensor(rng.integers(0, V, (B, T))))
               for _ in range(steps)]
    times = []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        logits = model(x)
        with loss_ctx():
            loss = TF.cross_entropy(logits.reshape(B * T, V), y.reshape(-1))
            loss.backward()
        _torch_clip_(params, world, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay allocated, as Helios' flat buffers
        if world > 1:
            tdist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        value = float((loss if world == 1 else loss.full_tensor()).detach())
        if not math.isfinite(value):
            raise SystemExit(f"torch tp: loss became non-finite at step {i}")
    state = sum(_local(p).numel() for p in params) + sum(_local(p.grad).numel() for p in params)
    state += sum(_local(v).numel() for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))
    if rank == 0:
        print(json.dumps({"step_ms": round(1e3 * statistics.median(times), 2), "model_state_bytes": 4 * state,
                          "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "final_loss": round(value, 6),  # 1 rank and tp 2 train the same: a check of the split
                          "torch": torch.__version__}), flush=True)
    if world > 1:
        tdist.destroy_process_group()


if __name__ == "__main__":
    main()
