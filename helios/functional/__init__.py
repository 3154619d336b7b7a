"""The differentiable ops of the Tensor API (PyTorch naming), built on helios._kernels.

Each op is a small :class:`~helios.autograd.Function` (forward on raw kernels,
backward in Helios ops) plus a public function that handles Python scalars, dtype
promotion and argument checking.  Tensor methods and operators forward here.

One module per op family: ``core`` (argument checks, type promotion, ``to``), ``elementwise``,
``reduce``, ``shape`` (views, indexing, cat/split), ``products`` (matmul, linear and its fused
forms, einsum), ``nn_ops`` (softmax, norms, embedding, losses, dropout), ``inplace``,
``indexing`` (gather/scatter, sort, scans, flip/roll/repeat), ``sdpa`` (attention).  Every name
is re-exported here, so ``helios.functional.X`` is the one way in; an op calls another family's
op as ``F.X``.
"""

from __future__ import annotations

from helios import dtypes as dt
from helios.tensor import Tensor

from helios.functional.core import (  # noqa: F401
    Number, MaxMin, _check_tensor, _scalar_cache, scalar_tensor, _as_tensor_like, _promote_pair, _KIND_RANK,
    result_type, sum_to_shape, _Cast, check_memory_format, to, _Contiguous, contiguous, clone, pin_memory,
)
from helios.functional.elementwise import (  # noqa: F401
    _binary_fn, _bwd_add, _bwd_sub, _bwd_mul, _bwd_div, _bwd_pow, _tie_weights, _bwd_maximum, _bwd_minimum, _Add,
    _Sub, _Mul, _Div, _Pow, _Maximum, _Minimum, _UnaryScalar, _float_result, add, sub, rsub, mul, div, _div_rounded,
    _DivRounded, _host_has_zero, rdiv, pow, rpow, maximum, minimum, _ClampT, clamp, _Unary, _unary, UNARY_RULES,
    UNARY_FUNCTIONS, PUBLIC_UNARY, neg, relu, gelu, square, _compare, eq, ne, lt, le, gt, ge, _logical, logical_and,
    logical_or, logical_xor, logical_not, _Where, where, masked_fill, silu, _SiluMul, silu_mul, leaky_relu,
)
from helios.functional.reduce import (  # noqa: F401
    _keep, _Sum, _reduce_dims, sum, mean, _var_args, var, _StdSqrt, std, _MaxMin, _MaxMinAll, _maxmin, max, min,
    _argext, argmax, argmin, _PNorm, norm, _CountNonzero, _AMaxMin, amax, amin,
)
from helios.functional.shape import (  # noqa: F401
    _shape_arg, _view, _Reshape, reshape, view, _Permute, permute, transpose, _Expand, expand, squeeze, unsqueeze,
    flatten, _Slice, _basic_index, _is_array_index, getitem, _index_host, _advanced_getitem, setitem, narrow,
    index_select, _gather, _rows, movedim_front, _Cat, cat, stack, _Split, split, chunk, _tri_mask, tril, triu, t,
    movedim, _no_grad_ctx, _advanced_setitem,
)
from helios.functional.products import (  # noqa: F401
    _Matmul, _heads_out, _direct_dest, _mm_grad, matmul, _Linear, _linear_grads, _LinearResidual, _LinearGelu,
    _MLPResidual, mlp_residual, _fusible_linear, linear_residual, linear_gelu, linear, _float_mm, mm, bmm,
    _beta_alpha, _wide, _ZeroGradFor, addmm, baddbmm, outer, _diagonal_view, einsum, _contract,
)
from helios.functional.nn_ops import (  # noqa: F401
    _Softmax, _softmax_impl, softmax, log_softmax, _SplitHeads, split_heads, _AttentionSoftmax, attention_softmax,
    _LayerNorm, layer_norm, _Embedding, _group_by_row, _regroup, _host_indices, embedding, embedding_add, _check_targets,
    _valid_targets, _same_targets, _CrossEntropy, cross_entropy, _Dropout, _mask_scale, dropout, _EPS, rms_norm, _Rotary, rotary,
    _reduce_loss, _loss_pair, mse_loss, l1_loss, nll_loss, one_hot, pad, _PadConstant, _pad_constant,
)
from helios.functional.inplace import (  # noqa: F401
    _check_inplace, finish_inplace, copy_, _inplace_binary, add_, sub_, mul_, div_, masked_fill_, clamp_, zero_, fill_, full_like,
    zeros_like, ones_like, check_layout,
)
from helios.functional.indexing import (  # noqa: F401
    SortResult, TopKResult, _host_ready, _index_tensor, _check_range, _check_gather_shapes, _as_nd, _Gather, gather,
    _scatter_raw, _Scatter, _scatter_args, _scatter_op, scatter, scatter_add, scatter_,
    scatter_add_, _IndexAdd, index_add, index_add_, _SortValues, _sort_impl, sort, argsort, msort, topk, _Cumsum,
    _Cumprod, _cum, cumsum, cumprod, _dims_arg, _Flip, _flip_raw, flip, roll, repeat, tile, repeat_interleave,
    multinomial,
)
from helios.functional.sdpa import (  # noqa: F401
    _FlashAttention, _as_bhtd, scaled_dot_product_attention, _sdpa_dense,
)

globals().update(UNARY_FUNCTIONS)  # exp, log, sqrt, ... (and _neg, _relu): made from the unary op table


# -- attach the methods to Tensor ----------------------------------------------------------------
def _install_methods() -> None:
    import helios.tensor as tensor_mod

    tensor_mod.F = __import__("helios.functional", fromlist=["_"])
    direct = [*PUBLIC_UNARY, "relu", "neg", "gelu", "square",
              "maximum", "minimum", "clamp", "clamp_", "sum", "mean", "var", "std", "max", "min", "argmax", "argmin",
              "reshape", "view", "permute", "transpose", "expand", "squeeze", "unsqueeze", "flatten", "narrow",
              "contiguous", "clone", "to", "matmul", "softmax", "log_softmax", "masked_fill", "masked_fill_",
              "split", "chunk", "tril", "triu", "add", "sub", "mul", "div", "pow", "eq", "ne", "lt", "le", "gt", "ge",
              "copy_", "add_", "sub_", "mul_", "div_", "zero_", "fill_", "index_select", "logical_not", "logical_and",
              "logical_or",
              "t", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_add", "index_add_", "sort",
              "argsort", "msort", "topk", "cumsum", "cumprod", "flip", "roll", "repeat", "tile", "repeat_interleave",
              "movedim", "norm", "amax", "amin", "mm", "bmm", "addmm", "baddbmm", "outer", "pin_memory"]
    g = globals()
    for name in direct:
        setattr(Tensor, name, g[name])
    Tensor.T = property(lambda self: permute(self, *reversed(range(self.ndim))))
    Tensor.mT = property(lambda self: transpose(self, -2, -1))
    def cast(d):
        def method(self, memory_format=None):
            return to(self, d, memory_format=memory_format)

        method.__name__ = {"float32": "float", "float16": "half", "int64": "long", "int32": "int"}.get(d.name, d.name)
        method.__doc__ = f"The tensor as {d.name} (the same tensor if it already is)."
        return method

    Tensor.float = cast(dt.float32)
    Tensor.half = cast(dt.float16)
    Tensor.bfloat16 = cast(dt.bfloat16)
    Tensor.long = cast(dt.int64)
    Tensor.int = cast(dt.int32)
    Tensor.bool = cast(dt.bool_)
    Tensor.expand_as = lambda self, o: expand(self, o.shape)
    Tensor.view_as = lambda self, o: view(self, o.shape)
    Tensor.type_as = lambda self, o: to(self, o.dtype)


_install_methods()
