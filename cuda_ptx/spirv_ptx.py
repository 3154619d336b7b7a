"""Translate a Helios SPIR-V compute kernel to PTX: the CUDA backend's kernels are the Vulkan ones.

One GLSL source per kernel, two backends: the Vulkan runtime hands the SPIR-V to the
driver, the CUDA runtime hands it to :func:`translate` and loads the PTX it returns.  The
translation is direct, since glslc's output is already low level:

* every SSA value becomes PTX registers (vectors and structs flattened to scalars); values
  the specialization constants decide are folded (:mod:`spirv_fold`), so a branch or an
  ``OpSwitch`` on a constant becomes one jump and the blocks it skips are never emitted;
* storage buffers become ``.u64`` parameters (one per descriptor binding: aliased
  bindings share it), push constants ``.u32`` parameters, one per 32-bit word (an array of them
  indexed by a register is read by selects among its words: no copy in local memory), shared
  memory one dynamic ``smem`` block, and function-scope arrays per-thread ``.local``
  memory (unless spirv-opt unrolled the [[unroll]] loops that index them: :func:`translate`);
* ``OpPhi`` becomes moves on the incoming edges (through temporaries when a phi reads
  another phi of the same block), blocks keep the module's structured order (what the
  emulator's lowest-pc reconvergence relies on);
* workgroup = CTA, ``gl_WorkGroupSize`` = ``.maxntid``, invocation ids from
  ``%tid``/``%ctaid``/``%ntid``; ``barrier()`` = ``bar.sync 0``.

Arithmetic keeps the Vulkan kernels' precision: IEEE add/mul/div/sqrt (``.rn``), ``fma.rn``,
and the hardware's ``ex2``/``lg2``/``sin``/``cos``/``rsqrt`` approximations, which are
what NVIDIA's Vulkan driver uses for the same GLSL built-ins.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass
from functools import lru_cache

from .spirv import (BUILTINS, DEC_ARRAY_STRIDE, DEC_BINDING, DEC_BUILTIN, SC_INPUT, SC_PRIVATE,
                    SC_PUSH, SC_STORAGE, SC_UNIFORM, SC_WORKGROUP, Module, SpirvError, Type, null_value,
                    read_module)
from .spirv_fold import fold
from helios.kernels_spirv.specialize import unrolled


@dataclass(frozen=True)
class Translated:
    """A translated kernel: its PTX and how to launch it."""

    ptx: str                      # PTX text with one .visible .entry
    entry: str                    # its name
    block: tuple                  # threads per workgroup (x, y, z)
    bindings: tuple               # descriptor binding numbers, one .u64 parameter each, in this order
    push_words: int               # then this many .u32 parameters: push constants as little-endian words
    shared_bytes: int             # dynamic shared memory the launch must give (0: none)


def translate(spirv: bytes, spec: tuple = (), name: str = "kernel", target: str = "sm_90") -> Translated:
    """PTX for the compute kernel ``spirv`` with specialization constant ``i`` = ``spec[i]``.

    A kernel with [[unroll]] loops is first given to spirv-opt, where it is installed, to unroll
    them and split the arrays they index into values (``specialize.unrolled``): this
    translation keeps loops and function-scope arrays as they are (per-thread ``.local``
    memory).  matmul's fp32 kernel at the nano model's shapes: 14,394 -> 3,217 steps of the
    emulator a launch, and no ``.local`` memory; the same results, bit for bit."""
    code, spec = bytes(spirv), tuple(int(s) for s in spec)
    flat = unrolled(code, spec)
    if flat is not None:
        code, spec = flat, ()
    m = read_module(code, spec)
    return _Translator(m, re.sub(r"\W", "_", name), target).run()


@lru_cache(maxsize=1)
def _translator_fingerprint() -> str:
    """A hash of the translator's own source: a cached translation is stale once it changes."""
    from helios.kernels_spirv import specialize

    from . import spirv, spirv_fold

    h = hashlib.sha256()
    for mod_file in (spirv.__file__, spirv_fold.__file__, specialize.__file__, __file__):
        with open(mod_file, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def translate_cached(spirv: bytes, spec: tuple = (), name: str = "kernel", target: str = "sm_90") -> Translated:
    """:func:`translate`, kept on disk (``~/.cache/helios/ptx``) by the SPIR-V, the specialization,
    the name, the target and the translator's source: a process opening ``cuda:0`` translates
    each of its kernels once per machine instead of once per process (the op suite on the
    emulated device, 288 kernels: 26.7 -> 25.1 s)."""
    from .toolchain import atomic_write, cache_dir

    spec = tuple(int(s) for s in spec)
    h = hashlib.sha256(_translator_fingerprint().encode())
    h.update(bytes(spirv))
    h.update(json.dumps([spec, name, target]).encode())
    path = cache_dir() / "ptx" / f"{h.hexdigest()}.json"
    try:
        with open(path) as f:
            d = json.load(f)
        return Translated(d["ptx"], d["entry"], tuple(d["block"]), tuple(d["bindings"]), d["push_words"],
                          d["shared_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet (or unreadable): translate and cache
    t = translate(spirv, spec, name, target)
    try:
        atomic_write(path, json.dumps(asdict(t)).encode())
    except OSError:
        pass  # a read-only cache folder only costs the next process the translation
    return t


# register classes: prefix and declared type
_CLASSES = {"pred": ("p", ".pred"), "b16": ("h", ".b16"), "b32": ("r", ".b32"), "f32": ("f", ".f32"),
            "b64": ("rd", ".b64"), "f64": ("fd", ".f64")}
_F_CMP = {"FOrdEqual": "eq", "FOrdNotEqual": "ne", "FOrdLessThan": "lt", "FOrdGreaterThan": "gt",
          "FOrdLessThanEqual": "le", "FOrdGreaterThanEqual": "ge", "FUnordEqual": "equ", "FUnordNotEqual": "neu",
          "FUnordLessThan": "ltu", "FUnordGreaterThan": "gtu", "FUnordLessThanEqual": "leu",
          "FUnordGreaterThanEqual": "geu"}
_I_CMP = {"IEqual": ("eq", "u"), "INotEqual": ("ne", "u"), "UGreaterThan": ("gt", "u"),
          "UGreaterThanEqual": ("ge", "u"), "ULessThan": ("lt", "u"), "ULessThanEqual": ("le", "u"),
          "SGreaterThan": ("gt", "s"), "SGreaterThanEqual": ("ge", "s"), "SLessThan": ("lt", "s"),
          "SLessThanEqual": ("le", "s")}
_NOT_FOLDED = {"Phi", "Load", "AccessChain", "InBoundsAccessChain", "ExtInst", "Undef", "Variable"}
_F_BIN = {"FAdd": "add.rn", "FSub": "sub.rn", "FMul": "mul.rn", "FDiv": "div.rn"}
_I_BIN = {"IAdd": ("add", "u"), "ISub": ("sub", "u"), "IMul": ("mul.lo", "u"), "UDiv": ("div", "u"),
          "SDiv": ("div", "s"), "UMod": ("rem", "u"), "SRem": ("rem", "s"), "BitwiseAnd": ("and", "b"),
          "BitwiseOr": ("or", "b"), "BitwiseXor": ("xor", "b")}
_LOGIC = {"LogicalAnd": "and", "LogicalOr": "or", "LogicalNotEqual": "xor"}
# GLSL.std.450 instruction numbers
_GLSL = {1: "Round", 2: "RoundEven", 3: "Trunc", 4: "FAbs", 5: "SAbs", 6: "FSign", 8: "Floor", 9: "Ceil",
         10: "Fract", 13: "Sin", 14: "Cos", 26: "Pow", 27: "Exp", 28: "Log", 29: "Exp2", 30: "Log2", 31: "Sqrt",
         32: "InverseSqrt", 37: "FMin", 38: "UMin", 39: "SMin", 40: "FMax", 41: "UMax", 42: "SMax", 43: "FClamp",
         44: "UClamp", 45: "SClamp", 46: "FMix", 48: "Step", 50: "Fma", 53: "Ldexp", 58: "PackHalf2x16",
         62: "UnpackHalf2x16", 74: "FindSMsb", 75: "FindUMsb", 79: "NMin", 80: "NMax"}
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453


def _reg_class(reg: str) -> str:
    """The register class of ``reg`` from its prefix (``%rd3`` -> ``b64``)."""
    pfx = re.match(r"%([a-z]+)", reg).group(1)
    return next(c for c, (p, _) in _CLASSES.items() if p == pfx)


def _mov(reg: str) -> str:
    """The mov instruction for a register of ``reg``'s class."""
    return "mov." + _CLASSES[_reg_class(reg)][1][1:]


def _f32_hex(x: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


@dataclass
class _Ptr:
    """A pointer value: state space, base address register (None: a push-constant offset), constant
    byte offset, pointee type id, for built-ins the built-in's name, and for a push constant
    indexed by a register that index (``dyn``: register, byte step, element count)."""

    space: str        # global | shared | local | param | builtin
    base: str | None
    offset: int
    tid: int
    builtin: str = ""
    dyn: tuple | None = None


class _Translator:
    def __init__(self, m: Module, name: str, target: str):
        self.m, self.name, self.target = m, name, target
        self.counts = {c: 0 for c in _CLASSES}
        self.prologue: list[str] = []
        self.body: list[str] = []
        self.vals: dict[int, list[str]] = {}     # SSA id -> flattened scalar registers
        self.vtype: dict[int, int] = {}          # SSA id -> type id
        self.ptrs: dict[int, _Ptr] = {}
        self.const_regs: dict[tuple, str] = {}
        self.bindings: list[int] = []
        self.shared_bytes = 0
        self.local_bytes = 0
        self.push_words = 0
        self.lmem_base: str | None = None
        self.n_stubs = 0
        self.smem_base: str | None = None

    # -- registers and constants ---------------------------------------------------------
    def reg(self, cls: str) -> str:
        pfx = _CLASSES[cls][0]
        self.counts[cls] += 1
        return f"%{pfx}{self.counts[cls]}"

    def emit(self, line: str) -> None:
        self.body.append("\t" + line)

    def scalar(self, tid: int) -> Type:
        t = self.m.types[tid]
        return self.m.types[t.elem] if t.kind == "vector" else t

    @staticmethod
    def cls(t: Type) -> str:
        if t.kind == "bool":
            return "pred"
        if t.kind == "int":
            return "b64" if t.width == 64 else "b32"
        if t.kind == "float":
            return {16: "b16", 32: "f32", 64: "f64"}[t.width]
        raise SpirvError(f"no register class for a {t.kind}")

    def const_reg(self, value, t: Type) -> str:
        """A register holding constant ``value`` of scalar type ``t``, set once in the prologue."""
        key = (t.kind, t.width, repr(value))
        r = self.const_regs.get(key)
        if r is not None:
            return r
        cls = self.cls(t)
        r = self.reg(cls)
        if cls == "pred":
            self.prologue.append(f"\tsetp.{'eq' if value else 'ne'}.u32 {r}, 0, 0;")
        elif cls == "f32":
            self.prologue.append(f"\tmov.f32 {r}, {_f32_hex(value)};")
        elif cls == "f64":
            self.prologue.append("\tmov.f64 %s, 0d%016X;" % (r, struct.unpack("<Q", struct.pack("<d", value))[0]))
        elif cls == "b16":
            import numpy as np
            bits = int(np.array(value, np.float16).view(np.uint16))
            self.prologue.append(f"\tmov.b16 {r}, {bits};")
        else:
            self.prologue.append(f"\tmov.{'u64' if cls == 'b64' else 'u32'} {r}, {int(value)};")
        self.const_regs[key] = r
        return r

    def flat_const(self, value, tid: int) -> list:
        t = self.m.types[tid]
        if t.kind in ("vector", "array"):
            return [x for v in value for x in self.flat_const(v, t.elem)]
        if t.kind == "struct":
            return [x for v, mt in zip(value, t.members) for x in self.flat_const(v, mt)]
        return [self.const_reg(value, t)]

    def regs(self, vid: int) -> list[str]:
        """The scalar registers of value ``vid`` (constants materialised)."""
        r = self.vals.get(vid)
        if r is not None:
            return r
        if vid in self.m.consts:
            r = self.flat_const(self.m.consts[vid], self.m.type_of_const(vid))
            self.vals[vid] = r
            return r
        raise SpirvError(f"%{vid} is used before it is defined")

    def type_of(self, vid: int) -> int:
        if vid in self.vtype:
            return self.vtype[vid]
        return self.m.type_of_const(vid)

    def define(self, vid: int, tid: int, regs: list[str]) -> None:
        self.vals[vid] = regs
        self.vtype[vid] = tid

    def fresh(self, tid: int) -> list[str]:
        """New registers for every scalar of a value of type ``tid``."""
        t = self.m.types[tid]
        if t.kind in ("vector", "array"):
            return [r for _ in range(t.count) for r in self.fresh(t.elem)]
        if t.kind == "struct":
            return [r for mt in t.members for r in self.fresh(mt)]
        return [self.reg(self.cls(t))]

    # -- memory layout ---------------------------------------------------------------------
    def size_align(self, tid: int) -> tuple[int, int]:
        """Bytes and alignment of type ``tid``: the module's explicit layout where it has one
        (storage buffers, push constants), std430-like natural layout elsewhere."""
        t = self.m.types[tid]
        if t.kind == "bool":
            return 4, 4
        if t.kind in ("int", "float"):
            return t.width // 8, t.width // 8
        if t.kind == "vector":
            s, _ = self.size_align(t.elem)
            n = 4 if t.count == 3 else t.count
            return s * t.count, s * n
        if t.kind == "array":
            return t.count * self.stride(tid), self.size_align(t.elem)[1]
        if t.kind == "struct":
            offs = self.m.member_offsets.get(tid)
            size, align = 0, 1
            for i, mt in enumerate(t.members):
                s, a = self.size_align(mt)
                off = offs[i] if offs and i in offs else -(-size // a) * a
                size, align = max(size, off + s), max(align, a)
            return -(-size // align) * align, align
        raise SpirvError(f"no layout for a {t.kind} type")

    def stride(self, tid: int) -> int:
        """Bytes between elements of array type ``tid``."""
        d = self.m.decorations.get(tid, {})
        if DEC_ARRAY_STRIDE in d:
            return d[DEC_ARRAY_STRIDE][0]
        s, a = self.size_align(self.m.types[tid].elem)
        return -(-s // a) * a

    def member_offset(self, tid: int, i: int) -> int:
        offs = self.m.member_offsets.get(tid)
        if offs and i in offs:
            return offs[i]
        off = 0
        for j, mt in enumerate(self.m.types[tid].members):
            s, a = self.size_align(mt)
            off = -(-off // a) * a
            if j == i:
                return off
            off += s
        raise SpirvError(f"struct %{tid} has no member {i}")

    # -- variables ---------------------------------------------------------------------------
    def setup_variables(self) -> None:
        m = self.m
        binding_regs: dict[int, str] = {}
        for vid, (ptid, sc) in sorted(m.variables.items()):
            pointee = m.types[ptid].elem
            dec = m.decorations.get(vid, {})
            if sc in (SC_STORAGE, SC_UNIFORM):
                b = dec[DEC_BINDING][0]
                if b not in binding_regs:
                    self.bindings.append(b)
                    r = self.reg("b64")
                    self.prologue.append(f"\tld.param.u64 {r}, [b{len(self.bindings) - 1}];")
                    binding_regs[b] = r
                self.ptrs[vid] = _Ptr("global", binding_regs[b], 0, pointee)
            elif sc == SC_WORKGROUP:
                s, a = self.size_align(pointee)
                off = -(-self.shared_bytes // max(a, 16)) * max(a, 16)
                self.shared_bytes = off + s
                self.ptrs[vid] = _Ptr("shared", self._smem(), off, pointee)
            elif sc == SC_PRIVATE:
                self.ptrs[vid] = _Ptr("local", self._lmem(), self._local_alloc(pointee), pointee)
            elif sc == SC_PUSH:
                size, _ = self.size_align(pointee)
                self.push_words = -(-size // 4)
                self.ptrs[vid] = _Ptr("param", None, 0, pointee)
            elif sc == SC_INPUT:
                if DEC_BUILTIN not in dec:
                    raise SpirvError(f"input variable %{vid} is not a built-in")
                name = BUILTINS.get(dec[DEC_BUILTIN][0])
                if name is None:
                    raise SpirvError(f"built-in {dec[DEC_BUILTIN][0]} is not handled")
                self.ptrs[vid] = _Ptr("builtin", None, 0, pointee, name)
            else:
                raise SpirvError(f"variable %{vid} in storage class {sc} is not handled")

    def setup_function_variables(self, used: set) -> None:
        """Per-thread storage for the function's variables that reachable code uses (a constant
        table behind a folded-away branch costs nothing)."""
        m = self.m
        for ins in m.function_vars:
            if ins.rid not in used:
                continue
            pointee = m.types[ins.rtype].elem
            p = _Ptr("local", self._lmem(), self._local_alloc(pointee), pointee)
            self.ptrs[ins.rid] = p
            if len(ins.ops) > 1:  # an initializer: store it at entry
                self.prologue_store(p, ins.ops[1])

    def prologue_store(self, p: _Ptr, vid: int) -> None:
        saved, self.body = self.body, []
        self.store(p, self.regs(vid))
        self.prologue.extend(self.body)
        self.body = saved

    def _smem(self) -> str:
        if self.smem_base is None:
            self.smem_base = self.reg("b32")
            self.prologue.append(f"\tmov.u32 {self.smem_base}, smem;")
        return self.smem_base

    def _lmem(self) -> str:
        if self.lmem_base is None:
            self.lmem_base = self.reg("b64")
            self.prologue.append(f"\tmov.u64 {self.lmem_base}, lmem;")
        return self.lmem_base

    def _local_alloc(self, tid: int) -> int:
        s, a = self.size_align(tid)
        a = max(a, 4)
        off = -(-self.local_bytes // a) * a
        self.local_bytes = off + s
        return off

    # -- built-ins -------------------------------------------------------------------------------
    def builtin(self, name: str) -> list[str]:
        """Registers of built-in ``name`` (computed once, in the prologue)."""
        key = ("builtin", name)
        if key in self.const_regs:
            return self.const_regs[key]

        def special(s):
            r = self.reg("b32")
            self.prologue.append(f"\tmov.u32 {r}, {s};")
            return r

        if name == "LocalInvocationId":
            out = [special(f"%tid.{c}") for c in "xyz"]
        elif name == "WorkgroupId":
            out = [special(f"%ctaid.{c}") for c in "xyz"]
        elif name == "NumWorkgroups":
            out = [special(f"%nctaid.{c}") for c in "xyz"]
        elif name == "WorkgroupSize":
            out = [self.const_reg(v, Type("int", 32)) for v in self.m.local_size]
        elif name == "GlobalInvocationId":
            tid, cta = self.builtin("LocalInvocationId"), self.builtin("WorkgroupId")
            out = []
            for c, n in zip(range(3), self.m.local_size):
                r = self.reg("b32")
                self.prologue.append(f"\tmad.lo.u32 {r}, {cta[c]}, {n}, {tid[c]};")
                out.append(r)
        elif name == "LocalInvocationIndex":
            tid = self.builtin("LocalInvocationId")
            x, y, _ = self.m.local_size
            r1, r2 = self.reg("b32"), self.reg("b32")
            self.prologue.append(f"\tmad.lo.u32 {r1}, {tid[2]}, {y}, {tid[1]};")
            self.prologue.append(f"\tmad.lo.u32 {r2}, {r1}, {x}, {tid[0]};")
            out = [r2]
        elif name == "SubgroupSize":
            out = [self.const_reg(32, Type("int", 32))]
        elif name == "SubgroupLocalInvocationId":
            out = [special("%laneid")]
        elif name == "SubgroupId":
            r = self.reg("b32")
            self.prologue.append(f"\tshr.u32 {r}, {self.builtin('LocalInvocationIndex')[0]}, 5;")
            out = [r]
        elif name == "NumSubgroups":
            x, y, z = self.m.local_size
            out = [self.const_reg(-(-(x * y * z) // 32), Type("int", 32))]
        else:
            raise SpirvError(f"built-in {name} is not handled")
        self.const_regs[key] = out
        return out

    # -- loads and stores ----------------------------------------------------------------------
    def access_chain(self, base: _Ptr, indices) -> _Ptr:
        tid, off, addr, dyn = base.tid, base.offset, base.base, base.dyn
        comp = None
        for idx in indices:
            t = self.m.types[tid]
            if t.kind == "struct":
                i = int(self.m.consts[idx])
                off += self.member_offset(tid, i)
                tid = t.members[i]
                continue
            if t.kind == "vector":
                step, nxt = self.size_align(t.elem)[0], t.elem
            elif t.kind in ("array", "rtarray"):
                step, nxt = self.stride(tid), t.elem
            else:
                raise SpirvError(f"access chain into a {t.kind}")
            if idx in self.m.consts:
                off += int(self.m.consts[idx]) * step
                if base.space == "builtin":
                    comp = int(self.m.consts[idx])
            elif base.space == "param" and dyn is None and t.kind == "array":
                dyn = (self._index_u32(idx), step, t.count)
            elif base.space in ("param", "builtin"):
                raise SpirvError("a built-in, a push constant's vector or a push constant twice indexed by a register")
            else:
                addr = self.add_scaled(base.space, addr, idx, step)
            tid = nxt
        out = _Ptr(base.space, addr, off, tid, base.builtin, dyn)
        if comp is not None:
            out.offset = comp
        return out

    def _index_u32(self, idx: int) -> str:
        """The index value ``idx`` as a 32-bit register (a 64-bit index is narrowed)."""
        (i,) = self.regs(idx)
        if self.scalar(self.type_of(idx)).width == 64:
            j = self.reg("b32")
            self.emit(f"cvt.u32.u64 {j}, {i};")
            return j
        return i

    def _param_word(self, off: int, dyn: tuple | None) -> str:
        """The push-constant word at byte ``off`` as a register.  For a pointer indexed by a register
        (``dyn``), the word of the element that register picks, chosen by selects among the array's
        elements: kernel parameters cannot be indexed by a register, and copying them all to
        per-thread .local memory to index them there (what this translator did before) cost every
        thread of a memory-bound kernel about 100 bytes of stores and loads before its first
        useful access."""
        if off % 4:
            raise SpirvError(f"push constant at byte {off}: not a whole word")
        r = self.reg("b32")
        self.emit(f"ld.param.u32 {r}, [pc{off // 4}];")
        if dyn is None:
            return r
        idx, step, count = dyn
        for k in range(1, count):
            w, p, picked = self.reg("b32"), self.reg("pred"), self.reg("b32")
            self.emit(f"ld.param.u32 {w}, [pc{(off + k * step) // 4}];")
            self.emit(f"setp.eq.u32 {p}, {idx}, {k};")
            self.emit(f"selp.b32 {picked}, {w}, {r}, {p};")
            r = picked
        return r

    def add_scaled(self, space: str, addr: str, idx: int, step: int) -> str:
        """``addr + idx * step`` in the space's address width."""
        it = self.scalar(self.type_of(idx))
        (i,) = self.regs(idx)
        if space == "shared":
            if it.width == 64:
                j = self.reg("b32")
                self.emit(f"cvt.u32.u64 {j}, {i};")
                i = j
            r = self.reg("b32")
            self.emit(f"mad.lo.u32 {r}, {i}, {step}, {addr};")
            return r
        r, t = self.reg("b64"), self.reg("b64")
        if it.width == 64:
            self.emit(f"mul.lo.u64 {t}, {i}, {step};")
        else:
            # indices are signed in SPIR-V: a negative one must not become 2^32 - k
            sfx = "s32" if it.signed else "u32"
            self.emit(f"mul.wide.{sfx} {t}, {i}, {step};")
        self.emit(f"add.s64 {r}, {addr}, {t};")
        return r

    def mem_type(self, t: Type) -> str:
        if t.kind == "bool":
            return "u32"
        if t.kind == "float":
            return {16: "b16", 32: "f32", 64: "f64"}[t.width]
        return {8: "u8", 16: "u16", 32: "u32", 64: "u64"}[t.width]

    def load(self, p: _Ptr) -> list[str]:
        if p.space == "builtin":
            regs = self.builtin(p.builtin)
            t = self.m.types[p.tid]
            return regs if t.kind == "vector" else [regs[p.offset]]
        if p.space == "param":
            return self._load_param(p.offset, p.tid, p.dyn)
        return self._load(p.space, p.base, p.offset, p.tid)

    def _addr(self, space: str, base: str | None, off: int) -> str:
        return f"[{base}+{off}]" if off else f"[{base}]"

    def _load(self, space, base, off, tid) -> list[str]:
        t = self.m.types[tid]
        if t.kind in ("array", "struct"):
            out = []
            n = t.count if t.kind == "array" else len(t.members)
            for i in range(n):
                et = t.elem if t.kind == "array" else t.members[i]
                eo = i * self.stride(tid) if t.kind == "array" else self.member_offset(tid, i)
                out += self._load(space, base, off + eo, et)
            return out
        if t.kind == "vector":
            et = self.m.types[t.elem]
            size = et.width // 8
            if t.count in (2, 4) and et.kind != "bool" and size * t.count <= 16 and size >= 4:
                regs = [self.reg(self.cls(et)) for _ in range(t.count)]
                self.emit(f"ld.{space}.v{t.count}.{self.mem_type(et)} {{{', '.join(regs)}}}, "
                          f"{self._addr(space, base, off)};")
                return regs
            return [r for i in range(t.count) for r in self._load(space, base, off + i * size, t.elem)]
        return [self._load_scalar(space, base, off, t)]

    def _load_param(self, off: int, tid: int, dyn: tuple | None) -> list[str]:
        """Registers of the push constant of type ``tid`` at byte ``off`` (``dyn``: see _param_word)."""
        t = self.m.types[tid]
        if t.kind in ("array", "struct", "vector"):
            out = []
            n = t.count if t.kind != "struct" else len(t.members)
            for i in range(n):
                et = t.members[i] if t.kind == "struct" else t.elem
                eo = (self.member_offset(tid, i) if t.kind == "struct"
                      else i * (self.stride(tid) if t.kind == "array" else self.size_align(t.elem)[0]))
                out += self._load_param(off + eo, et, dyn)
            return out
        if t.kind == "bool" or (t.kind == "int" and t.width == 32):
            r = self._param_word(off, dyn)
            return [self._to_bool(r) if t.kind == "bool" else r]
        if t.kind == "float" and t.width == 32:
            r = self.reg("f32")
            self.emit(f"mov.b32 {r}, {self._param_word(off, dyn)};")
            return [r]
        if t.width == 64:
            lo, hi, r = self._param_word(off, dyn), self._param_word(off + 4, dyn), self.reg(self.cls(t))
            self.emit(f"mov.b64 {r}, {{{lo}, {hi}}};")
            return [r]
        raise SpirvError(f"a {t.width}-bit push constant")

    def _load_scalar(self, space, base, off, t: Type) -> str:
        if t.kind == "bool":
            r = self.reg("b32")
            self.emit(f"ld.{space}.u32 {r}, {self._addr(space, base, off)};")
            return self._to_bool(r)
        r = self.reg(self.cls(t))
        self.emit(f"ld.{space}.{self.mem_type(t)} {r}, {self._addr(space, base, off)};")
        return r

    def _to_bool(self, r: str) -> str:
        p = self.reg("pred")
        self.emit(f"setp.ne.u32 {p}, {r}, 0;")
        return p

    def store(self, p: _Ptr, regs: list[str]) -> None:
        if p.space in ("param", "builtin"):
            raise SpirvError(f"a store to a {p.space} pointer")
        self._store(p.space, p.base, p.offset, p.tid, list(regs))

    def _store(self, space, base, off, tid, regs: list[str]) -> None:
        t = self.m.types[tid]
        if t.kind in ("array", "struct"):
            n = t.count if t.kind == "array" else len(t.members)
            for i in range(n):
                et = t.elem if t.kind == "array" else t.members[i]
                eo = i * self.stride(tid) if t.kind == "array" else self.member_offset(tid, i)
                k = self.m.scalar_count(et)
                self._store(space, base, off + eo, et, regs[:k])
                regs = regs[k:]
            return
        if t.kind == "vector":
            et = self.m.types[t.elem]
            size = et.width // 8
            if t.count in (2, 4) and et.kind != "bool" and size * t.count <= 16 and size >= 4:
                self.emit(f"st.{space}.v{t.count}.{self.mem_type(et)} {self._addr(space, base, off)}, "
                          f"{{{', '.join(regs)}}};")
                return
            for i in range(t.count):
                self._store(space, base, off + i * size, t.elem, [regs[i]])
            return
        (r,) = regs
        if t.kind == "bool":
            w = self.reg("b32")
            self.emit(f"selp.u32 {w}, 1, 0, {r};")
            r = w
        self.emit(f"st.{space}.{self.mem_type(t)} {self._addr(space, base, off)}, {r};")

    # -- the function body -------------------------------------------------------------------------
    def run(self) -> Translated:
        m = self.m
        self.setup_variables()
        # Fold what the specialization constants decide before the branches are looked at: a
        # condition computed in the body (OP == 3) is then a constant too.
        for b in m.blocks:
            for ins in b.instrs:
                if ins.rid and ins.op not in _NOT_FOLDED:
                    v = fold(m, ins.op, ins.rtype, ins.ops)
                    if v is not None:
                        m.set_const(ins.rid, v, ins.rtype)
        blocks = {b.label: b for b in m.blocks}
        order = [b.label for b in m.blocks]
        reachable = self._reachable(blocks, order[0])
        used = {ins.ops[0] for b in m.blocks if b.label in reachable for ins in b.instrs
                if ins.op in ("AccessChain", "InBoundsAccessChain", "Load", "Store")}
        self.setup_function_variables(used)
        self.preds: dict[int, set] = {}
        for b in m.blocks:
            if b.label in reachable:
                for s in self._successors(b):
                    self.preds.setdefault(s, set()).add(b.label)
        self.phis: dict[int, list] = {}
        for b in m.blocks:
            for ins in b.instrs:
                if ins.op == "Phi":
                    self.define(ins.rid, ins.rtype, self.fresh(ins.rtype))
                    self.phis.setdefault(b.label, []).append(ins)
        for label in order:
            if label not in reachable:
                continue
            self.body.append(f"$L_{label}:")
            self.stubs: list[str] = []
            for ins in blocks[label].instrs:
                self.instr(label, ins)
            self.body.extend(self.stubs)
        return Translated(self.render(), self.name, tuple(int(x) for x in m.local_size), tuple(self.bindings),
                          self.push_words, self.shared_bytes)

    def _const_cond(self, vid):
        """The value of ``vid`` if the specialization constants fixed it, else None."""
        return self.m.consts.get(vid)

    def _successors(self, b) -> list[int]:
        term = b.instrs[-1]
        if term.op == "Branch":
            return [term.ops[0]]
        if term.op == "BranchConditional":
            c = self._const_cond(term.ops[0])
            if c is not None:
                return [term.ops[1] if c else term.ops[2]]
            return [term.ops[1], term.ops[2]]
        if term.op == "Switch":
            sel = self._const_cond(term.ops[0])
            cases = list(zip(term.ops[2::2], term.ops[3::2]))
            if sel is not None:
                return [next((lab for lit, lab in cases if lit == sel), term.ops[1])]
            return [term.ops[1]] + [lab for _, lab in cases]
        return []

    def _reachable(self, blocks, entry) -> set:
        seen, todo = set(), [entry]
        while todo:
            b = todo.pop()
            if b in seen:
                continue
            seen.add(b)
            todo += self._successors(blocks[b])
        return seen

    def edge(self, src: int, dst: int) -> str:
        """The label to jump to for edge src -> dst: dst itself, or a stub that first sets dst's phis."""
        moves = []  # (phi register, incoming value)
        for phi in self.phis.get(dst, []):
            pairs = dict(zip(phi.ops[1::2], phi.ops[0::2]))  # parent block -> value
            if src not in pairs:
                raise SpirvError(f"phi %{phi.rid} has no value for the edge from block %{src}")
            moves += list(zip(self.vals[phi.rid], self.regs(pairs[src])))
        if not moves:
            return f"$L_{dst}"
        self.n_stubs += 1
        label = f"$E_{self.n_stubs}"
        lines = [f"{label}:"]
        dsts = {d for d, _ in moves}
        if any(s in dsts for _, s in moves):
            # a phi reads another phi of dst: copy every value out first (a parallel copy)
            temps = [self.reg(_reg_class(d)) for d, _ in moves]
            lines += [f"\t{_mov(d)} {t}, {s};" for (d, s), t in zip(moves, temps)]
            moves = [(d, t) for (d, _), t in zip(moves, temps)]
        lines += [f"\t{_mov(d)} {d}, {s};" for d, s in moves]
        lines.append(f"\tbra $L_{dst};")
        self.stubs += lines
        return label

    # -- one instruction -------------------------------------------------------------------------
    def instr(self, label: int, ins) -> None:
        op, m = ins.op, self.m
        if op in ("Phi", "LoopMerge", "SelectionMerge"):
            return
        if ins.rid in m.consts:  # folded
            return
        handler = getattr(self, "op_" + op, None)
        if handler is not None:
            handler(ins, label)
            return
        if op in _F_BIN or op in _I_BIN or op in _F_CMP or op in _I_CMP or op in _LOGIC:
            self.binary(ins)
            return
        raise SpirvError(f"Op{op} is not handled by the PTX translator")

    # control flow
    def op_Branch(self, ins, label):
        self.emit(f"bra {self.edge(label, ins.ops[0])};")

    def op_BranchConditional(self, ins, label):
        c = self._const_cond(ins.ops[0])
        if c is not None:
            self.emit(f"bra {self.edge(label, ins.ops[1] if c else ins.ops[2])};")
            return
        (p,) = self.regs(ins.ops[0])
        self.emit(f"@{p} bra {self.edge(label, ins.ops[1])};")
        self.emit(f"bra {self.edge(label, ins.ops[2])};")

    def op_Switch(self, ins, label):
        sel, default = ins.ops[0], ins.ops[1]
        cases = list(zip(ins.ops[2::2], ins.ops[3::2]))
        c = self._const_cond(sel)
        if c is not None:
            self.emit(f"bra {self.edge(label, next((lab for lit, lab in cases if lit == c), default))};")
            return
        (s,) = self.regs(sel)
        w = self.scalar(self.type_of(sel)).width
        for lit, lab in cases:
            p = self.reg("pred")
            self.emit(f"setp.eq.{'u64' if w == 64 else 'u32'} {p}, {s}, {lit};")
            self.emit(f"@{p} bra {self.edge(label, lab)};")
        self.emit(f"bra {self.edge(label, default)};")

    def op_Return(self, ins, label):
        self.emit("ret;")

    op_Unreachable = op_Return

    def op_ControlBarrier(self, ins, label):
        self.emit("bar.sync 0;")

    def op_MemoryBarrier(self, ins, label):
        self.emit("membar.cta;")

    # memory
    def op_AccessChain(self, ins, label):
        self.ptrs[ins.rid] = self.access_chain(self.ptrs[ins.ops[0]], ins.ops[1:])

    op_InBoundsAccessChain = op_AccessChain

    def op_Load(self, ins, label):
        self.define(ins.rid, ins.rtype, self.load(self.ptrs[ins.ops[0]]))

    def op_Store(self, ins, label):
        self.store(self.ptrs[ins.ops[0]], self.regs(ins.ops[1]))

    # composites (registers are never overwritten except phis on their edges, so aliasing is safe)
    def op_CompositeConstruct(self, ins, label):
        self.define(ins.rid, ins.rtype, [r for a in ins.ops for r in self.regs(a)])

    def op_CompositeExtract(self, ins, label):
        tid, start = self.type_of(ins.ops[0]), 0
        for lit in ins.ops[1:]:
            t = self.m.types[tid]
            if t.kind == "struct":
                start += sum(self.m.scalar_count(x) for x in t.members[:lit])
                tid = t.members[lit]
            else:
                start += lit * self.m.scalar_count(t.elem)
                tid = t.elem
        self.define(ins.rid, ins.rtype, self.regs(ins.ops[0])[start:start + self.m.scalar_count(tid)])

    def op_VectorShuffle(self, ins, label):
        both = self.regs(ins.ops[0]) + self.regs(ins.ops[1])
        et = self.m.types[self.m.types[ins.rtype].elem]
        self.define(ins.rid, ins.rtype,
                    [both[i] if i != 0xFFFFFFFF else self.const_reg(0, et) for i in ins.ops[2:]])

    def op_CopyObject(self, ins, label):
        self.define(ins.rid, ins.rtype, self.regs(ins.ops[0]))

    def op_Undef(self, ins, label):
        self.define(ins.rid, ins.rtype, self.flat_const(null_value(self.m, ins.rtype), ins.rtype))

    # arithmetic
    def binary(self, ins) -> None:
        a, b = self.regs(ins.ops[0]), self.regs(ins.ops[1])
        st = self.scalar(self.type_of(ins.ops[0]))
        out = []
        for x, y in zip(a, b):
            if ins.op in _F_BIN:
                d = self.reg(self.cls(st))
                self.emit(f"{_F_BIN[ins.op]}.f{st.width} {d}, {x}, {y};")
            elif ins.op in _I_BIN:
                opname, kind = _I_BIN[ins.op]
                d = self.reg(self.cls(st))
                w = 64 if st.width == 64 else 32
                x2, y2 = (self.sext(x, st.width), self.sext(y, st.width)) if kind == "s" and st.width < 32 else (x, y)
                self.emit(f"{opname}.{kind}{w} {d}, {x2}, {y2};")
                d = self.narrow(d, st.width)
            elif ins.op in _F_CMP:
                d = self.reg("pred")
                self.emit(f"setp.{_F_CMP[ins.op]}.f{st.width} {d}, {x}, {y};")
            elif ins.op in _I_CMP:
                cmp, kind = _I_CMP[ins.op]
                d = self.reg("pred")
                w = 64 if st.width == 64 else 32
                x2, y2 = (self.sext(x, st.width), self.sext(y, st.width)) if kind == "s" and st.width < 32 else (x, y)
                self.emit(f"setp.{cmp}.{kind}{w} {d}, {x2}, {y2};")
            else:
                d = self.reg("pred")
                self.emit(f"{_LOGIC[ins.op]}.pred {d}, {x}, {y};")
            out.append(d)
        self.define(ins.rid, ins.rtype, out)

    def sext(self, r: str, width: int) -> str:
        """A narrow int (held zero-extended in 32 bits) sign-extended to 32 bits."""
        d = self.reg("b32")
        self.emit(f"bfe.s32 {d}, {r}, 0, {width};")
        return d

    def narrow(self, r: str, width: int) -> str:
        """Keep a narrow int's register zero-extended after 32-bit arithmetic."""
        if width >= 32:
            return r
        d = self.reg("b32")
        self.emit(f"and.b32 {d}, {r}, {(1 << width) - 1};")
        return d

    def unary(self, ins, fn) -> None:
        self.define(ins.rid, ins.rtype, [fn(x) for x in self.regs(ins.ops[0])])

    def _op1(self, text: str, cls: str):
        def f(x):
            d = self.reg(cls)
            self.emit(text.format(d=d, x=x))
            return d
        return f

    def op_FNegate(self, ins, label):
        st = self.scalar(ins.rtype)
        self.unary(ins, self._op1(f"neg.f{st.width} {{d}}, {{x}};", self.cls(st)))

    def op_SNegate(self, ins, label):
        st = self.scalar(ins.rtype)
        w = 64 if st.width == 64 else 32
        self.unary(ins, lambda x: self.narrow(self._op1(f"neg.s{w} {{d}}, {{x}};", self.cls(st))(x), st.width))

    def op_Not(self, ins, label):
        st = self.scalar(ins.rtype)
        w = 64 if st.width == 64 else 32
        self.unary(ins, lambda x: self.narrow(self._op1(f"not.b{w} {{d}}, {{x}};", self.cls(st))(x), st.width))

    def op_LogicalNot(self, ins, label):
        self.unary(ins, self._op1("not.pred {d}, {x};", "pred"))

    def op_LogicalEqual(self, ins, label):
        a, b = self.regs(ins.ops[0]), self.regs(ins.ops[1])
        out = []
        for x, y in zip(a, b):
            t, d = self.reg("pred"), self.reg("pred")
            self.emit(f"xor.pred {t}, {x}, {y};")
            self.emit(f"not.pred {d}, {t};")
            out.append(d)
        self.define(ins.rid, ins.rtype, out)

    def op_IsNan(self, ins, label):
        st = self.scalar(self.type_of(ins.ops[0]))
        self.unary(ins, self._op1(f"testp.notanumber.f{st.width} {{d}}, {{x}};", "pred"))

    def op_IsInf(self, ins, label):
        st = self.scalar(self.type_of(ins.ops[0]))
        self.unary(ins, self._op1(f"testp.infinite.f{st.width} {{d}}, {{x}};", "pred"))

    def op_Any(self, ins, label):
        self._reduce_pred(ins, "or")

    def op_All(self, ins, label):
        self._reduce_pred(ins, "and")

    def _reduce_pred(self, ins, how):
        regs = self.regs(ins.ops[0])
        acc = regs[0]
        for r in regs[1:]:
            d = self.reg("pred")
            self.emit(f"{how}.pred {d}, {acc}, {r};")
            acc = d
        self.define(ins.rid, ins.rtype, [acc])

    def op_Select(self, ins, label):
        c = self._const_cond(ins.ops[0])
        if c is not None and not isinstance(c, tuple):
            self.define(ins.rid, ins.rtype, self.regs(ins.ops[1] if c else ins.ops[2]))
            return
        c, a, b = self.regs(ins.ops[0]), self.regs(ins.ops[1]), self.regs(ins.ops[2])
        st = self.scalar(ins.rtype)
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            p = c[i] if len(c) > 1 else c[0]
            if st.kind == "bool":
                t1, n, t2, d = self.reg("pred"), self.reg("pred"), self.reg("pred"), self.reg("pred")
                self.emit(f"and.pred {t1}, {p}, {x};")
                self.emit(f"not.pred {n}, {p};")
                self.emit(f"and.pred {t2}, {n}, {y};")
                self.emit(f"or.pred {d}, {t1}, {t2};")
            else:
                cls = self.cls(st)
                d = self.reg(cls)
                self.emit(f"selp.{_CLASSES[cls][1][1:]} {d}, {x}, {y}, {p};")
            out.append(d)
        self.define(ins.rid, ins.rtype, out)

    def op_VectorTimesScalar(self, ins, label):
        (s,) = self.regs(ins.ops[1])
        st = self.scalar(ins.rtype)
        self.unary(ins, self._op1(f"mul.rn.f{st.width} {{d}}, {{x}}, {s};", self.cls(st)))

    def op_UMulExtended(self, ins, label):
        (a,), (b,) = self.regs(ins.ops[0]), self.regs(ins.ops[1])
        lo, hi = self.reg("b32"), self.reg("b32")
        self.emit(f"mul.lo.u32 {lo}, {a}, {b};")
        self.emit(f"mul.hi.u32 {hi}, {a}, {b};")
        self.define(ins.rid, ins.rtype, [lo, hi])

    def op_BitCount(self, ins, label):
        self.unary(ins, self._op1("popc.b32 {d}, {x};", "b32"))

    def _shift(self, ins, how):
        st = self.scalar(ins.rtype)
        a, s = self.regs(ins.ops[0]), self.regs(ins.ops[1])
        sw = self.scalar(self.type_of(ins.ops[1])).width
        w = 64 if st.width == 64 else 32
        out = []
        for x, y in zip(a, s * len(a) if len(s) == 1 else s):
            if sw == 64:
                y2 = self.reg("b32")
                self.emit(f"cvt.u32.u64 {y2}, {y};")
                y = y2
            if how == "shr.s" and st.width < 32:
                x = self.sext(x, st.width)
            d = self.reg(self.cls(st))
            kind = {"shl": f"shl.b{w}", "shr.u": f"shr.u{w}", "shr.s": f"shr.s{w}"}[how]
            self.emit(f"{kind} {d}, {x}, {y};")
            out.append(self.narrow(d, st.width))
        self.define(ins.rid, ins.rtype, out)

    def op_ShiftLeftLogical(self, ins, label):
        self._shift(ins, "shl")

    def op_ShiftRightLogical(self, ins, label):
        self._shift(ins, "shr.u")

    def op_ShiftRightArithmetic(self, ins, label):
        self._shift(ins, "shr.s")

    def op_FMod(self, ins, label):
        st = self.scalar(ins.rtype)
        f = f"f{st.width}"
        out = []
        for x, y in zip(self.regs(ins.ops[0]), self.regs(ins.ops[1])):
            q, fl, t, d = (self.reg(self.cls(st)) for _ in range(4))
            self.emit(f"div.rn.{f} {q}, {x}, {y};")
            self.emit(f"cvt.rmi.{f}.{f} {fl}, {q};")
            self.emit(f"mul.rn.{f} {t}, {y}, {fl};")
            self.emit(f"sub.rn.{f} {d}, {x}, {t};")
            out.append(d)
        self.define(ins.rid, ins.rtype, out)

    # conversions
    def op_ConvertFToS(self, ins, label):
        self._f2i(ins, "s")

    def op_ConvertFToU(self, ins, label):
        self._f2i(ins, "u")

    def _f2i(self, ins, kind):
        src, dst = self.scalar(self.type_of(ins.ops[0])), self.scalar(ins.rtype)
        w = 64 if dst.width == 64 else 32
        def f(x):
            d = self.reg(self.cls(dst))
            self.emit(f"cvt.rzi.{kind}{w}.f{src.width} {d}, {x};")
            return self.narrow(d, dst.width)
        self.unary(ins, f)

    def op_ConvertSToF(self, ins, label):
        self._i2f(ins, "s")

    def op_ConvertUToF(self, ins, label):
        self._i2f(ins, "u")

    def _i2f(self, ins, kind):
        src, dst = self.scalar(self.type_of(ins.ops[0])), self.scalar(ins.rtype)
        w = 64 if src.width == 64 else 32
        def f(x):
            if kind == "s" and src.width < 32:
                x = self.sext(x, src.width)
            d = self.reg(self.cls(dst))
            self.emit(f"cvt.rn.f{dst.width}.{kind}{w} {d}, {x};")
            return d
        self.unary(ins, f)

    def op_UConvert(self, ins, label):
        self._iconv(ins, signed=False)

    def op_SConvert(self, ins, label):
        self._iconv(ins, signed=True)

    def _iconv(self, ins, signed):
        src, dst = self.scalar(self.type_of(ins.ops[0])), self.scalar(ins.rtype)
        def f(x):
            if src.width == 64 and dst.width == 64:
                return x
            if src.width == 64:
                d = self.reg("b32")
                self.emit(f"cvt.u32.u64 {d}, {x};")
                return self.narrow(d, dst.width)
            if signed and src.width < 32:
                x = self.sext(x, src.width)
            if dst.width == 64:
                d = self.reg("b64")
                self.emit(f"cvt.{'s64.s32' if signed else 'u64.u32'} {d}, {x};")
                return d
            return self.narrow(x, dst.width) if dst.width < src.width or signed else x
        self.unary(ins, f)

    def op_FConvert(self, ins, label):
        src, dst = self.scalar(self.type_of(ins.ops[0])), self.scalar(ins.rtype)
        if src.width == dst.width:
            self.unary(ins, lambda x: x)
            return
        rnd = ".rn" if dst.width < src.width else ""
        self.unary(ins, self._op1(f"cvt{rnd}.f{dst.width}.f{src.width} {{d}}, {{x}};", self.cls(dst)))

    def op_Bitcast(self, ins, label):
        src_t, dst_t = self.type_of(ins.ops[0]), ins.rtype
        ss, ds = self.scalar(src_t), self.scalar(dst_t)
        regs = self.regs(ins.ops[0])
        bits = [self.to_bits(r, ss) for r in regs]  # b16 / b32 / b64 registers
        if ss.width == ds.width:
            out = bits
        elif ss.width * 2 == ds.width:
            out = []
            for lo, hi in zip(bits[0::2], bits[1::2]):
                d = self.reg("b64" if ds.width == 64 else "b32")
                self.emit(f"mov.b{ds.width} {d}, {{{lo}, {hi}}};")
                out.append(d)
        elif ss.width == ds.width * 2:
            out = []
            for r in bits:
                lo, hi = (self.reg("b32" if ds.width == 32 else "b16") for _ in range(2))
                self.emit(f"mov.b{ss.width} {{{lo}, {hi}}}, {r};")
                out += [lo, hi]
        else:
            raise SpirvError(f"bitcast from {ss.width}-bit to {ds.width}-bit components")
        self.define(ins.rid, dst_t, [self.from_bits(r, ds) for r in out])

    def to_bits(self, r: str, t: Type) -> str:
        """``r`` as an untyped register of its width (b16 for 16-bit, b32, b64)."""
        if t.kind == "float" and t.width in (32, 64):
            d = self.reg("b32" if t.width == 32 else "b64")
            self.emit(f"mov.b{t.width} {d}, {r};")
            return d
        if t.kind == "int" and t.width == 16:
            d = self.reg("b16")
            self.emit(f"cvt.u16.u32 {d}, {r};")
            return d
        if t.kind == "int" and t.width == 8:
            raise SpirvError("bitcast of 8-bit integers")
        return r

    def from_bits(self, r: str, t: Type) -> str:
        if t.kind == "float" and t.width in (32, 64):
            d = self.reg("f32" if t.width == 32 else "f64")
            self.emit(f"mov.b{t.width} {d}, {r};")
            return d
        if t.kind == "int" and t.width == 16:
            d = self.reg("b32")
            self.emit(f"cvt.u32.u16 {d}, {r};")
            return d
        return r

    # GLSL.std.450
    def op_ExtInst(self, ins, label):
        if ins.ops[0] != self.m.ext_glsl:
            raise SpirvError("an extended instruction outside GLSL.std.450")
        name = _GLSL.get(ins.ops[1])
        if name is None:
            raise SpirvError(f"GLSL.std.450 instruction {ins.ops[1]} is not handled")
        args = [self.regs(a) for a in ins.ops[2:]]
        st = self.scalar(ins.rtype)
        if name == "PackHalf2x16":
            x, y = args[0]
            h0, h1, d = self.reg("b16"), self.reg("b16"), self.reg("b32")
            self.emit(f"cvt.rn.f16.f32 {h0}, {x};")
            self.emit(f"cvt.rn.f16.f32 {h1}, {y};")
            self.emit(f"mov.b32 {d}, {{{h0}, {h1}}};")
            self.define(ins.rid, ins.rtype, [d])
            return
        if name == "UnpackHalf2x16":
            (w,) = args[0]
            h0, h1, x, y = self.reg("b16"), self.reg("b16"), self.reg("f32"), self.reg("f32")
            self.emit(f"mov.b32 {{{h0}, {h1}}}, {w};")
            self.emit(f"cvt.f32.f16 {x}, {h0};")
            self.emit(f"cvt.f32.f16 {y}, {h1};")
            self.define(ins.rid, ins.rtype, [x, y])
            return
        n = len(args[0])
        cols = [[a[i] if len(a) > 1 else a[0] for a in args] for i in range(n)]
        self.define(ins.rid, ins.rtype, [self.glsl(name, st, c) for c in cols])

    def glsl(self, name: str, t: Type, a: list[str]) -> str:
        """One scalar of GLSL.std.450 ``name`` on operands ``a``."""
        cls = self.cls(t)
        f = f"f{t.width}"
        d = self.reg(cls)
        e = self.emit
        iw = 64 if t.width == 64 else 32
        if name in ("FAbs",):
            e(f"abs.{f} {d}, {a[0]};")
        elif name == "SAbs":
            e(f"abs.s{iw} {d}, {self.sext(a[0], t.width) if t.width < 32 else a[0]};")
        elif name in ("Floor", "Trunc", "Ceil", "RoundEven", "Round"):
            mode = {"Floor": "rmi", "Trunc": "rzi", "Ceil": "rpi", "RoundEven": "rni", "Round": "rni"}[name]
            e(f"cvt.{mode}.{f}.{f} {d}, {a[0]};")
        elif name == "Fract":
            fl = self.reg(cls)
            e(f"cvt.rmi.{f}.{f} {fl}, {a[0]};")
            e(f"sub.rn.{f} {d}, {a[0]}, {fl};")
        elif name == "FSign":
            pg, pl, t1 = self.reg("pred"), self.reg("pred"), self.reg(cls)
            one, mone = self.const_reg(1.0, t), self.const_reg(-1.0, t)
            e(f"setp.gt.{f} {pg}, {a[0]}, {self.const_reg(0.0, t)};")
            e(f"setp.lt.{f} {pl}, {a[0]}, {self.const_reg(0.0, t)};")
            e(f"selp.{f} {t1}, {mone}, {a[0]}, {pl};")
            e(f"selp.{f} {d}, {one}, {t1}, {pg};")
        elif name in ("Sin", "Cos"):
            e(f"{name.lower()}.approx.f32 {d}, {a[0]};")
        elif name == "Exp2":
            e(f"ex2.approx.f32 {d}, {a[0]};")
        elif name == "Exp":
            t1 = self.reg(cls)
            e(f"mul.rn.f32 {t1}, {a[0]}, {_f32_hex(LOG2E)};")
            e(f"ex2.approx.f32 {d}, {t1};")
        elif name == "Log2":
            e(f"lg2.approx.f32 {d}, {a[0]};")
        elif name == "Log":
            t1 = self.reg(cls)
            e(f"lg2.approx.f32 {t1}, {a[0]};")
            e(f"mul.rn.f32 {d}, {t1}, {_f32_hex(LN2)};")
        elif name == "Pow":
            t1, t2 = self.reg(cls), self.reg(cls)
            e(f"lg2.approx.f32 {t1}, {a[0]};")
            e(f"mul.rn.f32 {t2}, {t1}, {a[1]};")
            e(f"ex2.approx.f32 {d}, {t2};")
        elif name == "Sqrt":
            e(f"sqrt.rn.{f} {d}, {a[0]};")
        elif name == "InverseSqrt":
            e(f"rsqrt.approx.{f} {d}, {a[0]};")
        elif name in ("FMin", "FMax", "NMin", "NMax"):
            e(f"{'min' if 'Min' in name else 'max'}.{f} {d}, {a[0]}, {a[1]};")
        elif name in ("UMin", "UMax", "SMin", "SMax"):
            k = name[0].lower()
            x, y = (self.sext(a[0], t.width), self.sext(a[1], t.width)) if k == "s" and t.width < 32 else a[:2]
            e(f"{name[1:].lower()}.{k}{iw} {d}, {x}, {y};")
        elif name == "FClamp":
            t1 = self.reg(cls)
            e(f"max.{f} {t1}, {a[0]}, {a[1]};")
            e(f"min.{f} {d}, {t1}, {a[2]};")
        elif name in ("UClamp", "SClamp"):
            k = name[0].lower()
            x, lo, hi = [self.sext(v, t.width) for v in a] if k == "s" and t.width < 32 else a
            t1 = self.reg(cls)
            e(f"max.{k}{iw} {t1}, {x}, {lo};")
            e(f"min.{k}{iw} {d}, {t1}, {hi};")
        elif name == "FMix":
            t1 = self.reg(cls)
            e(f"sub.rn.{f} {t1}, {a[1]}, {a[0]};")
            e(f"fma.rn.{f} {d}, {t1}, {a[2]}, {a[0]};")
        elif name == "Step":
            p = self.reg("pred")
            e(f"setp.lt.{f} {p}, {a[1]}, {a[0]};")
            e(f"selp.{f} {d}, {self.const_reg(0.0, t)}, {self.const_reg(1.0, t)}, {p};")
        elif name == "Fma":
            e(f"fma.rn.{f} {d}, {a[0]}, {a[1]}, {a[2]};")
        elif name == "Ldexp":
            d = self.ldexp(a[0], a[1])
        elif name == "FindUMsb":
            c = self.reg("b32")
            e(f"clz.b32 {c}, {a[0]};")
            e(f"sub.s32 {d}, {self.const_reg(31, t)}, {c};")
        elif name == "FindSMsb":
            s, x, c = self.reg("b32"), self.reg("b32"), self.reg("b32")
            e(f"shr.s32 {s}, {a[0]}, 31;")
            e(f"xor.b32 {x}, {a[0]}, {s};")  # negative: the highest 0 bit
            e(f"clz.b32 {c}, {x};")
            e(f"sub.s32 {d}, {self.const_reg(31, t)}, {c};")
        else:
            raise SpirvError(f"GLSL.std.450 {name} is not handled")
        return d

    def ldexp(self, x: str, n: str) -> str:
        """x * 2^n, exact: n clamped to [-252, 254] and applied as two powers of two that are normal floats."""
        e = self.emit
        c, h, k, b1, b2, s1, s2, t, d = (self.reg(c) for c in ("b32",) * 5 + ("f32",) * 4)
        e(f"max.s32 {c}, {n}, -252;")
        e(f"min.s32 {c}, {c}, 254;")
        e(f"shr.s32 {h}, {c}, 1;")
        e(f"sub.s32 {k}, {c}, {h};")
        e(f"add.s32 {b1}, {h}, 127;")
        e(f"shl.b32 {b1}, {b1}, 23;")
        e(f"add.s32 {b2}, {k}, 127;")
        e(f"shl.b32 {b2}, {b2}, 23;")
        e(f"mov.b32 {s1}, {b1};")
        e(f"mov.b32 {s2}, {b2};")
        e(f"mul.rn.f32 {t}, {x}, {s1};")
        e(f"mul.rn.f32 {d}, {t}, {s2};")
        return d

    # subgroup operations only appear in the kernels written for 8-lane CPU drivers
    def _subgroup(self, ins, label):
        raise SpirvError(f"Op{ins.op}: subgroup kernels are written for 8-lane CPU drivers; the CUDA runtime "
                         "picks the shared-memory variants")

    op_GroupNonUniformBroadcast = op_GroupNonUniformShuffle = op_GroupNonUniformShuffleXor = _subgroup
    op_GroupNonUniformIAdd = op_GroupNonUniformFAdd = op_GroupNonUniformFMin = _subgroup
    op_GroupNonUniformFMax = op_SubgroupBallotKHR = _subgroup

    # -- output ----------------------------------------------------------------------------------
    def render(self) -> str:
        params = [f".param .u64 b{i}" for i in range(len(self.bindings))]
        params += [f".param .u32 pc{i}" for i in range(self.push_words)]
        x, y, z = self.m.local_size
        out = [".version 8.0", f".target {self.target}", ".address_size 64", ""]
        if self.shared_bytes:
            out.append(".extern .shared .align 16 .b8 smem[];")
        out.append(f".visible .entry {self.name}(")
        out.append(",\n".join("\t" + p for p in params))
        out.append(f")\n.maxntid {x}, {y}, {z}\n{{")
        if self.local_bytes:
            out.append(f"\t.local .align 16 .b8 lmem[{self.local_bytes}];")
        for c, (pfx, typ) in _CLASSES.items():
            if self.counts[c]:
                out.append(f"\t.reg {typ} %{pfx}<{self.counts[c] + 1}>;")
        out += self.prologue
        out += self.body
        out.append("}")
        return "\n".join(out) + "\n"

