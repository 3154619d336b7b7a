"""The hardware table: what one device computes, holds and moves.

Each :class:`Device` has its peak dense FLOP/s per dtype, memory, memory bandwidth, the
link between devices of one node (per device, per direction) and the network between
nodes (per device, per direction), each figure with its public source in a comment.

One source of truth for peaks: a device that :data:`helios.profile.mfu.PEAK_TABLE` knows
(H100, H200, A100) takes its peak from :func:`helios.profile.mfu.peak_flops`, the numbers
helios-train's MFU divides by; the table here adds what MFU does not need (memory,
bandwidths, links) and the devices MFU does not list (MI300X).

Units: bytes (memory, decimal GB = 1e9 in everything printed), bytes/s, FLOP/s, seconds.

Assumptions stated once
-----------------------
* ``ACHIEVABLE`` -- the fraction of peak that a well-shaped large GEMM reaches in a
  training step.  One default for every GPU (0.70), fitted once to the ten configurations of
  Narayanan et al. 2021 (validation.py; all ten then within 7 %); devices Helios has profiled carry
  their measured fraction instead (lavapipe below).
* ``LINK_EFFICIENCY`` -- collectives reach 80 % of a link's rate for large messages
  (nccl-tests bus bandwidth on NVLink and InfiniBand is typically 75-90 % of the line rate).
* α (per message, per hop): 5 µs within a node, 10 µs across nodes -- the order of the
  base + hardware latencies in NCCL's tuning model (src/graph/tuning.cc).
* ``reserve`` -- device memory the runtime keeps for itself (CUDA/ROCm context, NCCL
  buffers, cuBLAS workspaces): 2 GB on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from helios.comm import cost as comm_cost
from helios.profile.mfu import cpu_peak_estimate, peak_flops

from .model import PlanError

ACHIEVABLE = 0.70
LINK_EFFICIENCY = 0.8
ALPHA_INTRA = 5e-6
ALPHA_INTER = 10e-6
GPU_RESERVE = 2e9

_T = 1e12


@dataclass(frozen=True)
class Device:
    """One accelerator and the links around it."""

    key: str
    name: str
    peak: dict  # dtype -> dense FLOP/s
    memory: float  # bytes
    hbm_bw: float  # bytes/s
    intra_bw: float  # bytes/s per device per direction inside a node
    inter_bw: float  # bytes/s per device per direction between nodes
    per_node: int  # devices per node
    intra_alpha: float = ALPHA_INTRA
    inter_alpha: float = ALPHA_INTER
    achievable: float = ACHIEVABLE  # fraction of peak a large GEMM reaches in a training step
    achievable_source: str = "the default for GPUs, fitted to Megatron-LM's published runs"
    launch_s: float = 0.0  # exposed seconds per kernel launch (0: hidden behind the device's queue)
    kernels_per_layer: int = 0  # launches per layer per micro-batch, forward + backward (with launch_s)
    reserve: float = GPU_RESERVE
    link_efficiency: float = LINK_EFFICIENCY
    shared_host: bool = False  # devices of a node share one compute engine (CPU devices)
    compute_ranks: int = 0  # with shared_host: ranks sharing that engine (0: a node's); fake hosts on one machine share it
    sources: dict = field(default_factory=dict)

    def peak_for(self, dtype: str) -> float:
        v = self.peak.get(dtype)
        if not v:
            raise PlanError(f"{self.name} has no {dtype} rate in the table; use one of {', '.join(sorted(self.peak))}")
        return v

    def label(self, dtype: str) -> str:
        return f"{self.name}: {self.peak_for(dtype) / _T:.1f} TFLOP/s {dtype} dense, {self.memory / 1e9:.0f} GB"


def _mfu_peaks(name: str) -> dict:
    """Peaks from helios.profile.mfu (the MFU denominators), for the dtypes the planner uses."""
    out = {}
    for dt in ("bf16", "fp16", "fp32"):
        pk = peak_flops(name, dt)
        if pk is not None:
            out[dt] = pk.flops
    return out


def _gpus() -> dict[str, Device]:
    d = {}
    # H100 SXM5 80GB -- peak: helios.profile.mfu (NVIDIA H100 datasheet, 989.4 TFLOP/s bf16 dense);
    # 80 GB HBM3 at 3.35 TB/s (NVIDIA H100 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h100);
    # NVLink 4: 900 GB/s total per GPU = 450 GB/s each way (same datasheet);
    # DGX H100: 8x ConnectX-7 400 Gb/s for the compute fabric = 50 GB/s per GPU each way (DGX H100 user guide).
    d["h100-sxm"] = Device("h100-sxm", "NVIDIA H100 SXM", _mfu_peaks("NVIDIA H100 SXM"), 80e9, 3.35e12,
                           450e9, 50e9, 8)
    # H100 PCIe 80GB -- peak: helios.profile.mfu (756.5 TFLOP/s bf16 dense); 80 GB HBM2e at 2.0 TB/s
    # (H100 datasheet, PCIe column); between GPUs PCIe Gen5 x16 = 128 GB/s both ways = 64 GB/s each way
    # (same datasheet; the NVLink bridge joins pairs only and is not modelled);
    # network: assumed one 400 Gb/s NIC per two GPUs = 25 GB/s per GPU each way (a typical PCIe server).
    d["h100-pcie"] = Device("h100-pcie", "NVIDIA H100 PCIe", _mfu_peaks("NVIDIA H100 PCIe"), 80e9, 2.0e12,
                            64e9, 25e9, 8)
    # H200 SXM 141GB -- peak: helios.profile.mfu (989.4 TFLOP/s bf16 dense, as H100 SXM);
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s total (NVIDIA H200 datasheet, nvidia.com/en-us/data-center/h200);
    # DGX H200: 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU each way (DGX H200 user guide).
    d["h200"] = Device("h200", "NVIDIA H200 SXM", _mfu_peaks("NVIDIA H200"), 141e9, 4.8e12, 450e9, 50e9, 8)
    # A100 SXM4 80GB -- peak: helios.profile.mfu (312 TFLOP/s bf16 dense); 80 GB HBM2e at 2,039 GB/s,
    # NVLink 3: 600 GB/s total = 300 GB/s each way (NVIDIA A100 datasheet, nvidia.com/en-us/data-center/a100);
    # DGX A100 / Selene: 8x 200 Gb/s HDR InfiniBand per node = 25 GB/s per GPU each way
    # (Narayanan et al. 2021, section 5: "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs").
    d["a100"] = Device("a100", "NVIDIA A100 SXM 80GB", _mfu_peaks("NVIDIA A100"), 80e9, 2.039e12, 300e9, 25e9, 8)
    # A100 SXM4 40GB -- as above with 40 GB HBM2 at 1,555 GB/s (A100 datasheet).
    d["a100-40gb"] = replace(d["a100"], key="a100-40gb", name="NVIDIA A100 SXM 40GB", memory=40e9, hbm_bw=1.555e12)
    # AMD Instinct MI300X -- 1307.4 TFLOP/s bf16/fp16 dense, 163.4 TFLOP/s fp32 matrix; 192 GB HBM3 at
    # 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s (both ways) = 448 GB/s each way per GPU
    # (AMD Instinct MI300X data sheet, amd.com/en/products/accelerators/instinct/mi300/mi300x.html);
    # network: assumed one 400 Gb/s NIC per GPU = 50 GB/s each way (typical 8-GPU MI300X platforms).
    d["mi300x"] = Device("mi300x", "AMD Instinct MI300X", {"bf16": 1307.4 * _T, "fp16": 1307.4 * _T, "fp32": 163.4 * _T},
                         192e9, 5.3e12, 448e9, 50e9, 8)
    return d


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


#: lavapipe on this machine (2-core AMD EPYC VM, Mesa lavapipe 22.3.6), measured rather than assumed:
#: * matmul: 40.1 GFLOP/s fp32 on the GPT MLP shape (8*256x768)@(768x3072), 43.5 at 1024^3
#:   (`python bench/matmul.py --rounds 7 --sizes 1024 --layouts nn`, 2026-11-28, load average ~3;
#:   28.4 and 21.5 on 2026-11-21, load unrecorded).  Times on this host swing several
#:   times with its load: ``helios-plan --compute-from RUN_DIR`` fits the rate to a run instead.
#: * 34 us per dispatch of independent kernels (`python bench/dispatch.py`, helios_us_per_op,
#:   2026-11-28; 58 us on 2026-11-21): lavapipe runs them on the cores the host shares.
#: * 247 launches per step of helios-train's tiny (4 layers; run.db ``dispatches``, 2026-11-24):
#:   62 per layer, the embedding, head, loss and optimizer folded in.
#: * 27 GB/s memory copy (read + write, one numpy stream; measured 2026-11-24).
#: * memory: the host's RAM (lavapipe allocates device memory from it).
#: * links: helios.comm's shm and tcp transports, α and β from helios.comm.cost.params (one source).
#: Peak: helios.profile.mfu's CPU estimate (cores x clock x FLOPs/cycle), which MFU divides by too.
LAVAPIPE_MATMUL_FLOPS = 40.1e9
LAVAPIPE_DISPATCH_S = 34e-6
LAVAPIPE_KERNELS_PER_LAYER = 62
LAVAPIPE_MEM_BW = 27e9


def _lavapipe() -> Device:
    pk = cpu_peak_estimate("fp32")
    peak = pk.flops if pk is not None else 332e9  # bench/README.md's estimate for this VM when /proc is unreadable
    shm_a, shm_b = comm_cost.params("shm")
    tcp_a, tcp_b = comm_cost.params("tcp")
    return Device(
        "lavapipe", "lavapipe (Mesa, CPU)", {"fp32": peak}, _host_memory(), LAVAPIPE_MEM_BW,
        1 / shm_b, 1 / tcp_b, 8, intra_alpha=shm_a, inter_alpha=tcp_a,
        achievable=min(1.0, LAVAPIPE_MATMUL_FLOPS / peak),
        achievable_source=f"measured: {LAVAPIPE_MATMUL_FLOPS / 1e9:.1f} GFLOP/s matmul (bench/matmul.py) "
                          f"/ {peak / 1e9:.0f} GFLOP/s estimated peak",
        launch_s=LAVAPIPE_DISPATCH_S, kernels_per_layer=LAVAPIPE_KERNELS_PER_LAYER, reserve=0.0,
        link_efficiency=1.0, shared_host=True)


_ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200", "a100-80gb": "a100",
            "a100-sxm": "a100", "mi300": "mi300x", "llvmpipe": "lavapipe", "cpu": "lavapipe"}


def device_names() -> list[str]:
    return [*_gpus(), "lavapipe"]


def get_device(name: str) -> Device:
    """A device by table key (``h100-sxm``, ``a100``, ``mi300x``, ``lavapipe``...), case-insensitive."""
    k = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    k = _ALIASES.get(k, k)
    if k == "lavapipe":
        return _lavapipe()
    table = _gpus()
    if k not in table:
        raise PlanError(f"unknown --gpu {name!r}; known: {', '.join(device_names())}")
    return table[k]
