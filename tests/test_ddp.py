"""DistributedDataParallel on real Helios tensors: N ranks give what one rank gives.

The ranks are this file run as a script.  Each run trains a nano-sized GPT with AdamW for
a few steps on a fixed global batch; rank r takes its contiguous slice of every global
batch.  The per-step losses (averaged over ranks) and the final parameters must match the
run of one rank on the whole batch.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import check_ok, run_ranks  # noqa: E402

STEPS = 6
GLOBAL_BATCH = 8
T = 16


def _batches(step: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    data = rng.integers(0, vocab, size=(GLOBAL_BATCH, T + 1))
    return data[:, :-1], data[:, 1:]


def _rank_main(out_dir: str, mode: str, accum: int, bucket_mb: float) -> None:
    import helios as hl
    import helios.comm as dist
    from helios.nn import GPT, GPTConfig
    from helios.optim import AdamW, clip_grad_norm_
    from helios.schedule import DistributedDataParallel

    dist.init_process_group(backend=mode)
    r, n = dist.get_rank(), dist.get_world_size()
    # No linear biases: the key bias's gradient is exactly zero in real arithmetic, so its
    # float noise (1e-7) differs with the reduction order, and AdamW's normalisation turns
    # that noise into lr-sized updates that no tolerance could call equal.
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32, bias=False)
    # Every rank but 0 starts from other weights: the wrap must broadcast rank 0's.
    model = DistributedDataParallel(GPT(cfg, seed=7 if r == 0 else 99), bucket_cap_mb=bucket_mb)
    gpt = model.module
    decay = [p for p in gpt.parameters() if p.ndim >= 2]
    other = [p for p in gpt.parameters() if p.ndim < 2]
    opt = AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=3e-3)
    per_rank = GLOBAL_BATCH // n
    micro = per_rank // accum
    losses = []
    for step in range(STEPS):
        x, y = _batches(step, cfg.vocab_size)
        x, y = x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]
        total = 0.0
        for m in range(accum):
            xs, ys = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
            sync = m == accum - 1
            ctx = model.no_sync() if not sync else _null()
            with ctx:
                _, loss = model(hl.tensor(xs, dtype=hl.int64), hl.tensor(ys, dtype=hl.int64))
                loss = loss * (1.0 / accum)
                loss.backward()
            total += loss.item()
        clip_grad_norm_(gpt.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        avg = np.array([total], np.float64)
        dist.all_reduce(avg, op="avg")
        losses.append(float(avg[0]))
    launched = [e for e in model.bucket_log if e.what == "launched"]
    early = [e for e in launched if e.backward_nodes_done < e.backward_nodes_total]
    if r == 0:
        params = {name: p.numpy() for name, p in gpt.named_parameters()}
        np.savez(os.path.join(out_dir, f"params-{n}.npz"), **params)
        with open(os.path.join(out_dir, f"result-{n}.json"), "w") as f:
            json.dump({"losses": losses, "buckets": len(model.buckets), "launched": len(launched),
                       "launched_before_backward_end": len(early)}, f)
    dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _run(tmp_path, world: int, backend: str = "shm", accum: int = 1, bucket_mb: float = 0.01) -> dict:
    check_ok(run_ranks([__file__, str(tmp_path), backend, str(accum), str(bucket_mb)], world, timeout=240))
    with open(tmp_path / f"result-{world}.json") as f:
        res = json.load(f)
    res["params"] = dict(np.load(tmp_path / f"params-{world}.npz"))
    return res


def _same(a: dict, b: dict, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=rtol, atol=1e-6)
    for k in a["params"]:
        np.testing.assert_allclose(a["params"][k], b["params"][k], rtol=rtol, atol=1e-6, err_msg=k)


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_two_and_four_ranks_match_one_rank(tmp_path):
    one = _run(tmp_path, 1)
    two = _run(tmp_path, 2)
    four = _run(tmp_path, 4)
    _same(one, two)
    _same(one, four)
    # Small buckets (10 KiB): several, and the first is issued while backward still runs.
    assert two["buckets"] > 2 and two["launched"] == two["buckets"] * STEPS
    assert two["launched_before_backward_end"] > 0


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_no_sync_accumulation_and_tcp_match_one_rank(tmp_path):
    one = _run(tmp_path, 1, accum=2)
    two = _run(tmp_path, 2, backend="tcp", accum=2, bucket_mb=25)
    _same(one, two)
    assert two["buckets"] == 2  # one per flat gradient buffer (AdamW's two parameter groups)


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
