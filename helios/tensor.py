"""helios.Tensor: a strided view of device memory, with autograd metadata.

A tensor is (storage, shape, strides, offset, dtype).  Views (reshape, transpose,
permute, slicing, expand, squeeze) share the storage and only change the last three,
so they cost no device work.  Ops record dispatches and return at once; ``numpy()``
and ``item()`` read back, which submits the recorded work and waits for it.
"""

from __future__ import annotations

import time

import numpy as np

from helios import dtypes as dt
from helios.profile.profiler import current_collector
from helios._shape import contiguous_strides, norm_dim, numel
from helios.errors import DTypeError, ShapeError

# Submodules import each other lazily (functional needs Tensor and Tensor's operators need
# functional); this module-level handle is set when the helios.functional package has loaded.
F = None


class Storage:
    """One device allocation (a handle of its runtime's allocator); freed, deferred by the backend, when no
    tensor uses it.

    Public attributes: ``rt`` (the device runtime that owns the memory: the device contract,
    :class:`helios.backend.Runtime`), ``nbytes``, ``handle`` (the allocator's handle) and
    ``version`` (counts writes that autograd must see: an in-place op adds one, and a node that
    saved a tensor of this storage refuses to run backward after a later write).  A tensor
    returns its storage from :meth:`Tensor.untyped_storage`; :meth:`view` makes a tensor over
    any part of it.  :class:`helios.flat.LazyStorage` is one whose memory comes and goes."""

    __slots__ = ("rt", "handle", "nbytes", "version", "__weakref__")

    def __init__(self, rt, nbytes: int, pool: str = "activations"):
        self.rt = rt
        self.nbytes = nbytes
        self.handle = rt.alloc(nbytes, pool)
        self.version = 0

    def __del__(self):
        try:
            self.rt.free(self.handle)
        except Exception:  # interpreter exit: the device may already be closed
            pass

    def view(self, offset: int, shape: tuple, dtype: dt.DType, strides: tuple | None = None) -> Tensor:
        """A tensor of ``shape`` and ``dtype`` over this storage, its first element at element
        ``offset`` (counted in ``dtype``'s elements from the start of the storage), contiguous
        unless ``strides`` are given.  No copy, no device work and no autograd history: the
        flat-buffer view of data-parallel buckets, ZeRO shards and fused optimizers' packed
        parameters.  Refuses (ShapeError) a view that reaches outside the storage."""
        shape = tuple(int(s) for s in shape)
        strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
        if len(strides) != len(shape):
            raise ShapeError(f"Storage.view: {len(strides)} strides for a {len(shape)}-dim shape {shape}")
        if numel(shape):
            lo = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
            hi = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + 1
            if lo < 0 or hi * dtype.itemsize > self.nbytes:
                raise ShapeError(f"Storage.view: elements [{lo}, {hi}) of {dtype.name} reach outside the storage's "
                                 f"{self.nbytes} bytes ({self.nbytes // dtype.itemsize} elements)")
        return Tensor(self, shape, strides, int(offset), dtype)


class Tensor:
    """A multi-dimensional array on a device (Vulkan, CUDA, or host memory as "cpu"; PyTorch naming)."""

    __slots__ = ("_st", "shape", "_strides", "_off", "dtype", "requires_grad", "grad", "_node", "_host", "_grad_hooks",
                 "_out_index", "_history", "__weakref__")
    __array_priority__ = 1000  # numpy scalars/arrays on the left defer to our operators

    def __init__(self, st: Storage, shape: tuple, strides: tuple, off: int, dtype: dt.DType):
        self._st = st
        self.shape = shape
        self._strides = strides
        self._off = off
        self.dtype = dtype
        self.requires_grad = False
        self.grad = None
        self._node = None
        self._host = None  # (storage version, numpy copy) when the data came from the host
        self._grad_hooks = None  # post-accumulate-grad hooks of a leaf (a list), see autograd.tape
        self._out_index = 0  # which output of its node (ops with several outputs, like split)
        self._history = None  # producers before in-place ops moved it to a new node (autograd.tape.edge)

    # -- metadata -----------------------------------------------------------------------
    @property
    def device(self):
        """Where the data lives: a :class:`helios.device` ("vulkan:N", "cuda:N", or "cpu" for host memory);
        it is a str, so ``t.device == "vulkan:0"`` works."""
        return self._st.rt.device

    @property
    def is_cpu(self) -> bool:
        return self._st.rt.is_host

    def cpu(self) -> Tensor:
        """A copy in host memory (the same tensor if it is there already): a cpu tensor holds data
        (numpy(), item(), views, casts, copies, save) and runs no kernels; ``.to("vulkan:0")`` moves it back."""
        return self.to("cpu")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return numel(self.shape)

    def size(self, dim: int | None = None):
        """The shape, or the size of one dim."""
        if dim is None:
            return self.shape
        return self.shape[norm_dim(dim, self.ndim, "size")]

    def stride(self, dim: int | None = None):
        if dim is None:
            return self._strides
        return self._strides[norm_dim(dim, self.ndim, "stride")]

    def element_size(self) -> int:
        return self.dtype.itemsize

    def storage_offset(self) -> int:
        """The element offset of this tensor's first element in its storage (PyTorch's name):
        a view of a flat buffer starts where it starts in the buffer."""
        return self._off

    def untyped_storage(self) -> Storage:
        """The :class:`Storage` this tensor views (PyTorch's name).  Views of one buffer return
        the same object, so ``a.untyped_storage() is b.untyped_storage()`` says whether two
        tensors share memory; ``untyped_storage().view(offset, shape, dtype)`` makes another view."""
        return self._st

    def set_(self, source, storage_offset: int = 0, size: tuple | None = None, stride: tuple | None = None) -> Tensor:
        """Make this tensor view other memory, in place (PyTorch's ``set_``): ``source`` a
        :class:`Storage` (at element ``storage_offset``, of ``size``, contiguous unless ``stride``
        is given; ``size`` defaults to this tensor's shape) or a Tensor (its storage, offset, shape
        and strides).  The tensor keeps its identity, autograd flags and hooks (a parameter
        moved into a flat buffer stays the parameter); its values are whatever that memory holds
        (copy them there first).  Not recorded by autograd and not counted as a write."""
        if isinstance(source, Tensor):
            st, off, shape, strides, dtype = source._st, source._off, source.shape, source._strides, source.dtype
            if dtype is not self.dtype:
                raise DTypeError(f"set_: the source is {dtype.name}, this tensor {self.dtype.name}")
        else:
            t = source.view(storage_offset, self.shape if size is None else size, self.dtype, stride)
            st, off, shape, strides = t._st, t._off, t.shape, t._strides
        self._st, self._off, self.shape, self._strides, self._host = st, off, shape, strides, None
        return self

    @property
    def data(self) -> Tensor:
        """This tensor's values without autograd history: :meth:`detach` (PyTorch's ``.data``)."""
        return self.detach()

    @data.setter
    def data(self, new: Tensor) -> None:
        """Make this tensor the view ``new`` is (its storage, shape, strides, offset and dtype), in
        place: PyTorch's ``t.data = new``, which ``Module.to`` does to each parameter.  The tensor
        keeps its identity, autograd flags and hooks; unlike :meth:`set_`, the dtype may change.
        Not recorded by autograd and not counted as a write."""
        if not isinstance(new, Tensor):
            raise TypeError(f"Tensor.data: the new data must be a helios Tensor, got {type(new).__name__}")
        self._st, self.shape, self._strides, self._off, self.dtype, self._host = (
            new._st, new.shape, new._strides, new._off, new.dtype, new._host)

    @property
    def grad_slot(self):
        """Where backward accumulates this parameter's gradient: a view of a flat gradient buffer
        (set by a fused optimizer, DistributedDataParallel or ZeRO, which then treat the buffer's
        ranges as buckets or shards), or None (the gradient gets memory of its own).  Only
        parameters (:class:`helios.nn.Parameter`) can be given one."""
        return getattr(self, "_grad_slot", None)

    @grad_slot.setter
    def grad_slot(self, slot) -> None:
        if slot is not None and (slot.shape != self.shape or slot.dtype is not self.dtype):
            raise ShapeError(f"grad_slot: a {slot.dtype.name} {slot.shape} slot for a {self.dtype.name} "
                             f"{self.shape} tensor")
        self._grad_slot = slot

    def is_contiguous(self) -> bool:
        expected = 1
        for s, st in zip(reversed(self.shape), reversed(self._strides)):
            if s != 1 and st != expected:
                return False
            expected *= s
        return True

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    @property
    def grad_fn(self):
        return self._node

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        try:
            body = np.array2string(self.numpy(), precision=4, separator=", ", threshold=64)
        except Exception as e:  # never let repr raise
            body = f"<unreadable: {e}>"
        extra = f", dtype={self.dtype.name}" if self.dtype is not dt.float32 else ""
        if self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra}, device='{self.device}')"

    # -- host transfer ------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A host copy as a numpy array (bfloat16 comes back as float32).

        Submits the recorded work that writes this tensor and waits for it.
        """
        src = self if self.is_contiguous() else self.contiguous()
        out = np.empty(self.shape, dtype=self.dtype.np_storage)
        if out.size:
            col = current_collector()
            t0 = time.monotonic_ns() if col is not None else 0
            # Waits (inside the addon) only for recorded work that writes these bytes.
            src._st.rt.read(src._st.handle, src._off * self.dtype.itemsize, out.reshape(-1).view(np.uint8))
            if col is not None:
                col.record_op("device_to_host", self.shape, self.dtype.name, t0, time.monotonic_ns(), ())
        if self.dtype is dt.bfloat16:
            return dt.bf16_bits_to_float32(out)
        return out

    def tolist(self):
        return self.numpy().tolist()

    def item(self):
        """The value of a one-element tensor as a Python number."""
        if self.numel() != 1:
            raise ValueError(f"item(): only one-element tensors can be converted to a Python scalar, got shape {self.shape}")
        return self.numpy().reshape(()).item()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        if self.numel() != 1:
            raise RuntimeError(f"the truth value of a tensor with {self.numel()} elements is ambiguous")
        return bool(self.item())

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a.astype(dtype) if dtype is not None else a

    # -- autograd -----------------------------------------------------------------------
    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        """Accumulate gradients of this tensor into the ``.grad`` of the leaves."""
        from helios.autograd.tape import backward

        backward(self, gradient, retain_graph=retain_graph)

    def detach(self) -> Tensor:
        """The same data, cut from the tape."""
        t = Tensor(self._st, self.shape, self._strides, self._off, self.dtype)
        t._host = self._host
        return t

    def requires_grad_(self, flag: bool = True) -> Tensor:
        if flag and not self.dtype.is_floating_point:
            raise DTypeError(f"only floating-point tensors can require gradients, this one is {self.dtype.name}")
        if not self.is_leaf and not flag:
            raise RuntimeError("requires_grad_(False) on a non-leaf tensor: use detach() instead")
        self.requires_grad = flag
        return self

    def retain_grad(self) -> None:
        """Keep this non-leaf tensor's gradient in ``.grad`` after backward (a no-op on leaves)."""
        from helios.autograd.tape import retain_grad

        retain_grad(self)

    @property
    def retains_grad(self) -> bool:
        """Whether backward stores this non-leaf tensor's gradient in ``.grad``."""
        node = self._node
        return node is not None and node.retained is not None and any(
            i == self._out_index and ref() is self for ref, i in node.retained)

    def register_post_accumulate_grad_hook(self, hook):
        """Call ``hook(tensor)`` once per backward pass, after the last contribution to this leaf's
        ``.grad`` has been accumulated (PyTorch's name).  Returns a handle with ``remove()``."""
        from helios.autograd.tape import add_post_accumulate_hook

        return add_post_accumulate_hook(self, hook)

    # -- the op surface: thin forwards to helios.functional -----------------------------
    def __add__(self, o):
        if getattr(type(o), "_helios_defers_binary_ops", False):
            return NotImplemented  # let the other operand's reflected method answer (x * complex)
        return F.add(self, o)

    def __radd__(self, o):
        return F.add(self, o)

    def __sub__(self, o):
        if getattr(type(o), "_helios_defers_binary_ops", False):
            return NotImplemented  # let the other operand's reflected method answer (x * complex)
        return F.sub(self, o)

    def __rsub__(self, o):
        return F.rsub(self, o)

    def __mul__(self, o):
        if getattr(type(o), "_helios_defers_binary_ops", False):
            return NotImplemented  # let the other operand's reflected method answer (x * complex)
        return F.mul(self, o)

    def __rmul__(self, o):
        return F.mul(self, o)

    def __truediv__(self, o):
        return F.div(self, o)

    def __rtruediv__(self, o):
        return F.rdiv(self, o)

    def __pow__(self, o):
        return F.pow(self, o)

    def __rpow__(self, o):
        return F.rpow(self, o)

    def __neg__(self):
        return F.neg(self)

    def __matmul__(self, o):
        return F.matmul(self, o)

    def __rmatmul__(self, o):
        return F.matmul(o, self)

    def __lt__(self, o):
        return F.lt(self, o)

    def __le__(self, o):
        return F.le(self, o)

    def __gt__(self, o):
        return F.gt(self, o)

    def __ge__(self, o):
        return F.ge(self, o)

    def __eq__(self, o):  # elementwise, as in PyTorch
        return F.eq(self, o)

    def __ne__(self, o):
        return F.ne(self, o)

    def __and__(self, o):
        return F.logical_and(self, o)

    def __or__(self, o):
        return F.logical_or(self, o)

    def __invert__(self):
        return F.logical_not(self)

    __hash__ = object.__hash__

    def __getitem__(self, idx):
        return F.getitem(self, idx)

    def __setitem__(self, idx, value):
        F.setitem(self, idx, value)

    # Named methods are attached by helios.functional (one list, no duplication).
