"""Shape and stride arithmetic shared by the ops (pure Python, no device work)."""

from __future__ import annotations

from helios.errors import ShapeError


def contiguous_strides(shape: tuple) -> tuple:
    """Row-major strides (in elements) of ``shape``."""
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def broadcast_shapes(op: str, *shapes: tuple) -> tuple:
    """The broadcast of ``shapes`` (NumPy rules), or a ShapeError naming the op and the shapes."""
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        size = 1
        for s in shapes:
            d = s[i - ndim + len(s)] if i - ndim + len(s) >= 0 else 1
            if d != 1:
                if size != 1 and size != d:
                    raise ShapeError(f"{op}: shapes {' and '.join(str(tuple(x)) for x in shapes)} cannot be broadcast together "
                                     f"(dimension {i - ndim} is {size} vs {d})")
                size = d
        out.append(size)
    return tuple(out)


def broadcast_strides(shape: tuple, strides: tuple, to: tuple) -> tuple:
    """Strides that view a tensor of ``shape``/``strides`` as ``to`` (0 on broadcast dims)."""
    pad = len(to) - len(shape)
    out = []
    for i, size in enumerate(to):
        j = i - pad
        if j < 0 or shape[j] == 1 and size != 1:
            out.append(0)
        else:
            out.append(strides[j])
    return tuple(out)


def collapse(shape: tuple, *strides: tuple) -> tuple[list, list]:
    """Merge dims that are contiguous in every operand and drop size-1 dims.

    Returns (shape, [strides per operand]) with the fewest dims that index the same
    elements; a fully contiguous case becomes 1-D.  Kernels take at most 6 dims, and
    this keeps most views, broadcasts and transposes at 1-3.
    """
    dims = [i for i, s in enumerate(shape) if s != 1]
    new_shape: list = []
    new_strides: list = [[] for _ in strides]
    for i in dims:
        if new_shape and all(st[i] * shape[i] == ns[-1] for st, ns in zip(strides, new_strides)):
            new_shape[-1] *= shape[i]
            for st, ns in zip(strides, new_strides):
                ns[-1] = st[i]
        else:
            new_shape.append(shape[i])
            for st, ns in zip(strides, new_strides):
                ns.append(st[i])
    return new_shape, new_strides


def norm_dim(dim: int, ndim: int, op: str = "op") -> int:
    """Turn a possibly negative dim into 0..ndim-1, or an IndexError naming the op."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"{op}: dim {dim} is out of range for a tensor of {ndim} dims (expected {-n}..{n - 1})")
    return dim % n


def norm_dims(dim, ndim: int, op: str = "op") -> tuple:
    """dim=None (all), an int, or a sequence of ints -> sorted unique tuple of dims."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    out = sorted({norm_dim(d, ndim, op) for d in dim})
    if ndim == 0:  # dim 0 (or -1) of a 0-d tensor is valid, as in PyTorch, and names no real dim
        return ()
    return tuple(out)


def infer_reshape(op: str, shape: tuple, new: tuple) -> tuple:
    """Resolve a single -1 in ``new`` and check the element count."""
    n = numel(shape)
    if sum(1 for s in new if s == -1) > 1:
        raise ShapeError(f"{op}: only one dimension can be -1, got {tuple(new)}")
    known = 1
    for s in new:
        if s != -1:
            if s < 0:
                raise ShapeError(f"{op}: invalid size {s} in {tuple(new)}")
            known *= s
    if -1 in new:
        if known == 0 or n % known:
            raise ShapeError(f"{op}: cannot reshape a tensor of shape {tuple(shape)} ({n} elements) into {tuple(new)}")
        new = tuple(n // known if s == -1 else s for s in new)
    elif known != n:
        raise ShapeError(f"{op}: cannot reshape a tensor of shape {tuple(shape)} ({n} elements) into {tuple(new)}")
    return tuple(new)


def view_strides(shape: tuple, strides: tuple, new: tuple):
    """Strides that view ``shape``/``strides`` as ``new`` without a copy, or None if impossible.

    Walks the old dims from the last one, grouping runs that are contiguous with each
    other ("chunks"); each chunk must be covered exactly by a run of new dims.
    """
    if numel(shape) == 0 or not shape:
        return contiguous_strides(new)
    out = [0] * len(new)
    vd = len(new) - 1
    base = strides[-1]
    chunk_numel = 1
    view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        chunk_numel *= shape[d]
        chunk_ends = d == 0 or (shape[d - 1] != 1 and strides[d - 1] != chunk_numel * base)
        if chunk_ends:
            while vd >= 0 and (view_numel < chunk_numel or new[vd] == 1):
                out[vd] = view_numel * base
                view_numel *= new[vd]
                vd -= 1
            if view_numel != chunk_numel:
                return None
            if d > 0:
                base = strides[d - 1]
                chunk_numel = 1
                view_numel = 1
    if vd != -1:
        return None
    return tuple(out)
