"""Semantics of each PTX instruction the emulator models: for :class:`executor.Cta` (the
GEMM generators' kernels) and, compiled per program, for :class:`executor.Grid` (compute
kernels; the second half of this file).

A handler is ``fn(cta, ins, lanes)``: ``lanes`` are the thread ids that execute
the instruction (after the guard predicate), ``cta`` gives operand access
(:meth:`Cta.read` / :meth:`Cta.write` / :meth:`Cta.address`) and the state.  A
handler returns ``"spin"`` when the warp should give up its turn (a failed
``mbarrier.try_wait``).  Unknown opcodes are refused at load time, naming the line.

Comparisons, selects, conversions and float arithmetic have one definition, the
compiled form of the second half: the warp scheduler runs it through
:class:`_CtaOperands`, which reads and writes the CTA's registers with the same checks
as every other handler.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from .. import dtypes as D
from .. import layout as L
from .state import (SMEM_BASE, SMEM_CLUSTER_BASE, SMEM_CLUSTER_STRIDE, BulkStore, CpAsyncOp, EmulationError,
                        MBarrier, WgmmaOp)
from .ptx_parse import (DoubleArg, FloatArg, ImmArg, MemArg, NotArg, PtxInstr, PtxParseError, RegArg, SpecialArg, SymArg,
                        TensorArg, VecArg)

# -- integer and float arithmetic --------------------------------------------------------


def _width(typ: str) -> int:
    return 64 if typ.endswith("64") else 16 if typ.endswith("16") else 32


def _binop(fn):
    def h(cta, ins, lanes):
        t = ins.parts[-1]
        a = cta.read(ins.args[1], lanes, t)
        b = cta.read(ins.args[2], lanes, t)
        cta.write(ins.args[0], lanes, fn(a, b).astype(a.dtype))

    return h


def _div(cta, ins, lanes):
    t = ins.parts[-1]
    a, b = cta.read(ins.args[1], lanes, t), cta.read(ins.args[2], lanes, t)
    zero = b == 0
    bs = np.where(zero, b.dtype.type(1), b)
    r = a // bs if ins.parts[0] == "div" else a % bs
    # x / 0 is unspecified in PTX: all ones, without failing (a select may discard it)
    cta.write(ins.args[0], lanes, np.where(zero, ~b.dtype.type(0), r).astype(a.dtype))


def _shift(cta, ins, lanes):
    t = ins.parts[-1]
    a = cta.read(ins.args[1], lanes, t)
    amount = ins.args[2]
    if amount.__class__ is ImmArg and 0 <= amount.value < _width(t):
        # An immediate inside the width (the usual case): the shift in the operand's own type
        # wraps (shl) or fills with the sign (shr.s) as PTX says, with no widening.
        cta.write(ins.args[0], lanes, (a << amount.value) if ins.parts[0] == "shl" else (a >> amount.value))
        return
    s = cta.read(ins.args[2], lanes, "u32").astype(np.uint64)
    bits = _width(t)
    wide = a.astype(np.uint64) if t[0] != "s" else a.astype(np.int64)
    s_clamped = np.minimum(s, bits).astype(wide.dtype)
    if ins.parts[0] == "shl":
        r = np.where(s >= bits, 0, wide << np.minimum(s_clamped, bits - 1))
    else:
        r = np.where(s >= bits, 0 if t[0] != "s" else wide >> (bits - 1), wide >> np.minimum(s_clamped, bits - 1))
    mask = (1 << bits) - 1
    cta.write(ins.args[0], lanes, (r.astype(np.uint64) & np.uint64(mask)).astype(VIEW_UNSIGNED[bits]).view(a.dtype))


VIEW_UNSIGNED = {16: np.uint16, 32: np.uint32, 64: np.uint64}


def _mul(cta, ins, lanes):
    mode, t = ins.parts[1], ins.parts[-1]
    a, b = cta.read(ins.args[1], lanes, t), cta.read(ins.args[2], lanes, t)
    if mode == "wide":
        wide = np.int64 if t[0] == "s" else np.uint64
        cta.write(ins.args[0], lanes, a.astype(wide) * b.astype(wide))
    elif mode == "lo":
        cta.write(ins.args[0], lanes, (a * b).astype(a.dtype))
    else:
        raise cta.fail(f"mul.{mode} is not modelled")


def _mad(cta, ins, lanes):
    if ins.parts[1] != "lo":
        raise cta.fail(f"mad.{ins.parts[1]} is not modelled")
    t = ins.parts[-1]
    a, b, c = (cta.read(x, lanes, t) for x in ins.args[1:4])
    cta.write(ins.args[0], lanes, (a * b + c).astype(a.dtype))


def _fma(cta, ins, lanes):
    a, b, c = (cta.read(x, lanes, "f32").astype(np.float64) for x in ins.args[1:4])
    cta.write(ins.args[0], lanes, (a * b + c).astype(np.float32))


def _pred_logic(cta, ins, lanes):
    a, b = cta.read(ins.args[1], lanes, "pred"), cta.read(ins.args[2], lanes, "pred")
    fn = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[ins.parts[0]]
    cta.write(ins.args[0], lanes, fn(a, b))


def _mov(cta, ins, lanes):
    t = ins.parts[-1]
    cta.write(ins.args[0], lanes, cta.read(ins.args[1], lanes, t))


def _cvta(cta, ins, lanes):
    # Global and parameter addresses are already generic in the emulator.
    cta.write(ins.args[0], lanes, cta.read(ins.args[1], lanes, "u64"))


def _bra(cta, ins, lanes):
    cta.pc[lanes] = cta.prog.labels[ins.args[0].name]


def _ret(cta, ins, lanes):
    cta.alive[lanes] = False


def _nop(cta, ins, lanes):
    return None


# -- memory ----------------------------------------------------------------------------

_LD_TYPES = {"u16": 2, "b16": 2, "u32": 4, "s32": 4, "b32": 4, "f32": 4, "u64": 8, "b64": 8}


def _ld_param(cta, ins, lanes):
    bits = _width(ins.parts[-1])
    v = int(cta.param_value(ins.args[1].base.name)) & ((1 << bits) - 1)
    cta.write(ins.args[0], lanes, np.full(lanes.size, v, np.uint64 if bits == 64 else np.uint32))


def _vec_regs(arg) -> list:
    return list(arg.items) if isinstance(arg, VecArg) else [arg]


def _ld(cta, ins, lanes):
    """``ld.{global,shared,param}[.v2|.v4].TYPE``: a vector load reads its ``vec * size``
    bytes at once (aligned to the whole vector, as PTX requires)."""
    space, t = ins.parts[1].split("::")[0], ins.parts[-1]
    if space == "param":
        return _ld_param(cta, ins, lanes)
    if t not in _LD_TYPES:
        raise cta.fail(f"{ins.op}: type .{t} is not modelled")
    size = _LD_TYPES[t]
    dsts = _vec_regs(ins.args[0])
    vec = next((int(x[1:]) for x in ins.parts[2:-1] if x in ("v2", "v4")), 1)
    if len(dsts) != vec:
        raise cta.fail(f"{ins.op} needs {vec} destinations, got {len(dsts)}")
    addr = cta.address(ins.args[1], lanes)
    if space == "global":
        raw = cta.mem.load(addr.astype(np.uint64), size * vec)
    elif space == "shared":
        raw = cta.smem[cta.smem_index(addr, size * vec)]
    else:
        raise cta.fail(f"ld.{space} is not modelled")
    words = raw.copy().view({2: np.uint16, 4: np.uint32, 8: np.uint64}[size]).reshape(lanes.size, vec)
    for j, dst in enumerate(dsts):
        val = words[:, j]
        if size == 2 and cta.prog.reg_type(dst.name) == "b32":
            val = val.astype(np.uint32)  # ld.u16 into a 32-bit register zero-extends
        cta.write(dst, lanes, val)


def _st(cta, ins, lanes):
    parts = ins.parts
    space = parts[1]
    t = parts[-1]
    vec = int(parts[2][1:]) if parts[2].startswith("v") else 1
    regs = _vec_regs(ins.args[1])
    if len(regs) != vec:
        raise cta.fail(f"{ins.op} needs {vec} values, got {len(regs)}")
    size = _LD_TYPES[t]
    vals = [cta.read(r, lanes, t).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[size]) for r in regs]
    # each lane's bytes, its vector's elements in order (one value: its own bytes, no stacking)
    data = (vals[0] if vec == 1 else np.stack(vals, axis=1)).view(np.uint8).reshape(lanes.size, size * vec)
    addr = cta.address(ins.args[0], lanes)
    if space == "global":
        if np.any(addr % (size * vec)):
            raise cta.fail(f"misaligned {ins.op} at {int(addr[addr % (size * vec) != 0][0]):#x}")
        cta.mem.store(addr.astype(np.uint64), data)
    elif space == "shared":
        idx, lo, hi = cta.smem_span(addr, size * vec)  # one span test first: most stores touch neither
        for a in cta.mbars:
            if lo < a + 8 and a <= hi and np.any((idx >= a) & (idx < a + 8)):
                raise cta.fail(f"store overwrites the mbarrier at {a:#x}")
        for op in cta.bulk_pending:
            if lo < op.src + op.tmap.box_bytes and op.src <= hi and \
                    np.any((idx >= op.src) & (idx < op.src + op.tmap.box_bytes)):
                raise cta.fail(f"st.shared overwrites the box at {op.src:#x} that a bulk (TMA) store still reads "
                               "(wait for it with cp.async.bulk.wait_group.read first)")
        cta.smem[idx] = data
        cta.write_seq += 1
        cta.smem_writer[idx] = lanes[:, None]
        cta.smem_seq[idx] = cta.write_seq
    else:
        raise cta.fail(f"st.{space} is not modelled")


# -- Ampere async copies, ldmatrix, mma.sync ----------------------------------------------


def _cp_async(cta, ins, lanes):
    w = int(lanes[0]) // 32 if lanes.size else None
    if w is None:
        return
    size = int(ins.args[2].value)
    dst = cta.address(ins.args[0], lanes)
    src = cta.address(ins.args[1], lanes)
    cta.smem_index(dst, size)  # bounds/alignment now, not at landing time
    cta.cp_open.setdefault(w, []).append(CpAsyncOp(dst, src, size))


def _whole_warp(cta, lanes, what: str) -> int:
    w = int(lanes[0]) // 32
    live = np.arange(32 * w, 32 * w + 32)
    live = live[cta.alive[live]]
    if lanes.size != live.size:
        raise cta.fail(f"{what} executed by only some lanes of the warp; the emulator tracks its groups per warp")
    return w


def _cp_commit(cta, ins, lanes):
    w = _whole_warp(cta, lanes, "cp.async.commit_group")
    cta.cp_groups.setdefault(w, []).append(cta.cp_open.pop(w, []))


def _cp_wait(cta, ins, lanes):
    w = _whole_warp(cta, lanes, "cp.async.wait_group")
    keep = int(ins.args[0].value)
    groups = cta.cp_groups.get(w, [])
    while len(groups) > keep:
        for op in groups.pop(0):
            data = cta.mem.load(op.src.astype(np.uint64), op.size)
            cta.smem[cta.smem_index(op.dst, op.size)] = data


def _ldmatrix(cta, ins, lanes):
    p = ins.parts
    if "m8n8" not in p or "x4" not in p or p[-1] != "b16":
        raise cta.fail(f"{ins.op} is not modelled (only m8n8.x4 b16)")
    addr = cta.address(ins.args[1], lanes)
    if np.any(addr % 16):
        raise cta.fail("ldmatrix row addresses must be 16-byte aligned")
    rows = cta.smem[cta.smem_index(addr, 16)].copy().view(np.uint16)  # (32, 8)
    frag = L.ldmatrix([rows[i] for i in range(32)], trans="trans" in p)  # (32, 4, 2) uint16
    for j, r in enumerate(_vec_regs(ins.args[0])):
        v = frag[:, j, 0].astype(np.uint32) | (frag[:, j, 1].astype(np.uint32) << np.uint32(16))
        cta.write(r, lanes, v)


def _unpack16(words: np.ndarray, typ: str) -> np.ndarray:
    """Two 16-bit floats packed in each u32 -> float64 [..., 2] (low half first)."""
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16)
    if typ == "bf16":
        return D.bf16_bits_to_f32(halves).astype(np.float64)
    return halves.view(np.float16).astype(np.float64)


def _mma_sync(cta, ins, lanes):
    p = ins.parts
    if "m16n8k16" not in p or p[-4] != "f32" or p[-1] != "f32":
        raise cta.fail(f"{ins.op} is not modelled (only m16n8k16 with f32 accumulators)")
    typ = p[-3]
    dregs, aregs, bregs, cregs = (_vec_regs(a) for a in ins.args)
    a = _unpack16(np.stack([cta.read(r, lanes, "b32") for r in aregs], axis=1), typ)  # (32, 4, 2)
    b = _unpack16(np.stack([cta.read(r, lanes, "b32") for r in bregs], axis=1), typ)  # (32, 2, 2)
    c = np.stack([cta.read(r, lanes, "f32") for r in cregs], axis=1).astype(np.float64)
    d = L.mma_m16n8k16(a, b, c).astype(np.float32)
    for j, r in enumerate(dregs):
        cta.write(r, lanes, d[:, j])


def _shfl(cta, ins, lanes):
    """``shfl.sync.{bfly,idx,up,down}.b32 d, a, b, c, membermask`` within one 32-lane warp.

    Every live lane ``membermask`` names must execute it together (the lanes at the warp's
    lowest PC; a lane elsewhere would make the GPU wait or misbehave), and no lane outside
    the mask may.  Each lane reads ``a`` of its source lane (:func:`shfl_source_lane`); a
    source that executes it must have written ``a``.
    """
    p = ins.parts
    if "sync" not in p or p[-1] != "b32" or len(ins.args) != 5:
        raise cta.fail(f"{ins.op} is not modelled (shfl.sync.{{idx,bfly,down,up}}.b32 d, a, b, c, membermask)")
    mode = p[2]
    src = ins.args[1]
    if mode not in ("idx", "bfly", "down", "up") or not isinstance(src, RegArg):
        raise cta.fail(f"{ins.op}: expected shfl.sync.{{idx,bfly,down,up}}.b32 with a register source")
    masks = cta.read(ins.args[4], lanes, "u32")
    mask = int(masks[0])
    if np.any(masks != masks[0]):
        raise cta.fail("shfl.sync: the lanes disagree on membermask")
    w = int(lanes[0]) // 32
    warp = np.arange(32 * w, 32 * w + 32)
    named = warp[(mask >> (warp % 32) & 1).astype(bool) & cta.alive[warp]]
    if not np.array_equal(np.sort(lanes), named):
        missing, extra = np.setdiff1d(named, lanes), np.setdiff1d(lanes, named)
        why = (f"lanes {lane_ranges(missing)} named in membermask {mask:#x} are not executing it with the others"
               if missing.size else f"lanes {lane_ranges(extra)} execute it outside membermask {mask:#x}")
        raise cta.fail(f"shfl.sync: {why}")
    lane = lanes.astype(np.int64) % 32
    j = shfl_source_lane(mode, lane, cta.read(ins.args[2], lanes, "u32"), cta.read(ins.args[3], lanes, "u32"))
    source = 32 * w + j
    reg = cta.regs.get(src.name)
    if reg is None or reg.dtype != np.uint32:
        cta.read(src, lanes, "b32")  # raises: never written, or not a 32-bit register
    if src.name in cta.wgmma_state(lanes).locked:
        raise cta.fail(f"register {src.name} read while a wgmma writing it is in flight (no wgmma.wait_group)")
    unwritten = source[~cta.written[src.name][source]]
    if unwritten.size:
        raise cta.fail(f"shfl reads register {src.name} of lane {int(unwritten[0]) % 32}, which never wrote it")
    cta.write(ins.args[0], lanes, reg[source].copy())


def lane_ranges(lanes: np.ndarray) -> str:
    """Compact text for a set of thread ids as lanes of their warp (``0-3,8``)."""
    ids = sorted({int(x) % 32 for x in lanes})
    out, start = [], None
    for i, v in enumerate(ids):
        start = v if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


# -- Hopper: mbarrier, TMA, wgmma, setmaxnreg ---------------------------------------------


def _per_address(cta, lanes, arg):
    addr = cta.address(arg, lanes)
    uniq, counts = np.unique(addr, return_counts=True)
    return addr, uniq, counts


def _mbarrier(cta, ins, lanes):
    if lanes.size == 0:
        return None
    verb = ins.parts[1]
    if verb == "init":
        addr = cta.address(ins.args[0], lanes)
        count = int(cta.read(ins.args[1], lanes[:1], "u32")[0])
        for t, a in zip(lanes.tolist(), addr.tolist()):
            if a % 8:
                raise cta.fail(f"mbarrier at {a:#x} is not 8-byte aligned")
            cta.smem_index(np.array([a]), 8)
            cta.mbars[a] = MBarrier(count, count, published=False, init_thread=t)
        return None
    if verb == "arrive":
        addr, uniq, counts = _per_address(cta, lanes, ins.args[1])
        tx = int(cta.read(ins.args[2], lanes[:1], "u32")[0]) if "expect_tx" in ins.parts else 0
        if "shared::cluster" in ins.parts:  # the address may name a peer CTA's barrier (mapa)
            _remote_arrive(cta, ins, lanes, addr, tx)
            return None
        for a, n in zip(uniq.tolist(), counts.tolist()):
            b = cta.mbar(a)
            if tx:
                b.expect_tx(tx * n)
            b.arrive(n, cta.where())
        return None
    if verb == "try_wait":
        if "parity" not in ins.parts:
            raise cta.fail("only mbarrier.try_wait.parity is modelled")
        addr = cta.address(ins.args[1], lanes)
        parity = cta.read(ins.args[2], lanes, "u32")
        asked = list(zip(addr.tolist(), parity.tolist()))  # a warp usually asks one question 32 times
        answer = {k: cta.mbar(k[0]).test_parity(k[1]) for k in dict.fromkeys(asked)}
        ok = np.array([answer[k] for k in asked], bool)
        cta.write(ins.args[0], lanes, ok)
        return None if ok.any() else "spin"
    raise cta.fail(f"{ins.op} is not modelled")


def _remote_arrive(cta, ins, lanes, addr, tx: int) -> None:
    """``mbarrier.arrive.shared::cluster``: one arrival per lane on the barrier its address
    names (this CTA's or a peer's).

    It takes effect at once, but an arrival on a peer's barrier stays *unordered* until the
    arriving thread's next releasing ``barrier.cluster.arrive``: a peer that exits while
    one is unordered is an error (the arrival may still be in flight on a GPU)."""
    if tx:
        raise cta.fail("expect_tx on a shared::cluster barrier address is not modelled")
    for t, a in zip(lanes.tolist(), addr.tolist()):
        owner, local = cta.resolve_shared(int(a))
        cta.barrier_in(owner, local).arrive(1, cta.where())
        if owner is not cta:
            cta.unordered_remote.setdefault(t, set()).add(owner.rank)


def _tensor_rank(cta, ins, arg, tm) -> int:
    """The rank the opcode names (``.1d`` .. ``.5d``), checked against the tensor map's and the coordinates."""
    dims = [x for x in ins.parts if len(x) == 2 and x[1] == "d" and x[0] in "12345"]
    if len(dims) != 1:
        raise cta.fail(f"{ins.op}: expected one of .1d .. .5d")
    rank = int(dims[0][0])
    if rank != tm.rank:
        raise cta.fail(f"{ins.op} through a tensor map of rank {tm.rank}")
    if len(arg.coords) != rank:
        raise cta.fail(f"{ins.op} needs {rank} coordinates, got {len(arg.coords)}")
    return rank


def _tma_load(cta, ins, lanes):
    """``cp.async.bulk.tensor.{1..5}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
    [dst], [tmap, {c0, ..}], [mbar]{, ctaMask}`` (coordinates innermost first, signed).

    Without ``.multicast::cluster`` the box lands at ``dst`` and completes its bytes on
    ``mbar``, in the CTA those shared::cluster addresses name (the executing one for plain
    shared addresses).  With it, the box lands at the same CTA-relative offset in every
    CTA of ``ctaMask`` and completes on the barrier at ``mbar``'s offset in each, each
    landing at its own time.
    """
    p = ins.parts
    if "tile" not in p:
        raise cta.fail(f"{ins.op} is not modelled (only tile-mode loads)")
    multicast = "multicast::cluster" in p
    if len(ins.args) != (4 if multicast else 3):
        raise cta.fail("TMA load operands: [dst], [tensormap, {coords}], [mbar]" + (", ctaMask" if multicast else ""))
    dst_arg, src_arg, bar_arg = ins.args[:3]
    if not isinstance(src_arg, TensorArg):
        raise cta.fail("TMA source must be [tensormap, {coords}]")
    for t in lanes.tolist():
        one = np.array([t])
        dst_owner, dst = cta.resolve_shared(int(cta.address(dst_arg, one)[0]))
        bar_owner, bar = cta.resolve_shared(int(cta.address(bar_arg, one)[0]))
        if dst_owner is not bar_owner:
            raise cta.fail("TMA destination and its mbarrier are in different CTAs")
        tm = cta.tensor_map_at(int(cta.read(src_arg.tmap, one, "u64")[0]))
        _tensor_rank(cta, ins, src_arg, tm)
        coords = tuple(int(cta.read(c, one, "s32")[0]) for c in src_arg.coords)
        if (dst - SMEM_BASE) % 128:
            raise cta.fail(f"TMA destination {dst:#x} is not 128-byte aligned")
        targets = [dst_owner]
        if multicast:
            mask = int(cta.read(ins.args[3], one, "u16")[0])
            if mask == 0 or mask >> len(cta.peers):
                raise cta.fail(f"ctaMask {mask:#x} is empty or names CTAs outside the cluster of {len(cta.peers)}")
            targets = [cta.peers[r] for r in range(len(cta.peers)) if mask >> r & 1]
        for tgt in targets:
            tgt.smem_index(np.array([dst]), 1)
            tgt.smem_index(np.array([dst + tm.box_bytes - 1]), 1)
            cta.barrier_in(tgt, bar)  # must exist (and a peer's be published) when the copy is issued
            cta.schedule_tma(lambda tgt=tgt, dst=dst, bar=bar, tm=tm, coords=coords: _land_box(tgt, dst, bar, tm, coords))


def _box_shape(tm) -> tuple[int, ...]:
    """The box as an array of bytes, outermost dimension first: ``(box[r-1], .., box[1], box[0] * itemsize)``."""
    return tuple(reversed(tm.box[1:])) + (tm.box[0] * tm.itemsize,)


def _clip_box(tm, coords: tuple[int, ...]):
    """The part of the box at ``coords`` (innermost first) inside the tensor, as (tensor, box)
    index tuples over their byte views (outermost first); None when the box misses the
    tensor in some dimension."""
    in_tensor, in_box = [], []
    for i, (c, d, n) in enumerate(zip(coords, tm.dims, tm.box)):
        lo, hi = max(c, 0), min(c + n, d)
        if hi <= lo:
            return None
        scale = tm.itemsize if i == 0 else 1  # the inner dimension is in bytes
        in_tensor.append(slice(lo * scale, hi * scale))
        in_box.append(slice((lo - c) * scale, (hi - c) * scale))
    return tuple(reversed(in_tensor)), tuple(reversed(in_box))


def _tensor_bytes(mem, tm) -> np.ndarray:
    """The tensor map's tensor as a writable byte view, outermost dimension first, the inner
    one in bytes: ``(dims[r-1], .., dims[1], dims[0] * itemsize)`` with the map's strides.
    The whole tensor must lie in one allocation."""
    width = tm.dims[0] * tm.itemsize
    extent = width + sum((d - 1) * s for d, s in zip(tm.dims[1:], tm.strides))
    flat = mem.view(tm.base, extent)
    shape = tuple(reversed(tm.dims[1:])) + (width,)
    return np.lib.stride_tricks.as_strided(flat, shape, tuple(reversed(tm.strides)) + (1,))


def _land_box(tgt, dst: int, bar: int, tm, coords: tuple[int, ...]) -> None:
    """A TMA box arrives in CTA ``tgt``: read the tensor now, write it swizzled at ``dst``, complete its bytes on ``bar``.

    The box lands as ``box_rows`` rows of its inner extent (outer dimensions flattened,
    dimension 1 fastest), and the swizzle applies to those rows as to a 2-D box."""
    if tgt.exited:
        raise EmulationError(f"a TMA copy landed in CTA {tgt.ctaid[:2]} after it exited: a CTA must not leave "
                             "while copies into its shared memory are in flight")
    box = np.zeros(_box_shape(tm), np.uint8)
    clip = _clip_box(tm, coords)
    if clip:  # out-of-bounds parts of the box stay zero, as TMA fills them
        in_tensor, in_box = clip
        box[in_box] = _tensor_bytes(tgt.mem, tm)[in_tensor]
    lin = np.arange(tm.box_bytes) + dst
    bits = L.SWIZZLE_BITS[tm.swizzle]
    # The swizzle is a function of the absolute shared address, as in hardware.
    idx = L.swizzle(lin, bits)
    for a in tgt.mbars:
        if dst <= a < dst + tm.box_bytes:
            raise EmulationError(f"TMA box written at {dst:#x} overwrites the mbarrier at {a:#x}")
    tgt.smem[idx] = box.reshape(-1)
    tgt.mbar(bar).complete_tx(tm.box_bytes)


def _fence(cta, ins, lanes):
    """``fence.proxy.async``: this thread's shared-memory writes so far become visible to
    the async proxy (TMA).  ``fence.mbarrier_init``: the barriers this thread initialised
    are published to the cluster's peers.  Other fences order nothing the emulator models."""
    if ins.parts[1] == "proxy" and ins.parts[2].startswith("async"):
        cta.fenced_upto[lanes] = cta.write_seq
    elif ins.parts[1] == "mbarrier_init":
        cta.publish_barriers(lanes)


def _mapa(cta, ins, lanes):
    """``mapa.shared::cluster.u32 d, a, rank``: the shared::cluster address of shared address
    ``a`` (this CTA's) in the cluster's CTA ``rank``."""
    if "shared::cluster" not in ins.parts:
        raise cta.fail(f"{ins.op} is not modelled (only mapa.shared::cluster)")
    a = cta.read(ins.args[1], lanes, "u32").astype(np.int64)
    rank = cta.read(ins.args[2], lanes, "u32").astype(np.int64)
    if (rank >= len(cta.peers)).any():
        raise cta.fail(f"mapa to CTA rank {int(rank.max())} of a cluster of {len(cta.peers)}")
    cta.smem_index(a, 1)  # a must be in this CTA's own shared window
    cta.write(ins.args[0], lanes, (SMEM_CLUSTER_BASE + rank * SMEM_CLUSTER_STRIDE + a - SMEM_BASE).astype(np.uint32))


def _barrier(cta, ins, lanes):
    """``barrier.cluster.arrive`` / ``barrier.cluster.wait`` (``barrier.sync`` is the scheduler's).

    Each thread arrives once, then waits until every thread of the cluster has arrived;
    a wait that cannot pass yet leaves the warp where it is (``"spin"``).  A releasing
    arrive (not ``.relaxed``) orders the thread's earlier remote arrivals before the
    barrier and publishes the barriers it initialised.
    """
    p = ins.parts
    cb = cta.cluster_barrier
    if p[2] == "arrive":
        if cta.cb_arrived[lanes].any():
            raise cta.fail("barrier.cluster.arrive twice without a barrier.cluster.wait in between")
        if "relaxed" not in p:  # .release (the default): this thread's earlier operations complete first
            cta.publish_barriers(lanes)
            for t in lanes.tolist():
                cta.unordered_remote.pop(t, None)
        cta.cb_arrived[lanes] = True
        cta.cb_generation[lanes] = cb.generation
        cb.arrive(lanes.size)
        return None
    if p[2] == "wait":
        if not cta.cb_arrived[lanes].all():
            raise cta.fail("barrier.cluster.wait without a barrier.cluster.arrive before it")
        if (cta.cb_generation[lanes] < cb.generation).all():
            cta.cb_arrived[lanes] = False
            return None
        cta.pc[lanes] -= 1  # stay on the wait
        return "spin"
    raise cta.fail(f"{ins.op} is not modelled")


def _tma_store(cta, ins, lanes):
    """``cp.async.bulk.tensor.{1..5}d.global.shared::cta.bulk_group [tmap, {c0, ..}], [smem]``."""
    dst_arg, src_arg = ins.args
    if not isinstance(dst_arg, TensorArg):
        raise cta.fail("TMA store destination must be [tensormap, {coords}]")
    for t in lanes.tolist():
        one = np.array([t])
        src = int(cta.address(src_arg, one)[0])
        tm = cta.tensor_map_at(int(cta.read(dst_arg.tmap, one, "u64")[0]))
        _tensor_rank(cta, ins, dst_arg, tm)
        coords = tuple(int(cta.read(c, one, "s32")[0]) for c in dst_arg.coords)
        if (src - SMEM_BASE) % 1024:
            raise cta.fail(f"TMA store source {src:#x} is not 1024-byte aligned (the 128B swizzle atom)")
        cta.smem_index(np.array([src, src + tm.box_bytes - 1]), 1)
        span = slice(src, src + tm.box_bytes)
        writers, seqs = cta.smem_writer[span], cta.smem_seq[span]
        unseen = (writers >= 0) & (seqs > cta.fenced_upto[np.maximum(writers, 0)])
        if unseen.any():
            who = sorted(set(writers[unseen].tolist()))
            raise cta.fail(f"TMA store reads shared memory that threads {who[:4]}{'...' if len(who) > 4 else ''} "
                           "wrote without a fence.proxy.async since: the async proxy may not see it")
        op = BulkStore(src, tm, coords)
        cta.bulk_open.setdefault(t, []).append(op)
        cta.bulk_pending.append(op)
        op.queued = cta.schedule_tma(lambda op=op: _land_store(cta, op))


def _land_store(cta, op: BulkStore) -> None:
    """The store reads its box from shared memory (unswizzling it) and writes the in-bounds part to the tensor."""
    if op.landed:
        return
    tm = op.tmap
    idx = L.swizzle(np.arange(tm.box_bytes) + op.src, L.SWIZZLE_BITS[tm.swizzle])
    box = cta.smem[idx].reshape(_box_shape(tm))
    clip = _clip_box(tm, op.coords)
    if clip:  # TMA stores clip the box to the tensor
        in_tensor, in_box = clip
        _tensor_bytes(cta.mem, tm)[in_tensor] = box[in_box]
    op.landed = True
    cta.bulk_pending.remove(op)
    if op.queued in cta.tma_queue:  # landed early, at a wait: nothing left to do at its queued time
        cta.tma_queue.remove(op.queued)


def _bulk_commit(cta, ins, lanes):
    for t in lanes.tolist():
        cta.bulk_groups.setdefault(t, []).append(cta.bulk_open.pop(t, []))


def _bulk_wait(cta, ins, lanes):
    """``cp.async.bulk.wait_group[.read] N``: every group but this thread's newest N has landed."""
    keep = int(ins.args[0].value)
    for t in lanes.tolist():
        groups = cta.bulk_groups.get(t, [])
        while len(groups) > keep:
            for op in groups.pop(0):
                _land_store(cta, op)


def _wgmma(cta, ins, lanes):
    verb = ins.parts[1]
    if verb == "mma_async":  # the four warps together
        _wgmma_issue(cta, ins, lanes)
        return
    st = cta.wgmma_state(lanes)  # the rest: each warp on its own share
    if verb == "fence":
        st.dirty.clear()
    elif verb == "commit_group":
        st.groups.append(st.open_ops)
        st.open_ops = []
    elif verb == "wait_group":
        keep = int(ins.args[0].value)
        while len(st.groups) > keep:
            for run in _same_acc_runs(st.groups.pop(0)):
                _wgmma_retire(cta, lanes, run)
        flying = [op for g in st.groups for op in g] + st.open_ops
        st.locked = {r for op in flying for r in op.acc}
        st.inputs = {r for op in flying for r in op.a_regs}
    else:
        raise cta.fail(f"{ins.op} is not modelled")


def _uniform(cta, vals: np.ndarray, what: str) -> int:
    if np.any(vals != vals[0]):
        raise cta.fail(f"{what} differs across the warpgroup (wgmma needs it uniform)")
    return int(vals[0])


def _wgmma_issue(cta, ins, lanes) -> None:
    """``wgmma.mma_async`` by the 128 threads of a warpgroup: check the operands, queue the op.

    Two forms: A from shared memory (``d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b
    [, imm-trans-a, imm-trans-b]``) or, for 16-bit inputs, A from registers (``d, {a0, a1,
    a2, a3}, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-b``; the fragment of
    :func:`layout.wgmma_a_map`).  Register A is read here, and its registers may not be
    written until the wgmma retires (the tensor core reads them asynchronously); like the
    accumulators, they must not have been written since the last ``wgmma.fence``.
    """
    p = ins.parts
    shape = next(x for x in p if x.startswith("m64n"))
    n = int(shape[4: shape.index("k")])
    k = int(shape[shape.index("k") + 1:])
    if p[-3] != "f32":
        raise cta.fail("only f32 accumulators are modelled")
    in_dtype = p[-2]
    args = ins.args
    acc = [r.name for r in _vec_regs(args[0])]
    if len(acc) != n // 2:
        raise cta.fail(f"m64n{n} needs {n // 2} accumulator registers, got {len(acc)}")
    a_in_regs = isinstance(args[1], VecArg)
    a_regs = [r.name for r in _vec_regs(args[1])] if a_in_regs else []
    if a_in_regs and (in_dtype not in ("bf16", "f16") or k != 16):
        raise cta.fail(f"wgmma with A in registers is modelled for m64nNk16 bf16/f16 only, not .{shape}.{in_dtype}")
    if a_in_regs and len(a_regs) != 4:
        raise cta.fail(f"A in registers takes four .b32 registers per thread, got {len(a_regs)}")
    warps = [cta.wgmma[w] for w in sorted({int(t) // 32 for t in lanes})]
    for st in warps:
        for r in acc + a_regs:
            if r in st.dirty:
                what = "accumulator" if r in acc else "A-fragment register"
                raise cta.fail(f"{what} {r} was written by an ordinary instruction after the last wgmma.fence")
    # read now: every A register must have been written (cta.read checks) and is held fixed below
    a_frag = np.stack([cta.read(RegArg(r), lanes, "b32") for r in a_regs], axis=1) if a_in_regs else None
    da = None if a_in_regs else _uniform(cta, cta.read(args[1], lanes, "u64"), "descriptor A")
    db = _uniform(cta, cta.read(args[2], lanes, "u64"), "descriptor B")
    scale_d = bool(_uniform(cta, cta.read(args[3], lanes, "pred").astype(np.int64), "scale-d"))
    rest = [int(a.value) for a in args[4:]]
    if rest[:2] != [1, 1]:
        raise cta.fail("imm-scale-a/b other than 1 are not modelled")
    if a_in_regs:
        if len(rest) != 3:
            raise cta.fail("wgmma with A in registers takes imm-scale-a, imm-scale-b and imm-trans-b (7 operands)")
        trans_a, trans_b = 0, rest[2]
    else:
        trans_a, trans_b = (rest[2], rest[3]) if len(rest) == 4 else (0, 0)
    if in_dtype == "e4m3" and len(rest) != 2:
        raise cta.fail("fp8 wgmma takes no transpose arguments")
    itemsize = 1 if in_dtype == "e4m3" else 2
    for r in acc:
        if not cta.written[r][lanes].all() and scale_d:
            raise cta.fail(f"accumulator {r} read (scale-d=1) before anything wrote it")
    op = WgmmaOp(acc, da, db, scale_d, n, k * itemsize, in_dtype, bool(trans_b), ins.line, bool(trans_a),
                 a_regs, a_frag)
    for st in warps:
        st.open_ops.append(op)
        st.locked.update(acc)
        st.inputs.update(a_regs)


def _decode(raw: np.ndarray, in_dtype: str) -> np.ndarray:
    if in_dtype == "bf16":
        return D.bf16_bits_to_f32(raw.view(np.uint16)).astype(np.float64)
    if in_dtype == "f16":
        return raw.view(np.float16).astype(np.float64)
    if in_dtype == "e4m3":
        return D.decode(raw.view(np.uint8), "e4m3").astype(np.float64)
    raise EmulationError(f"wgmma input type {in_dtype} is not modelled")


def _a_from_registers(frag: np.ndarray, in_dtype: str) -> np.ndarray:
    """The 64 x 16 A tile (float64) that 128 threads' four ``.b32`` registers (``frag[thread, reg]``) hold."""
    rows, cols = L.wgmma_a_map()
    a = np.zeros((64, 16), np.float64)
    a[rows, cols] = _unpack16(frag, "bf16" if in_dtype == "bf16" else "f16")
    return a


def _warp_rows(cta, lanes, op, r0: int) -> np.ndarray:
    """Rows ``r0 .. r0 + 15`` (one warp's) of ``op``'s 64 x n product, float64, from the operands the
    descriptors name *now* (a warp retires its share when it waits, and reads what is there then)."""
    raw_t = np.uint8 if op.in_dtype == "e4m3" else np.uint16
    for d in (op.desc_a, op.desc_b):
        if d is not None and L.decode_desc(d)["start"] < SMEM_BASE:
            raise cta.fail(f"wgmma descriptor (line {op.line}) starts at {L.decode_desc(d)['start']:#x}, "
                           f"below the shared block at {SMEM_BASE:#x}")
    try:
        k = op.k_bytes // np.dtype(raw_t).itemsize
        if op.a_frag is not None:
            a = _a_from_registers(op.a_frag, op.in_dtype)[r0:r0 + 16]
        elif op.trans_a:
            a = _decode(L.wgmma_gather_mn(cta.smem, op.desc_a, 64, k, raw_t)[r0:r0 + 16], op.in_dtype)
        else:
            a = _decode(L.wgmma_gather(cta.smem, op.desc_a, 64, op.k_bytes, raw_t)[r0:r0 + 16], op.in_dtype)
        if op.trans_b:
            b = _decode(L.wgmma_gather_mn(cta.smem, op.desc_b, op.n, k, raw_t), op.in_dtype)  # n x k
        else:
            b = _decode(L.wgmma_gather(cta.smem, op.desc_b, op.n, op.k_bytes, raw_t), op.in_dtype)  # n x k
    except IndexError as e:
        raise cta.fail(f"wgmma operand (line {op.line}) runs past the shared block: {e}") from e
    return a @ b.T  # 16 x n


@functools.lru_cache(maxsize=None)
def _d_pick(n: int) -> np.ndarray:
    """``[lane, register]``: where each accumulator register of a ``wgmma m64nN`` lies in its warp's
    16 x n rows of the product, as flat indices (layout.wgmma_d_map: the same for every warp, less
    the warp's 16 w rows)."""
    rows, cols = L.wgmma_d_map(n)
    idx = rows[:32] * n + cols[:32]
    idx.flags.writeable = False
    return idx


def _same_acc_runs(group: list) -> list:
    """A commit group's ops in issue order, cut into runs of consecutive ops with the same accumulators."""
    runs = []
    for op in group:
        if runs and runs[-1][0].acc == op.acc:
            runs[-1].append(op)
        else:
            runs.append([op])
    return runs


def _wgmma_retire(cta, lanes, ops: list) -> None:
    """Retire one warp's share of ``ops`` (consecutive ops of one commit group with the same
    accumulators, in issue order): each adds its product to the accumulators in float32, as one
    op at a time would, but the registers are read and written once for the run."""
    r0 = (int(lanes[0]) % 128) // 32 * 16  # the warp's 16 rows of the 64
    pick = _d_pick(ops[0].n)[lanes % 32]
    # A warp's lanes are contiguous: a slice reads and writes each register without a gather.
    at = slice(int(lanes[0]), int(lanes[-1]) + 1) if int(lanes[-1]) - int(lanes[0]) + 1 == lanes.size else lanes
    regs, written = cta.regs, cta.written
    acc = None
    for op in ops:
        out = np.take(_warp_rows(cta, lanes, op, r0), pick)  # [lane, register]
        if op.scale_d:
            if acc is None:
                acc = np.stack([regs[r][at] for r in op.acc], axis=1).view(np.float32)
            out += acc
        acc = out.astype(np.float32)
    out = acc.view(np.uint32)
    # Straight into the registers: the wgmma owns them, so cta.write's in-flight checks do not apply.
    for j, r in enumerate(ops[0].acc):
        regs[r][at] = out[:, j]
        written[r][at] = True


def _setmaxnreg(cta, ins, lanes):
    g = int(lanes[0]) // 128
    cur = cta.nreg[g]
    n = int(ins.args[0].value)
    if n % 8 or not 24 <= n <= 256:
        raise cta.fail(f"setmaxnreg {n}: must be a multiple of 8 in [24, 256]")
    if ins.parts[1] == "dec" and n > cur:
        raise cta.fail(f"setmaxnreg.dec {n} above the current {cur} registers per thread")
    if ins.parts[1] == "inc" and n < cur:
        raise cta.fail(f"setmaxnreg.inc {n} below the current {cur} registers per thread")
    cta.nreg[g] = n
    total = 128 * sum(cta.nreg)
    if total > 65536:
        raise cta.fail(f"setmaxnreg budgets need {total} registers per CTA; an SM has 65536")


# -- dispatch -----------------------------------------------------------------------------

_TABLE = {
    "add": _binop(lambda a, b: a + b),
    "sub": _binop(lambda a, b: a - b),
    "and": _binop(lambda a, b: a & b),
    "or": _binop(lambda a, b: a | b),
    "xor": _binop(lambda a, b: a ^ b),
    "min": _binop(np.minimum),
    "max": _binop(np.maximum),
    "div": _div,
    "rem": _div,
    "shl": _shift,
    "shr": _shift,
    "mul": _mul,
    "mad": _mad,
    "fma": _fma,
    "mov": _mov,
    "cvta": _cvta,
    "bra": _bra,
    "ret": _ret,
    "ld": _ld,
    "st": _st,
    "fence": _fence,
    "bar": _nop,  # handled by the scheduler (a CTA barrier)
    "barrier": _barrier,
    "mapa": _mapa,
    "ldmatrix": _ldmatrix,
    "mma": _mma_sync,
    "mbarrier": _mbarrier,
    "wgmma": _wgmma,
    "setmaxnreg": _setmaxnreg,
}


def _compiled_on_cta(ins: PtxInstr) -> bool:
    """Whether the warp scheduler runs ``ins`` through the vectorised executor's compiled form:
    comparisons, selects, conversions and float arithmetic (``fma.f32`` keeps its own handler;
    arithmetic on 16-bit floats is refused there, not run as integer arithmetic)."""
    head, t = ins.parts[0], ins.parts[-1]
    if head in ("setp", "selp", "testp", "cvt"):
        return True
    return head in _FLOAT_HEADS and t in FLOATS and not (head == "fma" and t == "f32")


def _compile_for_cta(c: _CtaOperands, ins: PtxInstr):
    """The vectorised executor's compiler of ``ins``, over the CTA's operands."""
    head = ins.parts[0]
    if head == "setp":
        return _setp_c(c, ins)
    if head == "selp":
        return _selp_c(c, ins)
    if head == "testp":
        return _testp(c, ins)
    if head == "cvt":
        return _cvt_c(c, ins)
    return _float_op(c, ins)


def handler_for(ins: PtxInstr, prog):
    """The handler for one instruction of ``prog`` on the warp scheduler; raises for opcodes
    the emulator does not model."""
    p = ins.parts
    head = p[0]
    if head in ("and", "or", "xor") and p[-1] == "pred":
        return _pred_logic
    if _compiled_on_cta(ins):
        return _for_cta(ins, prog)
    if head == "shfl":
        return _shfl
    if head == "cp" and p[1] == "async":
        if p[2] == "bulk":
            if p[3] == "commit_group":
                return _bulk_commit
            if p[3] == "wait_group":
                return _bulk_wait
            return _tma_store if p[5] == "global" else _tma_load
        if p[2] == "commit_group":
            return _cp_commit
        if p[2] == "wait_group":
            return _cp_wait
        if p[2] in ("ca", "cg"):
            return _cp_async
    if head == "barrier" and p[1] not in ("cluster", "sync"):
        raise EmulationError(f"PTX line {ins.line}: {ins.text}: instruction {ins.op} is not modelled by the emulator")
    if head in _TABLE:
        return _TABLE[head]
    raise EmulationError(f"PTX line {ins.line}: {ins.text}: instruction {ins.op} is not modelled by the emulator")


# == compute kernels: handlers compiled once per program for the vectorised executor ==========
#
# :class:`executor.Grid` runs every thread of a launch (all its CTAs) as one numpy vector.
# Each instruction is compiled here, once per parsed program, into a closure
# ``fn(ex, sel)``: ``ex`` is the Grid, ``sel`` the threads that execute it -- ``None`` for
# every thread of the vector (no gather, no scatter: the common, converged case) or an
# index array.  Operand readers and writers are closures too, so nothing is looked up
# by name while a kernel runs.

class NotCompute(Exception):
    """The program uses instructions only the warp scheduler (:class:`executor.Cta`) models."""


# Instructions that need the warp-by-warp scheduler: async copies, tensor cores, mbarriers,
# clusters, and named barriers with thread counts.
_CTA_ONLY = {"mbarrier", "cp", "wgmma", "ldmatrix", "mma", "setmaxnreg", "mapa", "barrier.cluster"}

VIEW_T = {"pred": np.bool_, "u8": np.uint8, "s8": np.int8, "b8": np.uint8, "u16": np.uint16, "s16": np.int16,
          "b16": np.uint16, "f16": np.float16, "bf16": np.uint16, "u32": np.uint32, "s32": np.int32,
          "b32": np.uint32, "f32": np.float32, "u64": np.uint64, "s64": np.int64, "b64": np.uint64,
          "f64": np.float64}
STORE_T = {1: np.bool_, 8: np.uint16, 16: np.uint16, 32: np.uint32, 64: np.uint64}
UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
SIGNED = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
FLOATS = ("f16", "bf16", "f32", "f64")
LMEM_BASE = 0x0000_7D00_0000_0000  # where a thread's .local arrays start (each thread its own copy)
_BREV8 = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], np.uint8)


def tbits(t: str) -> int:
    """Width in bits of a PTX type name (``pred`` is 1)."""
    return 1 if t == "pred" else int(t.lstrip("bfsu") or 0) if t != "bf16" else 16


class CompiledOp:
    """One instruction ready to run: its kind, handler, guard and branch target."""

    __slots__ = ("kind", "fn", "guard", "negate", "target", "ins", "next")
    PLAIN, BRA, EXIT, BAR, NOP = range(5)

    def __init__(self, kind, fn, ins, guard=None, negate=False, target=-1):
        self.kind, self.fn, self.ins, self.guard, self.negate, self.target = kind, fn, ins, guard, negate, target
        self.next = -1  # where execution goes on (unconditional branches after it followed)


class _Compiler:
    """Register slots and operand closures for one program."""

    def __init__(self, prog) -> None:
        self.prog = prog
        self.slots: dict[str, int] = {}
        self.store: list = []  # storage dtype per slot
        self.names: list[str] = []
        off = 0
        self.local_off: dict[str, int] = {}
        for name, n in prog.locals.items():
            self.local_off[name] = off
            off += (n + 15) // 16 * 16
        self.local_bytes = off
        self.param_names = [p.name for p in prog.params]

    def slot(self, name: str) -> int:
        s = self.slots.get(name)
        if s is None:
            bits = tbits(self.prog.reg_type(name))
            s = self.slots[name] = len(self.store)
            self.store.append(STORE_T[bits])
            self.names.append(name)
        return s

    def reg_bits(self, name: str) -> int:
        return tbits(self.prog.reg_type(name)) if self.prog.reg_type(name) != "pred" else 1

    # -- sources ------------------------------------------------------------------------
    def src(self, arg, t: str):
        """A reader ``(ex, sel) -> array or numpy scalar`` of operand ``arg`` as PTX type ``t``."""
        vt = VIEW_T[t]
        if isinstance(arg, NotArg):
            inner = self.src(arg.reg, "pred")
            return lambda ex, sel: ~inner(ex, sel)
        if isinstance(arg, RegArg):
            s = self.slot(arg.name)
            conv = _read_conv(arg.name, self.store[s], t)

            def rd(ex, sel, s=s, conv=conv):
                u = ex.uni[s]
                if u is not None:  # the same value in every thread: a numpy scalar
                    return u if conv is None else conv(u)
                if not ex.complete[s]:
                    ex.check_written(s, sel)
                r = ex.regs[s]
                v = r if sel is None else r[sel]
                return v if conv is None else conv(v)
            return rd
        if isinstance(arg, ImmArg):
            if t in ("f32", "f64", "f16"):
                c = vt(arg.value)
            elif t == "pred":
                c = np.bool_(arg.value)
            else:
                c = UNSIGNED[max(tbits(t), 8)](arg.value & ((1 << tbits(t)) - 1)).astype(vt)
            return lambda ex, sel: c
        if isinstance(arg, FloatArg):
            c = np.float64(arg.value) if t == "f64" else np.uint32(arg.bits).view(np.float32) if t == "f32" else None
            if c is None:
                if tbits(t) != 32:
                    raise EmulationError(f"f32 immediate used as .{t}")
                c = np.uint32(arg.bits).view(vt)
            return lambda ex, sel: c
        if isinstance(arg, DoubleArg):
            if tbits(t) != 64:
                raise EmulationError(f"f64 immediate used as .{t}")
            c = np.uint64(arg.bits).view(vt)
            return lambda ex, sel: c
        if isinstance(arg, SpecialArg):
            name = arg.name

            def sp(ex, sel):
                v = ex.special(name)
                return (v if sel is None else v[sel]).astype(vt)
            return sp
        if isinstance(arg, SymArg):
            c = self.symbol(arg.name)
            c = UNSIGNED[tbits(t)](c & ((1 << tbits(t)) - 1)).view(vt) if t not in FLOATS else None
            if c is None:
                raise EmulationError(f"symbol {arg.name} used as .{t}")
            return lambda ex, sel: c
        raise EmulationError(f"operand {arg} cannot be read as a value")

    def symbol(self, name: str) -> int:
        if name == self.prog.shared_name:
            return SMEM_BASE
        if name in self.local_off:
            return LMEM_BASE + self.local_off[name]
        if name in self.param_names:
            from .state import PARAM_BASE
            return PARAM_BASE + 256 * self.param_names.index(name)
        raise EmulationError(f"unknown symbol {name}")

    # -- destinations -------------------------------------------------------------------
    def dst(self, arg, t: str):
        """A writer ``(ex, sel, value)`` into register ``arg`` of a value of PTX type ``t``
        (narrower integers sign- or zero-extend into the register, as PTX says)."""
        if isinstance(arg, SymArg) and arg.name == "_":
            return lambda ex, sel, v: None
        if not isinstance(arg, RegArg):
            raise EmulationError(f"destination {arg} is not a register")
        s = self.slot(arg.name)
        st = self.store[s]
        conv = _write_conv(arg.name, st, t)
        st_dt = np.dtype(st)

        def wr(ex, sel, v, s=s, conv=conv, st_dt=st_dt, st=st):
            cls = v.__class__
            if cls is st and sel is None:  # a scalar of the register's own type, for every thread
                ex.uni[s] = v
                ex.complete[s] = True
                return
            if cls is not np.ndarray or v.dtype != st_dt:
                v = conv(v)
            if sel is None:
                if v.ndim == 0:  # every thread gets the same value: keep one scalar, no vector op
                    ex.uni[s] = v[()]
                else:
                    ex.uni[s] = None
                    ex.regs[s][...] = v
                ex.complete[s] = True
                return
            r = ex.regs[s]
            u = ex.uni[s]
            if u is not None:  # some threads change it: back to one value per thread
                r[...] = u
                ex.uni[s] = None
            r[sel] = v
            if not ex.complete[s]:
                ex.written[s][sel] = True
        return wr


def _read_conv(name: str, st, t: str):
    """How a register stored as ``st`` reads as PTX type ``t``: None (as it is) or a function
    of the stored values; a type wider than the register, or a predicate read as a number
    (or the reverse), raises."""
    vt = VIEW_T[t]
    rb = np.dtype(st).itemsize * 8 if st is not np.bool_ else 1
    want = tbits(t)
    if (t == "pred") != (st is np.bool_):
        raise EmulationError(f"register {name} used as .{t}")
    if want > rb:
        raise EmulationError(f"register {name} ({rb}-bit) read as .{t}")
    if want == rb:
        return None if vt is st else (lambda v: v.view(vt))
    if t in FLOATS:  # a 16-bit float in the low half of a wider register
        low = UNSIGNED[want]
        return lambda v: v.astype(low).view(vt)
    return lambda v: v.astype(vt)  # the low bits of a wider register (astype wraps)


def _write_conv(name: str, st, t: str):
    """How a value of PTX type ``t`` goes into a register stored as ``st``: the same bits, or
    (narrower integers) sign- or zero-extended, as PTX says."""
    rb = np.dtype(st).itemsize * 8 if st is not np.bool_ else 1
    want = tbits(t)
    if (t == "pred") != (st is np.bool_):
        raise EmulationError(f"register {name} written as .{t}")
    if want > rb:
        raise EmulationError(f"a .{t} value written into {name} ({rb}-bit)")
    if want == rb or t == "pred":
        def conv(v, st=st):
            v = np.asarray(v)
            return v if v.dtype == st else v.view(st) if v.dtype.itemsize == np.dtype(st).itemsize else v.astype(st)
        return conv
    if t.startswith("s"):
        sw = SIGNED[rb]
        return lambda v: np.asarray(v).astype(VIEW_T[t]).astype(sw).view(st)
    low = UNSIGNED[want]
    return lambda v: np.asarray(v).view(low).astype(st) if np.asarray(v).dtype.itemsize * 8 == want \
        else np.asarray(v).astype(low).astype(st)


class _CtaOperands:
    """Operand readers and writers over an :class:`executor.Cta`, with the interface of
    :class:`_Compiler`'s, so the vectorised executor's instruction compilers (``_float_op``,
    ``_setp_c``, ``_selp_c``, ``_cvt_c`` ...) also give the warp scheduler its semantics:
    one definition of each instruction.  A compiled op is ``fn(cta, lanes)``; reads go
    through :meth:`Cta.read` and writes through :meth:`Cta.write`, so the written bits and
    the wgmma register checks apply as to every other handler."""

    _RAW = {1: "pred", 16: "b16", 32: "b32", 64: "b64"}  # Cta.read's raw view of a register of this width

    def __init__(self, prog) -> None:
        self.prog = prog
        self._consts = _Compiler(prog)  # immediates and symbols: the same constants as on the Grid

    def _store(self, name: str):
        t = self.prog.reg_type(name)
        return STORE_T[tbits(t)] if t != "pred" else np.bool_

    def src(self, arg, t: str):
        """A reader ``(cta, lanes) -> array or numpy scalar`` of operand ``arg`` as PTX type ``t``."""
        if isinstance(arg, NotArg):
            inner = self.src(arg.reg, "pred")
            return lambda cta, lanes: ~inner(cta, lanes)
        if isinstance(arg, RegArg):
            st = self._store(arg.name)
            conv = _read_conv(arg.name, st, t)
            raw = self._RAW[np.dtype(st).itemsize * 8 if st is not np.bool_ else 1]
            if conv is None:
                return lambda cta, lanes: cta.read(arg, lanes, raw)
            return lambda cta, lanes: conv(cta.read(arg, lanes, raw))
        if isinstance(arg, SpecialArg):
            vt = VIEW_T[t]
            return lambda cta, lanes: cta.read(arg, lanes, "u32").astype(vt)
        return self._consts.src(arg, t)  # a constant: ignores its arguments

    def dst(self, arg, t: str):
        """A writer ``(cta, lanes, value)`` into register ``arg`` of a value of PTX type ``t``."""
        if isinstance(arg, SymArg) and arg.name == "_":
            return lambda cta, lanes, v: None
        if not isinstance(arg, RegArg):
            raise EmulationError(f"destination {arg} is not a register")
        conv = _write_conv(arg.name, self._store(arg.name), t)

        def wr(cta, lanes, v):
            v = conv(v)
            cta.write(arg, lanes, np.broadcast_to(v, lanes.shape) if v.ndim == 0 else v)
        return wr


def _for_cta(ins, prog):
    """A warp-scheduler handler that runs the vectorised executor's compiled form of ``ins``
    (compiled once per instruction of a parsed program)."""
    fn = getattr(ins, "_cta_fn", None)
    if fn is None:
        c = _CtaOperands(prog)
        try:
            fn = _compile_for_cta(c, ins)
        except (EmulationError, PtxParseError) as e:
            raise EmulationError(f"PTX line {ins.line}: {ins.text}: {e}") from None
        ins._cta_fn = fn
    return lambda cta, ins_, lanes: fn(cta, lanes)


def _mulhi(a, b, bits: int, signed: bool):
    """High half of a full-width product, per lane."""
    if bits <= 32:
        wide = np.int64 if signed else np.uint64
        return ((np.asarray(a).astype(wide) * np.asarray(b).astype(wide)) >> (bits)).astype(
            SIGNED[bits] if signed else UNSIGNED[bits])
    ua, ub = np.asarray(a).view(np.uint64), np.asarray(b).view(np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    al, ah, bl, bh = ua & m32, ua >> s32, ub & m32, ub >> s32
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> s32) + (lh & m32) + (hl & m32)
    hi = hh + (lh >> s32) + (hl >> s32) + (mid >> s32)
    if signed:  # two's complement correction of the unsigned product
        hi = hi - np.where(np.asarray(a).view(np.int64) < 0, ub, 0).astype(np.uint64) \
            - np.where(np.asarray(b).view(np.int64) < 0, ua, 0).astype(np.uint64)
        return hi.view(np.int64)
    return hi


def _clz(x, bits: int):
    x = np.asarray(x).astype(np.uint64)
    n = np.zeros(x.shape, np.uint32)
    full = np.uint64((1 << bits) - 1) if bits < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    s = bits // 2
    while s >= 1:
        m = (x >> np.uint64(bits - s)) == 0
        n += np.where(m, np.uint32(s), np.uint32(0))
        x = np.where(m, (x << np.uint64(s)) & full, x)
        s //= 2
    return n + ((x >> np.uint64(bits - 1)) == 0).astype(np.uint32)


def _brev(x, bits: int):
    x = np.ascontiguousarray(np.asarray(x).astype(UNSIGNED[bits]).reshape(-1)).astype(f"<u{bits // 8}")
    rev = _BREV8[x.view(np.uint8).reshape(-1, bits // 8)[:, ::-1]]
    return np.ascontiguousarray(rev).view(f"<u{bits // 8}").reshape(-1).astype(UNSIGNED[bits])


def _low_mask(n):
    """``(1 << n) - 1`` per lane as uint64, for n in 0..64."""
    n = np.asarray(n).astype(np.uint64)
    return np.where(n >= 64, np.uint64(0xFFFFFFFFFFFFFFFF), (np.uint64(1) << np.minimum(n, 63)) - np.uint64(1))


def _bfe(a, pos, ln, bits: int, signed: bool):
    x = np.asarray(a).astype(UNSIGNED[bits]).astype(np.uint64)
    pos = np.asarray(pos).astype(np.uint64) & np.uint64(0xFF)
    ln = np.asarray(ln).astype(np.uint64) & np.uint64(0xFF)
    w = np.uint64(bits)
    shifted = np.where(pos >= w, np.uint64(0), x >> np.minimum(pos, w - np.uint64(1)))
    take = np.where(pos >= w, np.uint64(0), np.minimum(ln, w - np.minimum(pos, w)))
    mask = _low_mask(take)
    val = shifted & mask
    if signed:
        top = np.minimum(pos + ln - np.uint64(1), w - np.uint64(1))
        sbit = np.where(ln == 0, False, ((x >> np.minimum(top, np.uint64(63))) & np.uint64(1)) == 1)
        val = val | np.where(sbit, ~mask & _low_mask(w), np.uint64(0))
    return val.astype(UNSIGNED[bits]).view(SIGNED[bits] if signed else UNSIGNED[bits])


def _bfi(f, b, pos, ln, bits: int):
    f = np.asarray(f).astype(UNSIGNED[bits]).astype(np.uint64)
    b = np.asarray(b).astype(UNSIGNED[bits]).astype(np.uint64)
    pos = np.asarray(pos).astype(np.uint64) & np.uint64(0xFF)
    ln = np.asarray(ln).astype(np.uint64) & np.uint64(0xFF)
    w = np.uint64(bits)
    n = np.where(pos >= w, np.uint64(0), np.minimum(ln, w - np.minimum(pos, w)))
    sh = np.minimum(pos, np.uint64(63))
    mask = (_low_mask(n) << sh) & _low_mask(w)
    return ((b & ~mask) | ((f << sh) & mask)).astype(UNSIGNED[bits])


class _IntType(NamedTuple):
    """An integer instruction's type: as written (``t``), its unsigned view, width, signedness."""

    t: str
    ut: str
    bits: int
    signed: bool

    @property
    def st(self) -> str:
        """The type the values are read as: ``t`` when signed, else the unsigned view."""
        return self.t if self.signed else self.ut


def _int_op(c, ins):
    """Integer arithmetic and logic: add sub mul mad div rem min max abs neg and or xor not
    shl shr popc clz brev bfe bfi (types u/s/b 16, 32, 64)."""
    t = ins.parts[-1]
    bits = tbits(t)
    if bits not in (16, 32, 64):
        raise EmulationError(f"{ins.op}: integer type .{t} is not modelled")
    build = _INT_FAMILIES.get(ins.parts[0])
    if build is None:
        raise EmulationError(f"{ins.op} is not modelled")
    return build(c, ins, _IntType(t, f"u{bits}", bits, t.startswith("s")))


def _int_elementwise(c, ins, it: _IntType):
    """add sub and or xor, which wrap alike whatever the signedness."""
    if "sat" in ins.parts or "cc" in ins.parts:
        raise EmulationError(f"{ins.op}: .sat/.cc are not modelled")
    A = ins.args
    a, b, d = c.src(A[1], it.ut), c.src(A[2], it.ut), c.dst(A[0], it.ut)
    fn = {"add": np.add, "sub": np.subtract, "and": np.bitwise_and, "or": np.bitwise_or,
          "xor": np.bitwise_xor}[ins.parts[0]]
    return lambda ex, sel: d(ex, sel, fn(a(ex, sel), b(ex, sel)))


def _int_mul(c, ins, it: _IntType):
    """mul and mad, .lo (wrapping), .hi (the product's upper half) and .wide (twice the width)."""
    A, mode, mad = ins.args, ins.parts[1], ins.parts[0] == "mad"
    if mode == "lo":
        a, b, d = c.src(A[1], it.ut), c.src(A[2], it.ut), c.dst(A[0], it.ut)
        f = lambda x, y: x * y  # noqa: E731
        addend = it.ut
    elif mode == "hi":
        a, b, d = c.src(A[1], it.st), c.src(A[2], it.st), c.dst(A[0], it.st)
        f = lambda x, y: _mulhi(x, y, it.bits, it.signed)  # noqa: E731
        addend = it.st
    elif mode == "wide":
        if it.bits == 64:
            raise EmulationError(f"{ins.op}: mul.wide takes 16- or 32-bit operands")
        addend = ("s" if it.signed else "u") + str(2 * it.bits)
        wide = VIEW_T[addend]
        a, b, d = c.src(A[1], it.st), c.src(A[2], it.st), c.dst(A[0], addend)
        f = lambda x, y: np.asarray(x).astype(wide) * np.asarray(y).astype(wide)  # noqa: E731
    else:
        raise EmulationError(f"{ins.op} is not modelled")
    if not mad:
        return lambda ex, sel: d(ex, sel, f(a(ex, sel), b(ex, sel)))
    cc = c.src(A[3], addend)
    return lambda ex, sel: d(ex, sel, f(a(ex, sel), b(ex, sel)) + cc(ex, sel))


def _int_divrem(c, ins, it: _IntType):
    """div and rem: C's truncation for signed types; by zero, all ones (PTX leaves it unspecified)."""
    A, st, head = ins.args, it.st, ins.parts[0]
    a, b, d = c.src(A[1], st), c.src(A[2], st), c.dst(A[0], st)
    ones = VIEW_T[st](-1) if it.signed else UNSIGNED[it.bits](-1 & ((1 << it.bits) - 1))

    def divrem(ex, sel):
        x, y = np.asarray(a(ex, sel)), np.asarray(b(ex, sel))
        zero = y == 0
        ys = np.where(zero, VIEW_T[st](1), y)
        if it.signed:  # C semantics: the quotient truncates, the remainder takes the dividend's sign
            r = np.fmod(x, ys)
            out = r if head == "rem" else (x - r) // ys
        else:
            out = x % ys if head == "rem" else x // ys
        # PTX leaves x / 0 unspecified; all ones, without failing (a select may discard it)
        d(ex, sel, np.where(zero, ones, out).astype(VIEW_T[st]))
    return divrem


def _int_minmax(c, ins, it: _IntType):
    """min and max in the type's signedness."""
    A = ins.args
    a, b, d = c.src(A[1], it.st), c.src(A[2], it.st), c.dst(A[0], it.st)
    fn = np.minimum if ins.parts[0] == "min" else np.maximum
    return lambda ex, sel: d(ex, sel, fn(a(ex, sel), b(ex, sel)))


def _int_unary(c, ins, it: _IntType):
    """abs, neg (wrapping: -x mod 2^bits) and not."""
    A, head = ins.args, ins.parts[0]
    if head == "neg":
        a, d = c.src(A[1], it.ut), c.dst(A[0], it.ut)
        return lambda ex, sel: d(ex, sel, np.subtract(UNSIGNED[it.bits](0), a(ex, sel)))
    a, d = c.src(A[1], it.st), c.dst(A[0], it.st)
    fn = np.abs if head == "abs" else np.invert
    return lambda ex, sel: d(ex, sel, fn(a(ex, sel)))


def _int_shift(c, ins, it: _IntType):
    """shl and shr (arithmetic for signed types); a count of the width or more shifts everything out."""
    A, head, w = ins.args, ins.parts[0], it.bits
    st = it.t if head == "shr" and it.signed else it.ut
    a, s, d = c.src(A[1], st), c.src(A[2], "u32"), c.dst(A[0], st)

    def shift(ex, sel):
        x = np.asarray(a(ex, sel))
        n = np.asarray(s(ex, sel)).astype(np.uint64)
        big = n >= w
        k = np.minimum(n, w - 1).astype(x.dtype if x.dtype.kind == "u" else UNSIGNED[w]).astype(x.dtype)
        if head == "shl":
            out = np.where(big, x.dtype.type(0), x << k)
        elif it.signed:
            out = x >> np.where(big, x.dtype.type(w - 1), k)
        else:
            out = np.where(big, x.dtype.type(0), x >> k)
        d(ex, sel, out.astype(x.dtype))
    return shift


def _int_bits(c, ins, it: _IntType):
    """popc and clz (a u32 count), brev (the bits reversed)."""
    A, head = ins.args, ins.parts[0]
    a = c.src(A[1], it.ut)
    if head == "brev":
        d = c.dst(A[0], it.ut)
        return lambda ex, sel: d(ex, sel, _brev(a(ex, sel), it.bits))
    d = c.dst(A[0], "u32")
    if head == "popc":
        return lambda ex, sel: d(ex, sel, np.bitwise_count(np.asarray(a(ex, sel))).astype(np.uint32))
    return lambda ex, sel: d(ex, sel, _clz(a(ex, sel), it.bits))


def _int_bfe(c, ins, it: _IntType):
    """bfe: a bit field extracted, sign-extended for signed types."""
    A = ins.args
    a, pos, ln = c.src(A[1], it.ut), c.src(A[2], "u32"), c.src(A[3], "u32")
    d = c.dst(A[0], it.st)
    return lambda ex, sel: d(ex, sel, _bfe(a(ex, sel), pos(ex, sel), ln(ex, sel), it.bits, it.signed))


def _int_bfi(c, ins, it: _IntType):
    """bfi: a bit field inserted."""
    A = ins.args
    f, b, pos, ln = c.src(A[1], it.ut), c.src(A[2], it.ut), c.src(A[3], "u32"), c.src(A[4], "u32")
    d = c.dst(A[0], it.ut)
    return lambda ex, sel: d(ex, sel, _bfi(f(ex, sel), b(ex, sel), pos(ex, sel), ln(ex, sel), it.bits))


_INT_FAMILIES = {
    **dict.fromkeys(("add", "sub", "and", "or", "xor"), _int_elementwise),
    **dict.fromkeys(("mul", "mad"), _int_mul),
    **dict.fromkeys(("div", "rem"), _int_divrem),
    **dict.fromkeys(("min", "max"), _int_minmax),
    **dict.fromkeys(("abs", "neg", "not"), _int_unary),
    **dict.fromkeys(("shl", "shr"), _int_shift),
    **dict.fromkeys(("popc", "clz", "brev"), _int_bits),
    "bfe": _int_bfe,
    "bfi": _int_bfi,
}


_F32_TINY = np.float32(1.17549435e-38)


def _flush(x):
    """``.ftz``: subnormal f32 values become zero of the same sign."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < _F32_TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def _float_op(c, ins):
    """f32/f64 arithmetic: add sub mul fma mad div neg abs min max sqrt rsqrt rcp ex2 lg2 sin
    cos tanh copysign (``.ftz`` flushes subnormals, ``.sat`` clamps to [0, 1])."""
    p = ins.parts
    head, t = p[0], p[-1]
    if t not in ("f32", "f64"):
        raise EmulationError(f"{ins.op}: arithmetic on .{t} is not modelled")
    mods = set(p[1:-1])
    for r in ("rz", "rm", "rp"):
        if r in mods and head not in ("cvt",):
            raise EmulationError(f"{ins.op}: rounding .{r} is not modelled (only .rn)")
    ft = VIEW_T[t]
    ftz = "ftz" in mods and t == "f32"
    sat = "sat" in mods
    A = ins.args
    n_in = {"add": 2, "sub": 2, "mul": 2, "div": 2, "min": 2, "max": 2, "copysign": 2, "fma": 3, "mad": 3}.get(head, 1)
    srcs = [c.src(A[1 + i], t) for i in range(n_in)]
    d = c.dst(A[0], t)
    if head in ("fma", "mad"):
        # a*b is exact in f64 for f32 inputs; the sum is rounded twice (f64, then f32), which
        # differs from a single rounding only in rare halfway cases
        wide = np.float64 if t == "f32" else np.longdouble

        def f(x, y, z):
            return (np.asarray(x).astype(wide) * np.asarray(y).astype(wide) + np.asarray(z).astype(wide)).astype(ft)
    elif head == "copysign":  # d = b with a's sign
        def f(x, y):
            return np.copysign(np.asarray(y, ft), np.asarray(x, ft))
    else:
        f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
             "min": np.fmin, "max": np.fmax, "neg": np.negative, "abs": np.abs, "sqrt": np.sqrt,
             "rsqrt": lambda x: ft(1) / np.sqrt(x), "rcp": lambda x: ft(1) / x, "ex2": np.exp2, "lg2": np.log2,
             "sin": np.sin, "cos": np.cos, "tanh": np.tanh}.get(head)
        if f is None:
            raise EmulationError(f"{ins.op} is not modelled")

    def run(ex, sel):
        xs = [s(ex, sel) for s in srcs]
        if ftz:
            xs = [_flush(x) for x in xs]
        r = np.asarray(f(*xs), ft)
        if ftz:
            r = _flush(r)
        if sat:
            r = np.where(np.isnan(r), ft(0), np.clip(r, ft(0), ft(1))).astype(ft)
        d(ex, sel, r)
    return run


def _testp(c, ins):
    kind, t = ins.parts[1], ins.parts[-1]
    a, d = c.src(ins.args[1], t), c.dst(ins.args[0], "pred")
    fn = {"nan": np.isnan, "notanumber": np.isnan, "number": lambda x: ~np.isnan(x), "infinite": np.isinf,
          "finite": np.isfinite,
          "normal": lambda x: np.isfinite(x) & (np.abs(x) >= np.finfo(x.dtype).tiny),
          "subnormal": lambda x: (x != 0) & (np.abs(x) < np.finfo(x.dtype).tiny)}.get(kind)
    if fn is None:
        raise EmulationError(f"{ins.op} is not modelled")
    return lambda ex, sel: d(ex, sel, fn(np.asarray(a(ex, sel))))


def _setp_c(c, ins):
    p = ins.parts
    cmp, t = p[1], p[-1]
    if len(p) > 4 or (len(p) == 4 and p[2] != "ftz"):
        raise EmulationError(f"{ins.op} is not modelled (setp.CMP[.ftz].TYPE with one destination)")
    if t in FLOATS:
        if t in ("f16", "bf16"):
            raise EmulationError(f"{ins.op}: comparisons of .{t} are not modelled")
        a, b = c.src(ins.args[1], t), c.src(ins.args[2], t)
        base = cmp[:-1] if cmp.endswith("u") and cmp not in ("equ",) and len(cmp) == 3 else cmp
        unordered = cmp in ("equ", "neu", "ltu", "leu", "gtu", "geu")
        if unordered:
            base = cmp[:2]
        fn = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
              "ge": np.greater_equal}.get(base)
        if cmp in ("num", "nan"):
            def run(ex, sel):
                x, y = a(ex, sel), b(ex, sel)
                either = np.isnan(x) | np.isnan(y)
                d(ex, sel, either if cmp == "nan" else ~either)
        elif fn is None:
            raise EmulationError(f"{ins.op}: comparison {cmp} is not modelled")
        else:
            def run(ex, sel):
                x, y = a(ex, sel), b(ex, sel)
                either = np.isnan(x) | np.isnan(y)
                r = fn(x, y)
                d(ex, sel, (r | either) if unordered else (r & ~either))
        d = c.dst(ins.args[0], "pred")
        return run
    bits = tbits(t)
    if cmp in ("lo", "ls", "hi", "hs"):
        vt = UNSIGNED[bits]
        fn = {"lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal}[cmp]
    else:
        vt = SIGNED[bits] if t.startswith("s") else UNSIGNED[bits]
        fn = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
              "ge": np.greater_equal}.get(cmp)
        if fn is None:
            raise EmulationError(f"{ins.op}: comparison {cmp} is not modelled for integers")
    ts = {np.uint16: "u16", np.uint32: "u32", np.uint64: "u64", np.int16: "s16", np.int32: "s32",
          np.int64: "s64"}[vt]
    a, b, d = c.src(ins.args[1], ts), c.src(ins.args[2], ts), c.dst(ins.args[0], "pred")
    return lambda ex, sel: d(ex, sel, fn(a(ex, sel), b(ex, sel)))


def _selp_c(c, ins):
    t = ins.parts[-1]
    a, b, q, d = (c.src(ins.args[1], t), c.src(ins.args[2], t), c.src(ins.args[3], "pred"),
                  c.dst(ins.args[0], t))
    return lambda ex, sel: d(ex, sel, np.where(q(ex, sel), a(ex, sel), b(ex, sel)).astype(VIEW_T[t]))


def _pred_c(c, ins):
    head = ins.parts[0]
    d = c.dst(ins.args[0], "pred")
    a = c.src(ins.args[1], "pred")
    if head in ("not", "mov"):
        return (lambda ex, sel: d(ex, sel, ~np.asarray(a(ex, sel)))) if head == "not" else \
            (lambda ex, sel: d(ex, sel, a(ex, sel)))
    b = c.src(ins.args[2], "pred")
    fn = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[head]
    return lambda ex, sel: d(ex, sel, fn(a(ex, sel), b(ex, sel)))


def _mov_c(c, ins):
    t = ins.parts[-1]
    dst, src = ins.args[0], ins.args[1]
    bits = tbits(t)
    if isinstance(src, VecArg):  # pack: low element first
        n = len(src.items)
        part = {64: {2: "u32"}, 32: {2: "u16"}}.get(bits, {}).get(n)
        if part is None:
            raise EmulationError(f"{ins.op}: packing {n} values into .{t} is not modelled")
        rs = [c.src(x, part) for x in src.items]
        d = c.dst(dst, "u" + str(bits))
        wide, sh = UNSIGNED[bits], UNSIGNED[bits](bits // 2)

        def pack(ex, sel):
            lo, hi = rs[0](ex, sel), rs[1](ex, sel)
            d(ex, sel, np.asarray(lo).astype(wide) | (np.asarray(hi).astype(wide) << sh))
        return pack
    if isinstance(dst, VecArg):  # unpack
        n = len(dst.items)
        part = {64: {2: "u32"}, 32: {2: "u16"}}.get(bits, {}).get(n)
        if part is None:
            raise EmulationError(f"{ins.op}: unpacking .{t} into {n} values is not modelled")
        a = c.src(src, "u" + str(bits))
        ds = [c.dst(x, part) for x in dst.items]
        low, sh = UNSIGNED[bits // 2], UNSIGNED[bits](bits // 2)

        def unpack(ex, sel):
            v = np.asarray(a(ex, sel))
            ds[0](ex, sel, v.astype(low))
            ds[1](ex, sel, (v >> sh).astype(low))
        return unpack
    if t == "pred":
        return _pred_c(c, ins)
    a, d = c.src(src, t), c.dst(dst, t)
    return lambda ex, sel: d(ex, sel, a(ex, sel))


# -- cvt ----------------------------------------------------------------------------------

_INT_RANGE = {t: (0, (1 << tbits(t)) - 1) if t[0] == "u" else (-(1 << (tbits(t) - 1)), (1 << (tbits(t) - 1)) - 1)
              for t in ("u8", "s8", "u16", "s16", "u32", "s32", "u64", "s64")}


def _bf16_round(x64):
    """float64 -> bf16 bits, round to nearest even, in one rounding: first to f32 rounding
    to odd (truncate, set the sticky bit if inexact), then the f32 -> bf16 step."""
    x64 = np.asarray(x64, np.float64)
    f = x64.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x64)
    f = np.where(over & np.isfinite(x64), np.nextafter(f, np.float32(0)), f).astype(np.float32)
    bits = f.view(np.uint32).copy()
    inexact = np.isfinite(x64) & (f.astype(np.float64) != x64)
    bits |= inexact.astype(np.uint32)
    return D.f32_to_bf16_bits(bits.view(np.float32))


def _to_float(x, dt: str):
    """A float64 value (exact for every source) to the raw value of float type ``dt``."""
    if dt == "f64":
        return np.asarray(x, np.float64)
    if dt == "f32":
        return np.asarray(x, np.float64).astype(np.float32)
    if dt == "f16":
        return np.asarray(x, np.float64).astype(np.float16)  # numpy rounds double -> half directly
    return _bf16_round(x)


def _as_f64(v, t: str):
    if t == "bf16":
        return D.bf16_bits_to_f32(np.asarray(v).astype(np.uint16)).astype(np.float64)
    return np.asarray(v).astype(np.float64)


_ROUND_TO_INTEGRAL = {"rzi": np.trunc, "rni": np.rint, "rmi": np.floor, "rpi": np.ceil}


class _CvtMods(NamedTuple):
    """A cvt's modifiers: flush subnormals, saturate, round to an integral value (``rzi``...,
    or None), round to the destination float (``rn``..., or None)."""

    ftz: bool
    sat: bool
    irnd: str | None
    frnd: str | None


def _cvt_c(c, ins):
    """cvt: between integer and float types of every width, and two f32 into one bf16x2/f16x2."""
    p = ins.parts
    dt, at = p[-2], p[-1]
    mods = set(p[1:-2])
    if dt in ("bf16x2", "f16x2"):
        return _cvt_pair(c, ins, dt, at, mods)
    for t in (dt, at):
        if t not in VIEW_T or t in ("pred", "b8", "b16", "b32", "b64"):
            raise EmulationError(f"{ins.op}: conversion type .{t} is not modelled")
    irnd = mods & set(_ROUND_TO_INTEGRAL)
    frnd = mods & {"rn", "rz", "rm", "rp"}
    unknown = mods - {"ftz", "sat", *_ROUND_TO_INTEGRAL, "rn", "rz", "rm", "rp"}
    if unknown or len(irnd) + len(frnd) > 1:
        raise EmulationError(f"{ins.op}: modifiers {sorted(unknown or mods)} are not modelled")
    m = _CvtMods("ftz" in mods, "sat" in mods, next(iter(irnd), None), next(iter(frnd), None))
    a, d = c.src(ins.args[1], at), c.dst(ins.args[0], dt)
    build = {(True, False): _cvt_f2i, (False, True): _cvt_i2f, (True, True): _cvt_f2f,
             (False, False): _cvt_i2i}[(at in FLOATS, dt in FLOATS)]
    return build(ins, dt, at, m, a, d)


def _cvt_pair(c, ins, dt: str, at: str, mods: set):
    """cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 d, a, b: d = {hi: a, lo: b}, each rounded to nearest even."""
    if mods - {"rn", "relu", "satfinite"} or at != "f32" or mods & {"relu", "satfinite"}:
        raise EmulationError(f"{ins.op} is not modelled")
    a, b, d = c.src(ins.args[1], "f32"), c.src(ins.args[2], "f32"), c.dst(ins.args[0], "u32")
    if dt == "bf16x2":
        return lambda ex, sel: d(ex, sel, D.f32_pair_to_bf16x2(a(ex, sel), b(ex, sel)))

    def half(x):
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)

    return lambda ex, sel: d(ex, sel, (half(a(ex, sel)) << np.uint32(16)) | half(b(ex, sel)))


def _source_f64(x, at: str, m: _CvtMods):
    """A float source as float64, its f32 subnormals flushed under ``.ftz``."""
    x = _as_f64(x, at)
    if m.ftz and at == "f32":
        x = _flush(x.astype(np.float32)).astype(np.float64)
    return x


def _cvt_f2i(ins, dt: str, at: str, m: _CvtMods, a, d):
    """Float to integer: rounded as ``.rzi``/``.rni``/``.rmi``/``.rpi`` says, clamped to the range, NaN to 0."""
    if m.irnd is None:
        raise EmulationError(f"{ins.op}: float -> integer needs .rzi, .rni, .rmi or .rpi")
    rf = _ROUND_TO_INTEGRAL[m.irnd]
    lo, hi = _INT_RANGE[dt]

    def f2i(ex, sel):
        r = rf(_source_f64(a(ex, sel), at, m))
        nan = np.isnan(r)
        if tbits(dt) == 64:  # the range ends are not all f64 values: compare, then convert
            top = r >= float(hi + 1)
            bot = r < float(lo)
            safe = np.where(nan | top | bot, 0.0, r)
            out = safe.astype(VIEW_T[dt])
            out = np.where(top, VIEW_T[dt](hi), np.where(bot, VIEW_T[dt](lo), out))
        else:
            out = np.clip(np.where(nan, 0.0, r), lo, hi).astype(np.int64).astype(VIEW_T[dt])
        d(ex, sel, np.where(nan, VIEW_T[dt](0), out).astype(VIEW_T[dt]))
    return f2i


def _cvt_i2f(ins, dt: str, at: str, m: _CvtMods, a, d):
    """Integer to float, rounded to nearest even."""
    if m.irnd or (m.frnd and m.frnd != "rn"):
        raise EmulationError(f"{ins.op}: integer -> float rounds .rn only here")
    if tbits(at) == 64 and dt != "f64":
        def i2f(ex, sel):  # int64 -> f32 rounds once in numpy's cast; f16/bf16 go through it
            v = np.asarray(a(ex, sel))
            r = v.astype(np.float32) if dt == "f32" else _to_float(v.astype(np.float64), dt)
            d(ex, sel, r)
        return i2f
    return lambda ex, sel: d(ex, sel, _to_float(np.asarray(a(ex, sel)).astype(np.float64), dt))


def _cvt_f2f(ins, dt: str, at: str, m: _CvtMods, a, d):
    """Float to float: to an integral value in the same type, or to another width (``.rn`` when
    it narrows), with ``.sat`` clamping to [0, 1] and ``.ftz`` flushing f32 subnormals."""
    if m.irnd:  # round to an integral value in the same type
        if dt != at:
            raise EmulationError(f"{ins.op}: integer rounding between different float types")
        rf = _ROUND_TO_INTEGRAL[m.irnd]
        return lambda ex, sel: d(ex, sel, _to_float(rf(_source_f64(a(ex, sel), at, m)), dt))
    if m.frnd not in (None, "rn"):
        raise EmulationError(f"{ins.op}: float rounding .{m.frnd} is not modelled (only .rn)")
    if tbits(dt) < tbits(at) and not m.frnd:
        raise EmulationError(f"{ins.op}: a narrowing float conversion needs a rounding modifier (.rn)")

    def f2f(ex, sel):
        r = _to_float(_source_f64(a(ex, sel), at, m), dt)
        if m.sat:
            r = np.where(np.isnan(_as_f64(r, dt)), _to_float(0.0, dt),
                         _to_float(np.clip(_as_f64(r, dt), 0.0, 1.0), dt))
        if m.ftz and dt == "f32":
            r = _flush(r)
        d(ex, sel, r)
    return f2f


def _cvt_i2i(ins, dt: str, at: str, m: _CvtMods, a, d):
    """Integer to integer: extended by the source's signedness, then truncated (clamped with ``.sat``)."""
    lo, hi = _INT_RANGE[dt]

    def i2i(ex, sel):
        v = np.asarray(a(ex, sel))
        if m.sat:
            wide = v.astype(np.int64) if at[0] == "s" or tbits(at) < 64 else v
            if v.dtype == np.uint64:
                out = np.minimum(v, np.uint64(hi)) if hi >= 0 else v
                d(ex, sel, out.astype(VIEW_T[dt]))
                return
            d(ex, sel, np.clip(wide, max(lo, -(1 << 63)), min(hi, (1 << 63) - 1)).astype(VIEW_T[dt]))
            return
        d(ex, sel, v.astype(VIEW_T[dt]))  # numpy int casts sign-extend and wrap exactly as cvt
    return i2i


# -- memory -------------------------------------------------------------------------------

def _mem_shape(ins):
    """(state space, vector length, element type) of an ld/st, ignoring cache and ordering hints."""
    space, vec = None, 1
    for part in ins.parts[1:-1]:
        if part in ("global", "shared", "local", "param", "const") or part.startswith("shared::"):
            space = part.split("::")[0]
        elif part in ("v2", "v4", "v8"):
            vec = int(part[1:])
    if space is None:
        raise EmulationError(f"{ins.op}: generic addressing is not modelled (name .global/.shared/.local)")
    t = ins.parts[-1]
    if t not in VIEW_T or t == "pred":
        raise EmulationError(f"{ins.op}: type .{t} is not modelled")
    if vec > 1 and (vec * tbits(t) > 128 or tbits(t) < 32 and vec > 1 and tbits(t) != 16):
        raise EmulationError(f"{ins.op}: vector of {vec} x .{t} is not modelled")
    return space, vec, t


def _address(c, arg):
    """A reader of a memory operand's per-lane byte address (int64)."""
    if not isinstance(arg, MemArg):
        raise EmulationError(f"expected a memory operand [base+offset], got {arg}")
    off = np.int64(arg.offset)
    if isinstance(arg.base, SymArg):
        base = np.asarray(c.symbol(arg.base.name) + arg.offset, np.int64)
        return lambda ex, sel: base
    t = "s64" if tbits(c.prog.reg_type(arg.base.name)) == 64 else "u32"
    r = c.src(arg.base, t)
    if t == "s64":  # a 64-bit address register: the bits as they are (addresses sit far below 2^63)
        return (lambda ex, sel: r(ex, sel) + off) if arg.offset else r
    return lambda ex, sel: r(ex, sel).astype(np.int64) + off


def _ld_c(c, ins):
    space, vec, t = _mem_shape(ins)
    dsts = list(ins.args[0].items) if isinstance(ins.args[0], VecArg) else [ins.args[0]]
    if len(dsts) != vec:
        raise EmulationError(f"{ins.op} needs {vec} destinations, got {len(dsts)}")
    if space == "param":
        if vec != 1 or not isinstance(ins.args[1], MemArg) or not isinstance(ins.args[1].base, SymArg):
            raise EmulationError(f"{ins.op}: only ld.param of a parameter by name is modelled")
        name, bits = ins.args[1].base.name, tbits(t)
        if name not in c.param_names:
            raise EmulationError(f"ld.param of {name}, which is not a kernel parameter")
        d = c.dst(dsts[0], t)
        store = UNSIGNED[max(bits, 8)]

        def ldp(ex, sel):
            d(ex, sel, store(ex.param_value(name) & ((1 << bits) - 1)).view(VIEW_T[t]))
        return ldp
    addr = _address(c, ins.args[1])
    ds = [c.dst(x, t) for x in dsts]
    esize = max(tbits(t) // 8, 1)
    dt = VIEW_T[t]

    def ld(ex, sel):
        vals = ex.load(space, addr(ex, sel), sel, esize, vec, dt)  # [n, vec] (or [vec] when uniform)
        for j, w in enumerate(ds):
            w(ex, sel, vals[..., j])
    return ld


def _st_c(c, ins):
    space, vec, t = _mem_shape(ins)
    if space not in ("global", "shared", "local"):
        raise EmulationError(f"{ins.op}: stores to .{space} are not modelled")
    srcs = list(ins.args[1].items) if isinstance(ins.args[1], VecArg) else [ins.args[1]]
    if len(srcs) != vec:
        raise EmulationError(f"{ins.op} needs {vec} values, got {len(srcs)}")
    addr = _address(c, ins.args[0])
    rs = [c.src(x, t) for x in srcs]
    esize = max(tbits(t) // 8, 1)
    dt = VIEW_T[t]

    def st(ex, sel):
        a = addr(ex, sel)
        n = ex.count(sel)
        vals = np.empty((n, vec), dt)
        for j, r in enumerate(rs):
            vals[:, j] = r(ex, sel)
        ex.store(space, a, sel, esize, vec, vals)
    return st


# -- warp-level ---------------------------------------------------------------------------

def _shfl_c(c, ins):
    p = ins.parts
    if "sync" not in p or p[-1] != "b32":
        raise EmulationError(f"{ins.op} is not modelled (shfl.sync.MODE.b32)")
    mode = p[2]
    if mode not in ("idx", "bfly", "down", "up") or len(ins.args) != 5:
        raise EmulationError(f"{ins.op}: expected shfl.sync.{{idx,bfly,down,up}}.b32 d, a, b, c, membermask")
    if not isinstance(ins.args[1], RegArg):
        raise EmulationError(f"{ins.op}: the source must be a register")
    d = c.dst(ins.args[0], "b32")
    s = c.slot(ins.args[1].name)
    bsrc, csrc = c.src(ins.args[2], "u32"), c.src(ins.args[3], "u32")

    def shfl(ex, sel):
        lane = ex.lane if sel is None else ex.lane[sel]
        lane64 = lane.astype(np.int64)
        j = shfl_source_lane(mode, lane64, bsrc(ex, sel), csrc(ex, sel))
        tid = ex.tid_lin if sel is None else ex.tid_lin[sel]
        src_tid = tid - lane64 + j
        j = np.where(src_tid < ex.T, j, lane64)  # a lane past the end of the block: its own value
        g = ex.gid(sel)
        # an inactive or exited source lane gives its last value (PTX: unspecified); no check
        u = ex.uni[s]
        d(ex, sel, np.full(g.size, u) if u is not None else ex.regs[s][g - lane64 + j])
    return shfl


def shfl_source_lane(mode: str, lane: np.ndarray, b, c) -> np.ndarray:
    """``shfl.sync.{up,down,bfly,idx}``: the lane (0..31, int64) each of ``lane`` reads, from
    operands ``b`` (lane or offset) and ``c`` (clamp in bits 0-4, segment mask in bits 8-12),
    as the PTX ISA defines it; a lane whose source falls outside its segment reads its own value."""
    b = np.asarray(b).astype(np.int64) & 31
    cv = np.asarray(c).astype(np.int64)
    clamp, seg = cv & 31, (cv >> 8) & 31
    max_lane = (lane & seg) | (clamp & ~seg)
    min_lane = lane & seg
    if mode == "up":
        j = lane - b
        ok = j >= max_lane
    elif mode == "down":
        j = lane + b
        ok = j <= max_lane
    elif mode == "bfly":
        j = lane ^ b
        ok = j <= max_lane
    else:
        j = min_lane | (b & ~seg)
        ok = j <= max_lane
    return np.where(ok, j, lane)


def _warp_reduce(ex, sel, bits):
    """Per executing lane: the OR over its warp's executing lanes of ``bits`` (uint64)."""
    key = ex.warp_key if sel is None else ex.warp_key[sel]
    tot = np.bincount(key, weights=bits.astype(np.float64), minlength=ex.n_warps)  # distinct bits: sum = or
    return tot.astype(np.uint64)[key]


def _vote_c(c, ins):
    p = ins.parts
    if p[0] == "activemask":
        d = c.dst(ins.args[0], "b32")

        def am(ex, sel):
            lane = (ex.lane if sel is None else ex.lane[sel]).astype(np.uint64)
            d(ex, sel, _warp_reduce(ex, sel, np.uint64(1) << lane).astype(np.uint32))
        return am
    if "sync" not in p:
        raise EmulationError(f"{ins.op} is not modelled (vote.sync)")
    mode = p[2]
    q = c.src(ins.args[1], "pred")
    if mode == "ballot":
        d = c.dst(ins.args[0], "b32")
    elif mode in ("any", "all", "uni"):
        d = c.dst(ins.args[0], "pred")
    else:
        raise EmulationError(f"{ins.op} is not modelled")

    def vote(ex, sel):
        lane = (ex.lane if sel is None else ex.lane[sel]).astype(np.uint64)
        v = np.broadcast_to(np.asarray(q(ex, sel)), lane.shape)
        one = np.uint64(1) << lane
        yes = _warp_reduce(ex, sel, np.where(v, one, np.uint64(0)))
        if mode == "ballot":
            d(ex, sel, yes.astype(np.uint32))
            return
        active = _warp_reduce(ex, sel, one)
        d(ex, sel, yes != 0 if mode == "any" else yes == active if mode == "all" else (yes == 0) | (yes == active))
    return vote


# -- the compiler ---------------------------------------------------------------------------

_INT_HEADS = {"add", "sub", "mul", "mad", "div", "rem", "min", "max", "abs", "neg", "and", "or", "xor", "not",
              "shl", "shr", "popc", "clz", "brev", "bfe", "bfi"}
_FLOAT_HEADS = {"add", "sub", "mul", "fma", "mad", "div", "neg", "abs", "min", "max", "sqrt", "rsqrt", "rcp",
                "ex2", "lg2", "sin", "cos", "tanh", "copysign"}


# Opcodes whose warp-scheduler handlers only compute into registers or load and store memory:
# none moves a thread's PC, ends a thread, blocks its warp or waits (returns "spin").
_STRAIGHT_HEADS = {"add", "sub", "and", "or", "xor", "min", "max", "div", "rem", "shl", "shr", "mul", "mad",
                   "fma", "mov", "cvta", "ld", "st", "setp", "selp", "testp", "cvt"} | _FLOAT_HEADS


def runs_straight(ins: PtxInstr) -> bool:
    """Whether ``ins`` is straight-line code for the warp scheduler: a converged warp that runs
    it is still converged, at the next instruction, and free to go on (no branch, exit, wait,
    barrier or warp-collective).  The scheduler runs such runs back to back."""
    return ins.parts[0] in _STRAIGHT_HEADS


def is_compute_program(prog) -> bool:
    """True when ``prog`` uses no instruction that needs the warp scheduler (async copies,
    tensor cores, mbarriers, clusters, barriers with thread counts): the vectorised
    executor runs it, every CTA of a launch in one vector.  (Asked at every launch: the answer is
    kept on the program, which parse() shares read-only.)"""
    if prog.compute is None:
        prog.compute = _needs_no_warp_scheduler(prog)
    return prog.compute


def _needs_no_warp_scheduler(prog) -> bool:
    if prog.cluster is not None:
        return False
    for ins in prog.instrs:
        p = ins.parts
        if p[0] in _CTA_ONLY or ".".join(p[:2]) in _CTA_ONLY:
            return False
        if p[0] == "fence" and len(p) > 1 and p[1] in ("proxy", "mbarrier_init"):
            return False
        if p[0] in ("bar", "barrier") and (len(ins.args) != 1 or p[1] not in ("sync",)):
            return False
    return True


def _compile_one(c, ins, labels) -> CompiledOp:
    p = ins.parts
    head = p[0]
    guard = c.slot(ins.pred) if ins.pred else None
    if guard is not None and c.store[guard] is not np.bool_:
        raise EmulationError(f"guard {ins.pred} is not a predicate register")
    if head == "bra":
        return CompiledOp(CompiledOp.BRA, None, ins, guard, ins.negate, labels[ins.args[0].name])
    if head in ("ret", "exit"):
        return CompiledOp(CompiledOp.EXIT, None, ins, guard, ins.negate)
    if head in ("bar", "barrier"):
        if guard is not None:
            raise EmulationError("a guarded bar.sync is not modelled")
        if not isinstance(ins.args[0], ImmArg) or ins.args[0].value != 0:
            raise EmulationError("only barrier 0 (bar.sync 0) is modelled here")
        return CompiledOp(CompiledOp.BAR, None, ins)
    if head in ("membar", "fence"):
        return CompiledOp(CompiledOp.NOP, None, ins, guard, ins.negate)
    t = p[-1]
    if head in ("and", "or", "xor", "not") and t == "pred":
        fn = _pred_c(c, ins)
    elif head == "mov":
        fn = _mov_c(c, ins)
    elif head == "cvt":
        fn = _cvt_c(c, ins)
    elif head == "cvta":
        a, d = c.src(ins.args[1], "u64"), c.dst(ins.args[0], "u64")
        fn = lambda ex, sel: d(ex, sel, a(ex, sel))  # noqa: E731  (addresses are already generic)
    elif head == "setp":
        fn = _setp_c(c, ins)
    elif head == "selp":
        fn = _selp_c(c, ins)
    elif head == "testp":
        fn = _testp(c, ins)
    elif head == "ld":
        fn = _ld_c(c, ins)
    elif head == "st":
        fn = _st_c(c, ins)
    elif head == "shfl":
        fn = _shfl_c(c, ins)
    elif head in ("vote", "activemask"):
        fn = _vote_c(c, ins)
    elif t in ("f32", "f64", "f16", "bf16") and head in _FLOAT_HEADS:
        fn = _float_op(c, ins)
    elif head in _INT_HEADS:
        fn = _int_op(c, ins)
    else:
        raise EmulationError(f"instruction {ins.op} is not modelled by the emulator")
    return CompiledOp(CompiledOp.PLAIN, fn, ins, guard, ins.negate)


def compile_program(prog):
    """``(ops, compiler)`` for a compute program, compiled once and kept on the program
    (parsing is cached per text, so each kernel text is compiled once per process)."""
    cached = getattr(prog, "_compiled", None)
    if cached is not None:
        return cached
    c = _Compiler(prog)
    ops = []
    for ins in prog.instrs:
        try:
            ops.append(_compile_one(c, ins, prog.labels))
        except EmulationError as e:
            raise EmulationError(f"PTX line {ins.line}: {ins.text}: {e}") from None
        except PtxParseError as e:
            raise EmulationError(f"PTX line {ins.line}: {ins.text}: {e}") from None

    def resolve(q: int) -> int:
        """The first instruction at or after ``q`` that is not an unconditional branch, following
        branch chains: the translator's structured code has many (phi edges, merges), and each
        would cost a scheduler step; a thread at one would only go on to its target."""
        seen = set()
        while q < len(ops) and ops[q].kind == CompiledOp.BRA and ops[q].guard is None and q not in seen:
            seen.add(q)
            q = ops[q].target
        return q

    for p, op in enumerate(ops):
        op.next = resolve(p + 1)
    for op in ops:
        if op.kind == CompiledOp.BRA:
            op.target = resolve(op.target)
    c.start = resolve(0)
    prog._compiled = (ops, c)
    return prog._compiled
