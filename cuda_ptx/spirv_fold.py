"""Constant folding for SPIR-V instructions whose operands are all known.

Specialization constants (a kernel's op code, its workgroup size, a layout flag) are known
when a pipeline is built, so the translator folds every instruction they reach: an
``OpSwitch`` over the op code of ``ew_unary`` becomes one branch, and the other cases are
never emitted.  Integers are kept as unsigned bit patterns of their width; the opcodes
say when to read them as signed.
"""

from __future__ import annotations

import math
import struct

from .spirv import Module, wrap_int


def _signed(v: int, width: int) -> int:
    return v - (1 << width) if v >> (width - 1) & 1 else v


def _f32(x: float) -> float:
    """``x`` rounded to float32, as the device would hold it."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


_INT_BIN = {
    "IAdd": lambda a, b, w: a + b, "ISub": lambda a, b, w: a - b, "IMul": lambda a, b, w: a * b,
    "UDiv": lambda a, b, w: a // b if b else (1 << w) - 1, "UMod": lambda a, b, w: a % b if b else 0,
    "SDiv": lambda a, b, w: int(_signed(a, w) / _signed(b, w)) if b else -1,
    "SRem": lambda a, b, w: int(math.fmod(_signed(a, w), _signed(b, w))) if b else 0,
    "ShiftLeftLogical": lambda a, b, w: a << b if b < w else 0,
    "ShiftRightLogical": lambda a, b, w: a >> b if b < w else 0,
    "ShiftRightArithmetic": lambda a, b, w: _signed(a, w) >> min(b, w - 1),
    "BitwiseAnd": lambda a, b, w: a & b, "BitwiseOr": lambda a, b, w: a | b, "BitwiseXor": lambda a, b, w: a ^ b,
}
_INT_CMP = {
    "IEqual": lambda a, b, w: a == b, "INotEqual": lambda a, b, w: a != b,
    "UGreaterThan": lambda a, b, w: a > b, "UGreaterThanEqual": lambda a, b, w: a >= b,
    "ULessThan": lambda a, b, w: a < b, "ULessThanEqual": lambda a, b, w: a <= b,
    "SGreaterThan": lambda a, b, w: _signed(a, w) > _signed(b, w),
    "SGreaterThanEqual": lambda a, b, w: _signed(a, w) >= _signed(b, w),
    "SLessThan": lambda a, b, w: _signed(a, w) < _signed(b, w),
    "SLessThanEqual": lambda a, b, w: _signed(a, w) <= _signed(b, w),
}
_LOGIC = {"LogicalAnd": lambda a, b: a and b, "LogicalOr": lambda a, b: a or b,
          "LogicalEqual": lambda a, b: a == b, "LogicalNotEqual": lambda a, b: a != b}
_FLOAT_BIN = {"FAdd": lambda a, b: a + b, "FSub": lambda a, b: a - b, "FMul": lambda a, b: a * b}


def _componentwise(m: Module, rtype: int, vals: list, fn):
    """Apply ``fn`` to scalars, or component by component to vectors (tuples)."""
    if isinstance(vals[0], tuple):
        t = m.types[rtype]
        et = t.elem if t.kind == "vector" else rtype
        return tuple(_componentwise(m, et, [v[i] for v in vals], fn) for i in range(len(vals[0])))
    return fn(*vals)


def _scalar_type(m: Module, tid: int):
    t = m.types[tid]
    return m.types[t.elem] if t.kind == "vector" else t


def fold(m: Module, op: str, rtype: int, args: tuple):
    """The value of ``op`` (operand words ``args``, result type ``rtype``) if every operand it reads
    is a constant of ``m``, else None."""
    def const(i):
        return m.consts.get(args[i])

    if op == "CompositeExtract":
        v = const(0)
        if v is None:
            return None
        for lit in args[1:]:
            v = v[lit]
        return v
    if op == "CompositeConstruct":
        parts = [m.consts.get(a) for a in args]
        if any(p is None for p in parts):
            return None
        flat = []
        for p in parts:  # a vector built from smaller vectors concatenates them
            flat.extend(p if isinstance(p, tuple) and m.types[rtype].kind == "vector" else (p,))
        return tuple(flat)
    if op == "VectorShuffle":
        a, b = const(0), const(1)
        if a is None or b is None:
            return None
        both = tuple(a) + tuple(b)
        return tuple(both[i] for i in args[2:])
    if op == "Select":
        c, a, b = const(0), const(1), const(2)
        if c is None:
            return None
        if not isinstance(c, tuple):
            return (a if c else b) if (a if c else b) is not None else None
        if a is None or b is None:
            return None
        return tuple(x if k else y for k, x, y in zip(c, a, b))
    vals = [m.consts.get(a) for a in args]
    if any(v is None for v in vals) or not vals:
        return None
    st = _scalar_type(m, rtype)
    if op in _INT_BIN:
        w = st.width
        return _componentwise(m, rtype, vals, lambda a, b: wrap_int(_INT_BIN[op](a, b, w), st))
    if op in _INT_CMP:
        w = _scalar_type(m, m.type_of_const(args[0])).width
        return _componentwise(m, rtype, vals, lambda a, b: _INT_CMP[op](a, b, w))
    if op in _LOGIC:
        return _componentwise(m, rtype, vals, _LOGIC[op])
    if op == "LogicalNot":
        return _componentwise(m, rtype, vals, lambda a: not a)
    if op == "Not":
        return _componentwise(m, rtype, vals, lambda a: wrap_int(~a, st))
    if op == "SNegate":
        return _componentwise(m, rtype, vals, lambda a: wrap_int(-a, st))
    if op in ("UConvert", "SConvert"):
        src = _scalar_type(m, m.type_of_const(args[0]))
        if op == "SConvert":
            return _componentwise(m, rtype, vals, lambda a: wrap_int(_signed(a, src.width), st))
        return _componentwise(m, rtype, vals, lambda a: wrap_int(a, st))
    if op in _FLOAT_BIN and st.kind == "float":
        return _componentwise(m, rtype, vals, lambda a, b: _f32(_FLOAT_BIN[op](a, b)))
    if op == "FNegate":
        return _componentwise(m, rtype, vals, lambda a: -a)
    if op == "ConvertUToF":
        return _componentwise(m, rtype, vals, lambda a: _f32(float(a)))
    return None  # not folded: emitted as code

