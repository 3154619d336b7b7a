"""Row kernels of the GPT: softmax (and the causal attention softmax), LayerNorm forward and
backward, cross entropy, embedding forward and backward."""

from __future__ import annotations

import struct

from helios import dtypes as dt
from helios import fused_kernels
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
from helios._kernels.core import bind, column_chunks, empty, groups_for, narrow_view, workgroup_for_run
import helios._kernels as kern  # the other kernel families (bound once the package has loaded)


# cross_entropy.comp: V, rows, the offsets of x and t, the upstream gradient's scale, dx's row stride
_P_CE = struct.Struct("<4IfI")
_P_SOFTMAX = struct.Struct("<4IfI")
# C, rows, off_x, off_g, eps, off_w, off_b, off_dw, off_db, row_wgs, chunk (layernorm.comp's push constants)
_P_LN = struct.Struct("<4If6I")
_P_EMB = struct.Struct("<9I")  # embedding.comp: C, rows, V, off_w, off_i; MODE 3: T, V2, off_w2, off_p


# -- row ops ---------------------------------------------------------------------------------
# The most times a row kernel's invocation walks its share of a row, a workgroup sharing the row
# (softmax: max, sum, store and the masked tail; layer_norm: mean, variance, store).
_ROW_LOOPS = 4


def _row_wg(R: int) -> int:
    return 256 if R >= 1024 else 128 if R >= 256 else 64 if R >= 64 else 32


def _row_plan(rt, rows: int, R: int, what: str = "a row kernel"):
    """(workgroup size, one-row-per-invocation?, workgroup counts) for a row kernel (``what``,
    named by an error for a row too long for the driver: core.workgroup_for_run).

    On CPU devices (lavapipe) workgroup barriers are expensive and many rows give enough
    parallelism, so short rows go one per invocation; elsewhere a workgroup shares a row."""
    if (rt.info["type"] == "cpu" and R <= 4096 and rows >= 16) or (R <= 128 and rows >= 4096):
        return 64, True, groups_for((rows + 63) // 64)
    return workgroup_for_run(rt, R, _row_wg(R), _ROW_LOOPS, what), False, groups_for(rows)


def _row_variant(rt, dtype: dt.DType, per_thread: bool, out: dt.DType | None = None) -> str:
    """The kernel variant of a row kernel: ``f32_tx`` (fp32 rows read through texel views) where
    each invocation owns a row (or a column) on a CPU device, since llvmpipe gathers a texel for the 8 lanes'
    rows at once but loops over the lanes for a storage-buffer load; else the dtype's.  ``out``: an
    output dtype other than the input's (softmax's casts in the kernel, e.g. ``bf16_f32``)."""
    base = "f32_tx" if per_thread and dtype is dt.float32 and rt.info["type"] == "cpu" else dtype.tag
    return base if out is None or out is dtype else f"{base}_{out.tag}"


def softmax_rows(mode: int, x: Tensor, g: Tensor | None = None, scale: float = 1.0, causal: bool = False,
                 out_dtype: dt.DType | None = None) -> Tensor:
    """Softmax family over the last dim of contiguous ``x`` (see softmax.comp for modes).

    ``scale`` multiplies the inputs (forward modes) or the result (backward modes);
    ``causal`` masks column k of query row q (the second-to-last dim) where k > q.
    ``out_dtype`` (softmax and its backward): the result in another dtype than x's, computed
    in float32 as ever and rounded as it is stored, for autocast's casts in the kernel
    (helios.fused_kernels "cast+softmax": 16-bit x, float32 out; "softmax_bwd+cast": float32 y
    and g, a 16-bit out)."""
    rt = x._st.rt
    R = x.shape[-1]
    rows = x.numel() // R if R else 0
    out_dtype = out_dtype or x.dtype
    out = empty(x.shape, out_dtype, rt)
    if out.numel() == 0:
        return out
    name = ("softmax", "log_softmax", "softmax_bwd", "log_softmax_bwd")[mode]
    wg, per_thread, groups = _row_plan(rt, rows, R, name)
    pid = rt.pipeline("softmax", _row_variant(rt, x.dtype, per_thread, out_dtype), (mode, wg, per_thread))
    bx, ox = bind(x)
    bg, og = bind(g) if g is not None else (bx, 0)
    if out_dtype is not x.dtype:
        name = fused_kernels.dispatch_name({0: "cast+softmax", 2: "softmax_bwd+cast"}[mode], rt)
    rt.dispatch(pid, [bx, bg, bind(out, True)[0]], _P_SOFTMAX.pack(R, rows, ox, og, scale, x.shape[-2] if causal else 0), groups, name,
                5 * x.numel(), x.numel() * (2 * x.dtype.itemsize + out_dtype.itemsize))
    return out


def _ln_spec(spec: tuple, rms: bool) -> tuple:
    """layernorm.comp's specialization constants ``spec`` (MODE, AFFINE, WG, HAS_BIAS, ...), with
    RMS (constant 8) set where ``rms``: the constants between filled with their defaults
    (PARAM_W, PARAM_B true, PARTIALS false).  LayerNorm's tuples stay as they were."""
    if not rms:
        return spec
    return spec + (True, True, False)[len(spec) - 5:] + (True,)


def _ln_name(name: str, rms: bool, cast: bool = False) -> str:
    """A LayerNorm dispatch's name, or its RMSNorm twin's (``layer_norm_bwd+acc`` ->
    ``rms_norm_bwd+acc``); ``cast``: a backward's that reads a 16-bit gradient of a float32
    LayerNorm (``cast+layer_norm_bwd+acc``, helios.fused_kernels)."""
    name = name.replace("layer_norm", "rms_norm", 1) if rms else name
    return "cast+" + name if cast else name


def _low_operand(fn: str, x: Tensor, t: dt.DType, what: str) -> bool:
    """Whether LayerNorm's ``what`` of dtype ``t`` is a 16-bit one of a float32 ``x`` (the kernels'
    mixed variants: layernorm.comp's TL), refusing any dtype but x's or those."""
    if t is x.dtype:
        return False
    if x.dtype is dt.float32 and t in (dt.bfloat16, dt.float16):
        return True
    raise DTypeError(f"{fn}: {what} must be {x.dtype.name}"
                     + (" or a 16-bit float" if x.dtype is dt.float32 else "") + f", got {t.name}")


def layer_norm_fwd(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, rms: bool = False,
                   out_dtype: dt.DType | None = None):
    """y, mean, rstd of LayerNorm over the last dim of contiguous ``x``; with ``rms`` RMSNorm's
    (no mean subtracted: y = x * rstd * w (+ b), rstd = 1 / sqrt(mean(x^2) + eps), mean all 0).
    ``out_dtype``: a float32 x's y stored rounded to bfloat16 or float16, computed in float32 as
    ever (helios.fused_kernels "layer_norm+cast": what a cast kernel after it would store)."""
    rt = x._st.rt
    C = x.shape[-1]
    rows = x.numel() // C if C else 0
    out_dtype = out_dtype or x.dtype
    cast = _low_operand("layer_norm_fwd", x, out_dtype, "out_dtype")
    y = empty(x.shape, out_dtype, rt)
    mean = empty((rows,), dt.float32, rt)
    rstd = empty((rows,), dt.float32, rt)
    if rows == 0:
        return y, mean, rstd
    wg, per_thread, groups = _row_plan(rt, rows, C, "layer_norm")
    spec = _ln_spec((0, w is not None, wg, b is not None, per_thread), rms)
    pid = rt.pipeline("layernorm", _row_variant(rt, x.dtype, per_thread, out_dtype), spec)
    bx, ox = bind(x)
    bw, ow = bind(w) if w is not None else (bx, 0)
    bb, ob = bind(b) if b is not None else (bx, 0)
    name = _ln_name("layer_norm", rms) + ("+cast" if cast else "")
    rt.dispatch(pid, [bx, bw, bb, bind(y, True)[0], bind(mean, True)[0], bind(rstd, True)[0], bx, bx, bx],
                _P_LN.pack(C, rows, ox, 0, eps, ow, ob, 0, 0, 0, 0), groups,
                fused_kernels.dispatch_name(name, rt) if cast else name, 8 * x.numel(),
                x.numel() * (2 * x.dtype.itemsize + out_dtype.itemsize))
    return y, mean, rstd


def layer_norm_bwd_input(x: Tensor, w: Tensor | None, g: Tensor, mean: Tensor, rstd: Tensor,
                         acc: Tensor | None = None, rms: bool = False) -> Tensor:
    """dL/dx of LayerNorm (contiguous x and g; ``rms``: of RMSNorm).  With ``acc`` (a contiguous
    tensor of x's shape and dtype: a pending gradient of x) the kernel returns dx + acc, the add
    done in its store (helios.fused_kernels "layer_norm_bwd+acc"), bit for bit the separate add.
    g is x's dtype, or (a float32 x's) bfloat16 / float16: the gradient of a "layer_norm+cast"
    output, read as the float32 values its cast's backward would store; dx is float32 either way."""
    _check_acc("layer_norm_bwd_input", x, acc)
    cast = _low_operand("layer_norm_bwd_input", x, g.dtype, "the gradient")
    rt = x._st.rt
    C = x.shape[-1]
    dx = empty(x.shape, x.dtype, rt)
    if dx.numel() == 0:  # no rows (or no columns): nothing to compute, nothing to bind
        return dx
    rows = x.numel() // C
    wg, per_thread, groups = _row_plan(rt, rows, C, "layer_norm backward")
    spec = _ln_spec((1, w is not None, wg, acc is not None, per_thread), rms)
    pid = rt.pipeline("layernorm", _row_variant(rt, x.dtype, per_thread, g.dtype), spec)
    bx, ox = bind(x)
    bg, og = bind(g)
    bw, ow = bind(w) if w is not None else (bx, 0)
    bp, op = bind(acc) if acc is not None else (bx, 0)  # binding 2 (the bias slot) holds acc
    name = _ln_name("layer_norm_bwd+acc" if acc is not None else "layer_norm_bwd", rms, cast)
    if acc is not None or cast:
        name = fused_kernels.dispatch_name(name, rt)
    rt.dispatch(pid, [bx, bw, bp, bind(dx, True)[0], bind(mean)[0], bind(rstd)[0], bg, bx, bx],
                _P_LN.pack(C, rows, ox, og, 0.0, ow, op, 0, 0, 0, 0), groups, name, *_bwd_input_cost(x, g, acc))
    return dx


def _check_acc(fn: str, x: Tensor, acc: Tensor | None) -> None:
    """Refuse a pending gradient the input-gradient kernel cannot add in its store."""
    if acc is not None and (acc.shape != x.shape or acc.dtype is not x.dtype or not acc.is_contiguous()):
        raise ShapeError(f"{fn}: acc must be a contiguous {x.dtype.name} tensor of shape {x.shape}, "
                         f"got {acc.dtype.name} {acc.shape} with strides {acc._strides}")


def _bwd_input_cost(x: Tensor, g: Tensor, acc: Tensor | None):
    """(flops, bytes) of the input-gradient kernel, for the profiler (x and g read twice)."""
    return 10 * x.numel(), x.numel() * ((3 + (acc is not None)) * x.dtype.itemsize + 2 * g.dtype.itemsize)


def _bwd_params_cost(x: Tensor, g: Tensor):
    """(flops, bytes) of the parameter-gradient kernel, for the profiler."""
    return 5 * x.numel(), x.numel() * (x.dtype.itemsize + g.dtype.itemsize)


def _param_grads_out(x: Tensor, need_w: bool, need_b: bool, dw_out: Tensor | None, db_out: Tensor | None):
    """Where the parameter-gradient kernel writes: (dw, db, out binding, [dw offset, db offset],
    the storage written in place or None).  In place into ``dw_out`` / ``db_out`` where
    :func:`layer_norm_bwd_params` takes them (see there), else into a new [2, C] buffer.  With
    no rows or no columns there is nothing to bind (out binding None): the new buffer is zeroed."""
    rt = x._st.rt
    C = x.shape[-1]
    rows = x.numel() // C if C else 0
    dests = [d for d, need in ((dw_out, need_w), (db_out, need_b)) if need]
    direct = bool(dests) and rows > 0 and C > 0 and all(
        d is not None and d._st is dests[0]._st and d.shape == (C,) and d.dtype is x.dtype and d.is_contiguous()
        for d in dests)
    if direct:
        dw, db = (dw_out if need_w else None), (db_out if need_b else None)
        lo = min(d._off for d in dests)
        span = Tensor(dests[0]._st, (max(d._off for d in dests) + C - lo,), (1,), lo, x.dtype)
        bo, base = bind(span, True)
        offs = [d._off - lo + base if d is not None else 0 for d in (dw, db)]
        return dw, db, bo, offs, dests[0]._st
    out = empty((2, C), x.dtype, rt)
    dw = Tensor(out._st, (C,), (1,), out._off, x.dtype) if need_w else None
    db = Tensor(out._st, (C,), (1,), out._off + C, x.dtype) if need_b else None
    if rows == 0 or C == 0:
        kern.fill(out, 0)
        return dw, db, None, [0, 0], None
    return dw, db, bind(out, True)[0], [0, C], None


def layer_norm_bwd_params(x: Tensor, g: Tensor, mean: Tensor, rstd: Tensor, need_w: bool, need_b: bool,
                          dw_out: Tensor | None = None, db_out: Tensor | None = None):
    """(dw, db) of LayerNorm (contiguous x and g; None where not needed): per-column sums
    over the rows of g * xhat and of g, in one pass (on GPUs, long columns in runs whose
    partial sums a second dispatch adds up in order: :func:`helios._kernels.core.column_chunks`).

    ``dw_out`` / ``db_out`` (optional, contiguous [C] tensors of x's dtype) receive them
    instead of new memory when every needed one is given and they share a storage (one
    output binding: the slots of one flat gradient buffer); otherwise they are ignored and
    the results come in new memory.  g: as :func:`layer_norm_bwd_input`'s."""
    cast = _low_operand("layer_norm_bwd_params", x, g.dtype, "the gradient")
    rt = x._st.rt
    C = x.shape[-1]
    rows = x.numel() // C if C else 0
    dw, db, bo, offs, direct = _param_grads_out(x, need_w, need_b, dw_out, db_out)
    if bo is None:
        return dw, db
    runs, per_run = column_chunks(rt, rows, C)
    part = empty((runs, 2, C), dt.float32, rt) if runs > 1 else None
    variant = _row_variant(rt, x.dtype, True, g.dtype)
    pid = rt.pipeline("layernorm", variant, (2, False, 64, False, False, need_w, need_b, part is not None))
    name = _ln_name("layer_norm_bwd_params", False, cast)
    bx, ox = bind(x)
    bg, og = bind(g)
    ncol = (C + 63) // 64
    push = _P_LN.pack(C, rows, ox, og, 0.0, 0, 0, offs[0], offs[1], 0, per_run)
    rt.dispatch(pid, [bx, bx, bx, bo, bind(mean)[0], bind(rstd)[0], bg, bx, bind(part, True)[0] if part is not None else bx],
                push, groups_for(runs * ncol), fused_kernels.dispatch_name(name, rt) if cast else name, *_bwd_params_cost(x, g))
    if part is not None:
        _sum_partials(x, variant, need_w, need_b, bo, part, push)
    if direct is not None:
        direct.version += 1
    return dw, db


def _sum_partials(x: Tensor, variant: str, need_w: bool, need_b: bool, bo, part: Tensor, push: bytes) -> None:
    """The parameter gradients from their runs' partials ``part`` ([runs, 2, C]): each column's
    added in run order and stored into binding ``bo`` at the offsets in ``push``, as one pass
    stores them (layernorm.comp's MODE 4)."""
    rt, C, runs = x._st.rt, x.shape[-1], part.shape[0]
    bx = bind(x)[0]  # (the unused bindings)
    pid = rt.pipeline("layernorm", variant, (4, False, 64, False, False, need_w, need_b))
    rt.dispatch(pid, [bx, bx, bx, bo, bx, bx, bx, bx, bind(part)[0]], push, groups_for((C + 63) // 64),
                "layer_norm_bwd_params", 2 * runs * C, (2 * runs * 4 + 2 * x.dtype.itemsize) * C)


def layer_norm_bwd(x: Tensor, w: Tensor | None, g: Tensor, mean: Tensor, rstd: Tensor, need_w: bool, need_b: bool,
                   acc: Tensor | None = None, dw_out: Tensor | None = None, db_out: Tensor | None = None,
                   rms: bool = False):
    """(dx, dw, db) of LayerNorm (``rms``: RMSNorm's dx; its dw is LayerNorm's with mean 0, the
    mean RMSNorm's forward stores): :func:`layer_norm_bwd_input` (with ``acc``) and
    :func:`layer_norm_bwd_params` (with ``dw_out`` / ``db_out``), the same values bit for bit.

    With a parameter gradient needed the two run as one dispatch (helios.fused_kernels
    "layer_norm_bwd+params", "layer_norm_bwd+acc+params"): some workgroups do the rows (an
    invocation a row on CPU devices and for very many short rows, else a workgroup a row), the
    others the columns (spread among the rows' where each row is an invocation's, else first),
    each with the code of its own kernel.  Where the columns are summed in runs (GPUs, long
    columns: core.column_chunks) a second dispatch adds the runs' partials, as
    :func:`layer_norm_bwd_params` does.  With an invocation a row, the columns take one run."""
    _check_acc("layer_norm_bwd", x, acc)
    cast = _low_operand("layer_norm_bwd", x, g.dtype, "the gradient")
    rt = x._st.rt
    C = x.shape[-1]
    rows = x.numel() // C if C else 0
    plan = _row_plan(rt, rows, C, "layer_norm backward") if rows and C else None
    runs, per_run = column_chunks(rt, rows, C) if plan else (1, rows)
    # (an invocation a row spreads the columns among the rows for one run only: layernorm.comp)
    if plan is None or not (need_w or need_b) or (plan[1] and runs > 1):
        dx = layer_norm_bwd_input(x, w, g, mean, rstd, acc, rms)
        dw = db = None
        if need_w or need_b:
            dw, db = layer_norm_bwd_params(x, g, mean, rstd, need_w, need_b, dw_out, db_out)
        return dx, dw, db
    wg, per_thread, _ = plan
    dx = empty(x.shape, x.dtype, rt)
    dw, db, bo, offs, direct = _param_grads_out(x, need_w, need_b, dw_out, db_out)
    part = empty((runs, 2, C), dt.float32, rt) if runs > 1 else None
    row_wgs = (rows + wg - 1) // wg if per_thread else rows
    variant = _row_variant(rt, x.dtype, per_thread, g.dtype)
    pid = rt.pipeline("layernorm", variant,
                      _ln_spec((3, w is not None, wg, acc is not None, per_thread, need_w, need_b, part is not None), rms))
    bx, ox = bind(x)
    bg, og = bind(g)
    bw, ow = bind(w) if w is not None else (bx, 0)
    bp, op = bind(acc) if acc is not None else (bx, 0)  # binding 2 (the bias slot) holds acc, as in MODE 1
    name = fused_kernels.dispatch_name(_ln_name("layer_norm_bwd+acc+params" if acc is not None else "layer_norm_bwd+params", rms, cast), rt)
    (f1, n1), (f2, n2) = _bwd_input_cost(x, g, acc), _bwd_params_cost(x, g)
    push = _P_LN.pack(C, rows, ox, og, 0.0, ow, op, offs[0], offs[1], row_wgs, per_run)
    rt.dispatch(pid, [bx, bw, bp, bind(dx, True)[0], bind(mean)[0], bind(rstd)[0], bg, bo,
                      bind(part, True)[0] if part is not None else bx],
                push, groups_for(row_wgs + runs * ((C + wg - 1) // wg)), name, f1 + f2, n1 + n2)
    if part is not None:
        _sum_partials(x, variant, need_w, need_b, bo, part, push)
    if direct is not None:
        direct.version += 1
    return dx, dw, db


def cross_entropy_fwd(x: Tensor, t: Tensor, cast: bool = False):
    """Per-row loss and logsumexp for contiguous logits x[N, V] and int64 targets t[N].
    ``cast``: the dispatch is named as the fused "cast+cross_entropy" (16-bit logits read as the
    float32 values a cast to float32 would store; the kernel is the same)."""
    rt = x._st.rt
    N, V = x.shape
    loss = empty((N,), dt.float32, rt)
    lse = empty((N,), dt.float32, rt)
    if N == 0:
        return loss, lse
    if V == 0:  # no classes: logsumexp of nothing is -inf (PyTorch gives nan losses)
        return kern.fill(loss, float("nan")), kern.fill(lse, float("-inf"))
    wg, per_thread, groups = _row_plan(rt, N, V, "cross_entropy")
    pid = rt.pipeline("cross_entropy", x.dtype.tag, (0, wg, per_thread))
    bx, ox = bind(x)
    bt, ot = bind(t)
    rt.dispatch(pid, [bx, bt, bind(lse, True)[0], bind(loss, True)[0], bx, bx], _P_CE.pack(V, N, ox, ot, 1.0, V),
                groups, fused_kernels.dispatch_name("cast+cross_entropy", rt) if cast else "cross_entropy", 4 * x.numel(),
                x.numel() * x.dtype.itemsize)
    return loss, lse


def cross_entropy_bwd(x: Tensor, t: Tensor, lse: Tensor, gl: Tensor, cast: bool = False, scale: float = 1.0) -> Tensor:
    """d loss / d logits given the per-row upstream gradient ``gl`` (float32 [N]: contiguous,
    or one value expanded to N rows with stride 0, read once per row by the kernel) times
    ``scale`` (rounded to float32, multiplied in float32: a mean's 1/n, as a separate multiply
    of gl would), in x's dtype: computed in float32 and rounded as it is stored, its rows
    ``padded_row(rt, V)`` elements apart (a [N, V] view of them on GPUs).  ``cast``:
    named as the fused "cross_entropy_bwd+cast" (the float32 gradient's cast back to 16-bit logits)."""
    rt = x._st.rt
    N, V = x.shape
    ld = padded_row(rt, V)
    dx = narrow_view(empty((N, ld), x.dtype, rt), 1, 0, V)
    if dx.numel() == 0:
        return dx
    one = N > 1 and gl._strides[0] == 0
    bg, og = bind(Tensor(gl._st, (1,), (1,), gl._off, gl.dtype) if one else gl)
    if og != 0 or not (one or gl.is_contiguous()):  # the kernel reads gl from its binding's start
        gl, one = kern.copy(gl), False
        bg, og = bind(gl)
    wg, per_thread, groups = _row_plan(rt, N, V, "cross_entropy backward")
    pid = rt.pipeline("cross_entropy", x.dtype.tag, (1, wg, per_thread) + ((True,) if one else ()))
    bx, ox = bind(x)
    bt, ot = bind(t)
    rt.dispatch(pid, [bx, bt, bind(lse)[0], bind(lse)[0], bg, bind(dx, True)[0]], _P_CE.pack(V, N, ox, ot, scale, ld),
                groups, fused_kernels.dispatch_name("cross_entropy_bwd+cast", rt) if cast else "cross_entropy_bwd", 4 * x.numel(),
                2 * x.numel() * x.dtype.itemsize)
    return dx


def padded_row(rt, V: int) -> int:
    """The row stride of the logits' gradient [N, V] on ``rt``: V, or on a GPU V rounded up to a
    multiple of 8 (GPT-2's 50,257 -> 50,264), so that the LM head's backward products, which
    read it, load its rows in 16-byte runs (coopmat.load_modes) instead of one element at a time."""
    return V if V % 8 == 0 or rt.info.get("type") == "cpu" else -(-V // 8) * 8


def embedding_fwd(w: Tensor, idx: Tensor) -> Tensor:
    """out[..., :] = w[idx[...], :] for contiguous w [V, C] and contiguous int64 idx."""
    return _gather_rows(w, idx)


def embedding_add_fwd(w: Tensor, idx: Tensor, w2: Tensor, pos: Tensor) -> Tensor:
    """out[..., t, :] = w[idx[..., t], :] + w2[pos[t], :] ("embedding+add", the bits of the two
    gathers and their add): contiguous floating-point w [V, C] and w2 [V2, C] of one dtype,
    contiguous int64 idx [..., T] and pos [T]."""
    if w2.dtype is not w.dtype or w.dtype.kind != "float" or w2.shape[1:] != w.shape[1:] or pos.shape != idx.shape[-1:]:
        raise ShapeError(f"embedding_add_fwd: tables {w.dtype.name} {w.shape} and {w2.dtype.name} {w2.shape}, "
                         f"indices {idx.shape} and positions {pos.shape}: want one floating dtype, one width, "
                         "and a position for each index of a row")
    return _gather_rows(w, idx, w2, pos)


def _gather_rows(w: Tensor, idx: Tensor, w2: Tensor | None = None, pos: Tensor | None = None) -> Tensor:
    """embedding.comp's gathers: MODE 0 (w's rows), or MODE 3 with w2's rows at ``pos`` added."""
    rt = w._st.rt
    V, C = w.shape
    rows = idx.numel()
    out = empty(idx.shape + (C,), w.dtype, rt)
    if out.numel() == 0:
        return out
    bw, ow = bind(w)
    bi, oi = bind(idx)
    buffers, extra, name = [bw, bi, bi, bind(out, True)[0], bw, bi], (0, 0, 0, 0), "embedding"
    if w2 is not None:
        bw2, ow2 = bind(w2)
        bp, op = bind(pos)
        buffers[4:], extra = [bw2, bp], (pos.numel(), w2.shape[0], ow2, op)
        name = fused_kernels.dispatch_name("embedding+add", rt)
    pid = rt.pipeline("embedding", w.dtype.tag, (0 if w2 is None else 3,))
    gy = (rows + 3) // 4
    gz = (gy + 65534) // 65535
    gy = min(gy, 65535)
    rt.dispatch(pid, buffers, _P_EMB.pack(C, rows, V, ow, oi, *extra), ((C + 63) // 64, gy, gz),
                name, 0 if w2 is None else out.numel(), (2 if w2 is None else 3) * out.numel() * w.dtype.itemsize)
    return out


def embedding_bwd(g: Tensor, pos: Tensor, rowptr: Tensor, V: int, out: Tensor | None = None, add: bool = False,
                  name: str | None = None) -> Tensor:
    """dW[V, C] from the upstream g[rows, C] and the CSR grouping (pos int64, rowptr int32),
    written into ``out`` (a contiguous [V, C] tensor of g's dtype) when given; with ``add``,
    added to what ``out`` holds, as the separate add would ("embedding_bwd+acc").  ``name``: the
    fused kernel the dispatch is (helios.fused_kernels), e.g. "sum+embedding_bwd"."""
    rt = g._st.rt
    C = g.shape[-1]
    if add and out is None:
        raise ValueError("embedding_bwd: add=True needs the gradient to add to (out)")
    if out is None:
        out = empty((V, C), g.dtype, rt)
    elif out.shape != (V, C) or out.dtype is not g.dtype or not out.is_contiguous():
        raise ShapeError(f"embedding_bwd: out must be a contiguous {g.dtype.name} tensor of shape {(V, C)}, "
                         f"got {out.dtype.name} {out.shape}")
    if out.numel() == 0 or (add and g.numel() == 0):
        return out
    if g.numel() == 0:  # no position used the table: a zero gradient (nothing to bind)
        return kern.fill(out, 0)
    pid = rt.pipeline("embedding", g.dtype.tag, (2 if add else 1,))
    bg, og = bind(g)
    bo, oo = bind(out, True)
    gy = (V + 3) // 4
    gz = (gy + 65534) // 65535
    gy = min(gy, 65535)
    name = name or ("embedding_bwd+acc" if add else None)  # a fused kernel's (helios.fused_kernels)
    moved = 2 * g.numel() * g.dtype.itemsize + (2 * out.numel() * out.dtype.itemsize if add else 0)
    rt.dispatch(pid, [bg, bind(pos)[0], bind(rowptr)[0], bo, bg, bind(pos)[0]], _P_EMB.pack(C, V, V, og, oo, 0, 0, 0, 0),
                ((C + 63) // 64, gy, gz), fused_kernels.dispatch_name(name, rt) if name else "embedding_bwd",
                g.numel() + (out.numel() if add else 0), moved)
    out._st.version += 1
    return out
