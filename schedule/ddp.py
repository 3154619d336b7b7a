"""DistributedDataParallel: replicate a model on every rank and average gradients in buckets
whose all-reduce starts while backward is still running.

    model = DistributedDataParallel(GPT(cfg), bucket_cap_mb=25)
    opt = AdamW(model.parameters(), ...)
    with model.no_sync():
        model(x0, y0)[1].backward()          # accumulate locally, no communication
    model(x1, y1)[1].backward()              # buckets all-reduce during backward
    opt.step()

At wrap time the ranks check that they hold the same parameters (names, shapes, dtypes)
and rank 0's values are broadcast to all.  Gradients land in flat buffers (the fused
optimizer's, or DDP's own when the optimizer has none), so a bucket is a contiguous range
of one flat buffer: its all-reduce runs on the device memory in place (mapped where it is
host-visible).  Buckets hold parameters in reverse registration order, roughly the order
in which backward finishes them; a parameter's post-accumulate hook marks it ready, and a
bucket whose parameters are all ready is handed to the communicator's thread at once.
Buckets are issued in one fixed order on every rank (collectives must match across ranks).
When backward ends, DDP waits for what is still in flight, so ``loss.backward()`` returns
with averaged gradients.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

import helios.comm as dist
from helios import dtypes as dt
from helios import flat
from helios.autograd import tape
from helios.errors import ShapeError
from helios.nn import Module
from helios.tensor import Tensor


@dataclass
class Bucket:
    """A contiguous range [lo, hi) of one flat gradient buffer and the parameters in it."""

    index: int
    storage_key: int
    flat: Tensor  # the whole flat gradient buffer the range belongs to
    lo: int
    hi: int
    params: list = field(default_factory=list)
    ready: int = 0
    work: object = None

    @property
    def view(self) -> Tensor:
        """The bucket's gradients as one contiguous 1-D tensor over the flat buffer."""
        return flat.elements(self.flat, self.lo, self.hi - self.lo)

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.flat.dtype.itemsize


@dataclass
class BucketEvent:
    """One line of the bucket log: what happened to a bucket, when, and how far backward was."""

    bucket: int
    what: str  # "launched" | "reduced"
    time_ns: int
    backward_nodes_done: int
    backward_nodes_total: int


class DistributedDataParallel(Module):
    """Data parallel over ``group`` (the world by default), PyTorch's name and habits.

    ``bucket_cap_mb``: bucket size in MiB (25, as PyTorch); ``first_bucket_cap_mb``: the size
    of the first bucket cut from each gradient buffer, the one backward completes first (1,
    as PyTorch: communication starts early); ``find_unused_parameters``: a
    parameter that gets no gradient in a backward pass counts as a zero gradient (else it
    is an error that names the parameters); ``broadcast_from``: the (global) rank whose
    parameters every rank starts from, by default the group's first; ``params_to_ignore``: names
    of parameters DDP leaves alone (not compared, broadcast or averaged: each rank's own, such
    as the experts an expert-parallel rank holds, whose gradients the caller reduces).
    """

    def __init__(self, module: Module, bucket_cap_mb: float = 25.0, group=None, find_unused_parameters: bool = False,
                 broadcast_from: int | None = None, comm_hook=None, first_bucket_cap_mb: float = 1.0,
                 params_to_ignore=()) -> None:
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module = module
        self.group = group
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        self.first_bucket_cap_bytes = int(min(first_bucket_cap_mb, bucket_cap_mb) * (1 << 20))
        self.find_unused_parameters = find_unused_parameters
        ignored = set(params_to_ignore)
        unknown = ignored - {n for n, _ in module.named_parameters()}
        if unknown:
            raise ValueError(f"DistributedDataParallel: params_to_ignore names no parameter of the model: "
                             f"{', '.join(sorted(unknown))}")
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
        self._sync = True
        self._buckets = []
        self._layout_key = None
        self._own_flat = {}
        self._bucket_of = {}
        self._next_launch = 0
        self._armed = False
        self._ready_ids = set()
        self._covered = None  # indices of the buckets backward reduces now (None: all; see reducing_only)
        self.bucket_log: deque[BucketEvent] = deque(maxlen=4096)  # the latest bucket events, for tests and tools
        self.comm_hook = comm_hook or allreduce_hook
        # A context manager factory wrapped around the end-of-backward wait (the trainer times
        # it as its "comm" phase: the communication backward could not hide).
        self.wait_context = None
        if broadcast_from is None:
            broadcast_from = group.ranks[0] if group is not None else 0
        verify_same_parameters(self._named, group)
        broadcast_parameters([p for _, p in self._named] + [b for _, b in module.named_buffers()], broadcast_from, group)
        for _, p in self._named:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ---- the Module surface ------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.prepare_buckets()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next one outside reduces them all."""
        prev = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = prev

    @contextlib.contextmanager
    def reducing_only(self, params):
        """Backward passes inside give gradients to ``params`` only (one chunk of an interleaved
        pipeline stage's layers): they reduce the buckets holding those parameters and leave the
        others, which no gradient reached, to the backward passes that cover them (instead of
        counting their parameters as unused).  A bucket must hold only parameters of ``params``
        or none; every rank of the group must give the same ones, so every rank issues the same
        buckets in the same order."""
        ids = {id(p) for p in params}
        covered = set()
        for b in self._buckets:
            inside = [id(p) in ids for p in b.params]
            if any(inside) and not all(inside):
                raise ValueError("DistributedDataParallel.reducing_only: a gradient bucket holds parameters both "
                                 "inside and outside the ones given; the bucket would be reduced half complete")
            if all(inside):
                covered.add(b.index)
        prev = self._covered
        self._covered = covered
        try:
            yield
        finally:
            self._covered = prev

    def _reduces(self, b: Bucket) -> bool:
        """Whether backward reduces bucket ``b`` now (``reducing_only`` leaves the others out)."""
        return self._covered is None or b.index in self._covered

    @property
    def synchronizing(self) -> bool:
        """Whether a backward pass now reduces gradients (False inside :meth:`no_sync`)."""
        return self._sync

    def register_comm_hook(self, hook) -> None:
        """Replace how a ready bucket is communicated: ``hook(ddp, bucket) -> Work`` (a handle with
        ``wait()``) that leaves the averaged gradients (or what the optimizer expects) in place.
        A hook with ``state_dict``/``load_state_dict`` (helios.schedule.compression's) keeps its
        state in this object's state dict under ``comm_hook.``."""
        self.comm_hook = hook

    def state_dict(self):
        """The module's parameters (``module.<name>``) and, for a stateful comm hook, its state:
        ``comm_hook.<name>`` float32 arrays (error feedback, PowerSGD's Q) and ``comm_hook`` (a
        dict: its spec and step count).  The hook state is this rank's own."""
        sd = super().state_dict()
        if hasattr(self.comm_hook, "state_dict"):
            hs = self.comm_hook.state_dict()
            sd["comm_hook"] = {k: v for k, v in hs.items() if k != "tensors"}
            for k, v in hs["tensors"].items():
                sd[f"comm_hook.{k}"] = v
        return sd

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load what ``state_dict`` returned (the hook's part into the hook, which must be of the same kind)."""
        state = dict(state)
        meta = state.pop("comm_hook", None)
        tensors = {k[len("comm_hook."):]: state.pop(k) for k in [k for k in state if k.startswith("comm_hook.")]}
        if meta is not None:
            if not hasattr(self.comm_hook, "load_state_dict"):
                raise ValueError("DistributedDataParallel.load_state_dict: the state holds a comm hook's state "
                                 f"({meta.get('spec')}) but this model's comm hook keeps none")
            self.comm_hook.load_state_dict({**meta, "tensors": tensors})
        super().load_state_dict(state, strict)

    @property
    def buckets(self) -> list[Bucket]:
        """The current buckets, in the order they are issued."""
        return list(self._buckets)

    # ---- buckets -------------------------------------------------------------------------
    def prepare_buckets(self) -> None:
        """(Re)build buckets when the parameters' gradient slots changed (an optimizer packed them); the
        model's forward does it, and a caller that runs the module's parts itself (a ZeRO forward scope)."""
        for dtype in {p.dtype for _, p in self._named if p.grad_slot is None}:
            self._give_slots(dtype)
        key = tuple((id(p.grad_slot.untyped_storage()), p.grad_slot.storage_offset()) for _, p in self._named)
        if key == self._layout_key:
            return
        self._layout_key = key
        self._buckets = build_buckets(self._named, self.bucket_cap_bytes, self.first_bucket_cap_bytes)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}

    def _give_slots(self, dtype: dt.DType) -> None:
        """Gradients of parameters no fused optimizer packed land in one flat buffer of DDP's own."""
        params = [p for _, p in self._named if p.dtype is dtype and p.grad_slot is None]
        n = sum(p.numel() for p in params)
        buf = flat.zeros((n,), dtype, params[0].device, pool="weights")
        self._own_flat[dtype.name] = buf
        off = 0
        for p in params:
            p.grad_slot = buf.untyped_storage().view(buf.storage_offset() + off, p.shape, dtype)
            off += p.numel()

    def _on_grad_ready(self, p: Tensor) -> None:
        if not self._sync:
            return
        if not self._armed:
            self._armed = True
            self._next_launch = 0
            self._ready_ids.clear()
            for b in self._buckets:
                b.ready, b.work = 0, None
            tape.queue_callback(self._finish_backward)
        b = self._bucket_of.get(id(p))
        if b is None:
            raise RuntimeError("DistributedDataParallel: a parameter's gradient arrived before forward() built the "
                               "buckets; call the DDP-wrapped model, not the inner module")
        if p.grad is None or p.grad.untyped_storage() is not p.grad_slot.untyped_storage():
            flat.copy_into(p.grad_slot, p.grad)  # a gradient that missed its slot (dtype cast): put it in place
            p.grad = p.grad_slot
        self._ready_ids.add(id(p))
        b.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Issue, in bucket order, every bucket whose parameters are all ready."""
        while self._next_launch < len(self._buckets):
            b = self._buckets[self._next_launch]
            if not self._reduces(b):  # another chunk's bucket: its own backward reduces it
                self._next_launch += 1
                continue
            if b.ready < len(b.params):
                return
            done, total = tape.backward_progress()
            self.bucket_log.append(BucketEvent(b.index, "launched", time.monotonic_ns(), done, total))
            # Submit what is recorded: the bucket's gradients then end a submission of their own,
            # whose completion the communicator sees while the device runs the rest of backward.
            flat.flush(b.flat.device)
            b.work = self.comm_hook(self, b)
            self._next_launch = self._next_launch + 1

    def _finish_backward(self) -> None:
        """End of backward: deal with parameters that got no gradient, then wait for every bucket."""
        self._armed = False
        missing = [(n, p) for n, p in self._named
                   if id(p) not in self._ready_ids and self._reduces(self._bucket_of[id(p)])]
        if missing and not self.find_unused_parameters:
            names = ", ".join(n for n, _ in missing[:10]) + (" ..." if len(missing) > 10 else "")
            self._drain()
            raise RuntimeError(f"DistributedDataParallel: {len(missing)} parameter(s) got no gradient in this backward "
                               f"pass: {names}. Every rank must reduce every bucket; pass "
                               "find_unused_parameters=True to count them as zero, or use them in the loss.")
        for _, p in missing:
            if p.grad is None or p.grad.untyped_storage() is not p.grad_slot.untyped_storage():
                flat.fill_(p.grad_slot, 0)  # no gradient at all yet: it counts as zero
                p.grad = p.grad_slot
            self._bucket_of[id(p)].ready += 1
        self._launch_ready()
        self._drain()

    def _drain(self) -> None:
        ctx = self.wait_context() if self.wait_context is not None else contextlib.nullcontext()
        with ctx:
            self._wait_all()

    def _wait_all(self) -> None:
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
                done, total = tape.backward_progress()
                self.bucket_log.append(BucketEvent(b.index, "reduced", time.monotonic_ns(), done, total))


def allreduce_hook(ddp: DistributedDataParallel, bucket: Bucket):
    """The default comm hook: average the bucket over the group, asynchronously, in place."""
    return dist.all_reduce(bucket.view, op="avg", group=ddp.group, async_op=True)


def build_buckets(named: list, cap_bytes: int, first_cap_bytes: int | None = None) -> list[Bucket]:
    """Cut each flat gradient buffer into buckets of at most ``cap_bytes`` (a parameter is never
    split), the first one cut from each buffer at most ``first_cap_bytes``.

    Parameters are taken in reverse registration order (the order backward tends to finish
    them); within a flat buffer a bucket is a contiguous range.  Buckets are issued by the
    registration index of their earliest parameter, latest first: roughly the order in
    which they become complete, and the same on every rank.
    """
    order = {id(p): i for i, (_, p) in enumerate(named)}
    by_storage: dict[int, list] = {}
    for _, p in named:
        by_storage.setdefault(id(p.grad_slot.untyped_storage()), []).append(p)
    buckets: list[Bucket] = []
    for key, params in by_storage.items():
        params.sort(key=lambda p: p.grad_slot.storage_offset(), reverse=True)
        first = params[0].grad_slot
        st = first.untyped_storage()
        base = st.view(0, (st.nbytes // first.dtype.itemsize,), first.dtype)  # the whole buffer
        cut: list[Bucket] = []  # this buffer's buckets, the one being filled last
        for p in params:
            lo = p.grad_slot.storage_offset()
            hi = lo + p.numel()
            cap = first_cap_bytes if first_cap_bytes is not None and len(cut) == 1 else cap_bytes
            if cut and hi == cut[-1].lo and (cut[-1].hi - lo) * first.dtype.itemsize <= cap:
                cut[-1].lo = lo
                cut[-1].params.append(p)
                continue
            cut.append(Bucket(0, key, base, lo, hi, [p]))
        buckets += cut
    buckets.sort(key=lambda b: -min(order[id(p)] for p in b.params))
    for i, b in enumerate(buckets):
        b.index = i
    return buckets


def verify_same_parameters(named: list, group=None) -> None:
    """Raise ShapeError on every rank when the ranks' parameters differ in names, shapes or dtypes."""
    desc = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype.name}" for n, p in named)
    check_same_on_all_ranks(desc, "parameters (names, shapes and dtypes)", group, ShapeError)


def check_same_on_all_ranks(text: str, what: str, group=None, error=ValueError) -> None:
    """Compare a digest of ``text`` across ranks; raise ``error`` on every rank naming the ranks that differ."""
    n = dist.get_world_size(group)
    mine = np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], np.uint8).copy()
    every = np.empty(16 * n, np.uint8)
    dist.all_gather(every, mine, group=group)
    digests = [bytes(every[16 * i: 16 * (i + 1)]) for i in range(n)]
    if len(set(digests)) > 1:
        ref = digests[0]
        odd = [i for i, d in enumerate(digests) if d != ref]
        raise error(f"the ranks disagree on their {what}: rank(s) {odd} differ from rank 0. Launch every rank with "
                    "the same model and settings.")


def broadcast_parameters(tensors: list, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s values of ``tensors`` to every rank, in place."""
    with tape.no_grad():
        for t in tensors:
            if t.numel():
                dist.broadcast(t, src=src, group=group)
