"""MFU/HFU formulas, the peak table, the CPU estimate, and n/a handling."""

from __future__ import annotations

import math

import pytest
from helios.profile import (
    compute_mfu,
    cpu_peak_estimate,
    format_mfu,
    gpt_flops_per_token,
    gpt_hardware_flops_per_token,
    peak_flops,
)
from helios.profile.mfu import cpu_clock_ghz, cpu_flops_per_cycle

# GPT-2 small: 12 layers, width 768, context 1024; N from nanoGPT's non-embedding count.
N, L, T, C = 124_337_664, 12, 1024, 768


def test_model_flops_follow_palm_convention() -> None:
    assert gpt_flops_per_token(N, L, T, C) == 6 * N + 12 * L * T * C
    assert gpt_flops_per_token(N, L, T, C, causal_half=True) == 6 * N + 6 * L * T * C  # llm.c's count
    # 6N (~0.75 GFLOP) plus the attention term (~0.11 GFLOP) per token.
    assert 8.0e8 < gpt_flops_per_token(N, L, T, C) < 9.0e8


def test_hardware_flops_with_recompute() -> None:
    base = gpt_flops_per_token(N, L, T, C)
    assert gpt_hardware_flops_per_token(N, L, T, C, "none") == base
    assert gpt_hardware_flops_per_token(N, L, T, C, "selective") == base + 4 * L * T * C
    assert gpt_hardware_flops_per_token(N, L, T, C, "full") == 8 * N + 16 * L * T * C  # PaLM's HFU count
    assert gpt_hardware_flops_per_token(N, L, T, C, "full", causal_half=True) == 8 * N + 8 * L * T * C
    with pytest.raises(ValueError, match="recompute must be one of"):
        gpt_hardware_flops_per_token(N, L, T, C, "some")
    with pytest.raises(ValueError, match="n_layer must be >= 0"):
        gpt_flops_per_token(N, -1, T, C)


@pytest.mark.parametrize("name,dtype,tflops,display", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4, "NVIDIA H100 SXM"),
    ("NVIDIA H100 80GB HBM3", "float32", 66.9, "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", "bfloat16", 756.5, "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "bf16", 835.5, "NVIDIA H100 NVL"),
    ("NVIDIA H200", "bf16", 989.4, "NVIDIA H200 SXM"),
    ("NVIDIA H200 NVL", "fp32", 60.0, "NVIDIA H200 NVL"),
    ("NVIDIA GH200 480GB", "bf16", 989.4, "NVIDIA GH200"),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0, "NVIDIA A100"),
    ("NVIDIA GeForce RTX 4090", "fp32", 82.6, "NVIDIA GeForce RTX 4090"),
    ("NVIDIA GeForce RTX 3090", "bf16", 71.0, "NVIDIA GeForce RTX 3090"),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0, "NVIDIA V100 (no bf16)"),
])
def test_peak_table_lookup(name: str, dtype: str, tflops: float, display: str) -> None:
    p = peak_flops(name, dtype)
    assert p is not None and not p.estimate
    assert p.flops == pytest.approx(tflops * 1e12)
    assert p.device == display
    assert "TFLOP/s" in p.label and "estimate" not in p.label


@pytest.mark.parametrize("name,dtype", [
    ("AMD Radeon RX 7900 XTX", "bf16"),      # not in the table
    ("NVIDIA GeForce RTX 4090 D", "bf16"),   # a cut-down variant must not borrow the 4090's peak
    ("NVIDIA GeForce RTX 3080 Ti", "fp32"),
    ("Tesla V100-SXM2-16GB", "bf16"),        # no bf16 on Volta
    ("NVIDIA H100 80GB HBM3", "int8"),       # a dtype we do not rate
    ("", "bf16"),
])
def test_unknown_gives_none(name: str, dtype: str) -> None:
    assert peak_flops(name, dtype) is None


CPUINFO = """processor\t: 0
model name\t: Example CPU @ 2.20GHz
cpu MHz\t\t: 2600.000
flags\t\t: fpu sse sse2 avx avx2 fma
processor\t: 1
cpu MHz\t\t: 2400.000
"""


def test_cpu_estimate_from_cores_clock_isa() -> None:
    p = cpu_peak_estimate("fp32", cpuinfo=CPUINFO, cores=4)
    assert p is not None and p.estimate
    assert p.flops == pytest.approx(4 * 2.6e9 * 32)
    assert "estimate" in p.label and "AVX2+FMA" in p.label and "4 cores" in p.label
    # cpufreq max wins over the current MHz.
    p2 = cpu_peak_estimate("fp32", cpuinfo=CPUINFO, cores=4, max_khz_text="3500000\n")
    assert p2.flops == pytest.approx(4 * 3.5e9 * 32)
    # AVX-512 with bf16 support doubles the bf16 rate only.
    info512 = CPUINFO.replace("avx2 fma", "avx2 fma avx512f avx512_bf16")
    assert cpu_peak_estimate("fp32", cpuinfo=info512, cores=2).flops == pytest.approx(2 * 2.6e9 * 64)
    assert cpu_peak_estimate("bf16", cpuinfo=info512, cores=2).flops == pytest.approx(2 * 2.6e9 * 128)
    assert cpu_peak_estimate("bf16", cpuinfo=CPUINFO, cores=2).flops == pytest.approx(2 * 2.6e9 * 32)


def test_cpu_estimate_fallbacks_and_unknowns() -> None:
    no_mhz = "model name\t: Example CPU @ 2.20GHz\nflags\t\t: sse2\n"
    assert cpu_clock_ghz(no_mhz, "", None) == (2.2, "model name")
    assert cpu_peak_estimate("fp32", cpuinfo=no_mhz, cores=1).flops == pytest.approx(2.2e9 * 8)
    assert cpu_peak_estimate("fp32", cpuinfo="flags\t: sse2\n", cores=1) is None  # no clock anywhere
    assert cpu_peak_estimate("fp32", cpuinfo="cpu MHz\t: 2000\nflags\t: mmx\n", cores=1) is None  # unknown ISA
    assert cpu_flops_per_cycle({"asimd"}) == (16, "ASIMD")


def test_this_machine_cpu_device_is_an_estimate_or_none() -> None:
    p = peak_flops("llvmpipe (LLVM 15.0.6, 256 bits)", "fp32")
    if p is not None:  # reading this machine's clock may fail in a sandbox; never a non-estimate
        assert p.estimate and 1e9 < p.flops < 1e15 and "estimate" in p.label
    assert peak_flops("whatever", "fp32", device_type="cpu") == p


def test_mfu_values_and_na() -> None:
    peak = peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    fpt = gpt_flops_per_token(N, L, T, C)
    tps = 0.5 * peak.flops / fpt
    assert compute_mfu(fpt, tps, peak) == pytest.approx(0.5)
    assert compute_mfu(fpt, tps, peak.flops, n_devices=2) == pytest.approx(0.25)
    assert compute_mfu(fpt, tps, None) is None
    assert compute_mfu(fpt, None, peak) is None
    assert compute_mfu(fpt, tps, 0.0) is None
    assert compute_mfu(fpt, -1.0, peak) is None
    assert compute_mfu(fpt, math.nan, peak) is None
    with pytest.warns(RuntimeWarning, match="outside"):
        assert compute_mfu(fpt, 3 * tps, peak) is None  # 150% of peak: absurd, so n/a
    assert format_mfu(0.41349) == "41.3%" and format_mfu(None) == "n/a"
