"""Semantics of each PTX instruction the generators emit, for :class:`emulator.Cta`.

A handler is ``fn(cta, ins, lanes)``: ``lanes`` are the thread ids that execute
the instruction (after the guard predicate), ``cta`` gives operand access
(:meth:`Cta.read` / :meth:`Cta.write` / :meth:`Cta.address`) and the state.  A
handler returns ``"spin"`` when the warp should give up its turn (a failed
``mbarrier.try_wait``).  Unknown opcodes are refused at load time, naming the line.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as D
from . import layout as L
from .emu_state import (SMEM_BASE, SMEM_CLUSTER_BASE, SMEM_CLUSTER_STRIDE, BulkStore, CpAsyncOp, EmulationError,
                        MBarrier, WgmmaOp)
from .ptx_parse import PtxInstr, TensorArg, VecArg

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
    if np.any(b == 0):
        raise cta.fail("integer division by zero")
    r = a // b if ins.parts[0] == "div" else a % b
    cta.write(ins.args[0], lanes, r.astype(a.dtype))


def _shift(cta, ins, lanes):
    t = ins.parts[-1]
    a = cta.read(ins.args[1], lanes, t)
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


def _setp(cta, ins, lanes):
    cmp, t = ins.parts[1], ins.parts[2]
    a, b = cta.read(ins.args[1], lanes, t), cta.read(ins.args[2], lanes, t)
    fn = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
          "gt": np.greater, "ge": np.greater_equal}[cmp]
    cta.write(ins.args[0], lanes, fn(a, b))


def _pred_logic(cta, ins, lanes):
    a, b = cta.read(ins.args[1], lanes, "pred"), cta.read(ins.args[2], lanes, "pred")
    fn = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[ins.parts[0]]
    cta.write(ins.args[0], lanes, fn(a, b))


def _mov(cta, ins, lanes):
    t = ins.parts[-1]
    cta.write(ins.args[0], lanes, cta.read(ins.args[1], lanes, t))


def _cvt(cta, ins, lanes):
    p = ins.parts
    if p[1:] == ["u64", "u32"]:
        cta.write(ins.args[0], lanes, cta.read(ins.args[1], lanes, "u32").astype(np.uint64))
    elif p[1:] == ["rn", "bf16x2", "f32"]:  # d = {hi: a, lo: b}
        hi = D.f32_to_bf16_bits(cta.read(ins.args[1], lanes, "f32")).astype(np.uint32)
        lo = D.f32_to_bf16_bits(cta.read(ins.args[2], lanes, "f32")).astype(np.uint32)
        cta.write(ins.args[0], lanes, (hi << np.uint32(16)) | lo)
    elif p[1:] == ["rn", "bf16", "f32"]:
        cta.write(ins.args[0], lanes, D.f32_to_bf16_bits(cta.read(ins.args[1], lanes, "f32")))
    elif p[1:] == ["f32", "f16"]:
        h = cta.read(ins.args[1], lanes, "b16")
        cta.write(ins.args[0], lanes, h.view(np.float16).astype(np.float32))
    else:
        raise cta.fail(f"{ins.op} is not modelled")


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

_LD_TYPES = {"u16": 2, "b16": 2, "u32": 4, "b32": 4, "f32": 4, "u64": 8, "b64": 8}


def _ld_param(cta, ins, lanes):
    bits = _width(ins.parts[-1])
    v = int(cta.param_value(ins.args[1].base.name)) & ((1 << bits) - 1)
    cta.write(ins.args[0], lanes, np.full(lanes.size, v, np.uint64 if bits == 64 else np.uint32))


def _vec_regs(arg) -> list:
    return list(arg.items) if isinstance(arg, VecArg) else [arg]


def _ld(cta, ins, lanes):
    space, t = ins.parts[1], ins.parts[-1]
    if space == "param":
        return _ld_param(cta, ins, lanes)
    size = _LD_TYPES[t]
    addr = cta.address(ins.args[1], lanes)
    if space == "global":
        raw = cta.mem.load(addr.astype(np.uint64), size)
    elif space == "shared":
        raw = cta.smem[cta.smem_index(addr, size)]
    else:
        raise cta.fail(f"ld.{space} is not modelled")
    val = raw.copy().view({2: np.uint16, 4: np.uint32, 8: np.uint64}[size]).reshape(-1)
    if size == 2 and cta.prog.reg_type(ins.args[0].name) == "b32":
        val = val.astype(np.uint32)  # ld.u16 into a 32-bit register zero-extends
    cta.write(ins.args[0], lanes, val)


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
    data = np.stack(vals, axis=1).copy().view(np.uint8).reshape(lanes.size, size * vec)
    addr = cta.address(ins.args[0], lanes)
    if space == "global":
        if np.any(addr % (size * vec)):
            raise cta.fail(f"misaligned {ins.op} at {int(addr[addr % (size * vec) != 0][0]):#x}")
        cta.mem.store(addr.astype(np.uint64), data)
    elif space == "shared":
        idx = cta.smem_index(addr, size * vec)
        for a in cta.mbars:
            if np.any((idx >= a) & (idx < a + 8)):
                raise cta.fail(f"store overwrites the mbarrier at {a:#x}")
        for op in cta.bulk_pending:
            if np.any((idx >= op.src) & (idx < op.src + op.tmap.box_bytes)):
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
        ok = np.array([cta.mbar(int(a)).test_parity(int(q)) for a, q in zip(addr, parity)], bool)
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


def _tma_load(cta, ins, lanes):
    """``cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
    [dst], [tmap, {c0, c1}], [mbar]{, ctaMask}``.

    Without ``.multicast::cluster`` the box lands at ``dst`` and completes its bytes on
    ``mbar``, in the CTA those shared::cluster addresses name (the executing one for plain
    shared addresses).  With it, the box lands at the same CTA-relative offset in every
    CTA of ``ctaMask`` and completes on the barrier at ``mbar``'s offset in each, each
    landing at its own time.
    """
    p = ins.parts
    if "2d" not in p or "tile" not in p:
        raise cta.fail(f"{ins.op} is not modelled (only 2-D tile loads)")
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
        c0, c1 = (int(cta.read(c, one, "s32")[0]) for c in src_arg.coords)
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
            cta.schedule_tma(lambda tgt=tgt, dst=dst, bar=bar, tm=tm, c0=c0, c1=c1: _land_box(tgt, dst, bar, tm, c0, c1))


def _clip_box(tm, c0: int, c1: int):
    """The part of the box at column ``c0``, row ``c1`` inside the tensor, as (tensor, box)
    index pairs over their byte views; None when the box misses the tensor entirely."""
    r0, r1 = max(c1, 0), min(c1 + tm.box_rows, tm.rows)
    k0, k1 = max(c0, 0), min(c0 + tm.box_cols, tm.cols)
    if r1 <= r0 or k1 <= k0:
        return None
    isz = tm.itemsize
    return ((slice(r0, r1), slice(k0 * isz, k1 * isz)),
            (slice(r0 - c1, r1 - c1), slice((k0 - c0) * isz, (k1 - c0) * isz)))


def _tensor_bytes(mem, tm) -> np.ndarray:
    """The tensor map's matrix as a writable ``rows x (cols * itemsize)`` byte view."""
    pitch = tm.cols * tm.itemsize
    return mem.view(tm.base, tm.rows * pitch).reshape(tm.rows, pitch)


def _land_box(tgt, dst: int, bar: int, tm, c0: int, c1: int) -> None:
    """A TMA box arrives in CTA ``tgt``: read the tensor now, write it swizzled at ``dst``, complete its bytes on ``bar``."""
    if tgt.exited:
        raise EmulationError(f"a TMA copy landed in CTA {tgt.ctaid[:2]} after it exited: a CTA must not leave "
                             "while copies into its shared memory are in flight")
    box = np.zeros((tm.box_rows, tm.box_cols * tm.itemsize), np.uint8)
    clip = _clip_box(tm, c0, c1)
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
    """``cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [tmap, {c0, c1}], [smem]``."""
    dst_arg, src_arg = ins.args
    if not isinstance(dst_arg, TensorArg):
        raise cta.fail("TMA store destination must be [tensormap, {coords}]")
    for t in lanes.tolist():
        one = np.array([t])
        src = int(cta.address(src_arg, one)[0])
        tm = cta.tensor_map_at(int(cta.read(dst_arg.tmap, one, "u64")[0]))
        c0, c1 = (int(cta.read(c, one, "s32")[0]) for c in dst_arg.coords)
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
        op = BulkStore(src, tm, c0, c1)
        cta.bulk_open.setdefault(t, []).append(op)
        cta.bulk_pending.append(op)
        op.queued = cta.schedule_tma(lambda op=op: _land_store(cta, op))


def _land_store(cta, op: BulkStore) -> None:
    """The store reads its box from shared memory (unswizzling it) and writes the in-bounds part to the tensor."""
    if op.landed:
        return
    tm = op.tmap
    idx = L.swizzle(np.arange(tm.box_bytes) + op.src, L.SWIZZLE_BITS[tm.swizzle])
    box = cta.smem[idx].reshape(tm.box_rows, tm.box_cols * tm.itemsize)
    clip = _clip_box(tm, op.c0, op.c1)
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
            for op in st.groups.pop(0):
                _wgmma_retire(cta, lanes, op)
        st.locked = {r for g in st.groups for op in g for r in op.acc} | {r for op in st.open_ops for r in op.acc}
    else:
        raise cta.fail(f"{ins.op} is not modelled")


def _uniform(cta, vals: np.ndarray, what: str) -> int:
    if np.any(vals != vals[0]):
        raise cta.fail(f"{what} differs across the warpgroup (wgmma needs it uniform)")
    return int(vals[0])


def _wgmma_issue(cta, ins, lanes) -> None:
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
    warps = [cta.wgmma[w] for w in sorted({int(t) // 32 for t in lanes})]
    for st in warps:
        for r in acc:
            if r in st.dirty:
                raise cta.fail(f"accumulator {r} was written by an ordinary instruction after the last wgmma.fence")
    da = _uniform(cta, cta.read(args[1], lanes, "u64"), "descriptor A")
    db = _uniform(cta, cta.read(args[2], lanes, "u64"), "descriptor B")
    scale_d = bool(_uniform(cta, cta.read(args[3], lanes, "pred").astype(np.int64), "scale-d"))
    rest = [int(a.value) for a in args[4:]]
    if rest[:2] != [1, 1]:
        raise cta.fail("imm-scale-a/b other than 1 are not modelled")
    trans_a, trans_b = (rest[2], rest[3]) if len(rest) == 4 else (0, 0)
    if trans_a:
        raise cta.fail("M-major A (imm-trans-a=1) is not modelled")
    if in_dtype == "e4m3" and len(rest) != 2:
        raise cta.fail("fp8 wgmma takes no transpose arguments")
    itemsize = 1 if in_dtype == "e4m3" else 2
    for r in acc:
        if not cta.written[r][lanes].all() and scale_d:
            raise cta.fail(f"accumulator {r} read (scale-d=1) before anything wrote it")
    op = WgmmaOp(acc, da, db, scale_d, n, k * itemsize, in_dtype, bool(trans_b), ins.line)
    for st in warps:
        st.open_ops.append(op)
        st.locked.update(acc)


def _decode(raw: np.ndarray, in_dtype: str) -> np.ndarray:
    if in_dtype == "bf16":
        return D.bf16_bits_to_f32(raw.view(np.uint16)).astype(np.float64)
    if in_dtype == "f16":
        return raw.view(np.float16).astype(np.float64)
    if in_dtype == "e4m3":
        return D.decode(raw.view(np.uint8), "e4m3").astype(np.float64)
    raise EmulationError(f"wgmma input type {in_dtype} is not modelled")


def _wgmma_retire(cta, lanes, op) -> None:
    """Retire one warp's share: read the operands the descriptors name *now*, accumulate its 16 rows."""
    raw_t = np.uint8 if op.in_dtype == "e4m3" else np.uint16
    for d in (op.desc_a, op.desc_b):
        if L.decode_desc(d)["start"] < SMEM_BASE:
            raise cta.fail(f"wgmma descriptor (line {op.line}) starts at {L.decode_desc(d)['start']:#x}, "
                           f"below the shared block at {SMEM_BASE:#x}")
    try:
        a = _decode(L.wgmma_gather(cta.smem, op.desc_a, 64, op.k_bytes, raw_t), op.in_dtype)  # 64 x k
        if op.trans_b:
            k = op.k_bytes // np.dtype(raw_t).itemsize
            b = _decode(L.wgmma_gather_mn(cta.smem, op.desc_b, op.n, k, raw_t), op.in_dtype)  # n x k
        else:
            b = _decode(L.wgmma_gather(cta.smem, op.desc_b, op.n, op.k_bytes, raw_t), op.in_dtype)  # n x k
    except IndexError as e:
        raise cta.fail(f"wgmma operand (line {op.line}) runs past the shared block: {e}") from e
    prod = a @ b.T  # 64 x n
    rows, cols = L.wgmma_d_map(op.n)
    rows, cols = rows[lanes % 128], cols[lanes % 128]
    acc = np.stack([cta.regs[r][lanes].view(np.float32) for r in op.acc], axis=1).astype(np.float64)
    out = (prod[rows, cols] + (acc if op.scale_d else 0.0)).astype(np.float32)
    # Straight into the registers: the wgmma owns them, so cta.write's in-flight checks do not apply.
    for j, r in enumerate(op.acc):
        reg = cta.regs[r]
        reg[lanes] = out[:, j].view(reg.dtype)
        cta.written[r][lanes] = True


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
    "setp": _setp,
    "mov": _mov,
    "cvt": _cvt,
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


def handler_for(ins: PtxInstr):
    """The handler for one instruction; raises for opcodes the emulator does not model."""
    p = ins.parts
    head = p[0]
    if head in ("and", "or", "xor") and p[-1] == "pred":
        return _pred_logic
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
