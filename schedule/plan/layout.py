"""What a plan decides (:class:`Parallel`) and what the user fixes (:class:`Settings`).

Rank order is Megatron's (and helios' ``ParallelGrid``): TP innermost, then CP, then DP,
then PP.  A group whose ranks fit in one node talks over the node's link, otherwise over
the network (see :func:`group_link`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Parallel:
    """One point of the search: degrees, ZeRO stage, micro-batch and recomputation."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    mb: int = 1  # sequences per micro-batch
    recompute: str = "none"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per step per pipeline (gradient accumulation steps when pp = 1)."""
        return global_batch // (self.dp * self.mb)

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return " ".join(parts) + f" z{self.zero} mb{self.mb} {self.recompute}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Settings:
    """What the run is: precision, batch, token budget, price, and the modelling assumptions in force.

    ``dtype``: ``bf16`` is mixed precision as in the ZeRO paper (bf16 weights 2 B and
    gradients ``grad_bytes``, fp32 master weights + Adam moments 12 B per parameter);
    ``fp32`` is helios-train today (weights 4, gradients 4, moments 8).
    ``attention``: ``flash`` never stores the s x s scores (its backward recomputes them);
    ``materialized`` stores them (Megatron-LM 2021), the 5as/h term of Korthikanti et al.
    ``overlap``: gradient reduction hides behind backward compute as stated in timing.py, in
    buckets of ``bucket_bytes`` (the first ``first_bucket_bytes``);
    False puts every collective on the critical path (Megatron-LM 2021 reduced gradients
    after the pipeline flush).
    """

    global_batch: int  # sequences per optimizer step
    tokens: float  # training tokens in all
    dtype: str = "bf16"
    grad_bytes: int = 2
    attention: str = "flash"
    sequence_parallel: bool = True
    overlap: bool = True
    # DistributedDataParallel's bucket sizes (schedule/ddp.py's defaults, as PyTorch's; a test checks they agree):
    # gradients reduce in buckets as backward completes them, the first one small.
    bucket_bytes: int = 25 << 20
    first_bucket_bytes: int = 1 << 20
    price: float = 2.0  # $ per GPU-hour
    frag: float = 0.10  # allowance for fragmentation, fraction of activations + transient buffers

    @property
    def param_bytes(self) -> int:
        return 2 if self.dtype in ("bf16", "fp16") else 4

    @property
    def opt_bytes(self) -> int:
        """Optimizer bytes per parameter: fp32 master + two fp32 moments (12), or two moments (8) in fp32 training."""
        return 12 if self.dtype in ("bf16", "fp16") else 8

    @property
    def grad_b(self) -> int:
        return self.grad_bytes if self.dtype in ("bf16", "fp16") else 4

    @property
    def act_scale(self) -> float:
        """Korthikanti's activation counts assume 2-byte tensors; fp32 doubles them."""
        return 1.0 if self.dtype in ("bf16", "fp16") else 2.0

    def to_dict(self) -> dict:
        return asdict(self)


def group_link(stride: int, size: int, per_node: int) -> str:
    """``intra`` if a group of ``size`` ranks ``stride`` apart lies in one node, else ``inter``."""
    if size <= 1:
        return "none"
    return "intra" if stride * size <= per_node else "inter"
