"""Parse the PTX subset our generators emit into a flat program the emulator runs.

The emulator executes the *text* handed to ``ptxas``, not the IR it came from, so
the renderer is checked too.  The subset: one ``.entry`` with scalar/pointer/
``CUtensorMap`` parameters, ``.reg`` declarations, labels, and instructions of the
form ``[@[!]%p] op.sfx.sfx operand, ...;`` whose operands are registers, special
registers (``%tid.x``), integers, ``0fXXXXXXXX`` floats, symbols, ``_``, memory
references ``[base+off]``, tensor references ``[%rd, {%r, %r}]`` and vectors
``{%f0, %f1}``.  Anything else raises :class:`PtxParseError` naming the line.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

from helios.errors import HeliosError


class PtxParseError(HeliosError, ValueError):
    """The text is outside the PTX subset the emulator understands (names the line)."""


@dataclass(frozen=True)
class RegArg:
    """A register operand (``%r12``)."""

    name: str


@dataclass(frozen=True)
class SpecialArg:
    """A special register (``%tid.x``, ``%ctaid.y``, ``%laneid`` ...)."""

    name: str


@dataclass(frozen=True)
class ImmArg:
    """An integer immediate."""

    value: int


@dataclass(frozen=True)
class FloatArg:
    """An f32 immediate, kept as its 32 bits."""

    bits: int

    @property
    def value(self) -> float:
        return struct.unpack("<f", struct.pack("<I", self.bits))[0]


@dataclass(frozen=True)
class SymArg:
    """A symbol: a parameter, ``smem``, a label, or ``_`` (the sink)."""

    name: str


@dataclass(frozen=True)
class MemArg:
    """``[base+offset]``: base is a register or a symbol."""

    base: RegArg | SymArg
    offset: int


@dataclass(frozen=True)
class TensorArg:
    """``[tmap, {c0, c1, ...}]``: a tensor map address and its coordinates, innermost first."""

    tmap: RegArg
    coords: tuple


@dataclass(frozen=True)
class VecArg:
    """``{a, b, ...}``: a vector of operands."""

    items: tuple


@dataclass
class PtxInstr:
    """One instruction: guard, opcode (split on dots) and parsed operands; ``line`` for messages."""

    op: str
    args: tuple
    pred: str | None = None
    negate: bool = False
    line: int = 0
    text: str = ""
    parts: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # split once here: the handlers look at the parts on every execution
        self.parts = self.op.split(".")


@dataclass
class PtxParam:
    """A kernel parameter: name and kind (``u64``, ``u32``, ``tmap``)."""

    name: str
    kind: str


@dataclass
class PtxProgram:
    """A parsed ``.entry``: parameters, register classes, instructions and label targets."""

    name: str
    target: str
    params: list[PtxParam] = field(default_factory=list)
    reg_types: dict[str, str] = field(default_factory=dict)  # register prefix -> declared type
    instrs: list[PtxInstr] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)  # label -> index of the next instruction
    maxntid: int | None = None
    cluster: tuple[int, int, int] | None = None  # .reqnctapercluster

    def reg_type(self, name: str) -> str:
        """The declared type of register ``name`` (``%rd3`` -> ``b64``)."""
        m = re.fullmatch(r"%([a-z]+)\d+", name)
        if not m or m.group(1) not in self.reg_types:
            raise PtxParseError(f"register {name} is not declared (have classes {sorted(self.reg_types)})")
        return self.reg_types[m.group(1)]


_SPECIAL = re.compile(r"%(tid|ntid|ctaid|nctaid|clusterid|nclusterid|cluster_ctaid|cluster_nctaid)\.[xyz]"
                      r"|%laneid|%warpid|%cluster_ctarank|%cluster_nctarank")
_REG = re.compile(r"%[a-z]+\d+")
_INT = re.compile(r"-?(0[xX][0-9a-fA-F]+|\d+)")
_FLT = re.compile(r"0[fF]([0-9a-fA-F]{8})")
_SYM = re.compile(r"[$A-Za-z_][$\w]*")


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets or braces."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        out.append(tail)
    return out


def parse_operand(tok: str):
    """One operand token to its :class:`RegArg`/``ImmArg``/... form."""
    tok = tok.strip()
    if tok.startswith("{") and tok.endswith("}"):
        return VecArg(tuple(parse_operand(t) for t in _split_top(tok[1:-1])))
    if tok.startswith("[") and tok.endswith("]"):
        inner = tok[1:-1].strip()
        parts = _split_top(inner)
        if len(parts) == 2:  # [tmap, {coords}]
            base = parse_operand(parts[0])
            coords = parse_operand(parts[1])
            if not isinstance(base, RegArg) or not isinstance(coords, VecArg):
                raise PtxParseError(f"tensor reference {tok!r} must be [%rdN, {{coords}}]")
            return TensorArg(base, coords.items)
        m = re.fullmatch(r"([^+\-]+?)\s*(?:([+-])\s*(\d+|0x[0-9a-fA-F]+))?", inner)
        if not m:
            raise PtxParseError(f"cannot parse memory operand {tok!r}")
        base = parse_operand(m.group(1))
        if not isinstance(base, (RegArg, SymArg)):
            raise PtxParseError(f"memory operand base must be a register or symbol: {tok!r}")
        off = int(m.group(3), 0) if m.group(3) else 0
        return MemArg(base, -off if m.group(2) == "-" else off)
    if _SPECIAL.fullmatch(tok):
        return SpecialArg(tok)
    if _REG.fullmatch(tok):
        return RegArg(tok)
    if _FLT.fullmatch(tok):
        return FloatArg(int(_FLT.fullmatch(tok).group(1), 16))
    if _INT.fullmatch(tok):
        return ImmArg(int(tok, 0))
    if _SYM.fullmatch(tok):
        return SymArg(tok)
    raise PtxParseError(f"cannot parse operand {tok!r}")


def parse(ptx: str) -> PtxProgram:
    """Parse one module's ``.entry`` into a :class:`PtxProgram`."""
    target = ""
    lines = ptx.splitlines()
    prog: PtxProgram | None = None
    in_params = False
    in_body = False
    for no, raw in enumerate(lines, 1):
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        if line.startswith(".target"):
            target = line.split()[1]
            continue
        if line.startswith((".version", ".address_size", ".extern")):
            continue
        m = re.match(r"\.visible\s+\.entry\s+(\w+)\s*\(", line)
        if m:
            if prog is not None:
                raise PtxParseError(f"line {no}: only one .entry per module is supported")
            prog = PtxProgram(m.group(1), target)
            in_params = True
            continue
        if prog is None:
            raise PtxParseError(f"line {no}: unexpected {line!r} before the .entry")
        if in_params:
            if line.startswith(")"):
                in_params = False
                continue
            pm = re.match(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+(\w+)(\[\d+\])?", line)
            if not pm:
                raise PtxParseError(f"line {no}: cannot parse parameter {line!r}")
            kind = "tmap" if pm.group(3) else pm.group(1)
            prog.params.append(PtxParam(pm.group(2), kind))
            continue
        if line.startswith(".maxntid"):
            prog.maxntid = int(line.split()[1].rstrip(","))
            continue
        if line.startswith(".minnctapersm"):
            continue
        if line.startswith(".reqnctapercluster"):
            dims = tuple(int(x) for x in line.split(None, 1)[1].replace(",", " ").split())
            if len(dims) != 3:
                raise PtxParseError(f"line {no}: .reqnctapercluster needs three extents, got {line!r}")
            prog.cluster = dims
            continue
        if line == "{":
            in_body = True
            continue
        if line == "}":
            in_body = False
            continue
        if not in_body:
            raise PtxParseError(f"line {no}: unexpected {line!r} outside the kernel body")
        if line.startswith(".reg"):
            rm = re.fullmatch(r"\.reg\s+\.(\w+)\s+%([a-z]+)<\d+>;", line)
            if not rm:
                raise PtxParseError(f"line {no}: cannot parse register declaration {line!r}")
            prog.reg_types[rm.group(2)] = rm.group(1)
            continue
        if line.endswith(":"):
            prog.labels[line[:-1]] = len(prog.instrs)
            continue
        if not line.endswith(";"):
            raise PtxParseError(f"line {no}: instruction without ';': {line!r}")
        body = line[:-1].strip()
        pred, negate = None, False
        if body.startswith("@"):
            g, body = body.split(None, 1)
            negate = g.startswith("@!")
            pred = g[2:] if negate else g[1:]
        op, _, rest = body.partition(" ")
        try:
            args = tuple(parse_operand(t) for t in _split_top(rest)) if rest.strip() else ()
        except PtxParseError as e:
            raise PtxParseError(f"line {no}: {e}") from e
        prog.instrs.append(PtxInstr(op, args, pred, negate, no, raw.strip()))
    if prog is None:
        raise PtxParseError("no .visible .entry in the module")
    for ins in prog.instrs:
        if ins.op.startswith("bra"):
            tgt = ins.args[0]
            if not isinstance(tgt, SymArg) or tgt.name not in prog.labels:
                raise PtxParseError(f"line {ins.line}: branch to unknown label {ins.args[0]}")
    return prog
