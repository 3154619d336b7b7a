"""Run-time fusion of elementwise chains: the rules, the queue, and the kernels it generates.

``y = ((x * 2.0 + 1.0).relu() - z).exp()`` is five elementwise ops; unfused, each is one
dispatch that writes a temporary the next one reads back.  Here they become one generated
kernel that reads ``x`` and ``z`` once and writes ``y`` once.

How (the rules):

* *Deferred recording.*  helios._kernels hands a contiguous elementwise op on floats (unary
  with its scalars; binary of two same-shape operands, or of one and a single element seen
  everywhere, a 0-d tensor: the ops of the op table, kernels_spirv/ew_ops.py) to the
  runtime's :class:`Queue` as a descriptor instead of dispatching it: its op, its bindings
  and offsets, its length, its dtype, its scalars, and the dispatch it would have made.
  Anything else is dispatched at once, as before.
* *Emitted before anything that could see it.*  The runtime emits the queue before every
  other command (dispatch, copy, fill, a replayed graph), every host access (read, write,
  map, ready), flush, synchronize, stats, pool_stats, a profiling session's start or end,
  and a graph capture's start and end (helios.graph); and when it holds :data:`MAX_QUEUE`
  ops, or when the op being queued reads none of the queued results: the queue holds one
  chain, and an op that fuses with nothing is recorded as soon as the next op shows it.
* *What fuses.*  At emission the queue is cut into groups in order: an op joins the group
  before it when one of its operands is an output of that group (a chain), it has the
  group's length and dtype, and the group stays within :data:`MAX_OPS` ops,
  :data:`MAX_BINDINGS` buffers and :data:`MAX_PUSH_WORDS` push-constant words; an op that
  touches a group's output any other way (another range of it) starts a new group.  A group
  of one op is dispatched exactly as it would have been (same kernel, same push constants);
  a longer one runs as one ``ew_fused`` kernel.
* *What is stored.*  Every op's result is computed in a register.  A group's intermediate
  is stored only while its tensor lives (the user kept it) or a later group reads it: one
  whose storage was freed (the Python temporary died) by the time the queue is emitted is
  never written.  A freed buffer that a queued op names is not handed back to the allocator
  before the queue is emitted (:meth:`Queue.defer_free`), so its range is never reused under
  a queued op.
* *Bit for bit.*  The fused kernel runs the op table's expressions, in the chain's order,
  on the same float32 values: an intermediate is rounded to its storage dtype between two
  ops (nothing for float32; float16 / bfloat16 as the store would round it), each scalar
  arrives as the same float32 push constant, and each result passes an opaque no-op (an
  xor with a push constant that is 0) before the next op reads it, so the shader compiler
  cannot merge one op's arithmetic into the next's: lavapipe did contract ``x * y`` ending
  one op with the ``+ alpha * y`` of the next into an fma, which the separate kernels never
  do.  Within one op the compiler sees the expression it sees in the unfused kernel.  So a
  fused chain equals the unfused ops bit for bit (tests/test_elementwise_jit.py checks random
  chains and every table op on the device at hand).
* *Compiled once.*  A group's kernel is generated from its signature (the ops, where each
  operand comes from, which results are stored, the dtype); the source (with the text of
  the GLSL it includes) is hashed, and its SPIR-V is compiled by glslc (kernels_spirv/build.py's
  compiler and flags) into ``<helios cache>/spv/ew_fused/<hash>.spv`` once per machine, and
  made a pipeline once per process and signature.  Adding a fusible elementwise op is one
  entry in the op table: nothing here names an op.
* *Captured steps.*  Captured commands hold the fused dispatches (the capture's start emits
  what came before it, its end what came inside it), so a replay runs them too.  The graph
  holds every buffer made inside the capture (helios.graph), so those are never freed and
  the fused kernels store such intermediates: fewer dispatches, the same values.

The switch is helios.fused_kernels's: ``HELIOS_FUSION=0`` (``fused_kernels.ENABLED``, read when an op is
recorded) queues nothing.  ``ENABLED`` here turns this fusion alone off in-process (a test of
another fused kernel that counts elementwise dispatches pins it).  The dispatch is named
``ew_fused`` in the trace and the profiler (linked to the host op that recorded the chain's
last op; each unfused op to its own); at ``HELIOS_DEBUG=1`` the ops inside are listed,
``ew_fused[mul_s > add_s > relu > sub > exp]``.  The CUDA device has no queue (its ops
dispatch at once).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
import warnings

from helios import op_trace
from helios.kernels_spirv import ew_ops, registry

ENABLED = True  # this fusion alone (fused_kernels.ENABLED, HELIOS_FUSION, turns every fusion off)
MAX_QUEUE = 16  # ops held before the queue is emitted
MAX_OPS = 8  # ops in one fused kernel
MAX_BINDINGS = 8  # buffers one fused kernel binds (inputs and stored results)
MAX_PUSH_WORDS = 32  # 128 bytes of push constants: what every Vulkan device offers

_OPS = {(op.kind, op.name): op for op in ew_ops.OPS if op.glsl and op.kind in ("unary", "binary")}
# The scalars each op's float expression reads (only those travel as push constants).
_SCALARS = {key: tuple(s for s in (("p0", "p1") if key[0] == "unary" else ("alpha",))
                       if re.search(rf"\b{s}\b", op.glsl))
            for key, op in _OPS.items()}
_T = {"f32": 1, "f16": 2, "bf16": 3}  # storage tags (common.glsl) of the fusible dtypes
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def fusible(kind: str, name: str, tag: str) -> bool:
    """Whether op ``name`` of ``kind`` on storage ``tag`` may be queued (it has a float expression)."""
    return (kind, name) in _OPS and tag in _T


class EwOp:
    """One queued elementwise op: what the fusion needs, and the dispatch it stands for."""

    __slots__ = ("kind", "name", "tag", "n", "ins", "out", "scalars", "args", "operand", "ids", "bcast")

    def __init__(self, kind, name, tag, n, ins, out, scalars, args, operand, ids, bcast=None):
        self.kind, self.name, self.tag, self.n = kind, name, tag, n
        self.ins = ins  # per operand: (binding tuple, element offset in it)
        self.out = out  # (binding tuple, element offset in it)
        self.scalars = scalars  # (p0, p1) for unary, (alpha,) for binary
        self.args = args  # rt.dispatch's arguments, for the unfused path
        self.operand = operand  # the HELIOS_DEBUG operand text when it was recorded
        self.ids = ids  # the profiler's dispatch-id list of the host op that recorded it (or None)
        self.bcast = bcast  # None, or per operand whether it is one element seen everywhere


_TRACE = op_trace.current()  # the op being recorded (a queued op records under its own)


_CORE: list = []  # [helios._kernels.core] once imported


def _kernels_core():
    """helios._kernels.core (imported on first use: it imports helios.runtime, which imports this module)."""
    if not _CORE:
        from helios._kernels import core

        _CORE.append(core)
    return _CORE[0]




class Queue:
    """A runtime's queue of elementwise ops not yet recorded (see the module docstring)."""

    def __init__(self, rt):
        self.rt = rt
        self.ops: list[EwOp] = []
        self.names: set = set()  # handles the queued ops name
        self.outs: set = set()  # handles the queued ops write
        self.dead: list = []  # handles freed while queued ops named them
        self.lock = threading.RLock()  # several threads may record; a free in a GC pass may re-enter
        self.thread = None  # the thread that queued the ops held now (see settle)
        self._kernels: dict[tuple, tuple] = {}  # (signature, vec) -> (pipeline id, push struct) or False
        self._cuts: dict[tuple, list] = {}  # _shape(queue) -> _cut(queue)
        self.fused = 0  # fused dispatches made (each stands for 2+ ops)
        self.fused_ops = 0  # ops they stood for

    def add(self, op: EwOp) -> None:
        """Queue ``op``; first emit the queue when it is full or when ``op`` reads none of the
        queued results (so the queue holds one chain, and an op that fuses with nothing is
        recorded as soon as the next op shows it)."""
        with self.lock:
            ops = self.ops
            if ops and (len(ops) >= MAX_QUEUE or not any(b[0] in self.outs for b, _ in op.ins)):
                self._emit()
            if not self.ops:
                self.thread = threading.get_ident()
            self.ops.append(op)
            names = self.names
            for b, _ in op.ins:
                names.add(b[0])
            h = op.out[0][0]
            names.add(h)
            self.outs.add(h)

    def defer_free(self, handle) -> bool:
        """True (and the free is held until emission) when a queued op names ``handle``."""
        # Unlocked first (the common answer, no): only a queued op adds ``handle`` to names,
        # and it holds the tensor, so a handle being freed cannot be added meanwhile.
        if handle not in self.names:
            return False
        with self.lock:
            if handle in self.names:
                self.dead.append(handle)
                return True
            return False

    def settle(self) -> None:
        """Before a host access (read, write, ready, map): the thread that queued the ops records
        them, so it sees their writes.  Another thread (the comm engine polling a tensor that a
        collective was issued on: the issuing thread recorded its producers then) never records
        them, which could put them after work the queuing thread records meanwhile; it waits for
        an emission in progress instead (between taking the ops and recording them, the queue
        looks empty)."""
        with self.lock:
            if self.ops and self.thread == threading.get_ident():
                self._emit()

    def emit(self) -> None:
        """Record every queued op, fused where the rules allow, then free what died meanwhile."""
        with self.lock:
            self._emit()

    def _emit(self) -> None:
        # ``names`` stays filled until every dispatch is recorded: a buffer freed meanwhile (a
        # garbage-collection pass) is held back like any named one, then freed below.
        ops = self.ops
        if not ops:
            return
        self.ops = []  # the dispatches below must not emit again
        trace = _TRACE
        # the op being recorded now keeps its own operands and dispatch ids
        operand, ids = trace.operands, trace.dispatch_ids
        try:
            if len(ops) == 1 and not self.dead and not self.rt.debug:  # the common case: it fused with nothing
                trace.dispatch_ids = ops[0].ids  # the trace links the kernel to the op that made it
                self.rt.dispatch(*ops[0].args)
            elif len(ops) == 1:
                self._unfused(ops[0])
            else:
                self._emit_groups(ops, set(self.dead))
        finally:
            trace.operands = operand
            trace.dispatch_ids = ids
            self.names.clear()
            self.outs.clear()
            dead, self.dead = self.dead, []
            if dead:
                free = self.rt.free  # a graph being captured holds what its commands name (helios.graph)
                for h in dead:
                    free(h)

    def _emit_groups(self, ops: list, dead: set) -> None:
        # a training loop queues the same shapes of chain again and again: their cut is cached
        shape = _shape(ops, dead)
        cut = self._cuts.get(shape)
        if cut is None:
            if len(self._cuts) >= 1024:
                self._cuts.clear()
            cut = self._cuts[shape] = _cut(ops, dead)
        for start, length, tmpl in cut:
            if tmpl is None:
                self._unfused(ops[start])
            else:
                self._fused(ops[start:start + length], tmpl)

    def _unfused(self, op: EwOp) -> None:
        if self.rt.debug:  # the HELIOS_DEBUG line shows the operands of the op that made it
            _TRACE.operands = op.operand
        _TRACE.dispatch_ids = op.ids  # the trace links the kernel to the op that made it
        self.rt.dispatch(*op.args)

    def _fused(self, group: list, tmpl: _Template) -> None:
        rt = self.rt
        bindings, offs, scalars = tmpl.fill(group)
        n, tag = group[0].n, group[0].tag
        vec = _kernels_core().vec_width(tag, n, *(offs[i] for i in tmpl.aligned))
        entry = tmpl.pipelines.get(vec)
        if entry is None:
            entry = self._kernels.get((tmpl.sig, vec))
        if entry is None:
            try:
                entry = _pipeline(rt, tmpl.sig, vec)
            except Exception as e:  # noqa: BLE001 - no glslc, a driver refusing it: the ops run unfused
                warnings.warn(f"helios.elementwise_jit: cannot build the fused kernel for "
                              f"{' > '.join(op.name for op in group)} ({type(e).__name__}: {e}); "
                              "its ops run one by one", RuntimeWarning, stacklevel=2)
                entry = False
            self._kernels[(tmpl.sig, vec)] = entry
        tmpl.pipelines[vec] = entry
        if entry is False:
            for op in group:
                self._unfused(op)
            return
        pid, push = entry
        name = "ew_fused"
        if rt.debug:
            name = f"ew_fused[{' > '.join(op.name for op in group)}]"
            _TRACE.operands = group[-1].operand
        _TRACE.dispatch_ids = group[-1].ids
        flops = sum(op.args[5] for op in group)
        nbytes = n * _ITEMSIZE[tag] * len(bindings)
        rt.dispatch(pid, bindings, push.pack(n, 0, *offs, *scalars), _kernels_core().grid(n // vec), name, flops, nbytes)
        self.fused += 1
        self.fused_ops += len(group)


def _cut(ops: list, dead: set) -> list:
    """The queued ops cut into groups, in order, by the rules of the module docstring: a list of
    (first op, number of ops, template), the template None for a group of one op, else what
    :func:`_finish` makes.

    While a group grows, each result whose tensor lives counts as a stored binding; a group
    whose results a later group reads may need more, and is halved then (:func:`_close`)."""
    keys = []  # per op: ([(handle, first element) of each operand], that of its result)
    last_read: dict = {}  # (handle, first element) -> index of the last op reading it
    for j, op in enumerate(ops):
        isz = _ITEMSIZE[op.tag]
        srcs = [(b[0], b[1] // isz + o) for b, o in op.ins]
        for w in srcs:
            last_read[w] = j
        if op.bcast is not None:  # one element seen everywhere: never a register of the group
            srcs = [w + ("one",) if bc else w for w, bc in zip(srcs, op.bcast)]
        ob, oo = op.out
        keys.append((srcs, (ob[0], ob[1] // isz + oo)))
    out = []
    cur: list = []
    start = 0
    made: dict = {}  # (handle, first element) -> index in the group, of the group's results
    made_handles: set = set()
    bound: set = set()  # (handle, start, size) of the group's outside inputs
    nbind = nwords = 0
    for j, op in enumerate(ops):
        srcs, w_out = keys[j]
        link = (cur and op.n == cur[0].n and op.tag == cur[0].tag and any(w in made for w in srcs)
                and all(w in made or w[0] not in made_handles for w in srcs))  # not another range of a result
        stored = w_out[0] not in dead
        words = len(srcs) + stored + len(_SCALARS[(op.kind, op.name)])
        new = {(b[0], b[1], b[2]) for (b, _), w in zip(op.ins, srcs) if w not in made}
        if link:
            new -= bound
            link = (len(cur) < MAX_OPS and nbind + len(new) + stored <= MAX_BINDINGS
                    and nwords + words <= MAX_PUSH_WORDS)
        if not link:
            if cur:
                _close(out, cur, keys, start, dead, last_read)
            cur, start, made, made_handles, bound = [], j, {}, set(), set()
            nbind, nwords = 1, 3  # the last result's binding; n, zero and its offset
        cur.append(op)
        bound |= new
        nbind += len(new) + stored
        nwords += words
        made[w_out] = len(cur) - 1
        made_handles.add(w_out[0])
    _close(out, cur, keys, start, dead, last_read)
    return out


def _close(out: list, group: list, keys: list, start: int, dead: set, last_read: dict) -> None:
    """Append (start, length, template) to ``out``; halves of the group where its template
    exceeds a limit after all (results that a later group reads are stored too)."""
    tmpl = _finish(group, keys[start:start + len(group)], dead, last_read, start)
    if tmpl is False:
        h = len(group) // 2
        _close(out, group[:h], keys, start, dead, last_read)
        _close(out, group[h:], keys, start + h, dead, last_read)
    else:
        out.append((start, len(group), tmpl))


class _Template:
    """How to make a group's fused dispatch from its ops: the kernel's signature, and where each
    binding, offset and scalar comes from, as positions in the group (cached per queue shape)."""

    __slots__ = ("sig", "ins", "loads", "outs", "scalars", "aligned", "pipelines")

    def __init__(self, sig, ins, loads, outs, scalars, aligned):
        self.sig = sig
        self.aligned = aligned  # the offsets the vec4 path needs to be multiples of 4
        self.ins = ins  # per input binding: (op, operand) whose binding it is
        self.loads = loads  # per load: (op, operand) whose element offset it is
        self.outs = outs  # per stored result: the op
        self.scalars = scalars  # per scalar: (op, index in its scalars)
        self.pipelines: dict = {}  # vec -> (pipeline id, push struct) or False, on the runtime

    def fill(self, group: list) -> tuple:
        """(bindings, offsets, scalars) of the dispatch for ``group``."""
        outs = [group[j].out for j in self.outs]
        bindings = [group[j].ins[m][0] for j, m in self.ins] + [b for b, _ in outs]
        offs = [group[j].ins[m][1] for j, m in self.loads] + [o for _, o in outs]
        return bindings, offs, [group[j].scalars[i] for j, i in self.scalars]


def _finish(group: list, keys: list, dead: set, last_read: dict, start: int) -> _Template | None | bool:
    """The :class:`_Template` of a group's fused dispatch (None for one op; False where it
    would exceed MAX_BINDINGS or MAX_PUSH_WORDS).

    The signature names the kernel: the dtype tag, the number of input bindings, per load its
    input binding and whether it is one element seen everywhere, the number of stored
    results, and per op (kind, name, operand sources, stored slot or -1, scalar slots); a
    source is ("v", j) for op j's result in a register, or ("b", k) for load k."""
    if len(group) == 1:
        return None
    end = start + len(group) - 1
    made: dict = {}
    in_slots: dict = {}  # (handle, start, size) -> input binding index
    ins: list = []
    loads: dict = {}  # (binding index, element offset) -> load index
    load_binding: list = []
    load_at: list = []
    steps = []
    outs: list = []  # ops whose result is stored, in order
    scalars: list = []
    for j, (op, (srcs, w_out)) in enumerate(zip(group, keys)):
        src = []
        for m, ((b, o), w) in enumerate(zip(op.ins, srcs)):
            if w in made:
                src.append(("v", made[w]))
                continue
            key = (b[0], b[1], b[2])
            k = in_slots.get(key)
            if k is None:
                k = in_slots[key] = len(ins)
                ins.append((j, m))
            one = len(w) == 3  # one element seen everywhere
            li = loads.get((k, o, one))
            if li is None:
                li = loads[(k, o, one)] = len(load_binding)
                load_binding.append((k, one))
                load_at.append((j, m))
            src.append(("b", li))
        made[w_out] = j
        store = -1
        if j == len(group) - 1 or w_out[0] not in dead or last_read.get(w_out, -1) > end:
            store = len(outs)
            outs.append(j)
        names = _SCALARS[(op.kind, op.name)]
        idx = tuple(range(len(scalars), len(scalars) + len(names)))
        for sname in names:
            scalars.append((j, 1 if sname == "p1" else 0))
        steps.append((op.kind, op.name, tuple(src), store, idx))
    if len(ins) + len(outs) > MAX_BINDINGS or 2 + len(load_at) + len(outs) + len(scalars) > MAX_PUSH_WORDS:
        return False
    sig = (group[0].tag, len(ins), tuple(load_binding), len(outs), tuple(steps))
    # push: n, zero, then the element offset of every load, then of every store, then the scalars
    # offsets that must be multiples of 4 for the vec4 path: all but one-element loads
    aligned = tuple(i for i, (_, one) in enumerate(load_binding) if not one) + tuple(
        range(len(load_at), len(load_at) + len(outs)))
    return _Template(sig, ins, load_at, outs, scalars, aligned)


def _shape(ops: list, dead: set) -> tuple:
    """What the cut of ``ops`` into groups depends on, without the buffers: per op its kind,
    name, length, dtype, whether its tensor died, and per operand the queued op whose result
    it is, or else (input binding, load) numbers in order of first use (with a flag where it
    is another range of a queued result's buffer)."""
    made: dict = {}  # (handle, first element) -> op index
    outs: set = set()
    bindings: dict = {}
    loads: dict = {}
    parts = []
    for j, op in enumerate(ops):
        isz = _ITEMSIZE[op.tag]
        src = []
        for m, (b, o) in enumerate(op.ins):
            bc = op.bcast is not None and op.bcast[m]
            w = (b[0], b[1] // isz + o)
            p = None if bc else made.get(w)
            if p is None:
                k = bindings.setdefault((b[0], b[1], b[2]), len(bindings))
                p = (k, loads.setdefault((k, o, bc), len(loads)), b[0] in outs, bc)
            src.append(p)
        ob, oo = op.out
        made[(ob[0], ob[1] // isz + oo)] = j
        outs.add(ob[0])
        parts.append((op.kind, op.name, op.n, op.tag, ob[0] in dead, tuple(src)))
    return tuple(parts)


def source(sig: tuple) -> str:
    """The GLSL of the fused kernel with signature ``sig`` (see :func:`_finish`)."""
    tag, nin, load_binding, nout, steps = sig
    nloads = len(load_binding)
    nscal = sum(len(s[4]) for s in steps)
    T = _T[tag]
    L = ["#version 450",
         "// Generated by helios.elementwise_jit: " + " > ".join(s[1] for s in steps),
         f"#define TA {T}",
         f"#define TO {T}",
         '#include "common.glsl"',
         "#define EW_FLOAT_HELPERS",
         '#include "ew_ops.gen.glsl"',
         f"layout(local_size_x = {_kernels_core().WG}) in;"]
    for k in range(nin):
        L.append(f"layout(std430, binding = {k}) readonly buffer B{k} {{ HL_ST(TA) b{k}[]; }};")
    for m in range(nout):
        L.append(f"layout(std430, binding = {nin + m}) writeonly buffer O{m} {{ HL_ST(TO) o{m}[]; }};")
    members = (["uint n;", "uint zero;"] + [f"uint off{i};" for i in range(nloads + nout)]
               + [f"float s{i};" for i in range(nscal)])
    L.append("layout(push_constant) uniform P { " + " ".join(members) + " } p;")
    # the chain on one element: loads in, stored results out
    params = [f"float l{li}" for li in range(nloads)] + [f"out float w{m}" for m in range(nout)]
    L.append(f"void chain({', '.join(params)}) {{")
    for j, (kind, name, srcs, store, idx) in enumerate(steps):
        op = _OPS[(kind, name)]
        args = [f"v{s}" if w == "v" else f"l{s}" for w, s in srcs]
        decl = [f"float x = {args[0]};"]
        if kind == "binary":
            decl.append(f"float y = {args[1]};")
        for sname, si in zip(_SCALARS[(kind, name)], idx):
            decl.append(f"float {sname} = p.s{si};")
        # the result as its storage holds it: rounded to the dtype between ops, then passed
        # through an xor with the push constant ``zero`` (always 0): the compiler cannot see
        # through it, so it cannot merge this op's arithmetic with the next op's (lavapipe's
        # NIR contracted a mul ending one op with the add of the next into an fma)
        val = "r" if T == 1 else "HL_LDF(TO, HL_STF(TO, r))"
        val = f"uintBitsToFloat(floatBitsToUint({val}) ^ p.zero)"
        L.append(f"    float v{j};")
        L.append(f"    {{ {' '.join(decl)} float r = {op.glsl}; v{j} = {val}; }}  // {name}")
        if store >= 0:
            L.append(f"    w{store} = v{j};")
    L.append("}")
    L += ["layout(constant_id = 0) const int VEC = 1;",
          "void main() {"]
    if T == 1:
        # VEC 4 (float32, every offset and n a multiple of 4): 4 elements an invocation through
        # vec4 views of the buffers, the chain per component (as ew_unary/ew_binary's vec4 path)
        for k in range(nin):
            L.insert(-2, f"layout(std430, binding = {k}) readonly buffer B{k}v {{ vec4 b{k}v[]; }};")
        for m in range(nout):
            L.insert(-2, f"layout(std430, binding = {nin + m}) writeonly buffer O{m}v {{ vec4 o{m}v[]; }};")
        L += ["    if (VEC == 4) {",
              "        uint j = flat_invocation() * 4u;",
              "        if (j >= p.n) return;"]
        for li, (k, one) in enumerate(load_binding):
            if one:
                L.append(f"        vec4 L{li} = vec4(b{k}[p.off{li}]);")
            else:
                L.append(f"        vec4 L{li} = b{k}v[(p.off{li} + j) >> 2];")
        L += [f"        vec4 W{m};" for m in range(nout)]
        for c in "xyzw":
            L.append(f"        chain({', '.join([f'L{li}.{c}' for li in range(nloads)] + [f'W{m}.{c}' for m in range(nout)])});")
        for m in range(nout):
            L.append(f"        o{m}v[(p.off{nloads + m} + j) >> 2] = W{m};")
        L += ["        return;", "    }"]
    if T == 3:
        decls, body = _vec8(nin, nout, load_binding)
        at = L.index("layout(constant_id = 0) const int VEC = 1;")
        L[at:at] = decls
        L += body
    L += ["    uint i = flat_invocation();",
          "    if (i >= p.n) return;"]
    L += [f"    float w{m};" for m in range(nout)]
    loads = [f"HL_LDF(TA, b{k}[p.off{li}{'' if one else ' + i'}])" for li, (k, one) in enumerate(load_binding)]
    L.append(f"    chain({', '.join(loads + [f'w{m}' for m in range(nout)])});")
    for m in range(nout):
        L.append(f"    o{m}[p.off{nloads + m} + i] = HL_STF(TO, w{m});")
    L.append("}")
    return "\n".join(L) + "\n"


def _vec8(nin: int, nout: int, load_binding) -> tuple[list[str], list[str]]:
    """(declarations, main's branch) of a bfloat16 chain's VEC 8 path (every offset and n a multiple
    of 8): 8 elements an invocation through uvec4 views of the buffers (common.glsl's bf16_lo /
    bf16_hi / bf16_pair), the chain per element as on the one-element path."""
    decls = [f"layout(std430, binding = {k}) readonly buffer B{k}w {{ uvec4 b{k}w[]; }};" for k in range(nin)]
    decls += [f"layout(std430, binding = {nin + m}) writeonly buffer O{m}w {{ uvec4 o{m}w[]; }};" for m in range(nout)]
    nloads = len(load_binding)
    body = ["    if (VEC == 8) {",
            "        uint j = flat_invocation() * 8u;",
            "        if (j >= p.n) return;"]
    for li, (k, one) in enumerate(load_binding):
        body.append(f"        float S{li} = HL_LDF(TA, b{k}[p.off{li}]);" if one else
                    f"        uvec4 L{li} = b{k}w[(p.off{li} + j) >> 3];")
    body += [f"        uvec4 W{m};" for m in range(nout)]
    body.append("        for (int k = 0; k < 4; ++k) {")
    body += [f"            float lo{m}, hi{m};" for m in range(nout)]
    for half in ("lo", "hi"):
        args = [f"S{li}" if one else f"bf16_{half}(L{li}[k])" for li, (_, one) in enumerate(load_binding)]
        body.append(f"            chain({', '.join(args + [f'{half}{m}' for m in range(nout)])});")
    body += [f"            W{m}[k] = bf16_pair(lo{m}, hi{m});" for m in range(nout)]
    body.append("        }")
    body += [f"        o{m}w[(p.off{nloads + m} + j) >> 3] = W{m};" for m in range(nout)]
    body += ["        return;", "    }"]
    return decls, body


def _pipeline(rt, sig: tuple, vec: int) -> tuple:
    """(pipeline id, push struct) of the fused kernel ``sig`` on ``rt`` with ``vec`` (1, 4 or 8:
    :func:`helios._kernels.core.vec_width`) elements an invocation: SPIR-V from the disk cache, compiled by glslc on a miss."""
    code = spirv(source(sig))
    tag, nin, load_binding, nout, steps = sig
    nscal = sum(len(s[4]) for s in steps)
    push = struct.Struct(f"<{2 + len(load_binding) + nout}I{nscal}f")
    pid = rt.dev.pipeline(code, nin + nout, push.size, [vec], "ew_fused")
    rt._kernel_of_pipeline[pid] = None  # a generated kernel: no registry source for HELIOS_DEBUG=2
    return pid, push


_includes: list = []  # the text of the GLSL files a fused kernel includes (part of its hash)


def cache_path(src: str) -> str:
    """Where the SPIR-V of fused kernel source ``src`` is cached (named by a hash of the
    source and of the GLSL it includes)."""
    if not _includes:
        builder = registry.load_builder()
        builder.generate_sources()
        for f in ("common.glsl", ew_ops.GEN_NAME):
            with open(os.path.join(builder.GLSL_DIR, f)) as fh:
                _includes.append(fh.read())
    h = hashlib.sha256("\0".join([src, *_includes]).encode()).hexdigest()[:32]
    return os.path.join(registry.cache_dir(), "spv", "ew_fused", h + ".spv")


def spirv(src: str) -> bytes:
    """SPIR-V of fused kernel source ``src``: from the disk cache, else compiled by glslc and cached."""
    path = cache_path(src)
    if not os.path.exists(path):
        import subprocess

        builder = registry.load_builder()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp + ".comp", "w") as f:
            f.write(src)
        cmd = [builder.find_glslc(), builder.TARGET_ENV, "-O", "-I", builder.GLSL_DIR, tmp + ".comp", "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        os.unlink(tmp + ".comp")
        if res.returncode != 0:
            raise RuntimeError(f"glslc failed for a fused elementwise kernel:\n{' '.join(cmd)}\n{res.stderr}\n{src}")
        os.replace(tmp, path)
    with open(path, "rb") as f:
        return f.read()
