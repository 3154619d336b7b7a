"""Parse the PTX subset our generators emit into a flat program the emulator runs.

The emulator executes the *text* handed to ``ptxas``, not the IR it came from, so
the renderer is checked too.  The subset: one ``.entry`` with scalar/pointer/
``CUtensorMap`` parameters, ``.reg`` declarations, labels, and instructions of the
form ``[@[!]%p] op.sfx.sfx operand, ...;`` whose operands are registers, special
registers (``%tid.x``), integers, ``0fXXXXXXXX`` (f32) and ``0dXXXXXXXXXXXXXXXX`` (f64)
floats, symbols, ``_``, negated predicates ``!%p1``, memory references ``[base+off]``,
tensor references ``[%rd, {%r, %r}]`` and vectors ``{%f0, %f1}``.  Also what the
SPIR-V translator writes: parameters on the ``.entry`` line, ``.maxntid X, Y, Z``,
per-thread ``.local`` arrays, several statements on one line and ``/* */`` comments.
Anything else raises :class:`PtxParseError` naming the line.  :func:`parse` is cached
per text (the driver loads the same kernels over and over).
"""

from __future__ import annotations

import functools
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
class DoubleArg:
    """An f64 immediate (``0dXXXXXXXXXXXXXXXX``), kept as its 64 bits."""

    bits: int

    @property
    def value(self) -> float:
        return struct.unpack("<d", struct.pack("<Q", self.bits))[0]


@dataclass(frozen=True)
class NotArg:
    """A negated predicate source operand (``!%p1``)."""

    reg: "RegArg"


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
    pred_arg: RegArg | None = field(init=False, repr=False, compare=False)  # the guard as an operand

    def __post_init__(self) -> None:
        # split once here: the handlers look at the parts on every execution
        self.parts = self.op.split(".")
        self.pred_arg = RegArg(self.pred) if self.pred is not None else None


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
    maxntid: int | None = None  # threads per CTA: the product of .maxntid's extents
    ntid: tuple[int, int, int] | None = None  # .maxntid's extents as written (x, y, z)
    cluster: tuple[int, int, int] | None = None  # .reqnctapercluster
    locals: dict[str, int] = field(default_factory=dict)  # .local arrays: name -> bytes per thread
    shared_name: str = "smem"  # the dynamic shared block (.extern .shared ... NAME[])
    # ops.is_compute_program's answer, kept once asked (a parsed program is shared read-only)
    compute: bool | None = field(default=None, repr=False, compare=False)
    # executor.warp_tables' answer, kept once made (every CTA of every launch reads it)
    warp_tables: tuple | None = field(default=None, repr=False, compare=False)

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
_DBL = re.compile(r"0[dD]([0-9a-fA-F]{16})")
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


@functools.lru_cache(maxsize=1 << 16)
def parse_operand(tok: str):
    """One operand token to its :class:`RegArg`/``ImmArg``/... form (immutable, so cached per token:
    a kernel names the same registers over and over)."""
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
        m = re.fullmatch(r"([^+\-]+?)\s*(?:([+-])\s*(-?)\s*(\d+|0x[0-9a-fA-F]+))?", inner)
        if not m:
            raise PtxParseError(f"cannot parse memory operand {tok!r}")
        base = parse_operand(m.group(1))
        if not isinstance(base, (RegArg, SymArg)):
            raise PtxParseError(f"memory operand base must be a register or symbol: {tok!r}")
        off = int(m.group(4), 0) if m.group(4) else 0
        negative = (m.group(2) == "-") != (m.group(3) == "-")  # [%rd1+-4] is [%rd1-4]
        return MemArg(base, -off if negative else off)
    if tok.startswith("!"):
        reg = parse_operand(tok[1:])
        if not isinstance(reg, RegArg):
            raise PtxParseError(f"only a predicate register can be negated: {tok!r}")
        return NotArg(reg)
    if _SPECIAL.fullmatch(tok):
        return SpecialArg(tok)
    if _REG.fullmatch(tok):
        return RegArg(tok)
    if _FLT.fullmatch(tok):
        return FloatArg(int(_FLT.fullmatch(tok).group(1), 16))
    if _DBL.fullmatch(tok):
        return DoubleArg(int(_DBL.fullmatch(tok).group(1), 16))
    if _INT.fullmatch(tok):
        return ImmArg(int(tok, 0))
    if _SYM.fullmatch(tok):
        return SymArg(tok)
    raise PtxParseError(f"cannot parse operand {tok!r}")


def _statements(ptx: str):
    """``(line number, statement, raw line)`` for each statement: comments removed, a line
    split after each ``;``, labels and braces split off as statements of their own."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), ptx, flags=re.S)
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("//", 1)[0].strip()
        while line:
            if line[0] in "{}" and not line.startswith("{%") and not line.startswith("{ %"):
                yield no, line[0], raw
                line = line[1:].strip()
                continue
            lm = re.match(r"([$A-Za-z_][$\w]*):(?!:)\s*", line)
            if lm and not line.startswith("."):
                yield no, lm.group(1) + ":", raw
                line = line[lm.end():]
                continue
            semi = line.find(";")
            if semi < 0:
                yield no, line, raw
                break
            yield no, line[: semi + 1].strip(), raw
            line = line[semi + 1:].strip()


def _param(text: str, no: int) -> PtxParam:
    pm = re.match(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+(\w+)(\[\d+\])?$", text.strip())
    if not pm:
        raise PtxParseError(f"line {no}: cannot parse parameter {text.strip()!r}")
    return PtxParam(pm.group(2), "tmap" if pm.group(3) else pm.group(1))


@functools.lru_cache(maxsize=1024)
def parse(ptx: str) -> PtxProgram:
    """Parse one module's ``.entry`` into a :class:`PtxProgram` (cached per text: treat it as read-only)."""
    target = ""
    prog: PtxProgram | None = None
    pending: str | None = None  # the .entry's parameter text not yet closed by ')' (None: not in the list)
    depth = 0  # brace depth of the kernel body
    shared_name = "smem"
    for no, line, raw in _statements(ptx):
        if pending is not None:
            pending += " " + line
            if ")" not in pending:
                continue
            line, pending = _close_params(prog, pending, no), None
            if not line:
                continue
        if line.startswith(".target"):
            target = line.split()[1].rstrip(",;")
            continue
        if line.startswith((".version", ".address_size")):
            continue
        if line.startswith(".extern"):
            shared_name = _extern_shared(line, no)
            if prog is not None:
                prog.shared_name = shared_name
            continue
        m = re.match(r"\.visible\s+\.entry\s+(\w+)\s*(\(?)(.*)", line)
        if m:
            if prog is not None:
                raise PtxParseError(f"line {no}: only one .entry per module is supported")
            prog = PtxProgram(m.group(1), target, shared_name=shared_name)
            pending = m.group(3) if m.group(2) else m.group(3).lstrip("(")
            if ")" not in pending:
                continue
            rest, pending = _close_params(prog, pending, no), None  # the whole list on this line
            if rest == "{":
                depth += 1
            elif rest and not rest.startswith("."):
                raise PtxParseError(f"line {no}: unexpected {rest!r} after the parameters")
            if not rest.startswith("."):
                continue
            line = rest  # a directive after the list: read below
        if prog is None:
            raise PtxParseError(f"line {no}: unexpected {line!r} before the .entry")
        if _kernel_directive(prog, line, no):
            continue
        if line == "{":
            depth += 1
            continue
        if line == "}":
            depth -= 1
            continue
        if depth <= 0:
            raise PtxParseError(f"line {no}: unexpected {line!r} outside the kernel body")
        _body_statement(prog, line, raw, no)
    if prog is None:
        raise PtxParseError("no .visible .entry in the module")
    for ins in prog.instrs:
        if ins.op.startswith("bra"):
            tgt = ins.args[0]
            if not isinstance(tgt, SymArg) or tgt.name not in prog.labels:
                raise PtxParseError(f"line {ins.line}: branch to unknown label {ins.args[0]}")
    return prog


def _close_params(prog: PtxProgram, pending: str, no: int) -> str:
    """Add the parameters of ``pending`` (the list's text up to its ')') to ``prog``; the text after it."""
    inside, _, rest = pending.partition(")")
    for piece in inside.split(","):
        if piece.strip():
            prog.params.append(_param(piece, no))
    return rest.strip()


def _extern_shared(line: str, no: int) -> str:
    """The name of the dynamic shared array an ``.extern .shared`` line declares."""
    sm = re.match(r"\.extern\s+\.shared\s+(?:\.align\s+\d+\s+)?\.\w+\s+(\w+)\s*\[\s*\]\s*;", line)
    if not sm:
        raise PtxParseError(f"line {no}: only an .extern .shared array NAME[] is supported: {line!r}")
    return sm.group(1)


def _kernel_directive(prog: PtxProgram, line: str, no: int) -> bool:
    """Read a performance directive of the kernel (.maxntid, .reqnctapercluster; .minnctapersm,
    .reqntid and .pragma are skipped) into ``prog``; False where ``line`` is none of them."""
    if line.startswith(".maxntid"):
        dims = [int(x) for x in line.split(None, 1)[1].replace(",", " ").replace(";", " ").split()]
        if not 1 <= len(dims) <= 3:
            raise PtxParseError(f"line {no}: .maxntid needs one to three extents, got {line!r}")
        prog.ntid = tuple(dims + [1] * (3 - len(dims)))
        prog.maxntid = dims[0] * (dims[1] if len(dims) > 1 else 1) * (dims[2] if len(dims) > 2 else 1)
        return True
    if line.startswith((".minnctapersm", ".reqntid", ".pragma")):
        return True
    if line.startswith(".reqnctapercluster"):
        dims = tuple(int(x) for x in line.split(None, 1)[1].replace(",", " ").split())
        if len(dims) != 3:
            raise PtxParseError(f"line {no}: .reqnctapercluster needs three extents, got {line!r}")
        prog.cluster = dims
        return True
    return False


def _body_statement(prog: PtxProgram, line: str, raw: str, no: int) -> None:
    """One statement of the kernel body into ``prog``: a register or local-array declaration, a
    label, or an instruction (its guard, opcode and operands)."""
    if line.startswith(".reg"):
        rm = re.fullmatch(r"\.reg\s+\.(\w+)\s+%([a-z]+)<\d+>;", line)
        if not rm:
            raise PtxParseError(f"line {no}: cannot parse register declaration {line!r}")
        prog.reg_types[rm.group(2)] = rm.group(1)
        return
    if line.startswith(".local"):
        lm = re.fullmatch(r"\.local\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(\w+)\s*\[\s*(\d+)\s*\];", line)
        if not lm or lm.group(2) not in ("b8", "u8", "s8"):
            raise PtxParseError(f"line {no}: only .local .align A .b8 NAME[N] arrays are supported: {line!r}")
        prog.locals[lm.group(3)] = int(lm.group(4))
        return
    if line.startswith("."):
        raise PtxParseError(f"line {no}: directive {line.split()[0]} is not supported: {line!r}")
    if line.endswith(":"):
        prog.labels[line[:-1]] = len(prog.instrs)
        return
    if not line.endswith(";"):
        raise PtxParseError(f"line {no}: instruction without ';': {line!r}")
    body = line[:-1].strip()
    pred, negate = None, False
    if body.startswith("@"):
        g, body = body.split(None, 1)
        negate = g.startswith("@!")
        pred = g[2:] if negate else g[1:]
    op, *rest = body.split(None, 1)
    rest = rest[0] if rest else ""
    try:
        args = tuple(parse_operand(t) for t in _split_top(rest)) if rest.strip() else ()
    except PtxParseError as e:
        raise PtxParseError(f"line {no}: {e}") from e
    prog.instrs.append(PtxInstr(op, args, pred, negate, no, raw.strip()))
