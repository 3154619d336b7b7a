"""Fused kernels of the training step: the rules, the switch and the names.

A fused op does in one dispatch what a chain of ops did in several, with the same
arithmetic in the same order, so its results are bit for bit those of the chain:

* ``linear+residual``: ``x + linear(y, W, b)`` (the GPT block's two residual adds) as one
  matmul whose epilogue rounds ``y @ W^T + b`` to the storage type and adds ``x``
  (kernels_spirv/glsl/matmul.glsl, EPI 1).  Float addition is commutative, so the sum is
  the separate add's.
* ``linear+gelu``: ``gelu_tanh(linear(x, W, b))`` (the MLP's first layer) as one matmul that
  stores the pre-activation (backward needs it) and its GELU, with the elementwise
  kernel's GELU code (EPI 2).  Its backward multiplies the incoming gradient by GELU's
  derivative as ew_binary's gelu_tanh_bwd does.
* ``matmul+gelu_tanh_bwd``: in the GPT MLP's backward (helios.functional.mlp_residual), the
  hidden gradient g @ W2 rounded to the storage type and multiplied by gelu_tanh'(u) in the
  product's epilogue (EPI 3), u being the pre-activation linear+gelu stored.
* ``matmul+bias_grad``: a Linear layer's bias gradient (the output gradient g summed over
  its rows) in the weight gradient's matmul x^T g, where both gradients have free slots
  and the CPU (subgroup), GPU shared-memory or cooperative-matrix kernel runs the product
  (not a matrix engine): the CPU kernel's lanes add up the columns of g they load anyway, the
  GPU kernels' invocations the columns of each staged tile of g, row by row from 0.0 as the
  column reduction does (kernels_spirv/glsl/matmul.glsl, BSUM); the bias slot is stored
  through the bias binding, wherever that slot is.
* ``layer_norm_bwd+acc``: where a tensor's gradient is a pending gradient plus a
  LayerNorm's input gradient (the residual stream feeds the residual add and ln_1 / ln_2),
  the LayerNorm input-gradient kernel adds the pending gradient in its store (the tape
  offers it: ``Context.grad_pending``).
* ``layer_norm_bwd+params`` / ``layer_norm_bwd+acc+params``: a LayerNorm backward that needs
  the input gradient (with or without the pending-gradient add above) and the weight and / or
  bias gradients, as one dispatch: some workgroups run the input-gradient kernel's rows (an
  invocation a row on CPU devices, a workgroup a row on GPUs), the others the parameter-gradient
  kernel's columns (spread among the rows' on CPU devices, first on GPUs), each with its own code
  (kernels_spirv/glsl/layernorm.comp, MODE 3).  The two parts read the same inputs and write
  disjoint outputs, so nothing orders them.  Where a GPU sums long columns in runs, the runs'
  partials are added by a second dispatch, as the separate kernel's are (two dispatches instead
  of three).  ``rms_norm_bwd+acc``, ``rms_norm_bwd+params`` and
  ``rms_norm_bwd+acc+params`` are the same for ``F.rms_norm``'s kernel (layernorm.comp's RMS).
* ``sum_squares`` and ``sum_squares+clip_coef`` / ``sum+clip_coef``
  (helios.optim.clip_grad_norm_): the sum of squares over a flat gradient buffer as one
  reduction (no g * g temporary; each square rounded to float32 before it is added, as the
  product's store did), and the scalar chain sqrt -> + 1e-6 -> max_norm / x ->
  clamp(max=1) in that reduction's last pass (the first pass's partials are summed by the
  second on long buffers), with the elementwise kernel's code; the norm and the
  coefficient stay on the device.
* A packed parameter's later gradient contribution (the tied embedding table's second
  use) is added into its slot of the flat gradient buffer in place (autograd.tape), not
  added into a temporary that is then copied there.
* ``embedding_bwd+acc``: where that later contribution is the embedding's own (GPT's tied
  table: the LM head's product wrote the slot first), the embedding backward adds each row's
  sum, rounded to the table's dtype, to what the slot holds in its store (the tape offers the
  slot: ``Context.grad_pending``), so neither the [V, C] temporary nor the add over it is made.
* ``embedding+add``: a GPT's token rows plus its position rows (``wte(idx) + wpe(pos)``,
  helios.functional.embedding_add) as one gather of both tables, added as the add kernel adds.
  Backward, the position table's gradient is one embedding backward over every batch's rows
  (``sum+embedding_bwd``): each position's rows summed from 0.0 batch by batch, the order of the
  batch sum's one column run that the separate ops run first (where a position repeats, or the
  column sum would go in runs, the two separate kernels run instead).

Elementwise chains are fused at run time as well, into kernels generated from the op table
(``ew_fused``): their rules live in :mod:`helios.elementwise_jit`, under the same switch.

* ``cast+matmul``, ``cast+linear+gelu``, ``cast+linear+residual``: under bf16 / fp16 autocast,
  a linear layer whose input, weight or bias is float32 (the master weights; a LayerNorm's
  output) runs as one product in the autocast dtype that rounds its float32 operands to it as
  it loads them, what the cast kernels would store (helios.functional's _AutocastLinear and
  its fused forms, the mixed storage of kernels_spirv/glsl/matmul.glsl).  Backward, each
  gradient is a product of that kind written in its input's dtype: a float32 input gets the
  rounded gradient widened, what its cast's backward would give.  The projections add their
  float32 residual to the rounded product in the epilogue, as the promoting add would, and
  backward's products read their float32 output gradient (the residual stream's), rounding it
  as they load it, what the promoting add's backward would cast; with both free slots, the
  weight gradient's product also sums the bias gradient (``cast+matmul+bias_grad``: the
  CPU-driver kernel in bfloat16, the GPU shared-memory and cooperative-matrix kernels in
  bfloat16 or float16).  On a device whose matrix engine takes the autocast dtype
  (``cuda:N``) the operands' casts stay separate, made once (the engine rounds and widens
  float32 gradient slots in its own epilogue).
* ``cast+matmul+gelu_tanh_bwd``: the GPT MLP's backward under autocast
  (helios.functional.mlp_residual with a float32 residual), matmul+gelu_tanh_bwd's product
  with the casts above: c_proj's input gradient rounded to the autocast dtype and multiplied
  by gelu_tanh'(u) in its epilogue, not stored apart and read again by gelu_tanh_bwd.  With
  the two above, a ``--dtype bf16`` GPT step runs as many dispatches as a float32 one (the tiny
  config with helios-train's two parameter groups: 140 on the cooperative-matrix kernel, 131 since
  LayerNorm's backward is one dispatch on GPU plans, 125 since ``embedding_bwd+acc``,
  ``embedding+add``, the loss gradient's scale in its kernel and the cached backward seed;
  counted on lavapipe's emulation).

The other linear fusions run without autocast (under autocast the unfused ops convert their
operands between the parts); the LayerNorm and clip fusions run either way.

* ``cast+cross_entropy`` / ``cross_entropy_bwd+cast``: under autocast the loss is float32
  (cross_entropy is one of its float32 ops), so 16-bit logits were cast to a float32 copy
  first and the float32 gradient cast back.  The cross-entropy kernel reads 16-bit logits
  as the float32 values the cast stores (widening is exact) and computes in float32 either
  way, and its backward rounds each gradient as it stores it, as the cast back does: the
  same bits without the two copies of the logits (helios.functional.nn_ops.cross_entropy,
  the mean over index targets without class weights).
* ``layer_norm+cast`` / ``cast+layer_norm_bwd`` (and its ``+acc`` / ``+params`` forms): under
  autocast LayerNorm is float32, and a GPT's LayerNorm output is read only by the next autocast
  product, which rounds it to the autocast dtype as it loads it.  Where the caller says so
  (helios.functional.layer_norm's ``feeds_products``: GPT's ln_1, ln_2 and ln_f before plain
  Linear layers and the tied head), the LayerNorm kernel stores its float32 result rounded to
  that dtype, what the product reads; the product saves that 16-bit tensor for backward and
  writes the 16-bit input gradient, which LayerNorm's backward kernels read as the float32
  values the cast's backward would widen it to (layernorm.comp's mixed variants, e.g.
  ``f32_bf16``).  The same bits with half the bytes stored, kept and read, and on a matrix engine
  that reads only the autocast dtype, no cast kernel before the product.
* ``cast+softmax`` / ``softmax_bwd+cast``: likewise for attention's softmax under autocast
  (helios.functional.nn_ops.attention_softmax, the dense attention path): 16-bit scores are
  read as their float32 values and the float32 probabilities stored (what backward and the
  product with V read), and backward stores the float32 gradient rounded to the scores' dtype,
  as the cast back does (softmax.comp's mixed variants, e.g. ``bf16_f32``).
* ``rotary`` / ``rotary_bwd``: LLaMA's rotary position embedding, ``x * cos + roll(x, D/2) *
  sin`` (helios.functional.rotary), where it was the roll's two copies, two products (each
  after a cast where a 16-bit x meets float32 tables) and their sum; its backward, two products,
  the casts back, the roll's copies and the sum of x's two gradients, likewise one kernel
  (kernels_spirv/glsl/rotary.comp), which writes the gradient in x's layout (a transposed view
  of the projection's output: no copy on the way back).  ``rotary+cast`` / ``cast+rotary_bwd``:
  under autocast, where only the attention's products read q and k (F.rotary's
  ``feeds_products``), the float32 result of a 16-bit x stored in x's dtype, as the attention's
  cast would store it, and its gradient read in that dtype.

Who fuses: the GPT modules (helios.nn.modules Block / MLP / CausalSelfAttention) call the
fused functions of helios.functional where the pattern is present and the unfused parts
are the plain ones (a Linear module without a replaced forward, dropout that is the
identity, no autocast conversion between the parts); everything else takes the unfused
path, which stays the reference the tests compare against.

The switch: ``HELIOS_FUSION=0`` in the environment (read once, here, into ``ENABLED``)
turns every fusion off and gives the unfused kernels.  ``ENABLED`` is read at call time,
so tests flip it in-process as they do tape.GRADS_IN_PLACE.

Names: a fused kernel's dispatch name (the Chrome trace's kernel and the profiler's op)
is the pattern's name, e.g. ``linear+residual``; at ``HELIOS_DEBUG=1`` the dispatch name
also lists the ops inside, e.g. ``linear+residual[matmul > +bias > add]``.
"""

from __future__ import annotations

import os

# Whether the fused kernels run (HELIOS_FUSION=0: never; read at call time).
ENABLED = os.environ.get("HELIOS_FUSION", "1").strip().lower() not in ("0", "false", "off", "no")

# The ops inside each fused kernel, in their order (HELIOS_DEBUG lines, the module docstring).
PARTS = {
    "linear+residual": ("matmul", "+bias", "add"),
    "linear+gelu": ("matmul", "+bias", "gelu_tanh"),
    "matmul+gelu_tanh_bwd": ("matmul", "gelu_tanh_bwd"),
    "matmul+bias_grad": ("matmul", "sum"),
    "layer_norm_bwd+acc": ("layer_norm_bwd", "add"),
    "embedding_bwd+acc": ("embedding_bwd", "add"),
    "embedding+add": ("embedding", "embedding", "add"),
    "sum+embedding_bwd": ("sum", "embedding_bwd"),
    "layer_norm_bwd+params": ("layer_norm_bwd", "layer_norm_bwd_params"),
    "layer_norm_bwd+acc+params": ("layer_norm_bwd", "add", "layer_norm_bwd_params"),
    "rms_norm_bwd+acc": ("rms_norm_bwd", "add"),
    "rms_norm_bwd+params": ("rms_norm_bwd", "layer_norm_bwd_params"),
    "rms_norm_bwd+acc+params": ("rms_norm_bwd", "add", "layer_norm_bwd_params"),
    "cast+matmul": ("cast", "matmul", "cast"),
    "cast+linear+gelu": ("cast", "matmul", "+bias", "gelu_tanh", "cast"),
    "cast+linear+residual": ("cast", "matmul", "+bias", "cast", "add"),
    "cast+matmul+bias_grad": ("cast", "matmul", "sum", "cast", "cast"),
    "cast+matmul+gelu_tanh_bwd": ("cast", "matmul", "cast", "gelu_tanh_bwd"),
    "cast+cross_entropy": ("cast", "cross_entropy"),
    "cast+softmax": ("cast", "softmax"),
    "softmax_bwd+cast": ("softmax_bwd", "cast"),
    "cross_entropy_bwd+cast": ("cross_entropy_bwd", "cast"),
    "sum_squares": ("mul", "sum"),
    "sum_squares+clip_coef": ("mul", "sum", "sqrt", "add_s", "rdiv_s", "clamp"),
    "sum+clip_coef": ("sum", "sqrt", "add_s", "rdiv_s", "clamp"),
    "layer_norm+cast": ("layer_norm", "cast"),
    "rms_norm+cast": ("rms_norm", "cast"),
    "rotary": ("copy", "copy", "cast", "mul", "cast", "mul", "add"),
    "rotary_bwd": ("mul", "mul", "cast", "cast", "copy", "copy", "add"),
    "rotary+cast": ("copy", "copy", "cast", "mul", "cast", "mul", "add", "cast"),
    "cast+rotary_bwd": ("cast", "mul", "mul", "cast", "cast", "copy", "copy", "add"),
}
# A float32 LayerNorm's backward reading the 16-bit gradient of its "layer_norm+cast" output:
# the cast's backward (a widening cast) first, then the kernels above.
PARTS.update({"cast+" + name: ("cast",) + PARTS.get(name, (name,)) for name in (
    "layer_norm_bwd", "layer_norm_bwd+acc", "layer_norm_bwd+params", "layer_norm_bwd+acc+params", "layer_norm_bwd_params",
    "rms_norm_bwd", "rms_norm_bwd+acc", "rms_norm_bwd+params", "rms_norm_bwd+acc+params")})


def enabled() -> bool:
    """Whether fused kernels run now (the HELIOS_FUSION switch, or ENABLED as a test set it)."""
    return ENABLED


def dispatch_name(name: str, rt) -> str:
    """The dispatch name of fused kernel ``name`` on runtime ``rt``: the name itself, and at
    HELIOS_DEBUG >= 1 the ops inside it too (``linear+gelu[matmul > +bias > gelu_tanh]``)."""
    if getattr(rt, "debug", 0):
        return f"{name}[{' > '.join(PARTS[name])}]"
    return name
