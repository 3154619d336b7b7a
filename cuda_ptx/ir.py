"""A small intermediate form for tiled GPU kernels, rendered to PTX by :mod:`render`.

The IR has the handful of things a tiled GEMM needs and no more:

* :class:`Reg` / :class:`Pred` -- virtual registers of one PTX type; the renderer
  declares them per type (``.reg .f32 %f<N>``) so ptxas does the real allocation.
* :class:`Param` -- a kernel parameter (scalar, pointer, or an opaque 128-byte
  ``CUtensorMap`` passed by value, which TMA reads from parameter space).
* :class:`SharedTile` -- a named region of the one dynamic shared-memory block, with
  shape, dtype, alignment and swizzle recorded so the layout model can check it.
* statements: :class:`Instr` (one PTX instruction, optionally predicated),
  :class:`Loop` (a counted loop rendered with labels and a branch), :class:`If`,
  :class:`Comment`.  Barriers (``bar.sync``, ``mbarrier.*``, ``wgmma.fence``) are
  instructions built by helpers in :mod:`ops`, so every ordering point is visible
  in the statement list.

Generators build a :class:`Kernel` with :class:`Builder`; nothing here knows GEMM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Union

# PTX register classes: the prefix each type gets in the declaration.
REG_PREFIX = {
    "pred": "p",
    "b16": "h",
    "b32": "r",
    "u32": "r",
    "s32": "r",
    "b64": "rd",
    "u64": "rd",
    "s64": "rd",
    "f32": "f",
    "f64": "fd",
}
# Types sharing one declared class (u32/s32/b32 all live in %r).
REG_CLASS = {
    "pred": "pred",
    "b16": "b16",
    "b32": "b32",
    "u32": "b32",
    "s32": "b32",
    "b64": "b64",
    "u64": "b64",
    "s64": "b64",
    "f32": "f32",
    "f64": "f64",
}


@dataclass(frozen=True)
class Reg:
    """A virtual register: PTX class (``b32``, ``f32``, ...) and index within it."""

    cls: str
    index: int

    def __str__(self) -> str:
        return f"%{REG_PREFIX[self.cls]}{self.index}"


Pred = Reg  # a predicate is a register of class "pred"


@dataclass(frozen=True)
class Param:
    """A kernel parameter. ``kind`` is ``u64`` (pointer), ``u32``/``s32``/``f32``, or ``tmap``."""

    name: str
    kind: str

    def __str__(self) -> str:
        return self.name

    def decl(self) -> str:
        """The parameter's declaration in the ``.entry`` signature."""
        if self.kind == "tmap":
            # A CUtensorMap is 128 opaque bytes, 64-byte aligned; TMA reads it in param space.
            return f".param .align 128 .b8 {self.name}[128]"
        return f".param .{self.kind} {self.name}"


@dataclass(frozen=True)
class SharedTile:
    """A region of dynamic shared memory: byte ``offset`` from the block base, ``nbytes`` long.

    ``shape``/``dtype`` describe the tile (rows, cols) as stored; ``swizzle`` is the
    byte width of the XOR swizzle applied to it (0, 32, 64, 128), ``pad`` extra
    elements per row (the padded layouts of the mma.sync path).
    """

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...] = ()
    dtype: str = "b8"
    swizzle: int = 0
    pad: int = 0


Operand = Union[Reg, Param, int, float, str]  # noqa: UP007 (a runtime alias, 3.10-safe)


def fmt_operand(op: Operand) -> str:
    """Render one operand: registers by name, ints in decimal, floats as exact hex f32."""
    if isinstance(op, bool):
        return "1" if op else "0"
    if isinstance(op, int):
        return str(op)
    if isinstance(op, float):
        import struct

        return f"0f{struct.unpack('<I', struct.pack('<f', op))[0]:08X}"
    return str(op)


@dataclass
class Instr:
    """One PTX instruction. Operands render comma-separated; ``pred`` guards it (``@p``/``@!p``)."""

    op: str
    operands: tuple[Operand, ...] = ()
    pred: Reg | None = None
    negate: bool = False


@dataclass
class Comment:
    """A comment line in the rendered PTX (explains why, for whoever reads the output)."""

    text: str


@dataclass
class Label:
    """A branch target (for spin loops such as an mbarrier wait)."""

    name: str


@dataclass
class Loop:
    """``for (counter = start; counter < end; counter += step) body`` over a u32 register.

    ``start``, ``end`` and ``step`` are registers or ints; the loop is bottom-tested and
    assumes at least one trip (the generators guarantee it: K is a positive multiple
    of the tile, and a persistent kernel is launched with no more CTAs than tiles).
    """

    counter: Reg
    start: Operand
    end: Operand
    step: Operand
    body: list = field(default_factory=list)
    label: str = ""
    test: Reg | None = None  # the predicate the back-edge tests


@dataclass
class If:
    """Run ``body`` only where ``pred`` holds (``negate`` inverts); rendered as a branch around it."""

    pred: Reg
    body: list = field(default_factory=list)
    negate: bool = False
    label: str = ""


Stmt = Union[Instr, Comment, Label, Loop, If]  # noqa: UP007


@dataclass
class Kernel:
    """A whole ``.entry``: signature, launch bounds, shared tiles and the statement tree."""

    name: str
    target: str
    version: str
    params: list[Param] = field(default_factory=list)
    body: list = field(default_factory=list)
    shared: list[SharedTile] = field(default_factory=list)
    maxntid: tuple[int, int, int] | None = None
    minnctapersm: int | None = None
    cluster: tuple[int, int, int] | None = None  # .reqnctapercluster: CTAs per cluster, fixed at compile time
    reg_counts: dict[str, int] = field(default_factory=dict)
    threads: int = 0

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory the kernel needs at launch."""
        return max((t.offset + t.nbytes for t in self.shared), default=0)

    def tile(self, name: str) -> SharedTile:
        """Look a shared tile up by name."""
        for t in self.shared:
            if t.name == name:
                return t
        raise KeyError(f"no shared tile named {name!r}; have {[t.name for t in self.shared]}")


class Builder:
    """Builds a :class:`Kernel`: allocate registers and shared tiles, emit statements.

    Statements go to the innermost open block (``with b.loop(...)``/``with b.if_(...)``).
    """

    def __init__(self, name: str, target: str, version: str, threads: int) -> None:
        self.kernel = Kernel(name=name, target=target, version=version, threads=threads)
        self._blocks: list[list] = [self.kernel.body]
        self._labels = 0

    # -- declarations -------------------------------------------------------------
    def param(self, name: str, kind: str) -> Param:
        """Add a kernel parameter."""
        p = Param(name, kind)
        self.kernel.params.append(p)
        return p

    def reg(self, typ: str) -> Reg:
        """A fresh virtual register of PTX type ``typ``."""
        cls = REG_CLASS[typ]
        n = self.kernel.reg_counts.get(cls, 0)
        self.kernel.reg_counts[cls] = n + 1
        return Reg(cls, n)

    def regs(self, typ: str, n: int) -> list[Reg]:
        """``n`` fresh registers of one type."""
        return [self.reg(typ) for _ in range(n)]

    def shared(
        self,
        name: str,
        nbytes: int,
        align: int = 16,
        shape: tuple[int, ...] = (),
        dtype: str = "b8",
        swizzle: int = 0,
        pad: int = 0,
    ) -> SharedTile:
        """Place a tile in dynamic shared memory at the next ``align``-aligned offset."""
        off = self.kernel.shared_bytes
        off = (off + align - 1) // align * align
        t = SharedTile(name, off, nbytes, shape, dtype, swizzle, pad)
        self.kernel.shared.append(t)
        return t

    def label(self, stem: str) -> str:
        """A unique label name."""
        self._labels += 1
        return f"${stem}_{self._labels}"

    # -- statements ---------------------------------------------------------------
    def emit(self, op: str, *operands: Operand, pred: Reg | None = None, negate: bool = False) -> None:
        """Append one instruction to the current block."""
        self._blocks[-1].append(Instr(op, tuple(operands), pred, negate))

    def place(self, label: str) -> None:
        """Put ``label`` at the current point."""
        self._blocks[-1].append(Label(label))

    def comment(self, text: str) -> None:
        """Append a comment line."""
        self._blocks[-1].append(Comment(text))

    @contextlib.contextmanager
    def loop(self, counter: Reg, start: Operand, end: Operand, step: Operand) -> Iterator[Loop]:
        """Open a counted loop; statements emitted inside form its body."""
        lp = Loop(counter, start, end, step, [], self.label("loop"), self.reg("pred"))
        self._blocks[-1].append(lp)
        self._blocks.append(lp.body)
        try:
            yield lp
        finally:
            self._blocks.pop()

    @contextlib.contextmanager
    def if_(self, pred: Reg, negate: bool = False) -> Iterator[If]:
        """Open a block run only where ``pred`` (or its negation) holds."""
        blk = If(pred, [], negate, self.label("skip"))
        self._blocks[-1].append(blk)
        self._blocks.append(blk.body)
        try:
            yield blk
        finally:
            self._blocks.pop()

    # -- small conveniences used by every generator ------------------------------------
    def mov(self, typ: str, value: Operand) -> Reg:
        """A fresh register holding ``value``."""
        r = self.reg(typ)
        self.emit(f"mov.{typ}", r, value)
        return r

    def sreg(self, name: str) -> Reg:
        """Read a special register (``%tid.x``, ``%ctaid.y``, ...) into a fresh u32."""
        r = self.reg("u32")
        self.emit("mov.u32", r, name)
        return r

    def binop(self, op: str, typ: str, a: Operand, b: Operand) -> Reg:
        """``d = a <op> b`` into a fresh register."""
        r = self.reg(typ)
        self.emit(f"{op}.{typ}", r, a, b)
        return r

    def mad(self, typ: str, a: Operand, b: Operand, c: Operand) -> Reg:
        """``d = a*b + c`` (low half for integers) into a fresh register."""
        r = self.reg(typ)
        op = "mad.lo" if typ[0] in "us" else "fma.rn"
        self.emit(f"{op}.{typ}", r, a, b, c)
        return r

    def setp(self, cmp: str, typ: str, a: Operand, b: Operand) -> Reg:
        """A fresh predicate ``a <cmp> b``."""
        p = self.reg("pred")
        self.emit(f"setp.{cmp}.{typ}", p, a, b)
        return p

    def build(self) -> Kernel:
        """Finish and return the kernel."""
        if len(self._blocks) != 1:
            raise RuntimeError("unclosed loop/if block in kernel builder")
        return self.kernel
