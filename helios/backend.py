"""The device contract: everything the tensor layer, autograd and the profiler ask of a device.

A backend is one class implementing :class:`Runtime`: ``helios.runtime.VulkanRuntime``
(SPIR-V through the ``helios._vulkan`` addon), ``helios.cuda_ptx.tensor_runtime.CudaRuntime``
(PTX translated from the same SPIR-V, through the CUDA driver API) and
``helios.runtime.HostRuntime`` (the "cpu" device: host memory, no kernels).  Ops are
written once, in ``helios._kernels``: they record "kernel K, variant V, specialization
constants S, bindings B, push-constant bytes P, workgroup grid G" and the backend turns that
into work on its device.  Nothing above this seam names the API a backend drives; see
docs/device-contract.md for the two backends side by side.

The three parts (tinygrad's ``Compiled(allocator, compiler, runtime)`` is the model):

allocator
    ``alloc(nbytes, pool) -> handle``, ``free(handle)``, ``read(handle, offset, out_u8)``,
    ``write(handle, offset, data_u8)``, ``copy(src, src_offset, dst, dst_offset, nbytes)``,
    ``fill(handle, offset, nbytes, word32)``, ``pool_stats()``; for zero-copy host access
    ``ready(...)``, ``map(...)`` (None where memory is not host-visible) and ``host_wrote(...)``.
    A handle is an opaque value; views are (handle, byte offset) pairs, so a tensor view never
    allocates.
    ``read`` waits for the recorded work that writes those bytes; ``write`` is ordered after
    the recorded work that touches them; ``copy`` and ``fill`` are recorded like dispatches.
program
    ``pipeline(kernel, variant, spec) -> pid`` (built once, cached), then
    ``dispatch(pid, buffers, push, groups, name, flops, nbytes)`` records one launch;
    ``buffers`` are ``(handle, byte offset, nbytes, writes)`` for bindings 0..n-1.
stream
    ``flush()`` submits what is recorded, ``synchronize()`` waits for all of it, ``stats()``
    counts (``"dispatches"`` at least).  While a profiling session is open
    (``helios.profile.profiler.current_collector()`` is not None) the runtime numbers each
    dispatch, fill and copy with ``col.next_dispatch_seq()`` and hands the collector the
    device events at ``synchronize()`` (``{"events": [...], "submits": [...]}``, times on the
    host ``CLOCK_MONOTONIC`` clock); ``profiling_started(col)`` / ``profiling_stopping(col)``
    run when a session opens and before it closes.  ``mark()`` / ``wait_mark(id)`` /
    ``take_marks()`` time spans of device work without waiting (helios-train's phases); a
    backend without them returns None from ``mark()`` and callers synchronise instead.
facts
    ``name`` ("vulkan:0", "cuda:0", "cpu"), ``device`` (a :class:`helios.device`), ``index``,
    ``is_host``, ``info`` (``name``, ``type``: discrete | integrated | virtual | cpu | other,
    ``limits``: ``max_storage_buffer_range``, ``min_storage_buffer_offset_alignment``,
    ``subgroup_size``, ..., ``features``), ``features`` (``storage16``, ``storage8``,
    ``int64``), ``max_range`` (the most bytes one binding may span) and ``align`` (the
    alignment of a binding's offset).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

# The memory pools every backend accounts separately (by lifetime), as pool_stats() keys.
POOLS = ("weights", "activations", "staging")

# The kinds of command run_commands() takes: (kind, the arguments of dispatch / copy / fill / gemm / flash).
DISPATCH, COPY, FILL, GEMM, FLASH = 0, 1, 2, 3, 4


def attention_pairs(tq: int, tk: int, causal: bool) -> int:
    """The (query, key) pairs one head of an attention computes without a block mask (what the
    FLOPs of :meth:`Runtime.flash` and of the generic flash kernels count): all tq * tk, or,
    causal, min(i + 1, tk) keys for query row i."""
    if not causal:
        return tq * tk
    full = min(tq, tk)
    return full * (full + 1) // 2 + max(0, tq - tk) * tk


class Runtime(ABC):
    """One open device behind the contract (see the module docstring)."""

    name: str = ""
    index: int | None = None
    is_host: bool = False
    device = None  # helios.device of ``name``
    info: dict = {}
    features: dict = {}
    max_range: int = 0
    align: int = 256
    debug: int = 0  # HELIOS_DEBUG level the runtime logs kernels at (0: off)
    has_marks: bool = False  # whether mark() returns marks (device timestamps in the stream)
    # The queue of elementwise ops not yet recorded (helios.elementwise_jit.Queue), or None where the
    # backend dispatches them at once; a backend with one emits it before any other command.
    ew_queue = None

    def emit_pending(self) -> None:
        """Record the work held back for fusion (the elementwise queue) now (nothing by default)."""
        q = self.ew_queue
        if q is not None and q.ops:
            q.emit()

    # -- allocator ------------------------------------------------------------------------
    @abstractmethod
    def alloc(self, nbytes: int, pool: str = "activations"):
        """A handle to at least ``nbytes`` of device memory in ``pool`` (one of :data:`POOLS`)."""

    @abstractmethod
    def free(self, handle) -> None:
        """Release ``handle``; its bytes are reused only after the work recorded so far ran."""

    @abstractmethod
    def read(self, handle, offset: int, out) -> None:
        """Fill the uint8 array ``out`` from ``handle`` at byte ``offset`` (waits for the work writing them)."""

    @abstractmethod
    def write(self, handle, offset: int, data) -> None:
        """Copy the uint8 array ``data`` into ``handle`` at byte ``offset`` (after the work touching them)."""

    @abstractmethod
    def copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        """Record a device-to-device copy of ``nbytes``."""

    @abstractmethod
    def fill(self, handle, offset: int, nbytes: int, word: int) -> None:
        """Record a fill of ``nbytes`` (a multiple of 4) at ``offset`` with the 32-bit ``word``."""

    def ready(self, handle, offset: int, nbytes: int, for_write: bool = False) -> bool:
        """Whether no unfinished work writes the bytes (``for_write``: touches them); never waits.

        The default suits a backend whose ``read``/``write`` are ordered after the recorded work
        by its stream: they wait themselves, so the range is always ready for them."""
        return True

    def map(self, handle, offset: int, nbytes: int, for_write: bool = False):
        """A writable memoryview of the bytes in host-visible memory, after the work writing them
        (``for_write``: touching them) is done; None where the memory is not host-mapped (the
        default): use ``read``/``write`` then.  Call ``host_wrote`` after writing through it."""
        return None

    def host_wrote(self, handle, offset: int, nbytes: int) -> None:
        """Make host writes made through ``map`` visible to the device (nothing to do by default)."""

    @abstractmethod
    def pool_stats(self) -> dict:
        """Per pool of :data:`POOLS`: ``{"in_use_bytes", "peak_in_use_bytes", "reserved_bytes", "allocs", "frees", ...}``."""

    # -- program --------------------------------------------------------------------------
    @abstractmethod
    def pipeline(self, kernel: str, variant: str, spec: tuple = (), subgroup_size: int = 0):
        """An id for (kernel, variant, specialization constants), built on first use and cached.
        ``subgroup_size`` > 0: the kernel must run in full subgroups of exactly that many
        invocations (a kernel planned for one size); 0 leaves the size to the driver."""

    @abstractmethod
    def dispatch(self, pid, buffers: list, push: bytes, groups: tuple, name: str, flops: int = 0,
                 nbytes: int = 0) -> None:
        """Record one launch of ``pid`` over the workgroup grid ``groups`` (returns at once)."""

    def has_gemm(self, in_dtype: str) -> bool:
        """Whether :meth:`gemm` may take products of this input dtype (a Helios dtype name) at all,
        so callers prepare operands for it only then.  False by default."""
        return False

    def gemm(self, a: tuple, b: tuple, c: tuple, m: int, n: int, k: int, in_dtype: str, out_dtype: str,
             bias: tuple | None = None, batch: tuple = (), round_out: bool = False, residual: tuple | None = None) -> bool:
        """C = A @ B (+ bias) on the device's matrix engine, where it has one for this product; returns
        whether it recorded it (False: nothing was done, the caller runs its generic kernel).

        ``a`` = (handle, byte offset, row pitch in elements, major): ``"k"`` for row-major ``M x K``,
        ``"m"`` for its transpose stored row-major ``K x M``; ``b`` = (handle,
        byte offset, row pitch, major): ``"n"`` for row-major ``K x N``, ``"k"`` for its transpose
        stored row-major ``N x K``; ``c`` = (handle, byte offset, row pitch) of row-major ``M x N``.
        ``bias`` = (handle, byte offset) of an N-vector of ``in_dtype`` added to every row before C
        is rounded.  ``batch``: a batch of such products, all in one call: one ``(extent, A's stride,
        B's stride, C's stride)`` per batch dimension, outermost first, strides in elements from
        the offsets above (0: that operand is broadcast along the dimension; C's is never 0);
        ``()``, the default, is one product.  ``in_dtype`` / ``out_dtype`` are Helios dtype names.
        ``round_out`` (a float32 ``out_dtype``): each result rounded to ``in_dtype`` and stored
        widened, as the 16-bit product followed by a cast to float32 would give it; ``residual`` (with
        ``round_out``, one product) = (handle, byte offset, row pitch) of a float32 ``M x N`` matrix
        added to each rounded result before it is stored (a projection and its float32 residual
        add).  None by default."""
        return False

    def has_flash(self, dtype: str, head_dim: int) -> bool:
        """Whether :meth:`flash` may take attentions of this dtype (a Helios dtype name) and head
        dim at all, so callers prepare operands for it only then.  False by default."""
        return False

    def flash(self, pass_: str, dtype: str, problem: tuple, inputs: tuple, outputs: tuple, scale: float,
              causal: bool, block_mask: tuple | None = None) -> bool:
        """Flash attention on the device's own kernels (tensor cores), where it has them for these
        operands; returns whether it recorded the work (False: nothing was done, the caller runs
        its generic kernel).  ``dtype``: the operands' Helios dtype name.  ``problem`` = (B, H, Hk, Tq, Tk, D): H query heads share Hk K/V
        heads (grouped-query attention when Hk < H).  Operands are (handle, byte offset,
        (stride B, stride H, stride T) in elements) of [B, heads, T, D] tensors with D's stride 1;
        the outputs O, dQ, dK, dV are (handle, byte offset[, (stride B, stride H, stride T)]) of such
        tensors (contiguous where the strides are left out; dK's and dV's the same), and L, D
        (handle, byte offset) of contiguous ones.

        ``pass_ = "fwd"``: inputs (q, k, v), outputs (O [B, H, Tq, D] in q's dtype, L float32
        [B, H, Tq], the log-sum-exp of each row's scaled scores).  ``pass_ = "bwd"``: inputs
        (q, k, v, dO, L, D = rowsum(dO * O)[, O]), outputs (dQ, dK, dV), dK and dV with K's heads; a
        None output is not computed (dK and dV come together).  With O (the forward's output, an
        operand like q; dQ must be wanted) the backward computes D itself and writes it at D's
        place, else it reads D there.  ``block_mask`` = (handle, byte offset,
        block size, pairs): an int32 [ceil(Tq / bs), ceil(Tk / bs)] mask of the block pairs computed
        (bs a multiple of 64), the others skipped whole; ``pairs``: the (query, key) pairs one head
        computes under it (the FLOPs the profiler counts).  Deterministic: the same inputs give the same
        bits.  False by default."""
        return False

    def run_commands(self, commands) -> None:
        """Issue recorded commands in order: ``(DISPATCH, dispatch's arguments)``, ``(COPY, copy's)``,
        ``(FILL, fill's)``, ``(GEMM, gemm's)``, ``(FLASH, flash's)`` (``helios.graph``'s replay).  A backend may override
        this with a tighter loop."""
        calls = (self.dispatch, self.copy, self.fill, self.gemm, self.flash)
        for kind, args in commands:
            calls[kind](*args)

    # -- stream ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Submit what is recorded without waiting (a no-op where launches go out at once)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until every recorded op has finished; hand device events to an open profiling session."""

    @abstractmethod
    def stats(self) -> dict:
        """Stream counters: ``dispatches`` (since the runtime opened or the last reset) and more per backend."""

    def mark(self):
        """A device timestamp at this point of the stream, written once the work recorded before it
        has finished; returns an id for :meth:`take_marks`, or None where the backend has no
        timestamps (the default): a phase timer then synchronises instead.  Never waits."""
        return None

    def wait_mark(self, mark) -> None:
        """Wait until the work recorded before ``mark`` has finished (by default: all of it)."""
        self.synchronize()

    def take_marks(self) -> dict:
        """``{id: ns}`` of the marks whose work has finished since the last take; never waits.  The
        times are on the device's clock: only differences between marks mean anything."""
        return {}

    def profiling_started(self, col) -> None:
        """A profiling session opened: drop earlier events, timestamp dispatches from now on."""

    def profiling_stopping(self, col) -> None:
        """A profiling session is closing: wait, hand the last events to ``col``, stop timestamps."""
