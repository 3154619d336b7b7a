"""What every kernel family shares: output allocation, dtype checks, dispatch grids, binding a
tensor's buffer range, push-constant padding."""

from __future__ import annotations

from helios import dtypes as dt
from helios._shape import contiguous_strides, numel
from helios.errors import DTypeError, ShapeError
from helios.runtime import get_runtime
from helios.tensor import Storage, Tensor


MAX_DIMS = 6  # elementwise kernels; copy takes 8
WG = 256

_PAD6 = (0,) * 6
_ZERO14 = (0,) * 14  # the unused tail of a contiguous ew_unary push block


def empty(shape: tuple, dtype: dt.DType, rt=None, pool: str = "activations") -> Tensor:
    """A new contiguous tensor with uninitialised contents."""
    rt = rt or get_runtime()
    _check_dtype_supported(rt, dtype)
    n = numel(shape)
    return Tensor(Storage(rt, n * dtype.itemsize, pool), tuple(shape), contiguous_strides(shape), 0, dtype)


def empty_in_layout(shape: tuple, strides: tuple, dtype: dt.DType, rt=None) -> Tensor:
    """A new tensor of ``shape`` in ``dtype`` with ``strides`` where they lay its elements out
    densely in some order of the dims (a transposed view's: a gradient made so reaches the
    view's base without a copy), else a contiguous one."""
    order = sorted(range(len(shape)), key=lambda d: -strides[d])
    dense = contiguous_strides(tuple(shape[d] for d in order))
    if any(shape[d] > 1 and strides[d] != s for d, s in zip(order, dense)):
        return empty(shape, dtype, rt)
    rt = rt or get_runtime()
    _check_dtype_supported(rt, dtype)
    laid = [0] * len(shape)
    for d, s in zip(order, dense):
        laid[d] = s
    return Tensor(Storage(rt, max(numel(shape), 1) * dtype.itemsize, "activations"), tuple(shape), tuple(laid), 0, dtype)


def narrow_view(t: Tensor, dim: int, start: int, length: int) -> Tensor:
    """A raw (untracked) view of ``length`` indices of ``t`` from ``start`` along ``dim``: the same
    storage and strides, no copy (for launchers that cut an operand into parts)."""
    d = dim % t.ndim
    return Tensor(t._st, t.shape[:d] + (length,) + t.shape[d + 1:], t._strides, t._off + start * t._strides[d], t.dtype)


def _check_dtype_supported(rt, dtype: dt.DType) -> None:
    f = rt.features
    if dtype.itemsize == 2 and not f.get("storage16", False):
        raise DTypeError(f"{dtype.name} needs 16-bit storage buffers, which {rt.name} ({rt.info['name']}) lacks; use float32")
    if dtype.itemsize == 1 and not f.get("storage8", False):
        raise DTypeError(f"bool needs 8-bit storage buffers, which {rt.name} ({rt.info['name']}) lacks")
    if dtype is dt.int64 and not f.get("int64", False):
        raise DTypeError(f"int64 needs shaderInt64, which {rt.name} ({rt.info['name']}) lacks; use int32")


def grid(n: int) -> tuple:
    """Workgroup counts covering ``n`` invocations at WG per group (x is capped at 65535)."""
    g = (n + WG - 1) // WG
    if g <= 65535:
        return (g, 1, 1)
    return (65535, (g + 65534) // 65535, 1)


# Column reductions on GPUs (reduce's MODE 1; LayerNorm's parameter gradients): n outputs,
# each a sum over R rows, one invocation an output, leave a GPU nearly idle when n is small:
# a [8192, 768] LayerNorm's dw and db were 768 invocations walking 8192 rows each (a profiled
# GPT-2 step on an H200 spent 29 ms of 710 in LayerNorm's backward, its two kernels together;
# the share of this one is not measured), where an H200 has room for ~270k.  There the rows
# are cut into runs of at least COLUMN_RUN until about COLUMN_THREADS invocations are busy,
# each run's partial stored and the partials summed in order by a second pass (no atomics).
COLUMN_THREADS = 65536
COLUMN_RUN = 64


# Mesa's llvmpipe (lavapipe) ends every loop of an invocation once that invocation has run
# 65,535 loop iterations in all, its loops together (gallivm's LP_MAX_TGSI_LOOP_ITERATIONS, a
# guard against endless loops), and the kernel goes on with what it has: a column sum of a
# [70000, 8] tensor came out 16 % off, a [8, 600000] @ [600000, 8] product 31 %.  On such a
# driver a launcher gives no loop of an invocation more than LOOP_RUN iterations, which leaves
# the kernel's other loops (a workgroup tree's, an epilogue's) room under the limit.
DRIVER_LOOP_LIMIT = 65535
LOOP_RUN = 60000


def loop_run(rt) -> int | None:
    """The most iterations a launcher may give one loop of an invocation on ``rt``'s driver
    (:data:`LOOP_RUN` on llvmpipe), or None where the driver ends no loop early."""
    return device_loop_run(getattr(rt, "info", None) or {})


def device_loop_run(info) -> int | None:
    """:func:`loop_run` for a device described by its facts (a runtime's ``info``, or a device as
    helios-doctor enumerates it)."""
    return LOOP_RUN if str(info.get("name", "")).startswith("llvmpipe") else None


def workgroup_for_run(rt, n: int, wg: int, loops: int, what: str) -> int:
    """The workgroup size for a kernel that gives a workgroup ``n`` elements (a row), each
    invocation walking ``loops`` times over its share, plus up to ``wg`` steps of other loops:
    ``wg``, or where that would pass :func:`loop_run` the device's largest workgroup; where even
    that would, a ShapeError that names ``what`` and the longest row it takes."""
    cap = loop_run(rt)
    if cap is None or loops * -(-n // wg) + wg <= cap:
        return wg
    big = int(rt.info["limits"].get("max_workgroup_invocations", wg))
    if loops * -(-n // big) + big <= cap:
        return big
    raise ShapeError(f"{what}: a row of {n} elements is longer than the {(cap - big) // loops * big} one workgroup takes "
                     f"on {rt.info['name']}, which ends a kernel's loops after {DRIVER_LOOP_LIMIT:,} iterations; split the row")


def column_chunks(rt, R: int, n: int) -> tuple[int, int]:
    """(runs, rows per run) to cut a reduction of ``n`` outputs over ``R`` rows into: (1, R)
    on CPU devices (their few cores are busy with the outputs alone, and results stay those
    of one pass) and wherever one pass already fills a GPU, except that no run is longer than
    :func:`loop_run` allows.  A function of the shape and the device only, so a rerun sums in
    the same order."""
    runs = 1 if rt.info["type"] == "cpu" else max(1, min(R // COLUMN_RUN, COLUMN_THREADS // max(n, 1), 1024))
    cap = loop_run(rt)
    if cap is not None and R > cap * runs:
        runs = -(-R // cap)
    per_run = -(-R // runs) if R else 0
    return (-(-R // per_run) if per_run else 1), per_run


# Elements an invocation of a contiguous elementwise kernel takes through wide views of its
# buffers, by dtype tag: float32 4 (vec4), bfloat16 8 (uvec4: 16 bytes).  On CPU drivers one
# wide load replaces 4 or 8 (a bf16 multiply of 4M elements on lavapipe: 20 -> 5 ms); on GPUs it
# is one 16-byte access a thread.  The kernels' VEC paths (ew_unary, ew_binary, copy, the fused
# chains of helios.elementwise_jit) run the op per element: the same bits as one at a time.
VEC_WIDTH = {"f32": 4, "bf16": 8}


def vec_width(tag: str, n: int, *offsets: int) -> int:
    """The elements an invocation takes (:data:`VEC_WIDTH`) where ``n`` and every element offset
    are multiples of it, else 1."""
    width = VEC_WIDTH.get(tag, 1)
    return width if width > 1 and n % width == 0 and all(o % width == 0 for o in offsets) else 1


def groups_for(count: int) -> tuple:
    """Workgroup counts for ``count`` workgroups (one per row, say), 2-D past 65535."""
    if count <= 65535:
        return (count, 1, 1)
    return (65535, (count + 65534) // 65535, 1)


# An op on part of a storage larger than this binds only that part: the hazard tracker then
# sees which bytes the dispatch touches (a parameter's gradient slot in a flat buffer does
# not make the whole buffer look busy to a collective waiting on another part of it).
_WINDOW_ABOVE = 64 * 1024


def _is_part(t: Tensor) -> bool:
    """Whether ``t`` covers less than its whole storage."""
    return t._off != 0 or t.numel() * t.dtype.itemsize < t._st.nbytes


def bind(t: Tensor, writes: bool = False, span: int | None = None):
    """(binding tuple, element offset inside the bound range) for tensor ``t``.

    Small storages are bound whole, except when ``t`` is part of one above 64 KiB.  A
    storage above the device's maxStorageBufferRange (128 MiB on lavapipe), and such a
    part, is bound as an aligned window around the elements the op touches: ``span``
    elements from the tensor's offset (default: its extent).
    """
    st = t._st
    rt = st.rt
    if st.nbytes <= rt.max_range and not (st.nbytes > _WINDOW_ABOVE and _is_part(t)):
        return (st.handle, 0, max(st.nbytes, 4), writes), t._off
    isz = t.dtype.itemsize
    if span is None:
        span = 1 + sum((s - 1) * abs(x) for s, x in zip(t.shape, t._strides)) if t.numel() else 1
    lo = t._off * isz
    hi = (t._off + span) * isz
    start = lo - lo % rt.align
    size = (hi - start + 3) & ~3
    if size > rt.max_range:
        raise ShapeError(f"an op touches {hi - lo} bytes of one tensor at once, more than the device's "
                         f"maxStorageBufferRange ({rt.max_range}); split the tensor (e.g. with chunk()) first")
    return (st.handle, start, min(size, st.nbytes - start), writes), t._off - start // isz


def _tag(t: Tensor) -> str:
    return t.dtype.tag


def _pad(seq, n=6) -> tuple:
    return tuple(seq) + (0,) * (n - len(seq))


def _elems_per_dispatch(t: Tensor) -> int:
    """How many contiguous elements of ``t`` one dispatch may touch (window limit)."""
    return max(1, (t._st.rt.max_range - t._st.rt.align) // t.dtype.itemsize)
