"""Views and layout: reshape/view/permute/transpose/expand/squeeze, slicing and indexing
(basic, integer arrays, boolean masks; reads and writes), cat/stack/split/chunk, tril/triu,
t/movedim."""

from __future__ import annotations

import builtins

import numpy as np

from helios import _kernels as K
from helios import dtypes as dt
from helios._shape import broadcast_shapes, contiguous_strides, infer_reshape, norm_dim, norm_dims, numel, view_strides
from helios.autograd.tape import Function, no_grad
from helios.errors import DTypeError, ShapeError
from helios.tensor import Tensor
import helios.functional as F  # the other op families (bound once the package has loaded)


# -- views ---------------------------------------------------------------------------------------
def _shape_arg(shape: tuple) -> tuple:
    """Accept both f(x, 2, 3) and f(x, (2, 3))."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return shape


def _view(x: Tensor, shape, strides, off) -> Tensor:
    t = Tensor(x._st, tuple(shape), tuple(strides), off, x.dtype)
    return t


class _Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        st = view_strides(x.shape, x._strides, shape)
        if st is None:
            return _view(K.copy(x), shape, contiguous_strides(shape), 0)
        out = _view(x, shape, st, x._off)
        if x._host is not None and x.is_contiguous():  # the same elements in the same order: the host copy holds
            out._host = x._host
        return out

    @staticmethod
    def backward(ctx, g):
        return reshape(g, ctx.shape), None


def reshape(x: Tensor, *shape) -> Tensor:
    """``x`` with a new shape (a view when the strides allow, else a copy); one dim may be -1."""
    shape = _shape_arg(shape)
    shape = infer_reshape("reshape", x.shape, tuple(int(s) for s in shape))
    if shape == x.shape:
        return x
    return _Reshape.apply(x, shape)


def view(x: Tensor, *shape) -> Tensor:
    """Like reshape, but never copies: a ShapeError if the strides do not allow a view."""
    shape = _shape_arg(shape)
    shape = infer_reshape("view", x.shape, tuple(int(s) for s in shape))
    if view_strides(x.shape, x._strides, shape) is None:
        raise ShapeError(f"view: a tensor of shape {x.shape} with strides {x._strides} cannot be viewed as {shape} "
                         "without a copy; use reshape() or contiguous() first")
    return reshape(x, shape)


class _Permute(Function):
    @staticmethod
    def forward(ctx, x, perm):
        ctx.perm = perm
        return _view(x, [x.shape[p] for p in perm], [x._strides[p] for p in perm], x._off)

    @staticmethod
    def backward(ctx, g):
        inv = [0] * len(ctx.perm)
        for i, p in enumerate(ctx.perm):
            inv[p] = i
        return permute(g, *inv), None

    @staticmethod
    def grad_dest(node, i: int, resolve):
        """The input's gradient destination (if its producer offers one), permuted: a
        gradient written there comes out of backward as that destination's view."""
        d = resolve(node.inputs[0])
        if d is None:
            return None
        perm = node.ctx.perm
        return _view(d, [d.shape[p] for p in perm], [d._strides[p] for p in perm], d._off)


def permute(x: Tensor, *dims) -> Tensor:
    """Reorder dims (a view)."""
    dims = _shape_arg(dims)
    perm = tuple(norm_dim(d, x.ndim, "permute") for d in dims)
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"permute: {dims} is not a permutation of the {x.ndim} dims of a tensor of shape {x.shape}")
    if perm == tuple(range(x.ndim)):
        return x
    return _Permute.apply(x, perm)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dims (a view)."""
    if x.ndim < 2 and dim0 in (0, -1) and dim1 in (0, -1):
        return x
    d0, d1 = norm_dim(dim0, x.ndim, "transpose"), norm_dim(dim1, x.ndim, "transpose")
    perm = list(range(x.ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute(x, *perm)


class _Expand(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        from helios._shape import broadcast_strides

        return _view(x, shape, broadcast_strides(x.shape, x._strides, shape), x._off)

    @staticmethod
    def backward(ctx, g):
        return F.sum_to_shape(g, ctx.shape), None


def expand(x: Tensor, *shape) -> Tensor:
    """Broadcast size-1 dims to ``shape`` without copying (-1 keeps a dim)."""
    shape = _shape_arg(shape)
    pad = len(shape) - x.ndim
    if pad < 0:
        raise ShapeError(f"expand: target {shape} has fewer dims than the tensor's shape {x.shape}")
    full = []
    for i, s in enumerate(shape):
        j = i - pad
        cur = x.shape[j] if j >= 0 else 1
        s = cur if s == -1 else s
        if cur != 1 and cur != s:
            raise ShapeError(f"expand: cannot expand shape {x.shape} to {tuple(shape)} (dim {i}: {cur} -> {s})")
        full.append(s)
    full = tuple(full)
    if full == x.shape:
        return x
    return _Expand.apply(x, full)


def squeeze(x: Tensor, dim=None) -> Tensor:
    """Drop size-1 dims (all, or the given one(s) when of size 1)."""
    dims = norm_dims(dim, x.ndim, "squeeze") if dim is not None else tuple(range(x.ndim))
    shape = tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1))
    return reshape(x, shape)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """Insert a size-1 dim at ``dim``."""
    d = norm_dim(dim, x.ndim + 1, "unsqueeze")
    shape = x.shape[:d] + (1,) + x.shape[d:]
    return reshape(x, shape)


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    if x.ndim == 0:
        return reshape(x, (1,))
    s, e = norm_dim(start_dim, x.ndim, "flatten"), norm_dim(end_dim, x.ndim, "flatten")
    return reshape(x, x.shape[:s] + (numel(x.shape[s:e + 1]),) + x.shape[e + 1:])


class _Slice(Function):
    """A basic-indexing view: new shape, strides and offset over the same storage."""

    @staticmethod
    def forward(ctx, x, shape, strides, off):
        ctx.src = (x.shape, x._strides, x._off)
        ctx.view = (shape, strides, off)
        return _view(x, shape, strides, off)

    @staticmethod
    def backward(ctx, g):
        # Zeros laid out exactly like the source's storage span, so the same (strides,
        # offset) arithmetic places the gradient where the view's elements came from.
        src_shape, src_strides, src_off = ctx.src
        shape, strides, off = ctx.view
        span = 1 + builtins.sum((s - 1) * st for s, st in zip(src_shape, src_strides)) if numel(src_shape) else 0
        buf = K.fill(K.empty((span,), g.dtype, g._st.rt), 0)
        K.copy_into(Tensor(buf._st, shape, strides, off - src_off, g.dtype), g)
        src_view = Tensor(buf._st, src_shape, src_strides, 0, g.dtype)
        return (src_view if src_view.is_contiguous() else K.copy(src_view)), None, None, None


def _basic_index(x: Tensor, idx):
    """(shape, strides, offset) of x[idx] for ints, slices, None and Ellipsis."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    n_real = builtins.sum(1 for i in idx if i is not None and i is not Ellipsis)
    if n_real > x.ndim:
        raise IndexError(f"too many indices for a tensor of {x.ndim} dims: {idx}")
    if builtins.sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    expanded = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - n_real))
        else:
            expanded.append(i)
    while builtins.sum(1 for i in expanded if i is not None) < x.ndim:
        expanded.append(slice(None))
    shape, strides, off = [], [], x._off
    d = 0
    for i in expanded:
        if i is None:
            shape.append(1)
            strides.append(0)
            continue
        size, st = x.shape[d], x._strides[d]
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            i = int(i)
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of bounds for dim {d} of size {size}")
            off += (i % size) * st
        elif isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step <= 0:
                raise ValueError("slice step must be positive")
            n = builtins.max(0, (stop - start + step - 1) // step)
            if n:
                off += start * st
            shape.append(n)
            strides.append(st * step)
        else:
            raise IndexError(f"unsupported index {i!r}: use ints, slices, None, ... or a single integer tensor")
        d += 1
    return tuple(shape), tuple(strides), off


def _is_array_index(i) -> bool:
    return isinstance(i, (Tensor, list, np.ndarray))


def getitem(x: Tensor, idx) -> Tensor:
    """x[idx] with PyTorch's indexing: ints, slices (with steps), None and ... give views;
    integer tensors, lists and arrays and bool masks (advanced indexing) give a gather."""
    F._check_tensor(x, "getitem")
    if isinstance(idx, Tensor) and idx.dtype.kind == "int" and idx.ndim and x.ndim:
        # x[t]: rows of dim 0, negative indices counted from the end (no host round trip)
        n = x.shape[0]
        h = idx._host
        if h is not None and h[0] == idx._st.version and h[1].size == idx.numel() and h[1].size:
            if h[1].min() < -n or h[1].max() >= n:
                bad = int(h[1].min()) if h[1].min() < -n else int(h[1].max())
                raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {n}")
        t = idx if idx.dtype is dt.int64 else F.to(idx, dt.int64)
        return _gather(x, 0, F.where(F.lt(t, 0), t + n, t))
    items = idx if isinstance(idx, tuple) else (idx,)
    if builtins.any(_is_array_index(i) for i in items):
        return _advanced_getitem(x, items)
    shape, strides, off = _basic_index(x, idx)
    return _Slice.apply(x, shape, strides, off)


def _index_host(i) -> np.ndarray:
    """An advanced index on the host: int64, or bool for a mask."""
    a = F._host_indices(i) if isinstance(i, Tensor) else np.asarray(i)
    if a.dtype == np.bool_:
        return a
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise IndexError(f"tensors used as indices must be integer or bool, got {a.dtype}")
    return a.astype(np.int64)


def _advanced_getitem(x: Tensor, items: tuple) -> Tensor:
    """x[items] where some items are index arrays (PyTorch's rules): the basic items (ints,
    slices, None, ...) make a view first; the index arrays (a bool mask counts as one array per
    dim it covers) broadcast together to the result's index shape, which replaces their dims,
    in place when they are next to each other, else in front."""
    entries = []  # ("adv", int64 array) or ("basic", item)
    for i in items:
        if _is_array_index(i):
            a = _index_host(i)
            if a.dtype == np.bool_:
                if a.ndim == 0:
                    raise IndexError("a 0-d bool index is not supported; use None to add a dim")
                entries.extend(("adv", nz.astype(np.int64), a.shape[k], k) for k, nz in enumerate(np.nonzero(a)))
            else:
                entries.append(("adv", a, None, None))
        else:
            entries.append(("basic", i, None, None))
    used = builtins.sum(1 for e in entries if e[0] == "adv" or (e[1] is not None and e[1] is not Ellipsis))
    if used > x.ndim:
        raise IndexError(f"too many indices for a tensor of {x.ndim} dims")
    if builtins.sum(1 for e in entries if e[0] == "basic" and e[1] is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    full = []
    for e in entries:
        if e[0] == "basic" and e[1] is Ellipsis:
            full.extend([("basic", slice(None), None, None)] * (x.ndim - used))
        else:
            full.append(e)
    if not builtins.any(e[0] == "basic" and e[1] is Ellipsis for e in entries):
        full.extend([("basic", slice(None), None, None)] * (x.ndim - used))
    basic, adv_pos, arrays, vdim = [], [], [], 0
    for kind, i, mask_size, _ in full:
        if kind == "adv":
            basic.append(slice(None))
            adv_pos.append(vdim)
            arrays.append((i, mask_size))
            vdim += 1
        else:
            basic.append(i)
            if not (isinstance(i, (int, np.integer)) and not isinstance(i, bool)):
                vdim += 1
    shape, strides, off = _basic_index(x, tuple(basic))
    view = _Slice.apply(x, shape, strides, off)
    sizes = [view.shape[p] for p in adv_pos]
    wrapped = []
    for (a, mask_size), n, p in zip(arrays, sizes, adv_pos):
        if mask_size is not None and mask_size != n:
            raise IndexError(f"the shape of the mask does not match the indexed tensor's dim {p} ({mask_size} vs {n})")
        if a.size and (a.min() < -n or a.max() >= n):
            bad = int(a.min()) if a.min() < -n else int(a.max())
            raise IndexError(f"index {bad} is out of bounds for dimension {p} with size {n}")
        wrapped.append(np.where(a < 0, a + n, a))
    try:
        bcast = np.broadcast_arrays(*wrapped)
    except ValueError:
        raise IndexError("shape mismatch: indexing arrays could not be broadcast together with shapes "
                         + ", ".join(str(a.shape) for a in wrapped)) from None
    lin = np.zeros(bcast[0].shape, np.int64)
    for a, n in zip(bcast, sizes):
        lin = lin * n + a
    rest = [d for d in range(view.ndim) if d not in adv_pos]
    order = adv_pos + rest
    vp = permute(view, *order) if order != list(range(view.ndim)) else view
    flat = reshape(vp, (numel(tuple(sizes)),) + tuple(view.shape[d] for d in rest))
    out = _gather(flat, 0, K.from_numpy(lin, dt.int64, x._st.rt))
    p0 = adv_pos[0]
    if adv_pos == list(range(p0, p0 + len(adv_pos))) and p0 > 0:
        nb = lin.ndim
        out = permute(out, *(list(range(nb, nb + p0)) + list(range(nb)) + list(range(nb + p0, out.ndim))))
    return out


class _SetItem(Function):
    """x[idx] = value out of place (what a recorded ``x[idx] = value`` computes): the gradient
    of x is the incoming one with the written elements zeroed, the value's is the incoming
    one at those elements, summed over the value's broadcast dims."""

    @staticmethod
    def forward(ctx, x, value, idx):
        ctx.idx = idx
        ctx.value_shape, ctx.value_dtype = (value.shape, value.dtype) if isinstance(value, Tensor) else (None, None)
        out = K.copy(x)
        with no_grad():
            setitem(out, idx, value)
        return out

    @staticmethod
    def backward(ctx, g):
        gx = gv = None
        if ctx.needs_input_grad[0]:
            gx = K.copy(g)
            setitem(gx, ctx.idx, 0)
        if ctx.needs_input_grad[1]:
            gv = F.sum_to_shape(getitem(g, ctx.idx), ctx.value_shape)
            if gv.dtype is not ctx.value_dtype:
                gv = K.copy(gv, ctx.value_dtype)
        return gx, gv, None


def setitem(x: Tensor, idx, value) -> None:
    """x[idx] = value (in place); integer arrays, lists and bool masks in ``idx`` write the
    elements x[idx] reads (see :func:`_advanced_setitem`).  Under autograd the write is
    recorded (helios.functional.inplace): x's gradient skips the written elements and a
    value that requires grad gets theirs."""
    if F._check_inplace(x, "setitem", value):
        F.finish_inplace(x, _SetItem.apply(x, value, idx), True)
        return
    items = idx if isinstance(idx, tuple) else (idx,)
    if builtins.any(_is_array_index(i) for i in items):
        _advanced_setitem(x, items, value)
        return
    shape, strides, off = _basic_index(x, idx)
    target = Tensor(x._st, shape, strides, off, x.dtype)
    if isinstance(value, Tensor):
        if value.shape != shape:
            broadcast_shapes("setitem", value.shape, shape)
        K.copy_into(target, value)  # the copy kernel converts dtypes
    else:
        K.copy_into(target, F.scalar_tensor(value, x.dtype, x._st.rt))
    x._st.version += 1


def narrow(x: Tensor, dim: int, start, length: int) -> Tensor:
    """The slice [start, start+length) of ``dim`` (a view); ``start`` may be negative (from
    the end) or a 0-d integer tensor, as in PyTorch."""
    F._check_tensor(x, "narrow")
    d = norm_dim(dim, x.ndim, "narrow")
    start = int(start.item()) if isinstance(start, Tensor) else int(start)
    length = int(length.item()) if isinstance(length, Tensor) else int(length)
    size = x.shape[d] if x.ndim else 1
    if start < 0:
        start += size
    if not 0 <= start <= size or length < 0 or start + length > size:
        raise IndexError(f"narrow: start {start} with length {length} is out of range for dim {d} of size {size}")
    idx = [slice(None)] * x.ndim
    idx[d] = slice(start, start + length)
    return getitem(x, tuple(idx))


def index_select(x: Tensor, dim: int, index) -> Tensor:
    """Entries of ``x`` along ``dim`` picked by a 1-D (or 0-d) integer index (differentiable in x)."""
    F._check_tensor(x, "index_select")
    if not isinstance(index, Tensor):
        index = K.from_numpy(np.asarray(index, dtype=np.int64), dt.int64, x._st.rt)
    if index.dtype.kind != "int":
        raise DTypeError(f"index_select: the index must be int32 or int64, got {index.dtype.name}")
    d = norm_dim(dim, x.ndim, "index_select")
    if x.ndim == 0:  # a 0-d tensor has one entry: the result is 0-d too
        if index.numel() != 1:
            raise IndexError(f"index_select: a 0-d tensor needs a one-element index, got shape {index.shape}")
        return reshape(_gather(reshape(x, (1,)), 0, reshape(index, (1,))), ())
    if index.ndim == 0:
        index = reshape(index, (1,))
    return _gather(x, d, index)


def _gather(x: Tensor, d: int, index: Tensor) -> Tensor:
    """x's entries along dim ``d`` at an integer ``index`` of any shape (the index's dims
    replace dim ``d``)."""
    xt = movedim_front(x, d)
    rest = xt.shape[1:]
    table = reshape(F.contiguous(xt), (xt.shape[0], numel(rest)))
    out = F.embedding(index, table)
    out = reshape(out, index.shape + rest)
    if d != 0:
        nd = index.ndim
        perm = list(range(nd, nd + d)) + list(range(nd)) + list(range(nd + d, out.ndim))
        out = permute(out, *perm)
    return out


def _rows(t: Tensor) -> Tensor:
    """``t`` as a matrix [rows, last dim] (explicit sizes: reshape(-1, n) is ambiguous when
    the tensor is empty)."""
    return reshape(t, (numel(t.shape[:-1]), t.shape[-1]))


def movedim_front(x: Tensor, d: int) -> Tensor:
    if d == 0:
        return x
    return permute(x, d, *[i for i in range(x.ndim) if i != d])


# -- joining and splitting -----------------------------------------------------------------------
class _Cat(Function):
    @staticmethod
    def forward(ctx, dim, skip, *parts):
        ctx.dim = dim
        ctx.sizes = [None if s else p.shape[dim] for p, s in zip(parts, skip)]
        return K.cat_raw([p for p, s in zip(parts, skip) if not s], dim)

    @staticmethod
    def backward(ctx, g):
        out, pos = [None, None], 0
        for s in ctx.sizes:
            if s is None:  # a skipped (0,) tensor: an empty gradient
                out.append(K.empty((0,), g.dtype, g._st.rt))
                continue
            out.append(narrow(g, ctx.dim, pos, s))
            pos += s
        return tuple(out)


def cat(tensors, dim: int = 0) -> Tensor:
    """Concatenate along ``dim`` (shapes must match elsewhere).  As in PyTorch, 1-D empty
    tensors (shape (0,)) are skipped when other tensors have more dims."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat: expected a non-empty list of tensors")
    skip = tuple(x.shape == (0,) for x in tensors)
    if builtins.all(skip) or not builtins.any(skip):
        skip = (False,) * len(tensors)
    ref = next(x for x, s in zip(tensors, skip) if not s)
    d = norm_dim(dim, ref.ndim, "cat")
    t = ref.dtype
    for x in tensors:
        t = dt.promote(t, x.dtype)
    for i, (x, s) in enumerate(zip(tensors, skip)):
        if s:
            continue
        if x.ndim != ref.ndim or builtins.any(a != b for j, (a, b) in enumerate(zip(x.shape, ref.shape)) if j != d):
            raise ShapeError(f"cat: tensor {i} has shape {x.shape}, which does not match {ref.shape} outside dim {d}")
    tensors = [F.to(x, t) for x in tensors]
    return _Cat.apply(d, skip, *tensors)


def stack(tensors, dim: int = 0) -> Tensor:
    """Stack same-shape tensors along a new dim."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: expected a non-empty list of tensors")
    for i, x in enumerate(tensors):
        if x.shape != tensors[0].shape:
            raise ShapeError(f"stack: tensor {i} has shape {x.shape}, expected {tensors[0].shape} like tensor 0")
    d = norm_dim(dim, tensors[0].ndim + 1, "stack")
    return cat([unsqueeze(x, d) for x in tensors], d)


class _Split(Function):
    """Views of consecutive pieces of ``dim``; backward concatenates the pieces' gradients
    (one buffer, zeros for pieces that got none) instead of padding each piece to full size."""

    @staticmethod
    def forward(ctx, x, sizes, d):
        ctx.sizes, ctx.dim, ctx.shape = sizes, d, x.shape
        out, pos = [], 0
        for s in sizes:
            shape, strides, off = _basic_index(x, (slice(None),) * d + (slice(pos, pos + s),))
            out.append(_view(x, shape, strides, off))
            pos += s
        return tuple(out)

    @staticmethod
    def backward(ctx, grads):
        rt = next(g for g in grads if g is not None)._st.rt
        dtype = next(g for g in grads if g is not None).dtype
        parts = []
        for g, s in zip(grads, ctx.sizes):
            if g is None:
                shape = list(ctx.shape)
                shape[ctx.dim] = s
                g = K.fill(K.empty(tuple(shape), dtype, rt), 0)
            parts.append(g)
        return K.cat_raw(parts, ctx.dim), None, None


def split(x: Tensor, split_size_or_sections, dim: int = 0) -> tuple:
    """Split into chunks of a size (the last may be smaller) or of the given sizes (views)."""
    d = norm_dim(dim, x.ndim, "split")
    n = x.shape[d]
    if isinstance(split_size_or_sections, int):
        s = split_size_or_sections
        if s <= 0:
            raise ValueError(f"split: split_size must be positive, got {s}")
        sizes = [builtins.min(s, n - i) for i in range(0, n, s)] or [0]
    else:
        sizes = list(split_size_or_sections)
        if builtins.sum(sizes) != n:
            raise ShapeError(f"split: sections {sizes} sum to {builtins.sum(sizes)}, but dim {d} has size {n}")
    if len(sizes) == 1:
        return (x,)
    return _Split.apply(x, tuple(sizes), d)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple:
    """Split into ``chunks`` nearly equal parts (views)."""
    d = norm_dim(dim, x.ndim, "chunk")
    size = -(-x.shape[d] // chunks)
    return split(x, builtins.max(size, 1), d)


def _tri_mask(x: Tensor, diagonal: int, upper: bool) -> Tensor:
    rows, cols = x.shape[-2], x.shape[-1]
    r = reshape(K.arange(rows, 0, 1, dt.int64, x._st.rt), (rows, 1))
    c = reshape(K.arange(cols, 0, 1, dt.int64, x._st.rt), (1, cols))
    return F.ge(c - r, diagonal) if upper else F.le(c - r, diagonal)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    """Lower triangle of the last two dims (others zeroed)."""
    return F.where(_tri_mask(x, diagonal, False), x, 0)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    """Upper triangle of the last two dims (others zeroed)."""
    return F.where(_tri_mask(x, diagonal, True), x, 0)


def t(x: Tensor) -> Tensor:
    """The transpose of a matrix (a view); 0-d and 1-D tensors come back as they are."""
    F._check_tensor(x, "t")
    if x.ndim > 2:
        raise ShapeError(f"t: expects a tensor of at most 2 dims, got {x.ndim} (shape {x.shape}); use transpose(dim0, dim1)")
    return transpose(x, 0, 1) if x.ndim == 2 else x


def movedim(x: Tensor, source, destination) -> Tensor:
    """``x`` with the dims ``source`` moved to ``destination`` (a view)."""
    src = tuple(norm_dim(d, x.ndim, "movedim") for d in F._dims_arg(source, "movedim"))
    dst = tuple(norm_dim(d, x.ndim, "movedim") for d in F._dims_arg(destination, "movedim"))
    if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ValueError(f"movedim: source {source} and destination {destination} must be distinct dims of the same count")
    order = [None] * x.ndim
    for s, t_ in zip(src, dst):
        order[t_] = s
    rest = iter(d for d in range(x.ndim) if d not in src)
    return permute(x, *[o if o is not None else next(rest) for o in order])


def _no_grad_ctx():
    from helios.autograd.tape import no_grad

    return no_grad()


# -- indexing writes -------------------------------------------------------------------------------
def _advanced_setitem(x: Tensor, items: tuple, value) -> None:
    """x[items] = value where some items are index arrays or masks (PyTorch's rules: the
    value broadcasts to the shape x[items] has; where an index repeats, the last write wins)."""
    rt = x._st.rt
    if isinstance(value, Tensor):
        if value._st.rt is not rt:
            raise ShapeError(f"setitem: the value is on {value.device}, the tensor on {x.device}")
        v = value if value.dtype is x.dtype else K.copy(value, x.dtype)
    else:
        v = F.scalar_tensor(value, x.dtype, rt)
    # A single bool mask over leading dims with one value: a where, no host round trip.
    if len(items) == 1 and isinstance(items[0], Tensor) and items[0].dtype is dt.bool_ and v.numel() == 1 \
            and 0 < items[0].ndim <= x.ndim and items[0].shape == x.shape[:items[0].ndim]:
        m = reshape(items[0], items[0].shape + (1,) * (x.ndim - items[0].ndim))
        K.copy_into(x, K.where(m, reshape(v, ()), x))
        x._st.version += 1
        return
    n = x.numel()
    # Which elements x[items] names: the same indexing applied to their positions.
    positions = getitem(reshape(K.arange(n, 0, 1, dt.int64, rt), x.shape), items)
    M = positions.numel()
    if M == 0:
        broadcast_shapes("setitem", v.shape, positions.shape)
        return
    if v.shape != positions.shape:
        broadcast_shapes("setitem", v.shape, positions.shape)
        if len(v.shape) > len(positions.shape) or builtins.any(a != b and a != 1 for a, b in
                                                                zip(v.shape[::-1], positions.shape[::-1])):
            raise ShapeError(f"setitem: a value of shape {v.shape} cannot be written to {positions.shape} elements")
    src = K.copy(expand(v, positions.shape) if v.shape != positions.shape else v)
    keys, order = K.sort_rows(reshape(F.contiguous(positions), (1, M)))
    target = x if x.is_contiguous() else K.copy(x)
    K.scatter_rows(Tensor(target._st, (n, 1), (1, 1), target._off, x.dtype), Tensor(keys._st, (M,), (1,), 0, dt.int64),
                   Tensor(order._st, (M,), (1,), 0, dt.int32), Tensor(src._st, (M, 1), (1, 1), 0, x.dtype), "replace")
    if target is not x:
        K.copy_into(x, target)
    x._st.version += 1
