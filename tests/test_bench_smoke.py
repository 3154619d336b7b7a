"""Every benchmark's smoke mode runs, both sides: the benchmarks cannot rot unnoticed.

Each bench/*.py script runs as a subprocess with ``--smoke`` (tiny sizes, one round, Helios and
its peer; see each script's docstring) and must exit 0 and print JSON lines whose fields say
that both sides ran.  The multi-rank benchmarks run 2 ranks with ``LP_NUM_THREADS=1`` each.
The GPU-only benchmarks have their own tests: bench/ptx_gemm.py in tests/test_bench_ptx_gemm.py,
bench/attention.py --device cuda:0 in tests/test_cuda_flash.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from cluster_fixture import unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _has(line: dict, *fields: str) -> bool:
    return all(line.get(f) is not None for f in fields)


def _check_attention(lines):
    (row,) = [x for x in lines if x.get("bench") == "attention"]
    assert _has(row, "flash_fwd_bwd_ms", "dense_fwd_bwd_ms", "torch_fwd_bwd_ms", "flash_speedup_vs_torch"), row
    assert all(isinstance(row[f"{k}_peak_mib"], float) for k in ("flash", "dense", "torch")), row


def _check_autocast_step(lines):
    runs = [x for x in lines if x.get("bench") == "autocast_step"]
    assert {x["dtype"] for x in runs} == {"fp32", "bf16"}, lines
    for x in runs:
        assert x["tok_s"] > 0 and x["dispatches_per_step"] > 0 and x["device_ms_per_step"] > 0, x
    (summary,) = [x for x in lines if x.get("bench") == "autocast_step_summary"]
    assert _has(summary, "bf16_over_fp32_tok_s", "bf16_over_fp32_device_ms", "bf16_over_fp32_dispatches"), summary


def _check_collectives(lines):
    rows = [x for x in lines if x.get("bench") in ("all_reduce", "all_gather", "reduce_scatter")]
    assert {x["bench"] for x in rows} == {"all_reduce", "all_gather", "reduce_scatter"}, lines
    for x in rows:
        assert x["ranks"] == 2 and x["helios"]["time_us"] > 0 and x["peer"]["time_us"] > 0 and _has(x, "ratio"), x


def _check_compression(lines):
    rows = [x for x in lines if x.get("bench") == "compression"]
    assert {(x["side"], x["hook"]) for x in rows} == {("helios", "none"), ("helios", "powersgd"), ("peer", "torch-powersgd")}
    for x in rows:
        assert _has(x, "wire_bytes_per_step", "payload_bytes_per_step", "step_ms", "final_val_loss"), x
    (summary,) = [x for x in lines if x.get("bench") == "compression_summary"]
    assert _has(summary, "helios_powersgd_bytes_share", "helios_powersgd_val_gap_pct"), summary
    assert [x["bench"] for x in lines][-1] == "compression_plot"


def _check_data_parallel(lines):
    (row,) = [x for x in lines if x.get("bench") == "data_parallel_scaling"]
    assert _has(row, "helios_tok_s_1", "helios_tok_s_2", "peer_tok_s_1", "peer_tok_s_2", "ratio"), row
    (overlap,) = [x for x in lines if x.get("bench") == "data_parallel_overlap"]
    assert overlap["all_reduces"] > 0, overlap
    (ck,) = [x for x in lines if x.get("bench") == "checkpoint_step"]
    assert ck.get("checkpoint_steps", 0) > 0, ck
    (zero,) = [x for x in lines if x.get("bench") == "zero"]
    assert zero["stage"] == 0 and zero["bytes_per_rank"], zero


def _check_dispatch(lines):
    rows = {x["bench"]: x for x in lines}
    for name in ("dispatch_independent", "dispatch_chain"):
        assert _has(rows[name], "helios", "peer", "ratio"), rows


def _check_ew_fusion(lines):
    rows = {x["bench"]: x for x in lines}
    assert _has(rows["ew_fusion_chain4"], "fused_ms", "unfused_ms", "speedup"), rows
    assert rows["ew_fusion_chain4"]["fused_dispatches"] < rows["ew_fusion_chain4"]["unfused_dispatches"]
    assert _has(rows["ew_fusion_record"], "chain_fused", "chain_unfused"), rows


def _check_generate(lines):
    (row,) = lines
    assert _has(row, "kv_tok_s", "full_tok_s", "peer_tok_s", "kv_over_full", "kv_over_peer"), row
    assert isinstance(row["same_tokens"], bool), row


def _check_matmul(lines):
    assert len(lines) == 6, lines  # 2 shapes x 3 layouts
    for x in lines:
        assert _has(x, "helios_gflops", "numpy_gflops", "ratio") and x["rel_err"] < 1e-3, x


def _check_model_parallel(lines):
    rows = {x["layout"]: x for x in lines if "measure" not in x and x["layout"] != "pp 2"}
    assert set(rows) == {"1 rank", "tp 2", "torch tp 2"}, rows
    assert _has(rows["tp 2"], "step_ms", "measured_over_formula"), rows["tp 2"]
    assert _has(rows["torch tp 2"], "step_ms", "helios_step_ms", "final_loss"), rows["torch tp 2"]
    assert sorted(x["stage"] for x in lines if x["layout"] == "pp 2") == [0, 1]


def _check_profile_overhead(lines):
    (row,) = lines
    assert _has(row, "off_ms", "timers_ms", "full_ms", "timers_overhead_pct"), row


def _check_multihost(lines):
    rows = {}
    for x in lines:
        rows.setdefault(x["bench"], []).append(x)
    (lv,) = rows["multihost_levels"]
    assert all(_has(lv[k], "alpha_us", "GBps") for k in ("intra", "inter")), lv
    (ar,) = rows["multihost_all_reduce"]
    for side in ("hierarchical", "ring", "gloo"):  # Helios both ways and the peer, bytes from both hosts' links
        assert ar[side]["time_ms"] > 0 and len(ar[side]["host_tx_over_S"]) == 2, ar
    (tr,) = rows["multihost_train"]
    assert _has(tr, "one_host_2_ranks_tok_s", "two_hosts_2_ranks_tok_s", "scaling"), tr
    assert all(_has(tr[k], "step_ms_planned", "step_ms_measured") for k in ("plan_one_host", "plan_two_hosts")), tr
    (ld,) = rows["multihost_linkdown"]
    assert ld["trials"] == 1 and _has(ld, "all_ranks_commerror", "hangs", "all_within_timeout_of_op"), ld


def _check_ring_attention(lines):
    rows = {x["impl"]: x for x in lines}
    assert set(rows) == {"ring", "single", "torch", "summary"}, rows
    assert _has(rows["ring"], "fwd_bwd_ms") and _has(rows["torch"], "fwd_bwd_ms", "peak_mib"), rows
    assert _has(rows["summary"], "ring_speedup_vs_single_1t", "ring_speedup_vs_torch_1t"), rows["summary"]


def _check_train_parity(lines):
    (row,) = lines
    assert row["ok"] and row["same_start"] and _has(row, "helios_final_val_loss", "peer_final_val_loss"), row


def _check_train_step(lines):
    row, prof = lines
    assert _has(row, "helios_tok_s", "replay_tok_s", "peer_tok_s", "ratio", "peer_mfu"), row
    assert prof["bench"] == "train_step_kernels" and len(prof["kernels"]) == len(prof["ops"]) == 3, prof
    assert prof["dispatches"] >= sum(k["dispatches"] for k in prof["kernels"]) > 0, prof
    assert prof["kernels"][0]["ms"] >= prof["kernels"][-1]["ms"] > 0 and 0 < prof["kernels"][0]["share"] <= 1, prof
    assert row["vocab"] == 256, row  # the byte tokenizer's, unless --vocab


def _check_vulkan_coopmat(lines):
    attn = [x for x in lines if x["bench"] == "vulkan_flash_coop"]
    lines = [x for x in lines if x["bench"] == "vulkan_coopmat"]
    assert [(x["dtype"], x["T"], x["D"], x["causal"]) for x in attn] == [(dt, 64, 64, True) for dt in ("float16", "bfloat16")], attn
    for x in attn:
        assert _has(x, "coop_fwd_ms", "coop_fwd_bwd_ms", "plain_fwd_ms", "plain_fwd_bwd_ms") and x["rel_err"] < 2e-2, x
        assert x["kernel"] == ("flash_coop" if x["plan"] else "flash_attn"), x
        assert _has(x, "torch_fwd_ms", "ratio_fwd_vs_torch") or _has(x, "torch_skipped"), x
    assert [(x["dtype"], x["size"], x["layout"]) for x in lines] == [
        (dt, 64, lay) for dt in ("float16", "bfloat16") for lay in ("nn", "nt")], lines
    for x in lines:
        assert _has(x, "kernel", "reason", "coopmat_gflops", "plain_gflops", "speedup_vs_plain") and x["rel_err"] < 1e-2, x
        assert x["kernel"] == ("matmul_coop" if x["coopmat_shapes"] and x["tile"] else "matmul"), x
        assert _has(x, "cublas_gflops", "ratio_vs_cublas") or _has(x, "cublas_skipped"), x


def _check_store_attack(lines):
    rows = {x["window"]: x for x in lines if x.get("bench") == "store_attack"}
    assert set(rows) == {"quiet", "attack"} and all(x["steps"] > 0 for x in rows.values()), lines
    (summary,) = [x for x in lines if x.get("bench") == "store_attack_summary"]
    assert summary["connections"] > 0 and summary["rejected"] == summary["connections"], summary  # all refused


VK, MP = pytest.mark.vulkan, pytest.mark.multiproc
_NO_CLUSTER = unavailable()
CLUSTER = pytest.mark.skipif(_NO_CLUSTER is not None, reason=f"no fake cluster here: {_NO_CLUSTER}")
# script: (its check, whether its peer is PyTorch, whether it runs several ranks, pytest marks)
BENCHES = {
    "attention.py": (_check_attention, True, False, [VK]),
    "collectives.py": (_check_collectives, True, True, [MP]),  # helios.comm on host arrays: no device
    "compression.py": (_check_compression, True, True, [VK, MP]),
    "data_parallel.py": (_check_data_parallel, True, True, [VK, MP]),
    "dispatch.py": (_check_dispatch, False, False, [VK]),  # peer: the addon's raw C++ loop
    "autocast_step.py": (_check_autocast_step, False, False, [VK]),  # peer: the same run in fp32
    "ew_fusion.py": (_check_ew_fusion, False, False, [VK]),  # peer: the same ops unfused
    "generate.py": (_check_generate, True, False, [VK]),  # peer: transformers' generate on PyTorch CPU
    "matmul.py": (_check_matmul, False, False, [VK]),  # peer: numpy
    "model_parallel.py": (_check_model_parallel, True, True, [VK, MP]),
    "multihost.py": (_check_multihost, True, True, [VK, MP, CLUSTER]),  # namespace hosts: root and ip netns
    "profile_overhead.py": (_check_profile_overhead, False, False, [VK]),  # peer: profiling off
    "ring_attention.py": (_check_ring_attention, True, True, [VK, MP]),
    "store_attack.py": (_check_store_attack, False, True, [MP]),  # peer: the same job's quiet windows
    "train_parity.py": (_check_train_parity, True, False, [VK]),
    "train_step.py": (_check_train_step, True, False, [VK]),
    "vulkan_coopmat.py": (_check_vulkan_coopmat, False, False, [VK]),  # peers: the shared-memory kernel, cuBLAS where there is CUDA
}


def test_every_benchmark_has_a_smoke_test():
    """A new bench/*.py gets a smoke mode and a row here (GPU-only ones are tested elsewhere)."""
    gpu_only = {"ptx_gemm.py"}
    scripts = {f for f in os.listdir(BENCH) if f.endswith(".py") and f != "torch_twin.py"}
    assert scripts - gpu_only == set(BENCHES)


@pytest.mark.parametrize("script", [pytest.param(s, marks=m[3], id=s.removesuffix(".py")) for s, m in BENCHES.items()])
def test_benchmark_smoke_mode_runs_both_sides(script, tmp_path):
    check, needs_torch, multirank, _ = BENCHES[script]
    if needs_torch and not HAVE_TORCH:
        pytest.skip(f"bench/{script}'s peer is PyTorch, which is not installed")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if multirank:
        env.update(LP_NUM_THREADS="1", OMP_NUM_THREADS="1")  # each of the 2 ranks on one thread
    # cwd: a scratch folder, so a script that wrote beside itself or into its working folder shows
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), "--smoke"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, f"bench/{script} --smoke exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, f"bench/{script} --smoke printed no JSON line:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    check(lines)
    assert not os.listdir(tmp_path), f"bench/{script} --smoke left files in its working folder: {os.listdir(tmp_path)}"


@pytest.mark.vulkan
@pytest.mark.skipif(not HAVE_TORCH, reason="bench/attention.py's peer is PyTorch, which is not installed")
def test_attention_times_16_bit_grouped_query_flash_against_the_autocast_dense_path(tmp_path):
    """``attention.py --dtype bf16 --kv-heads 1``: flash on bf16 operands, the two query heads sharing
    one K/V head, against the dense path under bf16 autocast, both timed, each line saying its
    dtype and K/V heads; flags that do not go together are one line."""
    r = subprocess.run([sys.executable, os.path.join(BENCH, "attention.py"), "--smoke", "--no-memory", "--dtype", "bf16",
                        "--kv-heads", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = [x for x in map(json.loads, (x for x in r.stdout.splitlines() if x.startswith("{"))) if x.get("bench") == "attention"]
    assert row["dtype"] == "bf16" and (row["H"], row["Hk"]) == (2, 1), row
    assert _has(row, "flash_fwd_bwd_ms", "dense_fwd_bwd_ms", "torch_fwd_bwd_ms", "flash_speedup_vs_dense"), row
    for argv, why in ((["--dtype", "bf16", "--sparse"], "--dtype times flash against dense attention"),
                      (["--kv-heads", "3"], "--kv-heads 3 must divide --heads 4")):
        bad = subprocess.run([sys.executable, os.path.join(BENCH, "attention.py"), *argv],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert bad.returncode == 2 and why in bad.stderr.splitlines()[-1], bad.stderr


def _train_step_module(monkeypatch):
    """bench/train_step.py as a module (in this process: no interpreter to start)."""
    monkeypatch.syspath_prepend(BENCH)  # the script imports torch_twin from beside it
    spec = importlib.util.spec_from_file_location("bench_train_step", os.path.join(BENCH, "train_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_step_refuses_a_vocabulary_of_one_token_or_logits_too_large_to_bind(monkeypatch, capsys):
    from helios.runtime import get_runtime
    from helios.train import CONFIGS

    mod = _train_step_module(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["train_step.py", "--vocab", "1"])
    with pytest.raises(SystemExit) as e:
        mod._parse_args()
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith("--vocab 1: a vocabulary has at least 2 tokens")
    # nano's 8 x 32 rows of logits over 2**30 tokens: 8 GiB, more than any device binds at once
    monkeypatch.setattr(sys, "argv", ["train_step.py", "--config", "nano", "--vocab", str(2**30)])
    ap, args = mod._parse_args()
    with pytest.raises(SystemExit) as e:
        mod._check_fits(ap, args, 8, 32, CONFIGS["nano"], get_runtime())
    last = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and "--vocab 1073741824: the nano config's logits" in last and "binds at once" in last, last


def test_train_step_writes_every_profiled_dispatch(tmp_path, monkeypatch):
    """``train_step.py --dispatches PATH``: the profiled step's every dispatch, in order, one
    tab-separated line each with the op that recorded it, as many as the profile counted."""
    import numpy as np

    import helios as hl

    mod = _train_step_module(monkeypatch)
    x = hl.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    path = tmp_path / "dispatches.tsv"
    prof = mod.kernel_profile(lambda: ((x * 2.0).exp() + x).sum().item(), 3, "none", "fp32", "test", str(path))
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    assert rows[0] == ["seq", "kernel", "op", "shape", "dtype", "bytes", "device_us"]
    assert len(rows) - 1 == prof["dispatches"] >= 2  # the chain fuses into one kernel, then the sum
    assert [int(r[0]) for r in rows[1:]] == sorted(int(r[0]) for r in rows[1:])
    assert rows[-1][1:5] == ["sum", "sum", "()", "float32"] and all(float(r[6]) >= 0 for r in rows[1:])
    assert os.listdir(tmp_path) == ["dispatches.tsv"]  # no temporary file left beside it
