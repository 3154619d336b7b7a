"""Step capture and replay: run a training step's device work again without running its Python.

    x, y = hl.tensor(xb0), hl.tensor(yb0)            # the step's inputs: created before the capture
    with hl.graph.capture(inputs=(x, y)) as g:
        loss = step(x, y)                             # runs once, like any step, and is recorded
    for xb, yb in batches:
        g.replay(xb, yb)                              # new contents for x and y, the same commands again
        print(loss.item())                            # ``loss`` is the captured step's output tensor

What PyTorch's CUDA graphs are to PyTorch.  A step records a few hundred dispatches, and on a
small model the host time that takes (Python, autograd, shape logic: ~90 µs a dispatch) is
most of the step.  Capture keeps the list of what the step asked of the device through the
device contract (``helios.backend.Runtime``: ``dispatch``, ``copy``, ``fill``), with the exact
buffers and push-constant bytes; ``replay()`` hands that list to the runtime again, which
records it into fresh command buffers (hazard barriers, timestamps and submits as for any
work) at the cost of the runtime calls alone.  Two differences from CUDA graphs: the captured
step *runs* (it is a real step, its results are in the tensors it returned), and a replay
re-records the commands rather than resubmitting one command buffer (lavapipe and the
runtime's hazard tracking make that cheap, and the profiler still sees every kernel).

What makes a replay the same computation as running the step again:

* *Memory stays put.*  Every allocation the captured work touches, and every one made
  during the capture, is held until the graph is released (``g.release()`` or garbage
  collection): a tensor freed in between keeps its bytes for the graph.  A graph therefore
  holds all of a step's temporaries at once (PyTorch's graph pools do the same).
* *Host state is refreshed or refused.*  An op whose device work depends on host values
  registers what a replay must redo: ``dynamic_push(fn)`` (the last recorded dispatch takes
  its push constants from ``fn()`` at each replay: AdamW's step count and learning rate) and
  ``before_replay(fn)`` (host work to redo first: the embedding backward's index grouping, a
  check that a value the capture baked in still holds; its writes go through ``upload``, which
  does not wait for the previous replay).  What would differ otherwise is
  refused while capturing, with a message naming it: a read-back to the host (``.item()``,
  ``.numpy()``, a collective), uploading user data (``hl.tensor(array)``, ``x.copy_(array)``,
  ``.to(device)``: ``refuse_upload``), random numbers.  Constants an op uploads for itself
  (a cached scalar) are part of the graph, as the kernels' push constants are.
* *Inputs are static.*  ``capture(inputs=...)`` names the tensors a replay refills;
  ``replay(*new)`` copies arrays or tensors of the same shape and dtype into them (a shape
  change is refused: the commands were recorded for those shapes).  An array lands in a
  fresh buffer and a recorded copy moves it into the input when the previous replay may still
  read that input, so the host can prepare replay k+1 while the device runs replay k.

A graph captures the work of one device (the current one): every command issued on it while
the block runs, from any thread; other devices' work is not recorded.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from helios.backend import COPY as _COPY  # a recorded command: (kind, the runtime call's arguments)
from helios.backend import DISPATCH as _DISPATCH
from helios.backend import FILL as _FILL
from helios.backend import FLASH as _FLASH
from helios.backend import GEMM as _GEMM
from helios.errors import HeliosError, ShapeError

__all__ = ["capture", "Graph", "GraphCaptureError", "capturing", "dynamic_push", "before_replay", "upload", "refuse",
           "refuse_upload"]


class GraphCaptureError(HeliosError, RuntimeError):
    """Work inside ``hl.graph.capture`` that a replay could not repeat, or a graph used wrongly."""


_state = threading.local()  # .graph: the Graph being captured on this thread, or None


def capturing():
    """The :class:`Graph` being captured on this thread, or None (cheap: ops call it on their host paths)."""
    return getattr(_state, "graph", None)


def dynamic_push(fn) -> None:
    """While capturing: the dispatch recorded last takes its push-constant bytes from ``fn()`` at
    each replay (``fn`` runs at replay time, after the ``before_replay`` functions).  No-op otherwise."""
    g = capturing()
    if g is not None:
        g._dynamic_push(fn)


def before_replay(fn) -> None:
    """While capturing: run ``fn()`` at the start of each replay, before any command is issued
    (host work a replay must redo, or a check that raises :class:`GraphCaptureError`). No-op otherwise."""
    g = capturing()
    if g is not None:
        g._hooks.append(fn)


def upload(dst, data) -> None:
    """Write the array ``data`` (``dst``'s storage dtype, ``dst.numel()`` values) into tensor ``dst``
    without waiting for unfinished work that reads its bytes (the previous replay, which the
    device may still run while the host prepares the next one): where such work is pending, the
    values go to a fresh staging buffer and a recorded copy moves them in, ordered after the
    earlier reads and before what is recorded next.  A replay's refill and the before_replay
    functions write through it.  (Where device memory is not host-mapped, a write goes through
    the stream and waits anyway.)"""
    rt = dst._st.rt
    handle, off = dst._st.handle, dst._off * dst.dtype.itemsize
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if rt.ready(handle, off, data.size, for_write=True):
        rt.write(handle, off, data)  # nothing unfinished touches it: a copy into the mapping
        return
    tmp = rt.alloc(data.size, "staging")
    try:
        rt.write(tmp, 0, data)
        rt.copy(tmp, 0, handle, off, data.size)
    finally:
        rt.free(tmp)  # reused only once the recorded copy has run


def refuse(rt, what: str, why: str) -> None:
    """Raise :class:`GraphCaptureError` while capturing on ``rt``: ``what`` does something inside
    the captured step that a replay would not repeat (``why``: what that is and what to do)."""
    g = capturing()
    if g is not None and g.rt is rt:
        raise GraphCaptureError(f"hl.graph.capture: {what} inside the captured step {why}")


def refuse_upload(what: str, rt) -> None:
    """:func:`refuse` for the public upload paths: user data copied from the host."""
    refuse(rt, what, "uploads host data that a replay would not upload again; create the step's inputs before "
               "the capture and pass them as capture(inputs=...), then replay(new_values)")


class _Holds:
    """Per runtime: the handles live graphs hold, and frees deferred until no graph holds them.

    Installed as the runtime's ``free`` while any graph on it lives (an instance attribute over
    the class's method), so a tensor dropped by its owner keeps its bytes for the graphs."""

    def __init__(self, rt):
        self.rt = rt
        self.real_free = rt.free
        self.count: dict = {}  # handle -> number of live graphs holding it
        self.deferred: set = set()  # held handles whose owner freed them
        rt.free = self.free

    def hold(self, handles) -> None:
        for h in handles:
            self.count[h] = self.count.get(h, 0) + 1

    def free(self, handle) -> None:
        if handle in self.count:
            self.deferred.add(handle)
        else:
            self.real_free(handle)

    def drop(self, handles) -> None:
        for h in handles:
            left = self.count[h] - 1
            if left:
                self.count[h] = left
                continue
            del self.count[h]
            if h in self.deferred:
                self.deferred.discard(h)
                self.real_free(h)
        if not self.count:  # no graph left on this runtime: the runtime's own free again
            del self.rt.free
            _holds.pop(id(self.rt), None)


_holds: dict[int, _Holds] = {}


def _holds_for(rt) -> _Holds:
    h = _holds.get(id(rt))
    if h is None:
        h = _holds[id(rt)] = _Holds(rt)
    return h





class Graph:
    """A captured step: the commands it recorded on one device, replayable (see the module docstring)."""

    def __init__(self, rt, inputs=()):
        self.rt = rt
        self.inputs = tuple(inputs)
        self.ops: list[tuple] = []  # (kind, args) in recording order
        self._patches: dict[int, object] = {}  # op index -> fn() giving its push bytes at replay
        self._hooks: list = []
        self._handles: set = set()
        self._state = "capturing"  # -> "ready" | "failed ..." | "released"
        self._held = False  # whether _holds counts this graph's handles
        self.replays = 0

    # -- capture ----------------------------------------------------------------------------
    def _dispatch(self, pid, buffers, push, groups, name, flops=0, nbytes=0):
        self._real["dispatch"](pid, buffers, push, groups, name, flops, nbytes)
        bufs = [tuple(b) for b in buffers]
        self._touch(b[0] for b in bufs)
        self.ops.append((_DISPATCH, (pid, bufs, bytes(push), tuple(groups), name, flops, nbytes)))

    def _copy(self, src, src_offset, dst, dst_offset, nbytes):
        self._real["copy"](src, src_offset, dst, dst_offset, nbytes)
        self._touch((src, dst))
        self.ops.append((_COPY, (src, src_offset, dst, dst_offset, nbytes)))

    def _fill(self, handle, offset, nbytes, word):
        self._real["fill"](handle, offset, nbytes, word)
        self._touch((handle,))
        self.ops.append((_FILL, (handle, offset, nbytes, word)))

    def _gemm(self, a, b, c, m, n, k, in_dtype, out_dtype, bias=None, batch=(), round_out=False, residual=None):
        took = self._real["gemm"](a, b, c, m, n, k, in_dtype, out_dtype, bias, batch, round_out, residual)
        if took:  # a product the matrix engine declined was not recorded: the caller's kernel is
            self._touch((a[0], b[0], c[0]) + tuple(t[0] for t in (bias, residual) if t is not None))
            self.ops.append((_GEMM, (tuple(a), tuple(b), tuple(c), m, n, k, in_dtype, out_dtype,
                                     None if bias is None else tuple(bias), tuple(tuple(d) for d in batch), round_out,
                                     None if residual is None else tuple(residual))))
        return took

    def _flash(self, pass_, dtype, problem, inputs, outputs, scale, causal, block_mask=None):
        took = self._real["flash"](pass_, dtype, problem, inputs, outputs, scale, causal, block_mask)
        if took:  # declined: the caller's own kernels are recorded instead
            outs = tuple(None if o is None else tuple(o) for o in outputs)
            self._touch(t[0] for t in (*inputs, *outs, block_mask) if t is not None)
            self.ops.append((_FLASH, (pass_, dtype, tuple(problem), tuple(tuple(t) for t in inputs), outs, scale, causal,
                                      None if block_mask is None else tuple(block_mask))))
        return took

    def _alloc(self, nbytes, pool="activations"):
        h = self._real["alloc"](nbytes, pool)
        self._touch((h,))  # held from the start: its free is deferred like any held handle's
        return h

    def _read(self, handle, offset, out):
        raise GraphCaptureError("hl.graph.capture: a read-back to the host (.item(), .numpy(), printing a tensor, a "
                                "collective over the host) inside the captured step cannot be replayed; read the "
                                "step's outputs after the capture, or after each replay")

    def _map(self, handle, offset, nbytes, for_write=False):
        if not for_write:
            self._read(handle, offset, None)
        self._touch((handle,))
        return self._real["map"](handle, offset, nbytes, for_write)

    def _dynamic_push(self, fn) -> None:
        if not self.ops or self.ops[-1][0] != _DISPATCH:
            raise GraphCaptureError("dynamic_push: the last command recorded in this capture is not a dispatch")
        self._patches[len(self.ops) - 1] = fn

    # The contract's methods a capture stands in for (``free`` is _Holds'; host writes are
    # constants an op uploads for itself, kept: the public upload paths refuse first).
    _INTERPOSED = ("dispatch", "copy", "fill", "gemm", "flash", "alloc", "read", "map")

    def _begin(self) -> None:
        rt = self.rt
        rt.emit_pending()  # elementwise ops queued before the capture are not part of it (helios.elementwise_jit)
        self._holds = _holds_for(rt)
        self._real = {m: getattr(rt, m) for m in self._INTERPOSED}
        for m in self._INTERPOSED:
            setattr(rt, m, getattr(self, "_" + m))
        self._held = True  # from here every handle the capture touches is held at once (_touch)
        self._touch(t._st.handle for t in self.inputs)

    def _touch(self, handles) -> None:
        """Hold each handle the first time the capture touches it, so that an owner freeing it later
        in the captured step (a gradient dropped by zero_grad, a temporary) leaves its bytes to the
        graph instead of giving them back to the allocator while the commands still name them."""
        for h in handles:
            if h not in self._handles:
                self._handles.add(h)
                self._holds.hold((h,))

    def _end(self, failed: bool) -> None:
        for m in self._INTERPOSED:
            delattr(self.rt, m)  # the class's methods again
        del self._real
        if failed:
            self.release()
        self._state = "failed (the capture raised)" if failed else "ready"

    # -- replay -----------------------------------------------------------------------------
    def made_inside(self, t) -> bool:
        """Whether a captured command wrote ``t``'s storage: then its values at the start of a
        replay are the previous run's, not this one's (a ``before_replay`` function must not read
        them).  A tensor an op uploaded during the capture and no command wrote is a constant."""
        h = t._st.handle
        for kind, args in self.ops:
            if kind == _DISPATCH:
                if any(b[0] == h and b[3] for b in args[1]):
                    return True
            elif kind == _GEMM:
                if args[2][0] == h:
                    return True
            elif kind == _FLASH:
                if any(o is not None and o[0] == h for o in args[4]):
                    return True
            elif (args[2] if kind == _COPY else args[0]) == h:
                return True
        return False

    def replay(self, *inputs, flush: bool = True) -> None:
        """Run the captured commands again: first copy ``inputs`` (arrays or tensors, one per tensor
        named in ``capture(inputs=...)``, same shapes) into the static inputs, then run the
        ``before_replay`` functions, then issue every command (dynamic push constants recomputed).
        ``flush=False``: leave the commands recorded, unsubmitted (the caller's next flush or wait
        submits them)."""
        if self._state != "ready":
            raise GraphCaptureError(f"replay: this graph is {self._state}; only a graph whose capture finished can replay")
        if capturing() is not None:
            raise GraphCaptureError("replay: another graph is being captured on this thread; replay after it ends")
        if inputs:
            self._refill(inputs)
        for fn in self._hooks:  # their writes go through upload(): they do not wait for the previous replay
            fn()
        ops = self.ops
        for i, fn in self._patches.items():  # the dynamic push constants of this replay
            args = ops[i][1]
            ops[i] = (_DISPATCH, args[:2] + (fn(),) + args[3:])
        self.rt.run_commands(ops)
        if flush:
            self.rt.flush()
        self.replays += 1

    def _refill(self, inputs) -> None:
        from helios.tensor import Tensor

        if len(inputs) != len(self.inputs):
            raise GraphCaptureError(f"replay: got {len(inputs)} inputs, the graph was captured with "
                                    f"{len(self.inputs)} (capture(inputs=...))")
        for i, (dst, new) in enumerate(zip(self.inputs, inputs)):
            shape = tuple(new.shape)
            if shape != dst.shape:
                raise ShapeError(f"replay: input {i} has shape {shape}, the graph was captured for {dst.shape}; "
                                 "capture another graph for that shape")
            if isinstance(new, Tensor):
                if new.dtype is not dst.dtype:
                    raise GraphCaptureError(f"replay: input {i} is {new.dtype.name}, the graph was captured with "
                                            f"{dst.dtype.name}")
                dst.copy_(new)
                continue
            arr = np.asarray(new)
            if arr.dtype.kind != np.dtype(dst.dtype.np_storage).kind and not (
                    arr.dtype.kind in "iu" and dst.dtype.kind == "int"):
                raise GraphCaptureError(f"replay: input {i} is a {arr.dtype} array, the graph's input is "
                                        f"{dst.dtype.name}")
            bits = np.ascontiguousarray(arr, dtype=dst.dtype.np_storage)
            upload(dst, bits)
            dst._st.version += 1
            # The host copy ops consult instead of reading back (index grouping, range checks),
            # updated in place where the capture made it shared (capture() above).
            host = (dst._st.version, bits) if dst.is_contiguous() and dst._off == 0 else (-1, bits)
            if isinstance(dst._host, list):
                dst._host[:] = host
            else:
                dst._host = host if host[0] >= 0 else None

    def release(self) -> None:
        """Give back what the graph holds (freed tensors' bytes return to the allocator); it cannot replay after."""
        if self._held:
            self._holds.drop(self._handles)
            self._held = False
        self._state = "released"
        self.inputs = ()
        self.ops = []
        self._patches = {}
        self._hooks = []

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter exit: the device may be gone
            pass

    def __repr__(self) -> str:
        return f"Graph({self.rt.name}, {len(self.ops)} commands, {self._state}, {self.replays} replays)"


@contextlib.contextmanager
def capture(inputs=(), device=None):
    """Capture the device work done inside the block into a :class:`Graph` (the block runs as usual).

    ``inputs``: the tensors ``Graph.replay(*new)`` refills (created before the capture, on the
    captured device).  ``device``: which device's work to capture (default: the current one)."""
    from helios.runtime import get_runtime
    from helios.tensor import Tensor

    if capturing() is not None:
        raise GraphCaptureError("capture: a graph is already being captured on this thread (captures do not nest)")
    rt = get_runtime(device)
    inputs = tuple(inputs)
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor):
            raise GraphCaptureError(f"capture: inputs[{i}] is a {type(t).__name__}, not a Tensor; create the step's "
                                    "inputs as tensors before the capture")
        if t._st.rt is not rt:
            raise GraphCaptureError(f"capture: inputs[{i}] is on {t.device}, the capture records {rt.name}")
        if t._host is not None:
            # One mutable [version, values] the views made inside the capture share (a view copies
            # the reference): a refill updates it in place, so a replay hook reading a view's host
            # copy (cross entropy's target count, the embedding's index grouping) sees the new
            # batch without reading it back, which would wait for the previous replay.
            t._host = [t._host[0], t._host[1]]
    g = Graph(rt, inputs)
    g._begin()
    _state.graph = g
    ok = False
    try:
        yield g
        rt.emit_pending()  # the step's last elementwise ops are part of it (helios.elementwise_jit)
        ok = True
    finally:
        _state.graph = None
        g._end(failed=not ok)
