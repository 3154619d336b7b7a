"""Read a SPIR-V compute module (what glslc makes of a Helios GLSL kernel) into plain Python.

The CUDA backend runs the Vulkan backend's kernels: :mod:`spirv_ptx` translates this
module to PTX.  This file only decodes the binary: types, constants (specialization
constants resolved and folded), decorations, global variables, and the entry function
as basic blocks of :class:`Instr`.  It knows the opcodes glslc emits for Helios'
kernels; anything else is refused by name, never guessed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from helios.errors import HeliosError


class SpirvError(HeliosError, ValueError):
    """A SPIR-V module outside what the translator handles (names the opcode or the id)."""


MAGIC = 0x07230203

# opcode -> name, for every opcode the reader accepts (SPIR-V 1.5 unified spec numbering)
OPCODES = {
    0: "Nop", 1: "Undef", 3: "Source", 4: "SourceExtension", 5: "Name", 6: "MemberName", 7: "String", 8: "Line",
    10: "Extension", 11: "ExtInstImport", 12: "ExtInst", 14: "MemoryModel", 15: "EntryPoint", 16: "ExecutionMode",
    17: "Capability", 19: "TypeVoid", 20: "TypeBool", 21: "TypeInt", 22: "TypeFloat", 23: "TypeVector",
    28: "TypeArray", 29: "TypeRuntimeArray", 30: "TypeStruct", 32: "TypePointer", 33: "TypeFunction",
    41: "ConstantTrue", 42: "ConstantFalse", 43: "Constant", 44: "ConstantComposite", 46: "ConstantNull",
    48: "SpecConstantTrue", 49: "SpecConstantFalse", 50: "SpecConstant", 51: "SpecConstantComposite",
    52: "SpecConstantOp", 54: "Function", 56: "FunctionEnd", 59: "Variable", 61: "Load", 62: "Store",
    65: "AccessChain", 66: "InBoundsAccessChain", 71: "Decorate", 72: "MemberDecorate", 79: "VectorShuffle",
    80: "CompositeConstruct", 81: "CompositeExtract", 83: "CopyObject", 109: "ConvertFToU", 110: "ConvertFToS",
    111: "ConvertSToF", 112: "ConvertUToF", 113: "UConvert", 114: "SConvert", 115: "FConvert", 124: "Bitcast",
    126: "SNegate", 127: "FNegate", 128: "IAdd", 129: "FAdd", 130: "ISub", 131: "FSub", 132: "IMul", 133: "FMul",
    134: "UDiv", 135: "SDiv", 136: "FDiv", 137: "UMod", 138: "SRem", 139: "SMod", 141: "FMod",
    142: "VectorTimesScalar", 151: "UMulExtended", 154: "Any", 155: "All", 156: "IsNan", 157: "IsInf",
    164: "LogicalEqual", 165: "LogicalNotEqual", 166: "LogicalOr", 167: "LogicalAnd", 168: "LogicalNot",
    169: "Select", 170: "IEqual", 171: "INotEqual", 172: "UGreaterThan", 173: "SGreaterThan",
    174: "UGreaterThanEqual", 175: "SGreaterThanEqual", 176: "ULessThan", 177: "SLessThan", 178: "ULessThanEqual",
    179: "SLessThanEqual", 180: "FOrdEqual", 181: "FUnordEqual", 182: "FOrdNotEqual", 183: "FUnordNotEqual",
    184: "FOrdLessThan", 185: "FUnordLessThan", 186: "FOrdGreaterThan", 187: "FUnordGreaterThan",
    188: "FOrdLessThanEqual", 189: "FUnordLessThanEqual", 190: "FOrdGreaterThanEqual", 191: "FUnordGreaterThanEqual",
    194: "ShiftRightLogical", 195: "ShiftRightArithmetic", 196: "ShiftLeftLogical", 197: "BitwiseOr",
    198: "BitwiseXor", 199: "BitwiseAnd", 200: "Not", 205: "BitCount", 224: "ControlBarrier", 225: "MemoryBarrier",
    245: "Phi", 246: "LoopMerge", 247: "SelectionMerge", 248: "Label", 249: "Branch", 250: "BranchConditional",
    251: "Switch", 253: "Return", 255: "Unreachable", 317: "NoLine", 330: "ModuleProcessed",
    337: "GroupNonUniformBroadcast", 345: "GroupNonUniformShuffle", 346: "GroupNonUniformShuffleXor",
    349: "GroupNonUniformIAdd", 350: "GroupNonUniformFAdd", 355: "GroupNonUniformFMin", 358: "GroupNonUniformFMax",
    4421: "SubgroupBallotKHR",
}

# storage classes, decorations and built-ins the translator looks at
SC_INPUT, SC_UNIFORM, SC_WORKGROUP, SC_PRIVATE, SC_FUNCTION, SC_PUSH, SC_STORAGE = 1, 2, 4, 6, 7, 9, 12
DEC_SPEC_ID, DEC_ARRAY_STRIDE, DEC_BUILTIN, DEC_BINDING, DEC_SET, DEC_OFFSET = 1, 6, 11, 33, 34, 35
# The image opcodes of the kernels that read through texel views (CPU-driver variants): named in
# the refusal so a caller sees which variant it should not have passed.
_TEXEL_OPCODES = {25: "TypeImage", 27: "TypeSampledImage", 86: "SampledImage", 95: "ImageFetch", 100: "Image"}

BUILTINS = {24: "NumWorkgroups", 25: "WorkgroupSize", 26: "WorkgroupId", 27: "LocalInvocationId",
            28: "GlobalInvocationId", 29: "LocalInvocationIndex", 36: "SubgroupSize", 38: "NumSubgroups",
            40: "SubgroupId", 41: "SubgroupLocalInvocationId"}
EXEC_LOCAL_SIZE = 17

# Opcodes whose first two operands are the result type and the result id.
_NO_RESULT = {"Nop", "Source", "SourceExtension", "Name", "MemberName", "Line", "Extension", "MemoryModel",
              "EntryPoint", "ExecutionMode", "Capability", "Decorate", "MemberDecorate", "Store", "ControlBarrier",
              "MemoryBarrier", "LoopMerge", "SelectionMerge", "Branch", "BranchConditional", "Switch", "Return",
              "Unreachable", "FunctionEnd", "NoLine", "ModuleProcessed"}
_RESULT_ONLY = {"ExtInstImport", "String", "Label", "TypeVoid", "TypeBool", "TypeInt", "TypeFloat", "TypeVector",
                "TypeArray", "TypeRuntimeArray", "TypeStruct", "TypePointer", "TypeFunction"}


@dataclass
class Type:
    """A SPIR-V type: ``kind`` is void, bool, int, float, vector, array, rtarray, struct, pointer or function."""

    kind: str
    width: int = 0          # int / float bits
    signed: bool = False
    elem: int = 0           # vector / array / pointer: the element (pointee) type id
    count: int = 0          # vector / array length
    members: tuple = ()     # struct member type ids
    storage: int = 0        # pointer storage class


@dataclass
class Instr:
    """One instruction of the entry function: its op name, result type and id (0 when none) and the
    remaining operand words."""

    op: str
    rtype: int
    rid: int
    ops: tuple


@dataclass
class Block:
    label: int
    instrs: list = field(default_factory=list)  # everything after OpLabel, the terminator included


@dataclass
class Module:
    """A decoded compute module: what the translator needs, with specialization constants applied."""

    types: dict = field(default_factory=dict)          # id -> Type
    consts: dict = field(default_factory=dict)         # id -> Python value (int, float bits kept as float, bool, tuple)
    decorations: dict = field(default_factory=dict)    # id -> {decoration: [operands]}
    member_offsets: dict = field(default_factory=dict)  # struct id -> {member: byte offset}
    variables: dict = field(default_factory=dict)      # global id -> (pointer type id, storage class)
    ext_glsl: int = -1                                 # id of the GLSL.std.450 import
    entry_id: int = 0
    entry_name: str = ""
    local_size: tuple = (1, 1, 1)
    blocks: list = field(default_factory=list)         # the entry function's blocks, in module order
    function_vars: list = field(default_factory=list)  # Instr of each OpVariable in the function

    def type_of_const(self, cid: int) -> int:
        """The type id of constant ``cid``."""
        return self._const_types[cid]

    def set_const(self, cid: int, value, tid: int) -> None:
        """Record ``cid`` as a constant of type ``tid`` (the reader's, or one folded later)."""
        self.consts[cid] = value
        self._const_types[cid] = tid

    def __post_init__(self):
        self._const_types: dict[int, int] = {}

    def scalar_count(self, tid: int) -> int:
        """Scalars a value of type ``tid`` flattens to (vectors, arrays and structs in order)."""
        t = self.types[tid]
        if t.kind in ("vector", "array"):
            return t.count * self.scalar_count(t.elem)
        if t.kind == "struct":
            return sum(self.scalar_count(m) for m in t.members)
        return 1


def _string(words, i: int) -> tuple[str, int]:
    """A nul-terminated literal string starting at word ``i``; returns it and the next word index."""
    raw = b""
    while True:
        w = struct.pack("<I", words[i])
        i += 1
        if b"\0" in w:
            raw += w[:w.index(b"\0")]
            return raw.decode(), i
        raw += w


def _const_value(t: Type, words) -> object:
    if t.kind == "float":
        if t.width == 32:
            return struct.unpack("<f", struct.pack("<I", words[0]))[0]
        if t.width == 64:
            return struct.unpack("<d", struct.pack("<II", words[0], words[1]))[0]
        if t.width == 16:
            import numpy as np
            return float(np.frombuffer(struct.pack("<H", words[0] & 0xFFFF), np.float16)[0])
    v = words[0] if t.width <= 32 else words[0] | (words[1] << 32)
    return wrap_int(v, t)


def wrap_int(v: int, t: Type) -> int:
    """``v`` reduced to the type's width (as an unsigned bit pattern: signedness lives in the opcodes)."""
    return int(v) & ((1 << t.width) - 1)


def read_module(spirv: bytes, spec: tuple = ()) -> Module:
    """Decode ``spirv`` with specialization constant ``i`` set to ``spec[i]`` (the defaults elsewhere)."""
    if len(spirv) % 4 or len(spirv) < 20:
        raise SpirvError(f"not a SPIR-V module: {len(spirv)} bytes")
    words = struct.unpack(f"<{len(spirv) // 4}I", spirv)
    if words[0] != MAGIC:
        raise SpirvError(f"not a SPIR-V module: magic {words[0]:#x}")
    m = Module()
    cur_fn = None
    block = None
    for op, args in _instructions(words):
        if op in _SKIPPED or _declare_type(m, op, args):
            continue
        if op == "Function":
            cur_fn = args[1]
        elif op == "FunctionEnd":
            cur_fn = None
        elif op == "Label":
            block = Block(args[0])
            m.blocks.append(block)
        elif not _declare(m, op, args, spec, in_function=cur_fn is not None):
            _body_instr(m, op, args, cur_fn, block)
    _resolve_sizes(m)
    return m


# Instructions the translator has no use for.
_SKIPPED = frozenset(("Nop", "Source", "SourceExtension", "Name", "MemberName", "String", "Line", "NoLine",
                      "ModuleProcessed", "Capability", "Extension", "MemoryModel"))


def _instructions(words: tuple):
    """(op name, operand words) of each instruction after the header; raises for an opcode the
    translator does not handle (a texel-view kernel's, named as such)."""
    i = 5
    while i < len(words):
        n, code = words[i] >> 16, words[i] & 0xFFFF
        if n == 0:
            raise SpirvError(f"instruction with word count 0 at word {i}")
        args = words[i + 1:i + n]
        i += n
        op = OPCODES.get(code)
        if op is None and code in _TEXEL_OPCODES:
            raise SpirvError(f"Op{_TEXEL_OPCODES[code]}: texel-view kernels (samplerBuffer reads) are written for CPU "
                             "drivers; the CUDA runtime picks the storage-buffer variants")
        if op is None:
            raise SpirvError(f"SPIR-V opcode {code} is not handled by the PTX translator")
        yield op, args


def _declare_type(m: Module, op: str, args: tuple) -> bool:
    """Record an OpType* in ``m``; False for any other instruction."""
    if op == "TypeVoid":
        m.types[args[0]] = Type("void")
    elif op == "TypeBool":
        m.types[args[0]] = Type("bool")
    elif op == "TypeInt":
        m.types[args[0]] = Type("int", width=args[1], signed=bool(args[2]))
    elif op == "TypeFloat":
        m.types[args[0]] = Type("float", width=args[1])
    elif op == "TypeVector":
        m.types[args[0]] = Type("vector", elem=args[1], count=args[2])
    elif op == "TypeArray":
        m.types[args[0]] = Type("array", elem=args[1], count=-args[2])  # length id: resolved by _resolve_sizes
    elif op == "TypeRuntimeArray":
        m.types[args[0]] = Type("rtarray", elem=args[1])
    elif op == "TypeStruct":
        m.types[args[0]] = Type("struct", members=tuple(args[1:]))
    elif op == "TypePointer":
        m.types[args[0]] = Type("pointer", storage=args[1], elem=args[2])
    elif op == "TypeFunction":
        m.types[args[0]] = Type("function")
    else:
        return False
    return True


def _declare(m: Module, op: str, args: tuple, spec: tuple, in_function: bool) -> bool:
    """Record a module-level declaration in ``m`` (the entry point, its workgroup size, decorations,
    constants and specialization constants, global variables); False for anything else."""
    if op == "ExtInstImport":
        name, _ = _string(args, 1)
        if name != "GLSL.std.450":
            raise SpirvError(f"extended instruction set {name!r} is not handled")
        m.ext_glsl = args[0]
    elif op == "EntryPoint":
        if args[0] != 5:  # GLCompute
            raise SpirvError("only compute shaders are translated")
        m.entry_id = args[1]
        m.entry_name, _ = _string(args, 2)
    elif op == "ExecutionMode":
        if args[1] == EXEC_LOCAL_SIZE:
            m.local_size = tuple(args[2:5])
    elif op == "Decorate":
        m.decorations.setdefault(args[0], {})[args[1]] = list(args[2:])
    elif op == "MemberDecorate":
        if args[2] == DEC_OFFSET:
            m.member_offsets.setdefault(args[0], {})[args[1]] = args[3]
    elif op in ("ConstantTrue", "ConstantFalse"):
        m.set_const(args[1], op == "ConstantTrue", args[0])
    elif op == "Constant":
        m.set_const(args[1], _const_value(m.types[args[0]], args[2:]), args[0])
    elif op == "ConstantComposite":
        m.set_const(args[1], tuple(m.consts[c] for c in args[2:]), args[0])
    elif op == "ConstantNull":
        m.set_const(args[1], null_value(m, args[0]), args[0])
    elif op.startswith("SpecConstant"):
        _resolve_spec(m, (args[0], args[1], op, args[2:]), spec)
    elif op == "Variable" and not in_function:
        m.variables[args[1]] = (args[0], args[2])
    elif op == "Undef" and not in_function:
        m.set_const(args[1], null_value(m, args[0]), args[0])
    else:
        return False
    return True


def _body_instr(m: Module, op: str, args: tuple, cur_fn: int | None, block: Block | None) -> None:
    """Append an instruction of the entry function's body to ``block`` (a function variable to
    ``m.function_vars``); raises outside a function body or in a second function."""
    if cur_fn is None or block is None:
        raise SpirvError(f"Op{op} outside a function body")
    if cur_fn != m.entry_id:
        raise SpirvError("function calls are not translated: the module has more than one function")
    if op in _NO_RESULT:
        ins = Instr(op, 0, 0, tuple(args))
    elif op in _RESULT_ONLY:
        ins = Instr(op, 0, args[0], tuple(args[1:]))
    else:
        ins = Instr(op, args[0], args[1], tuple(args[2:]))
    if op == "Variable":
        m.function_vars.append(ins)
    else:
        block.instrs.append(ins)


def _resolve_sizes(m: Module) -> None:
    """Array lengths from their constants' ids, and the workgroup size from a WorkgroupSize builtin
    constant where the module has one (it overrides the execution mode)."""
    for tid, t in m.types.items():
        if t.kind == "array" and t.count <= 0:
            t.count = int(m.consts[-t.count])
    ws = [v for v, d in m.decorations.items() if DEC_BUILTIN in d and d[DEC_BUILTIN][0] == 25 and v in m.consts]
    if ws:
        m.local_size = tuple(int(x) for x in m.consts[ws[0]])


def null_value(m: Module, tid: int):
    """The value a null (or undefined) constant of type ``tid`` takes: zeros and false."""
    t = m.types[tid]
    if t.kind == "bool":
        return False
    if t.kind in ("int",):
        return 0
    if t.kind == "float":
        return 0.0
    if t.kind in ("vector", "array"):
        return tuple(null_value(m, t.elem) for _ in range(t.count))
    if t.kind == "struct":
        return tuple(null_value(m, x) for x in t.members)
    raise SpirvError(f"null of a {t.kind} type")


def _resolve_spec(m: Module, item, spec: tuple) -> None:
    """Record specialization constant ``item`` (rtype, rid, op, operands) with its value in ``spec``
    (by SpecId), else its default; an OpSpecConstantOp is folded now that its operands are known."""
    rtype, rid, op, args = item
    t = m.types[rtype]
    sid = m.decorations.get(rid, {}).get(DEC_SPEC_ID)
    given = spec[sid[0]] if sid is not None and sid[0] < len(spec) else None
    if op in ("SpecConstantTrue", "SpecConstantFalse"):
        value = bool(given) if given is not None else op == "SpecConstantTrue"
    elif op == "SpecConstant":
        if given is None:
            value = _const_value(t, args)
        elif t.kind == "float":
            value = float(given)
        else:
            value = wrap_int(int(given), t)
    elif op == "SpecConstantComposite":
        value = tuple(m.consts[c] for c in args)
    else:
        from .spirv_fold import fold

        inner = OPCODES.get(args[0])
        if inner is None:
            raise SpirvError(f"OpSpecConstantOp with opcode {args[0]} is not handled")
        value = fold(m, inner, rtype, args[1:])
        if value is None:
            raise SpirvError(f"OpSpecConstantOp {inner} could not be folded")
    m.set_const(rid, value, rtype)
