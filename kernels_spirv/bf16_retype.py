"""Declare a compiled kernel's 16-bit float type bfloat16 (SPV_KHR_bfloat16).

The shader compiler this project can install (glslang 13) has no ``bfloat16_t``
(GL_EXT_bfloat16 came later), so a bf16 cooperative-matrix kernel is written with
``float16_t`` standing for bfloat16 (``-DF16_AS_BF16``) and compiled as fp16.  Its
SPIR-V then differs from the bf16 module only in how the 16-bit float type is
declared: ``retype`` adds the BFloat16KHR encoding to that ``OpTypeFloat 16``, the
capabilities BFloat16TypeKHR and BFloat16CooperativeMatrixKHR and the extension, and drops
the Float16 capability (no IEEE fp16 type is left, so a device without fp16 arithmetic runs it).

That is only sound where the kernel never relies on fp16's encoding: a 16-bit
float constant other than zero would change its value (its bits are kept), and
arithmetic on bfloat16 values is not allowed at all (SPV_KHR_bfloat16 allows
memory, conversion, composite and function instructions, OpSelect, OpPhi and the
cooperative-matrix multiply-add).  ``retype`` refuses a module with such a
constant or with an instruction outside that list taking or giving the type; the
tests run spirv-val on the result.

This file must not import helios: kernels_spirv/build.py loads it by path.
"""

from __future__ import annotations

import struct

MAGIC = 0x07230203
OP_EXTENSION, OP_CAPABILITY, OP_TYPE_FLOAT = 10, 17, 22
OP_CONSTANT, OP_SPEC_CONSTANT = 43, 50
CAP_BF16_TYPE, CAP_BF16_COOPMAT = 5116, 5118  # BFloat16TypeKHR, BFloat16CooperativeMatrixKHR
CAP_FLOAT16 = 9  # IEEE fp16 arithmetic: no such type is left, so no device need have it
ENCODING_BF16 = 0  # the FP Encoding operand of OpTypeFloat: BFloat16KHR
EXTENSION = "SPV_KHR_bfloat16"

# Opcodes that may take or give a bfloat16 value (SPV_KHR_bfloat16's validation rules, as far
# as a compute kernel uses them).  Types, constants and annotations are checked apart.
_MEMORY = set(range(59, 71)) | {4457, 4458}        # OpVariable .. OpInBoundsPtrAccessChain; coopmat load, store
_CONVERSIONS = set(range(109, 125))                # OpConvertFToU .. OpBitcast
_COMPOSITES = set(range(77, 85)) | {400}           # OpVectorExtractDynamic .. OpTranspose, OpCopyLogical
_FUNCTIONS = {54, 55, 57, 254}                     # OpFunction, OpFunctionParameter, OpFunctionCall, OpReturnValue
_OTHERS = {169, 245, 4459, 4460}                   # OpSelect, OpPhi, coopmat multiply-add and length
ALLOWED = _MEMORY | _CONVERSIONS | _COMPOSITES | _FUNCTIONS | _OTHERS
_TYPES_ON = {23, 24, 28, 29, 30, 32, 33, 4456}     # types built on others: vector .. function, coopmat
OP_FUNCTION = 54
OP_EXT_INST = 12  # operands: result type, result, set, instruction (a literal, not an id), ids
# Body instructions that take no value of a float type: their other operands are labels and
# literals (a line, a merge's control, a branch's weights, a switch's cases), any of which may
# equal a 16-bit value's id.  OpLine, OpLoopMerge, OpSelectionMerge, OpBranchConditional, OpSwitch.
_NO_FLOAT_OPERANDS = {8, 246, 247, 250, 251}


class RetypeError(ValueError):
    """The module cannot be declared bfloat16 as it is."""


def words_of(spirv: bytes) -> tuple:
    """The 32-bit words of a little-endian SPIR-V module; a RetypeError for anything else."""
    if len(spirv) % 4 or len(spirv) < 20:
        raise RetypeError("not a SPIR-V module (length)")
    words = struct.unpack(f"<{len(spirv) // 4}I", spirv)
    if words[0] != MAGIC:
        raise RetypeError("not a little-endian SPIR-V module")
    return words


def instructions(words: tuple):
    """(offset, opcode, operand words) of each instruction of a module's ``words`` after the header."""
    at = 5
    while at < len(words):
        count, op = words[at] >> 16, words[at] & 0xFFFF
        if count == 0 or at + count > len(words):
            raise RetypeError(f"malformed instruction at word {at}")
        yield at, op, words[at + 1:at + count]
        at += count


def _string_words(text: str) -> list[int]:
    """A SPIR-V literal string: UTF-8, nul-terminated, padded to whole words (little-endian)."""
    raw = text.encode() + b"\0"
    raw += b"\0" * (-len(raw) % 4)
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def _bf16_types(words: tuple) -> set[int]:
    """Ids of the 16-bit float type and of every type built on it (vectors, arrays, pointers, ...)."""
    ids: set[int] = set()
    for _, op, ops in instructions(words):
        if op == OP_TYPE_FLOAT and ops[1] == 16:
            if len(ops) > 2:
                raise RetypeError("the module already declares a 16-bit float encoding")
            ids.add(ops[0])
        elif op in _TYPES_ON and any(o in ids for o in ops[1:]):
            ids.add(ops[0])
    return ids


def _check_uses(words: tuple, scalar: int, types: set[int]) -> None:
    """Refuse a 16-bit float constant other than +-0, a specialization constant of that type, and
    any function-body instruction outside ALLOWED that gives or takes a value of ``types``."""
    values: set[int] = set()
    in_body = False
    for at, op, ops in instructions(words):
        if op == OP_SPEC_CONSTANT and ops[0] == scalar:
            raise RetypeError(f"a 16-bit float specialization constant (word {at}) would change its value")
        if op == OP_CONSTANT and ops[0] == scalar and ops[2] & 0x7FFF:
            raise RetypeError(f"the 16-bit float constant 0x{ops[2]:04x} (word {at}) would change its value")
        in_body = in_body or op == OP_FUNCTION
        if not in_body:
            if op in {OP_CONSTANT, 44, 46} and ops[0] in types:  # constants (composite, null) of the types
                values.add(ops[1])
            continue
        gives = len(ops) > 1 and ops[0] in types
        takes = () if op in _NO_FLOAT_OPERANDS else ops[4:] if op == OP_EXT_INST else ops
        if op not in ALLOWED and (gives or any(o in values for o in takes)):
            raise RetypeError(f"opcode {op} (word {at}) works on a 16-bit float: not allowed on bfloat16")
        if gives:
            values.add(ops[1])


def retype(spirv: bytes) -> bytes:
    """``spirv`` with its 16-bit float type declared bfloat16 (see the module docstring); a
    RetypeError where the module has no such type or relies on fp16's encoding."""
    words = words_of(spirv)
    types = _bf16_types(words)
    scalars = [ops[0] for _, op, ops in instructions(words) if op == OP_TYPE_FLOAT and ops[1] == 16]
    if not scalars:
        raise RetypeError("the module has no 16-bit float type")
    _check_uses(words, scalars[0], types)
    out = list(words[:5])
    caps_done = False
    for at, op, ops in instructions(words):
        if not caps_done and op != OP_CAPABILITY:
            out += [(2 << 16) | OP_CAPABILITY, CAP_BF16_TYPE, (2 << 16) | OP_CAPABILITY, CAP_BF16_COOPMAT]
            ext = _string_words(EXTENSION)
            out += [((1 + len(ext)) << 16) | OP_EXTENSION, *ext]
            caps_done = True
        if op == OP_TYPE_FLOAT and ops[1] == 16:
            out += [(4 << 16) | OP_TYPE_FLOAT, ops[0], 16, ENCODING_BF16]
        elif op == OP_CAPABILITY and ops[0] == CAP_FLOAT16:
            continue
        else:
            out += words[at:at + 1 + len(ops)]
    return struct.pack(f"<{len(out)}I", *out)
