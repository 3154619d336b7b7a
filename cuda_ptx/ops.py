"""Instruction helpers shared by the generators: parameters, addresses, barriers, stores.

Each helper emits a few IR instructions through a :class:`Builder`; they exist so
the generators read as the algorithm, not as PTX spelling.
"""

from __future__ import annotations

from .config import GemmConfig
from .ir import Builder, Param, Reg


def ld_param(b: Builder, p: Param, typ: str) -> Reg:
    """Load a scalar kernel parameter."""
    r = b.reg(typ)
    b.emit(f"ld.param.{typ}", r, f"[{p}]")
    return r


def ld_param_ptr(b: Builder, p: Param) -> Reg:
    """Load a pointer parameter and convert it to a global-space address."""
    r = ld_param(b, p, "u64")
    g = b.reg("u64")
    b.emit("cvta.to.global.u64", g, r)
    return g


def tile_origin(b: Builder, cfg: GemmConfig) -> tuple[Reg, Reg]:
    """Row and column where this CTA's tile of C starts (one tile per CTA).

    ``cfg.group_m == 0``: CTA (x, y) takes tile (y, x).  Otherwise the CTAs, taken in
    launch order (x fastest), walk the tiles in the grouped order of :func:`tile_at`.
    """
    if not cfg.group_m:
        m0 = b.binop("mul.lo", "u32", b.sreg("%ctaid.y"), cfg.bm)
        n0 = b.binop("mul.lo", "u32", b.sreg("%ctaid.x"), cfg.bn)
        return m0, n0
    tiles_n, tiles_m = b.sreg("%nctaid.x"), b.sreg("%nctaid.y")
    lin = b.mad("u32", b.sreg("%ctaid.y"), tiles_n, b.sreg("%ctaid.x"))
    return tile_at(b, cfg, lin, tiles_n, tiles_m)


def tile_at(b: Builder, cfg: GemmConfig, lin: Reg, tiles_n: Reg, tiles_m: Reg) -> tuple[Reg, Reg]:
    """Row and column where tile number ``lin`` of a ``tiles_m x tiles_n`` grid of tiles starts.

    ``cfg.group_m == 0``: row by row.  Otherwise the tiles are walked in groups of
    ``group_m`` tile-rows: down a column of the group, then to the next column.  CTAs
    resident at the same time then share a few A row-panels and B column-panels, which
    stay in L2, instead of all of B streaming through it.  The last group is shorter
    when the tile-rows run out.
    """
    if not cfg.group_m:
        tile_m, tile_n = b.binop("div", "u32", lin, tiles_n), b.binop("rem", "u32", lin, tiles_n)
        return b.binop("mul.lo", "u32", tile_m, cfg.bm), b.binop("mul.lo", "u32", tile_n, cfg.bn)
    per_group = b.binop("mul.lo", "u32", tiles_n, cfg.group_m)
    first_m = b.binop("mul.lo", "u32", b.binop("div", "u32", lin, per_group), cfg.group_m)
    group_rows = b.binop("min", "u32", b.binop("sub", "u32", tiles_m, first_m), cfg.group_m)
    within = b.binop("rem", "u32", lin, per_group)
    tile_m = b.binop("add", "u32", first_m, b.binop("rem", "u32", within, group_rows))
    tile_n = b.binop("div", "u32", within, group_rows)
    return b.binop("mul.lo", "u32", tile_m, cfg.bm), b.binop("mul.lo", "u32", tile_n, cfg.bn)


def smem_base(b: Builder) -> Reg:
    """The shared-space address of the dynamic shared block (32-bit: shared addresses fit)."""
    return b.mov("u32", "smem")


def addr(b: Builder, base: Reg, off_elems: Reg, esz: int) -> Reg:
    """``base + off_elems * esz`` as a 64-bit address (the offset is widened first)."""
    t = b.reg("u64")
    b.emit("mul.wide.u32", t, off_elems, esz)
    r = b.reg("u64")
    b.emit("add.u64", r, base, t)
    return r


def load_in_f32(b: Builder, cfg: GemmConfig, dst: Reg, ptr: Reg) -> None:
    """Load one input element from global memory and widen it to f32.

    bf16 is the top half of an f32, so a shift widens it on any arch (``cvt.f32.bf16``
    needs sm_90); fp16 goes through ``cvt.f32.f16``.
    """
    if cfg.in_dtype == "bf16":
        u = b.reg("u32")
        b.emit("ld.global.u16", u, f"[{ptr}]")
        b.emit("shl.b32", u, u, 16)
        b.emit("mov.b32", dst, u)
    elif cfg.in_dtype == "fp16":
        h = b.reg("b16")
        b.emit("ld.global.b16", h, f"[{ptr}]")
        b.emit("cvt.f32.f16", dst, h)
    else:
        raise ValueError(f"no scalar widening for {cfg.in_dtype}")


def store_c(b: Builder, cfg: GemmConfig, c_g: Reg, off_elems: Reg, vals: list[Reg]) -> None:
    """Store 1 or 2 consecutive fp32 results at ``C + off_elems`` in the output dtype."""
    osz = 4 if cfg.out_dtype == "f32" else 2
    p = addr(b, c_g, off_elems, osz)
    if cfg.out_dtype == "f32":
        if len(vals) == 1:
            b.emit("st.global.f32", f"[{p}]", vals[0])
        else:
            b.emit("st.global.v2.f32", f"[{p}]", "{" + f"{vals[0]}, {vals[1]}" + "}")
    else:
        if len(vals) == 1:
            h = b.reg("b16")
            b.emit("cvt.rn.bf16.f32", h, vals[0])
            b.emit("st.global.b16", f"[{p}]", h)
        else:
            # cvt.rn.bf16x2.f32 d, hi, lo: the first source lands in the upper half.
            r = b.reg("b32")
            b.emit("cvt.rn.bf16x2.f32", r, vals[1], vals[0])
            b.emit("st.global.b32", f"[{p}]", r)


def bar_sync(b: Builder, barrier: int = 0, count: int | None = None) -> None:
    """Named CTA barrier ``bar.sync id[, count]`` (count: threads taking part)."""
    if count is None:
        b.emit("bar.sync", barrier)
    else:
        b.emit("bar.sync", barrier, count)


def mbar_wait(b: Builder, bar: Reg, parity: Reg) -> None:
    """Spin on ``mbarrier.try_wait.parity`` until the phase with ``parity`` of the barrier at shared
    address ``bar`` has completed."""
    lbl = b.label("wait")
    done = b.reg("pred")
    b.place(lbl)
    b.emit("mbarrier.try_wait.parity.shared::cta.b64", done, f"[{bar}]", parity)
    b.emit("bra", lbl, pred=done, negate=True)


def ring_advance(b: Builder, slot: Reg, phase: Reg, stages: int) -> None:
    """Move a ring position on: slot += 1; on wrap slot = 0 and the expected parity flips."""
    wrap = b.reg("pred")
    b.emit("add.u32", slot, slot, 1)
    b.emit("setp.eq.u32", wrap, slot, stages)
    b.emit("mov.u32", slot, 0, pred=wrap)
    b.emit("xor.b32", phase, phase, 1, pred=wrap)


def reg_vector(regs) -> str:
    """A PTX vector operand ``{%r1, %r2, ...}`` (accumulators, A fragments, stored pairs)."""
    return "{" + ", ".join(str(r) for r in regs) + "}"


def smem_desc(b: Builder, out: Reg, addr: Reg, const: int) -> None:
    """``out = const | ((addr & 0x3FFFF) >> 4)``: a wgmma descriptor for the tile at shared ``addr``
    (``const``: the layout's fields with a zero start, :func:`layout.encode_desc`)."""
    t = b.reg("u32")
    b.emit("and.b32", t, addr, 0x3FFFF)
    b.emit("shr.u32", t, t, 4)
    b.emit("cvt.u64.u32", out, t)
    b.emit("or.b64", out, out, const)
