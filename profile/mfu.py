"""Model FLOPs utilisation (MFU), hardware FLOPs utilisation (HFU), device peak table.

Formula (a GPT, per token, forward + backward)
----------------------------------------------
We follow the PaLM paper (Chowdhery et al. 2022, appendix B), which is also
nanoGPT's ``estimate_mfu``::

    model_flops_per_token = 6*N + 12*L*T*C

* ``N`` -- parameters that take part in matmuls: every weight of the model,
  the tied token embedding counted once (it is the LM head's weight),
  *positional embeddings excluded* (a lookup, no FLOPs). Norm gains and biases
  are counted too; they are a rounding error.
* ``6*N`` -- each weight does one multiply-add (2 FLOPs) per token in the
  forward pass and two in the backward pass (gradient w.r.t. the input and
  w.r.t. the weight): 2 + 4 = 6.
* ``12*L*T*C`` -- attention scores and the weighted sum, which have no weights:
  per layer and token the forward does ``Q K^T`` (2*T*C FLOPs) and ``A V``
  (2*T*C FLOPs) = 4*T*C, and the backward twice that: 12*T*C per layer.
  ``L`` = layers, ``T`` = sequence length (context), ``C`` = model width
  (heads x head size).
* No causal discount: the masked half of the score matrix is counted, as in
  PaLM and nanoGPT. llm.c counts ``6*L*T*C`` instead (it halves the attention
  term for the causal mask); pass ``causal_half=True`` to get llm.c's number.

Then::

    MFU = model_flops_per_token * tokens_per_second / (peak_flops * n_devices)

HFU counts the FLOPs the hardware really ran, which is more than the model's
when activations are recomputed in the backward pass::

    hardware_flops_per_token = model_flops_per_token + recompute_extra
      recompute="none"      : extra = 0
      recompute="selective" : extra = 4*L*T*C        (attention core run again, as in Megatron's
                                                       selective recompute)
      recompute="full"      : extra = 2*N + 4*L*T*C  (a whole second forward pass: PaLM's 8N + 16LTC
                                                       total with the 12LTC convention)
    HFU = hardware_flops_per_token * tokens_per_second / (peak_flops * n_devices)

Peaks
-----
``peak_flops(device_name, dtype)`` looks the device name up in
:data:`PEAK_TABLE` (dense -- no structured sparsity -- tensor-core numbers from
the vendors' datasheets; for GeForce cards the rate with FP32 accumulate, which is
what training uses). A CPU device (a Vulkan CPU device such as lavapipe/llvmpipe,
or ``device_type="cpu"``) gets an *estimate*::

    peak = cores x clock x FLOPs_per_cycle_per_core

``cores`` is ``os.cpu_count()`` (logical CPUs: with SMT this overstates the
peak, so the MFU shown errs low, never above 100%); the clock is the maximum
frequency from cpufreq, else ``lscpu``'s "CPU max MHz", else the highest
"cpu MHz" in /proc/cpuinfo, else the "@ x.xxGHz" of the model name; FLOPs per
cycle (fp32) come from the ISA flags, assuming two FMA pipes: AVX-512 64, AVX2+FMA
32, AVX 16, SSE2 8, AArch64 ASIMD 16. ``avx512_bf16`` doubles the bf16 rate
(``avx512_fp16`` the fp16 rate); otherwise bf16/fp16 run at the fp32 rate. The
result is labelled as an estimate everywhere it is shown.

An unknown device, an unknown dtype for a known device, or a non-positive rate
gives ``None``, shown as "n/a" -- never a made-up peak. An MFU outside [0, 1]
means the peak or the FLOP count is wrong; :func:`compute_mfu` then warns and returns None.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass

# ---------------------------------------------------------------------------- formulas


def gpt_flops_per_token(n_params: int, n_layer: int, seq_len: int, d_model: int, causal_half: bool = False) -> int:
    """Model FLOPs per token for one forward+backward of a GPT: ``6N + 12LTC`` (``6N + 6LTC`` if causal_half)."""
    for name, v in (("n_params", n_params), ("n_layer", n_layer), ("seq_len", seq_len), ("d_model", d_model)):
        if int(v) < 0:
            raise ValueError(f"gpt_flops_per_token: {name} must be >= 0, got {v}")
    attn = (6 if causal_half else 12) * n_layer * seq_len * d_model
    return 6 * int(n_params) + int(attn)


_RECOMPUTE = ("none", "selective", "full")


def gpt_hardware_flops_per_token(
    n_params: int,
    n_layer: int,
    seq_len: int,
    d_model: int,
    recompute: str = "none",
    causal_half: bool = False,
) -> int:
    """Hardware FLOPs per token: model FLOPs plus the recomputed forward work (see module docstring)."""
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute must be one of {_RECOMPUTE}, got {recompute!r}")
    base = gpt_flops_per_token(n_params, n_layer, seq_len, d_model, causal_half)
    attn_fwd = (2 if causal_half else 4) * n_layer * seq_len * d_model
    if recompute == "none":
        return base
    if recompute == "selective":
        return base + attn_fwd
    return base + 2 * int(n_params) + attn_fwd


_WARNED: set[tuple[float, float, int]] = set()


def compute_mfu(flops_per_token: float, tokens_per_s: float | None, peak: PeakFlops | float | None, n_devices: int = 1) -> float | None:
    """Utilisation = flops_per_token * tokens_per_s / (peak * n_devices), or None when it cannot be known.

    Use model FLOPs for MFU and hardware FLOPs for HFU. Returns None (shown as
    "n/a") when the peak is unknown, the throughput is missing, or the result
    falls outside [0, 1] (which only a wrong peak or FLOP count can produce; a
    warning says so).
    """
    peak_v = peak.flops if isinstance(peak, PeakFlops) else peak
    if peak_v is None or tokens_per_s is None or n_devices <= 0:
        return None
    if not (math.isfinite(peak_v) and peak_v > 0 and math.isfinite(tokens_per_s) and tokens_per_s >= 0):
        return None
    u = float(flops_per_token) * float(tokens_per_s) / (float(peak_v) * n_devices)
    if not (0.0 <= u <= 1.0):
        key = (float(peak_v), float(flops_per_token), n_devices)
        if key in _WARNED:  # once per (peak, FLOPs) pair, not once per step
            return None
        _WARNED.add(key)
        warnings.warn(
            f"utilisation {u:.3g} is outside [0, 1]: the peak ({peak_v:.4g} FLOP/s x {n_devices}) or the FLOPs per "
            f"token ({flops_per_token:.4g}) is wrong; reporting n/a",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return u


def format_mfu(u: float | None) -> str:
    """``0.413`` -> ``"41.3%"``; None -> ``"n/a"``."""
    return "n/a" if u is None else f"{100.0 * u:.1f}%"


# ---------------------------------------------------------------------------- peak table

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "f32": "fp32", "float32": "fp32", "float": "fp32",
}


def canonical_dtype(dtype: str) -> str | None:
    """Map a dtype spelling (``"bfloat16"``, ``"f32"``...) to ``bf16``/``fp16``/``fp32``; None if not a float we rate."""
    return _DTYPE_ALIASES.get(str(dtype).lower().replace("torch.", "").replace("helios.", ""))


_T = 1e12
#: (regex matched against the device name, display name, {dtype: dense FLOP/s}).
#: Order matters: the first match wins, so variants come before the family.
#: Source: the vendors' datasheets / architecture whitepapers, dense (no sparsity).
PEAK_TABLE: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"\bGH200\b", "NVIDIA GH200", {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp32": 66.9 * _T}),
    (r"\bH200\b.*\bNVL\b", "NVIDIA H200 NVL", {"bf16": 835.5 * _T, "fp16": 835.5 * _T, "fp32": 60.0 * _T}),
    (r"\bH200\b", "NVIDIA H200 SXM", {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp32": 66.9 * _T}),
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", {"bf16": 756.5 * _T, "fp16": 756.5 * _T, "fp32": 51.2 * _T}),
    (r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", {"bf16": 835.5 * _T, "fp16": 835.5 * _T, "fp32": 60.0 * _T}),
    (r"\bH100\b", "NVIDIA H100 SXM", {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp32": 66.9 * _T}),
    (r"\bA100\b", "NVIDIA A100", {"bf16": 312.0 * _T, "fp16": 312.0 * _T, "fp32": 19.5 * _T}),
    (r"\bL40S\b", "NVIDIA L40S", {"bf16": 362.1 * _T, "fp16": 362.1 * _T, "fp32": 91.6 * _T}),
    (r"\bL4\b", "NVIDIA L4", {"bf16": 121.0 * _T, "fp16": 121.0 * _T, "fp32": 30.3 * _T}),
    (r"\bA10\b", "NVIDIA A10", {"bf16": 125.0 * _T, "fp16": 125.0 * _T, "fp32": 31.2 * _T}),
    (r"\bV100\b", "NVIDIA V100 (no bf16)", {"fp16": 125.0 * _T, "fp32": 15.7 * _T}),
    (r"\bT4\b", "NVIDIA T4 (no bf16)", {"fp16": 65.0 * _T, "fp32": 8.1 * _T}),
    (r"RTX 4090(?! D)(?!.*Laptop)", "NVIDIA GeForce RTX 4090", {"bf16": 165.2 * _T, "fp16": 165.2 * _T, "fp32": 82.6 * _T}),
    (r"RTX 4080(?! SUPER)(?!.*Laptop)", "NVIDIA GeForce RTX 4080", {"bf16": 97.5 * _T, "fp16": 97.5 * _T, "fp32": 48.7 * _T}),
    (r"RTX 3090(?! Ti)(?!.*Laptop)", "NVIDIA GeForce RTX 3090", {"bf16": 71.0 * _T, "fp16": 71.0 * _T, "fp32": 35.6 * _T}),
    (r"RTX 3080(?! Ti)(?!.*Laptop)", "NVIDIA GeForce RTX 3080", {"bf16": 59.5 * _T, "fp16": 59.5 * _T, "fp32": 29.8 * _T}),
)

# Names a Vulkan CPU implementation reports.
_CPU_DEVICE_RE = re.compile(r"llvmpipe|lavapipe|swiftshader|^cpu\b", re.IGNORECASE)


@dataclass(frozen=True)
class PeakFlops:
    """A device's peak rate for one dtype, where it came from, and whether it is an estimate."""

    flops: float
    device: str
    dtype: str
    source: str
    estimate: bool

    @property
    def label(self) -> str:
        """Human-readable, e.g. ``"989.4 TFLOP/s bf16, NVIDIA H100 SXM (datasheet)"``."""
        v = self.flops
        num = f"{v / 1e12:.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.1f} GFLOP/s"
        tag = "estimate: " if self.estimate else ""
        return f"{num} {self.dtype}, {self.device} ({tag}{self.source})"


def peak_flops(device_name: str, dtype: str = "bf16", device_type: str | None = None) -> PeakFlops | None:
    """Peak FLOP/s of ``device_name`` for ``dtype``; a labelled estimate for CPU devices; None if unknown."""
    dt = canonical_dtype(dtype)
    if dt is None or not device_name:
        return None
    if (device_type or "").lower() == "cpu" or _CPU_DEVICE_RE.search(device_name):
        return cpu_peak_estimate(dt)
    for pattern, display, rates in PEAK_TABLE:
        if re.search(pattern, device_name, re.IGNORECASE):
            v = rates.get(dt)
            if v is None or v <= 0:
                return None
            return PeakFlops(v, display, dt, "vendor datasheet, dense", estimate=False)
    return None


# ---------------------------------------------------------------------------- CPU estimate


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _lscpu_max_mhz() -> float | None:
    exe = shutil.which("lscpu")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=5, check=False,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^CPU max MHz:\s*([\d.]+)", out, re.MULTILINE)
    return float(m.group(1)) if m else None


def cpu_clock_ghz(cpuinfo: str | None = None, max_khz_text: str | None = None, lscpu_mhz: float | None = None) -> tuple[float, str] | None:
    """Best known per-core clock in GHz and where it came from; inputs are injectable for tests."""
    if max_khz_text is None:
        max_khz_text = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if max_khz_text and max_khz_text.strip().isdigit() and int(max_khz_text.strip()) > 0:
        return int(max_khz_text.strip()) / 1e6, "cpufreq max"
    if lscpu_mhz is None and cpuinfo is None:
        lscpu_mhz = _lscpu_max_mhz()
    if lscpu_mhz and lscpu_mhz > 0:
        return lscpu_mhz / 1e3, "lscpu max MHz"
    if cpuinfo is None:
        cpuinfo = _read("/proc/cpuinfo") or ""
    mhz = [float(x) for x in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.MULTILINE)]
    mhz = [x for x in mhz if x > 0]
    if mhz:
        return max(mhz) / 1e3, "/proc/cpuinfo cpu MHz"
    m = re.search(r"@\s*([\d.]+)\s*GHz", cpuinfo)
    if m:
        return float(m.group(1)), "model name"
    return None


def cpu_flops_per_cycle(flags: set[str], dtype: str = "fp32") -> tuple[int, str] | None:
    """FLOPs per cycle per core for ``dtype`` from the ISA flags (two FMA pipes assumed); None if unknown ISA."""
    if "avx512f" in flags:
        base, isa = 64, "AVX-512"
    elif "avx2" in flags and "fma" in flags:
        base, isa = 32, "AVX2+FMA"
    elif "avx" in flags:
        base, isa = 16, "AVX"
    elif "asimd" in flags:
        base, isa = 16, "ASIMD"
    elif "sse2" in flags:
        base, isa = 8, "SSE2"
    else:
        return None
    if dtype == "bf16" and "avx512_bf16" in flags:
        return base * 2, isa + "+BF16"
    if dtype == "fp16" and "avx512_fp16" in flags:
        return base * 2, isa + "+FP16"
    return base, isa


def cpu_peak_estimate(dtype: str = "fp32", cpuinfo: str | None = None, cores: int | None = None,
                      max_khz_text: str | None = None, lscpu_mhz: float | None = None) -> PeakFlops | None:
    """Estimated CPU peak: cores x clock x FLOPs/cycle, labelled an estimate; None if any factor is unknown."""
    dt = canonical_dtype(dtype)
    if dt is None:
        return None
    if cpuinfo is None:
        cpuinfo = _read("/proc/cpuinfo") or ""
        clock = cpu_clock_ghz(None, max_khz_text, lscpu_mhz)
    else:
        clock = cpu_clock_ghz(cpuinfo, max_khz_text if max_khz_text is not None else "", lscpu_mhz)
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    flags = set(m.group(1).split()) if m else set()
    fpc = cpu_flops_per_cycle(flags, dt)
    n = cores if cores is not None else os.cpu_count()
    if clock is None or fpc is None or not n or n <= 0:
        return None
    ghz, clock_src = clock
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    name = model.group(1).strip() if model else "CPU"
    src = f"{n} cores x {ghz:.2f} GHz ({clock_src}) x {fpc[0]} FLOP/cycle ({fpc[1]})"
    return PeakFlops(n * ghz * 1e9 * fpc[0], name, dt, src, estimate=True)
