"""Flat buffers: views over one storage, raw device ops on ranges of them, and storage whose
memory comes and goes.  The operations the parallel schedules (``helios.schedule``: data
parallel's gradient buckets, ZeRO's shards and gathered units, the pipeline's activation
buffers, the collectives' staging) run on memory they own, below autograd.

    import helios.flat as flat
    buf = flat.zeros((n,), hl.float32, device=p.device, pool="weights")   # one flat buffer
    p.set_(buf.untyped_storage(), off, p.shape)          # a parameter now lives at [off, off + p.numel())
    bucket = flat.elements(buf, lo, hi - lo)             # a 1-D view of elements [lo, hi): no copy
    flat.mul_(bucket, 0.5)                               # in place, recorded, no autograd
    flat.copy_into(flat.elements(buf, 0, 4), flat.from_numpy(np.ones(4, np.float32), hl.float32, buf.device))

Views come from :meth:`helios.tensor.Storage.view` (any offset, shape, strides of a storage),
:meth:`Tensor.untyped_storage` / :meth:`Tensor.storage_offset` (where a tensor lies) and
:func:`elements` (a range of a contiguous tensor's elements).  Unlike ``helios.functional``'s
ops, none of these is recorded by autograd, whatever grad mode and ``requires_grad`` say: they
run inside autograd Functions' forwards and backwards and on buffers no graph owns.  An op
that writes into an existing tensor counts the write (its storage's ``version``, as every
launcher does), so a graph that saved the old values refuses to run backward; a write made
behind the ops' back (a collective filling a buffer) is counted with :func:`mark_written`, and
a :class:`LazyStorage` being refilled with the values it held (``filling``) counts nothing.

Each is one launcher call of ``helios._kernels`` (the same dispatches; an op on part of a flat
buffer binds only that part, so the hazard tracker knows which bytes it touches).
``device`` arguments take a device name (``"vulkan:0"``), a :class:`helios.device` (a
tensor's ``.device``), a runtime (a storage's ``rt``) or None (the current device); ``pool``
is the allocator's pool ("weights", "activations" or "staging"; helios.backend.POOLS).
"""

from __future__ import annotations

import threading

import numpy as np

from helios import _kernels as _K
from helios import dtypes as dt
from helios.errors import HeliosError, ShapeError
from helios.runtime import get_runtime
from helios.tensor import Storage, Tensor

__all__ = ["LazyStorage", "adamw_", "add_", "alignment", "copy", "copy_into", "elements", "empty", "fill_", "flush",
           "from_numpy", "mark_written", "mul_", "pool_in_use", "read", "zeros"]


# ---- allocation -----------------------------------------------------------------------------------
def empty(shape: tuple, dtype: dt.DType, device=None, pool: str = "activations") -> Tensor:
    """A new contiguous tensor of ``shape`` with uninitialised contents, in ``pool``."""
    return _K.empty(tuple(shape), dtype, get_runtime(device), pool)


def zeros(shape: tuple, dtype: dt.DType, device=None, pool: str = "activations") -> Tensor:
    """A new contiguous tensor of zeros (one fill, recorded), in ``pool``."""
    return _K.fill(_K.empty(tuple(shape), dtype, get_runtime(device), pool), 0)


def from_numpy(arr, dtype: dt.DType, device=None, pool: str = "activations") -> Tensor:
    """A new tensor holding a copy of the numpy array ``arr`` as ``dtype`` (written at once, no wait
    on the device).  As ``helios.tensor()``, without its refusal while a step is being captured
    (``helios.graph``): for a schedule's own constants and loaded values."""
    return _K.from_numpy(arr, dtype, get_runtime(device), pool)


# ---- views ------------------------------------------------------------------------------------------
def elements(t: Tensor, start: int, n: int) -> Tensor:
    """A 1-D view of elements ``[start, start + n)`` of the contiguous tensor ``t`` (row-major),
    sharing its storage: a bucket of a flat gradient buffer, a rank's chunk of a shard.  No copy,
    no autograd.  Refuses a non-contiguous ``t`` and a range outside it."""
    if not t.is_contiguous():
        raise ShapeError(f"flat.elements: the tensor must be contiguous, got shape {t.shape} strides {t.stride()}")
    if start < 0 or n < 0 or start + n > t.numel():
        raise ShapeError(f"flat.elements: elements [{start}, {start + n}) are outside the tensor's {t.numel()}")
    return t.untyped_storage().view(t.storage_offset() + start, (n,), t.dtype)


# ---- raw ops --------------------------------------------------------------------------------------------
def copy(x: Tensor, dtype: dt.DType | None = None) -> Tensor:
    """A contiguous copy of ``x`` in memory of its own (converted to ``dtype`` if given): the buffer
    a collective reduces in place while autograd keeps ``x``."""
    return _K.copy(x, dtype)


def copy_into(dst: Tensor, src: Tensor) -> None:
    """``dst[...] = src`` (``src`` broadcast to dst's shape, any strides, a dtype conversion if
    they differ; through the host across devices)."""
    _K.copy_into(dst, src)


def fill_(t: Tensor, value) -> Tensor:
    """Set every element of the contiguous tensor ``t`` to ``value``; returns ``t``."""
    return _K.fill(t, value)


def _operand(t: Tensor, other) -> Tensor:
    if isinstance(other, Tensor):
        return other
    from helios.functional import scalar_tensor

    return scalar_tensor(other, t.dtype, t.untyped_storage().rt)


def add_(t: Tensor, other) -> Tensor:
    """``t += other`` in place (``other`` a tensor of t's dtype broadcast to its shape, or a
    number); ``t`` contiguous.  Each element is read and written by the same invocation, so no
    temporary is made.  Returns ``t``."""
    return _K.binary_("add", t, _operand(t, other))


def mul_(t: Tensor, other) -> Tensor:
    """``t *= other`` in place (as :func:`add_`): averaging a reduced sum, scaling gradients by
    a clip coefficient held on the device.  Returns ``t``."""
    return _K.binary_("mul", t, _operand(t, other))


def mark_written(t) -> None:
    """Count a write to a tensor's storage (or to a :class:`Storage`), as the ops here and the
    in-place ops of ``helios.functional`` do: graphs that saved its old values refuse to run
    backward.  For writes the ops do not see: a collective's (an all-gather of updated parameters
    into a flat buffer) or a host write."""
    (t.untyped_storage() if isinstance(t, Tensor) else t).version += 1


def read(t: Tensor, start: int, stop: int) -> np.ndarray:
    """Elements ``[start, stop)`` of ``t``'s row-major elements, copied to the host as they are
    stored (bfloat16 as its uint16 bits, float8 as uint8): only those bytes are read (a
    non-contiguous ``t`` is made contiguous on the device first).  Waits for the work that
    writes them."""
    if start < 0 or stop < start or stop > t.numel():
        raise ShapeError(f"flat.read: elements [{start}, {stop}) are outside the tensor's {t.numel()}")
    src = t if t.is_contiguous() else _K.copy(t)
    out = np.empty(stop - start, t.dtype.np_storage)
    if out.size:
        st = src.untyped_storage()
        st.rt.read(st.handle, (src.storage_offset() + start) * t.dtype.itemsize, out.view(np.uint8))
    return out


def flush(device=None) -> None:
    """Submit the work recorded so far on ``device`` without waiting for it: what is recorded
    then ends a submission of its own, whose completion a collective waiting on those bytes
    sees while the device runs what comes after."""
    get_runtime(device).flush()


def pool_in_use(device, pool: str) -> int:
    """Bytes ``pool`` of ``device``'s allocator holds for live buffers now (its size classes
    round each buffer up): what a ZeRO memory report measures."""
    return int(get_runtime(device).pool_stats()[pool]["in_use_bytes"])


def alignment(device=None) -> int:
    """The storage-offset alignment of one binding on ``device``, in bytes
    (``min_storage_buffer_offset_alignment``): a range of a flat buffer that one kernel binds
    starts at a multiple of it."""
    return int(get_runtime(device).info["limits"]["min_storage_buffer_offset_alignment"])


def adamw_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, consts: tuple) -> None:
    """The fused AdamW update (``helios.optim.AdamW``'s kernel, element for element) of four
    1-D float32 views of one length ``n``, each anywhere in its own flat buffer: ``param``,
    ``exp_avg`` and ``exp_avg_sq`` in place from ``grad``.  ``consts``:
    ``helios.optim.adamw_constants(group, step)``.  ZeRO's update of one rank's chunk binds the
    full-size parameters beside shard-sized gradients and moments this way.  The views' storage
    offsets must agree modulo the device's binding alignment (ranges cut at aligned chunk
    boundaries do); a range wider than one binding (``maxStorageBufferRange``) is cut into
    several dispatches."""
    from helios.optim import adamw_dispatch

    ops = (param, grad, exp_avg, exp_avg_sq)
    n = param.numel()
    for t in ops:
        if t.ndim != 1 or t.dtype is not dt.float32 or t.numel() != n or t.stride(0) != 1:
            raise ShapeError(f"flat.adamw_: four contiguous 1-D float32 views of one length, got "
                             f"{[(x.shape, x.dtype.name) for x in ops]}")
    rt = param.untyped_storage().rt
    q = max(1, alignment(rt) // 4)
    off = param.storage_offset() % q
    if any(t.storage_offset() % q != off for t in ops):
        raise ShapeError(f"flat.adamw_: the views' storage offsets {[t.storage_offset() for t in ops]} differ modulo "
                         f"the binding alignment ({q} elements); one dispatch indexes all four alike")
    lim = rt.max_range // 4 - q
    sts = [t.untyped_storage() for t in ops]
    bases = [t.storage_offset() - off for t in ops]
    while n > 0:
        adv = off - off % q
        bases = [b + adv for b in bases]
        off -= adv
        m = min(n, lim - off)
        bufs = [(st.handle, b * 4, (off + m) * 4, w) for st, b, w in zip(sts, bases, (True, False, True, True))]
        adamw_dispatch(rt, bufs, m, off, consts)
        off += m
        n -= m


# ---- storage that comes and goes ----------------------------------------------------------------------
class LazyStorage(Storage):
    """A storage whose device memory exists only between ``materialize()`` and ``release()``
    (ZeRO-3's gathered units and gradient staging).

    Tensors viewing it (``view()``) keep their identity while the memory comes and goes (a
    gradient slot, a sharded parameter).  Touching ``handle`` while released calls
    ``on_demand(self)``, which must materialize it (or raise); so does touching it from the
    thread whose id is in ``waiter`` while a collective that fills it is in flight (``on_demand``
    then waits for it; the communicator's thread, which fills it, passes).  While ``filling`` is
    set, writes do not count (``version`` keeps its value: the gather refills the values it held,
    so an op that saved a view for backward then sees the version backward will).  ``owner`` is
    the caller's (what the storage belongs to)."""

    __slots__ = ("_h", "pool", "on_demand", "owner", "waiter", "_v", "filling")

    def __init__(self, device, nbytes: int, pool: str, on_demand, owner=None) -> None:
        self._v, self.filling = 0, False
        self.rt, self.nbytes, self.version = get_runtime(device), nbytes, 0
        self._h = None
        self.pool, self.on_demand, self.owner = pool, on_demand, owner
        self.waiter = None

    @property
    def version(self) -> int:
        return self._v

    @version.setter
    def version(self, v: int) -> None:
        if not self.filling:
            self._v = v

    @property
    def handle(self) -> int:
        if self._h is None or (self.waiter is not None and self.waiter == threading.get_ident()):
            self.on_demand(self)
            if self._h is None:
                raise HeliosError("a sharded buffer was used while it was not materialized")
        return self._h

    @property
    def materialized(self) -> bool:
        """Whether the memory is there now."""
        return self._h is not None

    def materialize(self) -> int:
        """Allocate the memory (uninitialised) if it is not there; the pool bytes it took (0 if it was there)."""
        if self._h is not None:
            return 0
        before = pool_in_use(self.rt, self.pool)
        self._h = self.rt.alloc(self.nbytes, self.pool)
        return pool_in_use(self.rt, self.pool) - before

    def release(self) -> int:
        """Free the memory (reused once the work recorded so far is done); the pool bytes given back."""
        if self._h is None:
            return 0
        before = pool_in_use(self.rt, self.pool)
        h, self._h = self._h, None
        self.rt.free(h)
        return before - pool_in_use(self.rt, self.pool)

    def __del__(self):
        try:
            if self._h is not None:
                self.rt.free(self._h)
                self._h = None
        except Exception:  # interpreter exit: the device may already be closed
            pass
