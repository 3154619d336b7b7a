"""Raw device ops: each function records one or a few dispatches and returns new tensors.

No autograd here (helios.functional builds the differentiable ops on top).  Outputs
are fresh contiguous tensors; inputs may be any strided view: shapes and strides
travel as push constants, dims are collapsed first so most ops index 1-3 dims.

One module per kernel family, each with the push-constant layouts it packs: ``core``
(allocation, grids, binding), ``elementwise`` (op codes from kernels_spirv/ew_ops.py, copies,
fills), ``reductions``, ``gemm``, ``rows`` (softmax, LayerNorm, cross entropy, embedding),
``creation`` (random numbers, ranges), ``indexing`` (sort, scan, gather, scatter), ``flash``,
``optim`` (the AdamW update), ``rotary`` (RoPE).
Every name is re-exported here; a family's tuning knobs are set on its module
(``helios._kernels.gemm._MM_CPU_TILE``).
"""

from __future__ import annotations

from helios._kernels.core import (  # noqa: F401
    MAX_DIMS, WG, _PAD6, _ZERO14, empty, _check_dtype_supported, grid, groups_for, _WINDOW_ABOVE, _is_part, bind,
    _tag, _pad, _elems_per_dispatch, column_chunks,
)
from helios._kernels.elementwise import (  # noqa: F401
    UNARY, BINARY, COMPARE, INT_UNARY, _P_UNARY, _P_BINARY, _P_WHERE, _P_COPY, unary, _unary_into, _too_wide,
    _split_outer, _flat_window, binary, binary_, _binary_into, _binary_args, _broadcast, where, copy, copy_into,
    fill, _scalar_host, from_numpy, write_grad_slot,
)
from helios._kernels.reductions import (  # noqa: F401
    REDUCE, _P_REDUCE, _value_dtype, reduce, _reduce_dest, _reduce_rows, sum_squares_fits, sum_squares, clip_coef,
    _reduce_cols, _reduce_wide, _reduce_all_windows, gather_1d, cat_raw,
)
from helios._kernels.gemm import (  # noqa: F401
    _P_MATMUL, _P_MATMUL_EPI, _MM_GPU_SPEC, _MM_CPU_TILE, _MM_CPU_WY, _MM_SG, _mm_cpu_tile, _mm_cpu_config,
    _cpu_mm_kernel, matmul_any_layout, _swap_last, _MM_EPI, matmul_epilogue, matmul_bias_grad, matmul, _check_epi,
    _check_mm_out, scalar_zero, casts_operands_first,
)
from helios._kernels.rows import (  # noqa: F401
    _P_CE, _P_SOFTMAX, _P_LN, _P_EMB, _row_wg, _row_plan, softmax_rows, layer_norm_fwd, layer_norm_bwd_input,
    layer_norm_bwd_params, layer_norm_bwd, cross_entropy_fwd, cross_entropy_bwd, embedding_fwd, embedding_add_fwd, embedding_bwd,
)
from helios._kernels.creation import (  # noqa: F401
    _P_RNG, _P_IOTA, rng, arange,
)
from helios._kernels.indexing import (  # noqa: F401
    _P_SORT, _P_SCAN, _P_GATHER, _P_SCATTER, _SORT_BLOCK, sort_rows, _SCAN_OUT, scan, gather, scatter_rows,
)
from helios._kernels.rotary import rotary_supported, rotary_fwd, rotary_bwd  # noqa: F401
from helios._kernels.optim import _P_ADAMW, adamw_constants, adamw_dispatch, adamw_push  # noqa: F401
from helios._kernels.flash import (  # noqa: F401
    _P_FLASH, FLASH_HEAD_DIMS, _FA_FWD, _FA_PRE, _FA_DQ, _FA_DKV, _FA_SG_ROWS, _FA_GPU_WG, _FA_KERNEL, _FA_CPU_WY,
    fa_subgroup_kernel_runs_on, _fa_cpu, flash_attn_supported, _fa_operand, flash_attn_pairs, FLASH_BLOCK, FlashBlockMask,
    _FlashLaunch, flash_attn_fwd, flash_attn_bwd,
)

# autograd writes packed gradient slots through this launcher (it imports no launcher itself)
from helios.autograd.tape import set_grad_slot_writer  # noqa: E402

set_grad_slot_writer(write_grad_slot)
