"""Pipeline stages balanced by measured time (helios-train --pp-balance time): ``balance`` over
given times is the brute force's split, a model whose output layer is heavy moves a layer off
the last stage, and two ranks balanced by time train what one rank trains, every rank building
the same split (also the interleaved schedule's virtual stages)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from helios.schedule.pipeline import balance, describe_stages, layer_times, layer_weights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_dist import BIN, _env, launch, losses  # noqa: E402


def _brute_force(weights: list[float], parts: int) -> list[tuple[int, int]]:
    """Every way to cut ``weights`` into ``parts`` contiguous pieces; the one whose heaviest piece
    is lightest."""
    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = [0, *cuts, n]
        bounds = list(zip(edges[:-1], edges[1:]))
        heaviest = max(sum(weights[lo:hi]) for lo, hi in bounds)
        if best is None or heaviest < best[0]:
            best = (heaviest, bounds)
    return best[1]


def test_balance_over_measured_times_is_the_brute_force_split():
    rng = np.random.default_rng(3)
    for n in range(2, 9):
        for parts in range(1, n + 1):
            times = list(rng.uniform(0.5e-3, 20e-3, n))  # seconds, as layer_times gives them
            assert balance(times, parts) == _brute_force(times, parts), (times, parts)
    # A heavy output layer (the last "layer") alone on the last stage, where its parameter count
    # (the final LayerNorm's) would have put it with blocks.
    times = [1.0e-3, 3.0e-3, 3.1e-3, 2.9e-3, 3.0e-3, 12.0e-3]
    assert balance(times, 2) == _brute_force(times, 2) == [(0, 5), (5, 6)]
    assert describe_stages(balance(times, 2), 4, times=times) == (
        "0: embeddings, blocks 0-3 (13.0 ms) | 1: final LayerNorm and output layer (12.0 ms)")
    with pytest.raises(ValueError, match="5 times for 6 layers"):
        describe_stages(balance(times, 2), 4, times=times[:5])


@pytest.mark.vulkan
def test_a_heavy_output_layer_moves_a_layer_off_the_last_stage():
    from helios.nn import GPT, GPTConfig
    from helios.random import get_rng_state

    # A large vocabulary with a narrow model: the tied table makes the embeddings heavy by
    # parameter count, while the output layer's matmul and the cross entropy make the last
    # layer the slow one.
    cfg = GPTConfig(vocab_size=16384, block_size=64, n_layer=3, n_head=2, n_embd=32)
    gpt = GPT(cfg, seed=0)
    before = get_rng_state()
    times = layer_times(gpt, np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 64)), reps=3)
    assert len(times) == cfg.n_layer + 2 and all(t > 0 for t in times)
    by_params, by_time = balance(layer_weights(gpt), 2), balance(times, 2)
    assert by_params == [(0, 1), (1, 5)]  # the embeddings alone, every block with the output layer
    assert by_time[-1][0] > by_params[-1][0], (times, by_time)
    # Measuring leaves no gradient behind and the generator where it was.
    assert all(p.grad is None for p in gpt.parameters())
    assert get_rng_state() == before
    with pytest.raises(ValueError, match="batch must be"):
        layer_times(gpt, np.zeros(4, np.int64))


@pytest.mark.parametrize("flags,needle", [
    (["--pp-balance", "speed"], "--pp-balance must be params or time, got 'speed'"),
    (["--pp-balance", "time"], "--pp-balance time balances the stages of a pipeline: give --pp 2 or more"),
])
def test_a_bad_pp_balance_is_one_line_naming_the_flag(tmp_path, flags, needle):
    r = subprocess.run([os.path.join(BIN, "helios-train"), "--config", "nano", "--out", str(tmp_path), *flags],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"helios-train: error: {needle}"]


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_two_ranks_balanced_by_time_train_what_one_rank_trains(tmp_path):
    one = launch(1, tmp_path / "one", "--steps", "4", "--microbatches", "4")
    pp = launch(2, tmp_path / "pp", "--steps", "4", "--pp", "2", "--microbatches", "4", "--pp-balance", "time")
    assert one.returncode == 0, one.stderr[-3000:]
    assert pp.returncode == 0, pp.stdout[-2000:] + pp.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "pp"), losses(tmp_path / "one"), rtol=1e-5)
    assert "[rank 0] pipeline balance: each layer's forward + backward measured on this device" in pp.stdout
    said = {}
    for line in pp.stdout.splitlines():
        for rank in (0, 1):
            if line.startswith(f"[rank {rank}] pipeline stages: "):
                said.setdefault(rank, []).append(line.split("pipeline stages: ", 1)[1])
    assert sorted(said) == [0, 1] and all(len(v) == 1 for v in said.values()), pp.stdout[-3000:]
    assert said[0] == said[1]  # every rank built the same split
    assert said[0][0].startswith("0: embeddings") and " ms) | 1: " in said[0][0]


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_interleaved_stages_balanced_by_time_train_what_one_rank_trains(tmp_path):
    # The tiny config's 4 blocks: 2 ranks x 2 chunks, 4 virtual stages cut by the measured times.
    args = ("--config", "tiny", "--steps", "2", "--microbatches", "4")  # (batch 8 x 16 tokens, as launch gives)
    one = launch(1, tmp_path / "one", *args)
    pp = launch(2, tmp_path / "pp", *args, "--pp", "2", "--pp-virtual", "2", "--pp-balance", "time")
    assert one.returncode == 0, one.stderr[-3000:]
    assert pp.returncode == 0, pp.stdout[-2000:] + pp.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "pp"), losses(tmp_path / "one"), rtol=1e-5)
    said = [ln.split("] ", 1) for ln in pp.stdout.splitlines() if "] pipeline stages: " in ln]
    assert sorted(r for r, _ in said) == ["[rank 0", "[rank 1"] and said[0][1] == said[1][1], pp.stdout[-3000:]
    assert "3 (rank 1 chunk 1): " in said[0][1] and said[0][1].endswith("ms)")
