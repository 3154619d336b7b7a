"""The shape of a GPT to plan for: its parameter counts and FLOPs.

A :class:`ModelShape` is a GPT as helios-train builds it (helios/nn.py: pre-norm
blocks with LayerNorm, biases, a 4x GELU MLP, learned positions, the token embedding
tied to the LM head), optionally with a mixture-of-experts MLP (``n_experts`` experts,
``top_k`` of them per token).

Parameters
----------
Per layer: attention ``4h^2 + 4h`` (QKV and output projection, with biases), MLP per
expert ``2hf + f + h`` (``f`` = ffn width, 4h by default), two LayerNorms ``4h``, a router
``hE`` when there are experts.  Plus the token embedding ``Vh`` (the LM head shares it),
learned positions ``Th`` and the final LayerNorm ``2h``.  For helios-train's ``tiny``
(4 x 128, V 256, T 64) this is 834,304, which is what ``GPT.num_parameters()`` prints.

FLOPs
-----
Model FLOPs per token are helios-train's MFU count, :func:`helios.profile.mfu.gpt_flops_per_token`
(``6N + 12LTC``, N without the positional table; with experts N counts the ``top_k``
experts a token goes through, not all of them).  Hardware FLOPs add the recomputed forward
work, :func:`helios.profile.mfu.gpt_hardware_flops_per_token`.  Megatron-LM's own
accounting (Narayanan et al. 2021, eq. 3, which counts a full recomputation) is
:func:`megatron_flops_per_iteration`; it is used only to compare with their published
TFLOP/s.

From a parameter count
----------------------
:func:`shape_for_params` picks a shape for ``--params N``: head size 128 (64 below 1e9
parameters), width/depth ratio close to 128 (GPT-3 175B's 12288/96; Kaplan et al. 2020 find
the loss flat over a wide range of aspect ratios), width a multiple of 8 heads so that any
TP degree up to 8 divides the heads, depth a multiple of 4 (of 8 from 1e10 parameters, so that
pipelines of 2, 4 and 8 stages divide it); the pair minimising
``|ln(aspect/128)| + 10 x relative size error`` wins.  The planner prints the shape
it picked and its exact parameter count; pass ``--layers/--hidden/--heads`` to plan a
specific one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from helios.profile.mfu import gpt_flops_per_token, gpt_hardware_flops_per_token


class PlanError(ValueError):
    """A request the planner cannot answer: one line saying what was asked and what would work.
    ``reason`` names the kind of refusal for programs (helios-plan --json prints it)."""

    reason = "bad_request"


@dataclass(frozen=True)
class ModelShape:
    """A GPT: ``n_layer`` blocks of width ``d_model`` with ``n_head`` heads, vocabulary ``vocab``, context ``seq``."""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq: int
    ffn: int = 0  # MLP width; 0 means 4 * d_model
    n_experts: int = 1  # > 1: every layer's MLP is a mixture of this many experts
    top_k: int = 1  # experts per token
    name: str = ""

    def __post_init__(self) -> None:
        for k in ("n_layer", "d_model", "n_head", "vocab", "seq", "n_experts", "top_k"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"model {k} must be a positive integer, got {v!r}")
        if self.d_model % self.n_head:
            raise PlanError(f"the width {self.d_model} is not a multiple of the {self.n_head} heads")
        if self.top_k > self.n_experts:
            raise PlanError(f"top-k {self.top_k} is more than the {self.n_experts} experts")

    # ------------------------------------------------------------------ sizes
    @property
    def f(self) -> int:
        """MLP width."""
        return self.ffn or 4 * self.d_model

    @property
    def moe(self) -> bool:
        return self.n_experts > 1

    def attn_params(self) -> int:
        h = self.d_model
        return 4 * h * h + 4 * h

    def expert_params(self) -> int:
        """One expert (one dense MLP)."""
        h, f = self.d_model, self.f
        return 2 * h * f + f + h

    def layer_dense_params(self) -> int:
        """Parameters of one block that are not experts: attention, LayerNorms, router (and the MLP when dense)."""
        h = self.d_model
        p = self.attn_params() + 4 * h
        return p + (h * self.n_experts if self.moe else self.expert_params())

    def layer_expert_params(self) -> int:
        """Expert parameters of one block (0 for a dense model)."""
        return self.n_experts * self.expert_params() if self.moe else 0

    def layer_params(self) -> int:
        return self.layer_dense_params() + self.layer_expert_params()

    def layer_active_params(self) -> int:
        """Parameters one token goes through in a block."""
        return self.layer_dense_params() + (self.top_k * self.expert_params() if self.moe else 0)

    def embedding_params(self) -> int:
        return self.vocab * self.d_model

    def position_params(self) -> int:
        return self.seq * self.d_model

    def n_params(self) -> int:
        """Every parameter, as ``GPT.num_parameters()`` counts them."""
        return self.n_layer * self.layer_params() + self.embedding_params() + self.position_params() + 2 * self.d_model

    def n_matmul_params(self) -> int:
        """N of the MFU formula: the parameters a token goes through, positions excluded, the tied embedding once."""
        return self.n_layer * self.layer_active_params() + self.embedding_params() + 2 * self.d_model

    # ------------------------------------------------------------------ FLOPs
    def flops_per_token(self) -> int:
        """Model FLOPs per token, forward + backward (helios-train's MFU numerator)."""
        return gpt_flops_per_token(self.n_matmul_params(), self.n_layer, self.seq, self.d_model)

    def hardware_flops_per_token(self, recompute: str) -> int:
        """Model FLOPs plus what ``recompute`` (none/selective/full) runs again."""
        return gpt_hardware_flops_per_token(self.n_matmul_params(), self.n_layer, self.seq, self.d_model, recompute)

    def describe(self) -> str:
        moe = f", {self.n_experts} experts top-{self.top_k}" if self.moe else ""
        return (f"{self.n_layer} layers x {self.d_model} wide, {self.n_head} heads, ffn {self.f}, "
                f"vocab {self.vocab}, context {self.seq}{moe}: {fmt_count(self.n_params())} parameters")

    def to_dict(self) -> dict:
        return {**asdict(self), "n_params": self.n_params(), "flops_per_token": self.flops_per_token()}

    def with_seq(self, seq: int) -> "ModelShape":
        return replace(self, seq=seq)


def megatron_flops_per_iteration(batch: int, seq: int, n_layer: int, d_model: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. (3): ``96 B s l h^2 (1 + s/6h + V/16lh)`` FLOPs per iteration.

    Their count assumes full activation recomputation (a forward pass run twice), which is
    how their published "teraFLOP/s per GPU" were measured.
    """
    h = d_model
    return 96.0 * batch * seq * n_layer * h * h * (1 + seq / (6 * h) + vocab / (16 * n_layer * h))


def fmt_duration(s: float, seconds_digits: int = 2) -> str:
    """A duration in the unit that reads best: µs, ms, s, min, h or days."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.{seconds_digits}f} s"
    if s < 2 * 3600:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def fmt_count(n: float) -> str:
    """1.008e12 -> '1.01T', 7.5e9 -> '7.50B', 834304 -> '834.3K'."""
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suf}" if n / div >= 100 else f"{n / div:.2f}{suf}" if div >= 1e9 else f"{n / div:.1f}{suf}"
    return f"{n:.0f}"


def shape_for_params(n_params: float, seq: int, vocab: int = 51200, n_experts: int = 1, top_k: int = 1) -> ModelShape:
    """A GPT shape with about ``n_params`` parameters (see the module docstring for the rules)."""
    if not (isinstance(n_params, (int, float)) and math.isfinite(n_params) and n_params >= 1e4):
        raise PlanError(f"--params must be a number of parameters >= 1e4, got {n_params!r}")
    head = 128 if n_params >= 1e9 else 64
    grain = 8 * head if n_params >= 1e9 else head  # width a multiple of 8 heads (any TP up to 8 divides them)
    best = None
    l0 = max(1.0, (n_params / (12 * 128.0 ** 2)) ** (1 / 3))  # 12 L h^2 = N with h = 128 L
    step = 8 if n_params >= 1e10 else 4  # deep models: depth a multiple of 8, so pipelines of 2, 4, 8 stages divide it
    depths = {1, 2} | set(range(step, max(2 * step, int(2 * l0) + step), step))
    for L in sorted(depths):
        # the width solving 12 L h^2 + (V + T) h = N, rounded down and up to the grain
        b = vocab + seq
        h_exact = (-b + math.sqrt(b * b + 48.0 * L * n_params)) / (24.0 * L)
        for h in {max(grain, grain * math.floor(h_exact / grain)), max(grain, grain * math.ceil(h_exact / grain))}:
            shape = ModelShape(L, h, h // head, vocab, seq, n_experts=n_experts, top_k=top_k)
            err = abs(shape.n_params() - n_params) / n_params
            aspect = abs(math.log((h / L) / 128.0))
            key = aspect + 10.0 * err  # 5 % off in size weighs like a 1.65x off aspect ratio
            if best is None or key < best[0]:
                best = (key, shape)
    assert best is not None
    return replace(best[1], name=f"~{fmt_count(n_params)} (derived)")


#: helios-train's named configurations (helios/train.py CONFIGS), as shapes; vocab 256 = its byte tokenizer.
HELIOS_CONFIGS = {
    "nano": dict(n_layer=2, n_head=2, d_model=32, seq=32, batch=8),
    "tiny": dict(n_layer=4, n_head=4, d_model=128, seq=64, batch=16),
    "small": dict(n_layer=6, n_head=6, d_model=192, seq=128, batch=16),
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, seq=1024, batch=8),
}


def helios_config(name: str, vocab: int = 256) -> tuple[ModelShape, int]:
    """(shape, sequences per step) of one of helios-train's ``--config`` names."""
    if name not in HELIOS_CONFIGS:
        raise PlanError(f"--model {name!r} is not a helios-train config; known: {', '.join(HELIOS_CONFIGS)}")
    c = HELIOS_CONFIGS[name]
    return ModelShape(c["n_layer"], c["d_model"], c["n_head"], vocab, c["seq"], name=name), c["batch"]
