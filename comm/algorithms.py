"""Collective algorithms over the progress engine (TCP, ibverbs, and forced on shm).

* ring: reduce-scatter then all-gather around the ring, each chunk cut into segments of
  ``HELIOS_COMM_SEGMENT_BYTES``; a segment's arrival reduces it and posts its next send at
  once, so every segment flows through all 2(n-1) steps without waiting for its chunk.
* tree: binomial reduce to the root then binomial broadcast (log2 n latency terms);
  broadcast and reduce are segmented and pipelined down / up the tree.
* halving_doubling: recursive halving reduce-scatter and recursive doubling all-gather
  over the largest power of two p <= n; the other n - p ranks first hand their data to a
  neighbour and get the result back at the end (the usual fix-up).

Messages are tagged ``(sequence number, step, segment)`` so a message can only ever be
matched by the step it was sent for.  Inputs are flat numpy arrays (storage dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from helios.comm import reduce_ops as R
from helios.comm.engine import Engine

LAST_STEP = 0xFFFE


class Ctx:
    """One operation's view of the engine: rank, size, sequence number, deadline."""

    def __init__(self, engine: Engine, rank: int, n: int, seq: int, seg_bytes: int, deadline: float) -> None:
        self.e, self.rank, self.n, self.seq = engine, rank, n, seq
        self.seg_bytes, self.deadline = max(1, seg_bytes), deadline

    def tag(self, step: int, seg: int = 0) -> int:
        """The message tag of ``(step, segment)`` in this operation."""
        return (self.seq << 32) | (step << 16) | seg

    def run(self) -> None:
        """Complete everything posted so far."""
        self.e.wait_all(self.deadline)

    def seg_elems(self, longest: int, isz: int) -> int:
        """Elements per segment for an operation whose longest chunk is ``longest`` (<= 65535 segments)."""
        return max(1, self.seg_bytes // isz, -(-longest // 0xFFFF))

    def segments(self, lo: int, hi: int, isz: int, per: int | None = None) -> list[tuple[int, int]]:
        """Element ranges of ``per`` elements (default: from ``seg_bytes``) covering ``[lo, hi)``."""
        if hi <= lo:
            return []
        per = per or self.seg_elems(hi - lo, isz)
        return [(a, min(a + per, hi)) for a in range(lo, hi, per)]


def bounds(count: int, parts: int) -> list[int]:
    """Element boundaries of ``parts`` near-equal chunks of ``count``."""
    q, r = divmod(count, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


# ---------------------------------------------------------------------------- ring
def _ring(c: Ctx, buf: np.ndarray, bnd: list[int], op: str, dtype: str, rs_shift: int | None, ag_own: int | None,
          avg: bool) -> None:
    """Pipelined ring over chunks ``bnd`` of ``buf``.

    ``rs_shift`` (None: no reduce-scatter): at reduce-scatter step s, rank r sends chunk
    (r - s + shift) and receives chunk (r - s - 1 + shift); after n-1 steps it owns chunk
    (r + 1 + shift), fully reduced.  ``ag_own`` (None: no all-gather): the chunk this rank
    owns before the all-gather is (r + ag_own); at step t it sends chunk (r + ag_own - t).
    Segment i of a chunk always covers the same relative elements, so the temporary
    buffers of step s can be reused by step s + 2 once segment i of step s is reduced.
    """
    n, r = c.n, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    isz = buf.itemsize
    e = c.e
    longest = max(bnd[i + 1] - bnd[i] for i in range(n))
    per = c.seg_elems(longest, isz)
    nrs = n - 1 if rs_shift is not None else 0

    def segs_of(ch: int) -> list[tuple[int, int]]:
        return c.segments(bnd[ch], bnd[ch + 1], isz, per)

    def ag_send(t: int, i: int, a: int, b: int) -> None:
        e.post_send(right, c.tag(nrs + t, i), buf[a:b])

    if ag_own is not None:
        # All-gather receives land in place (their bytes cannot exist before this rank has
        # sent its share of that chunk), so they are all posted now.
        for t in range(n - 1):
            for i, (a, b) in enumerate(segs_of((r + ag_own - t - 1) % n)):
                def on_ag(t: int = t, i: int = i, a: int = a, b: int = b) -> None:
                    if t + 1 < n - 1:
                        ag_send(t + 1, i, a, b)
                e.post_recv(left, c.tag(nrs + t, i), buf[a:b], on_ag)

    if rs_shift is None:
        if ag_own is not None:
            for i, (a, b) in enumerate(segs_of((r + ag_own) % n)):
                ag_send(0, i, a, b)
        c.run()
        return

    tmp = [e.scratch(longest, buf.dtype), e.scratch(longest, buf.dtype)]

    def rs_chunk(s: int) -> int:
        return (r - s - 1 + rs_shift) % n

    def post_rs(s: int, i: int, own_tmp: bool = False) -> None:
        ch = rs_chunk(s)
        segs = segs_of(ch)
        if i >= len(segs):
            return
        a, b = segs[i]
        rel = a - bnd[ch]
        t = np.empty(b - a, dtype=buf.dtype) if own_tmp else tmp[s & 1][rel: rel + b - a]

        def on_rs() -> None:
            R.reduce_into(buf[a:b], t, op, dtype)
            if s + 1 < n - 1:
                e.post_send(right, c.tag(s + 1, i), buf[a:b])
            else:
                if avg:
                    R.finish_avg(buf[a:b], n, "avg", dtype)
                if ag_own is not None:
                    ag_send(0, i, a, b)
            if s + 2 < n - 1:
                post_rs(s + 2, i, own_tmp)

        e.post_recv(left, c.tag(s, i), t, on_rs)

    for s in range(n - 1):
        count = len(segs_of(rs_chunk(s)))
        # Steps 0 and 1 post everything; later steps only the segment indices that the
        # step two before did not have (chunks differ by one element), with their own buffer.
        first = 0 if s < 2 else len(segs_of(rs_chunk(s - 2)))
        for i in range(first, count):
            post_rs(s, i, own_tmp=s >= 2)
    for i, (a, b) in enumerate(segs_of((r + rs_shift) % n)):
        e.post_send(right, c.tag(0, i), buf[a:b])
    c.run()


def ring_all_reduce(c: Ctx, buf: np.ndarray, op: str, dtype: str) -> None:
    """Ring all-reduce: pipelined reduce-scatter then all-gather."""
    if c.n == 1:
        R.finish_avg(buf, 1, op, dtype)
        return
    _ring(c, buf, bounds(buf.size, c.n), op, dtype, rs_shift=0, ag_own=1, avg=op == "avg")


def ring_all_gather(c: Ctx, out: np.ndarray, x: np.ndarray) -> None:
    """Ring all-gather into ``out`` (rank order)."""
    m = x.size
    out[c.rank * m:(c.rank + 1) * m] = x
    if c.n > 1:
        _ring(c, out, [j * m for j in range(c.n + 1)], "sum", "uint8", rs_shift=None, ag_own=0, avg=False)


def ring_reduce_scatter(c: Ctx, out: np.ndarray, x: np.ndarray, op: str, dtype: str) -> None:
    """Ring reduce-scatter: ``out`` = reduced chunk ``rank`` of ``x``."""
    m = out.size
    work = c.e.scratch(x.size, x.dtype)
    work[...] = x
    if c.n > 1:
        _ring(c, work, [j * m for j in range(c.n + 1)], op, dtype, rs_shift=-1, ag_own=None, avg=op == "avg")
    else:
        R.finish_avg(work, 1, op, dtype)
    out[...] = work[c.rank * m:(c.rank + 1) * m]


# ------------------------------------------------------------------- halving-doubling
class _HD:
    """Rank mapping of recursive halving-doubling with the non-power-of-two fix-up."""

    def __init__(self, n: int, r: int) -> None:
        self.p2 = 1 << (n.bit_length() - 1)
        self.rem = n - self.p2
        self.n, self.r = n, r
        if r < 2 * self.rem:
            self.nr = r // 2 if r % 2 else -1  # even ranks of the first 2*rem sit out
        else:
            self.nr = r - self.rem

    def real(self, v: int) -> int:
        """Real rank of virtual rank v."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first_block(self, v: int) -> int:
        """First real block held by virtual rank v (v == p2 gives n)."""
        return 2 * v if v < self.rem else v + self.rem

    @property
    def extra_partner(self) -> int | None:
        """For ranks in the fix-up pairs: the other rank of the pair."""
        if self.r >= 2 * self.rem:
            return None
        return self.r + 1 if self.r % 2 == 0 else self.r - 1


def _hd_rs(c: Ctx, hd: _HD, work: np.ndarray, vb: list[int], op: str, dtype: str) -> tuple[int, int]:
    """Recursive halving over virtual element bounds ``vb``; returns the owned element range."""
    nr, lo, hi = hd.nr, 0, hd.p2
    mask, step = hd.p2 >> 1, 1
    tmp = c.e.scratch(max(vb[i + 1] - vb[i] for i in range(hd.p2)) * max(1, hd.p2 // 2), work.dtype)
    while mask:
        partner = hd.real(nr ^ mask)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if nr & mask == 0 else ((mid, hi), (lo, mid))
        ka, kb = vb[keep[0]], vb[keep[1]]
        c.e.post_send(partner, c.tag(step), work[vb[give[0]]:vb[give[1]]])
        t = tmp[: kb - ka]
        c.e.post_recv(partner, c.tag(step), t)
        c.run()
        R.reduce_into(work[ka:kb], t, op, dtype)
        lo, hi = keep
        mask >>= 1
        step += 1
    return vb[lo], vb[hi]


def _hd_ag(c: Ctx, hd: _HD, work: np.ndarray, vb: list[int]) -> None:
    """Recursive doubling all-gather over virtual element bounds ``vb``."""
    nr, mask, step = hd.nr, 1, 0x100
    while mask < hd.p2:
        partner = hd.real(nr ^ mask)
        mine = nr & ~(mask - 1)
        theirs = mine ^ mask
        c.e.post_send(partner, c.tag(step), work[vb[mine]:vb[mine + mask]])
        c.e.post_recv(partner, c.tag(step), work[vb[theirs]:vb[theirs + mask]])
        c.run()
        mask <<= 1
        step += 1


def _sit_out(c: Ctx, partner: int, give: np.ndarray, result: np.ndarray) -> None:
    """A rank the fix-up leaves out: it gives its data to its pair's other rank, then receives
    the finished ``result`` from it."""
    c.e.post_send(partner, c.tag(0), give)
    c.e.post_recv(partner, c.tag(LAST_STEP), result)
    c.run()


def _fold_in(c: Ctx, partner: int, work: np.ndarray, op: str, dtype: str) -> None:
    """The pair's staying rank reduces the data of the rank that sits out into ``work``."""
    tmp = c.e.scratch(work.size, work.dtype)
    c.e.post_recv(partner, c.tag(0), tmp)
    c.run()
    R.reduce_many(work, (tmp, work), op, dtype)


def _hand_back(c: Ctx, partner: int, result: np.ndarray) -> None:
    """The pair's staying rank sends the finished ``result`` to the rank that sat out."""
    c.e.post_send(partner, c.tag(LAST_STEP), result)
    c.run()


def hd_all_reduce(c: Ctx, buf: np.ndarray, op: str, dtype: str) -> None:
    """Recursive halving-doubling all-reduce (any n, with the fix-up)."""
    n = c.n
    if n == 1:
        R.finish_avg(buf, 1, op, dtype)
        return
    hd = _HD(n, c.rank)
    partner = hd.extra_partner
    if partner is not None:
        if hd.nr < 0:
            _sit_out(c, partner, buf, buf)
            return
        _fold_in(c, partner, buf, op, dtype)
    vb = bounds(buf.size, hd.p2)
    a, b = _hd_rs(c, hd, buf, vb, op, dtype)
    R.finish_avg(buf[a:b], n, op, dtype)
    _hd_ag(c, hd, buf, vb)
    if partner is not None:
        _hand_back(c, partner, buf)


def hd_all_gather(c: Ctx, out: np.ndarray, x: np.ndarray) -> None:
    """Recursive doubling all-gather (any n, with the fix-up)."""
    n, r, m = c.n, c.rank, x.size
    out[r * m:(r + 1) * m] = x
    if n == 1:
        return
    hd = _HD(n, r)
    partner = hd.extra_partner
    if partner is not None:
        if hd.nr < 0:
            _sit_out(c, partner, x, out)
            return
        c.e.post_recv(partner, c.tag(0), out[partner * m:(partner + 1) * m])
        c.run()
    vb = [hd.first_block(v) * m for v in range(hd.p2 + 1)]
    _hd_ag(c, hd, out, vb)
    if partner is not None:
        _hand_back(c, partner, out)


def hd_reduce_scatter(c: Ctx, out: np.ndarray, x: np.ndarray, op: str, dtype: str) -> None:
    """Recursive halving reduce-scatter (any n, with the fix-up)."""
    n, r, m = c.n, c.rank, out.size
    work = c.e.scratch(x.size, x.dtype)
    work[...] = x
    if n == 1:
        R.finish_avg(work, 1, op, dtype)
        out[...] = work
        return
    hd = _HD(n, r)
    partner = hd.extra_partner
    if partner is not None:
        if hd.nr < 0:
            _sit_out(c, partner, work, out)
            return
        _fold_in(c, partner, work, op, dtype)
    vb = [hd.first_block(v) * m for v in range(hd.p2 + 1)]
    a, b = _hd_rs(c, hd, work, vb, op, dtype)
    R.finish_avg(work[a:b], n, op, dtype)
    if partner is not None:
        _hand_back(c, partner, work[partner * m:(partner + 1) * m])
    out[...] = work[r * m:(r + 1) * m]


# ------------------------------------------------------------------------- trees
def binomial(n: int, v: int) -> tuple[int | None, list[int]]:
    """Parent and children of relative rank ``v`` in a binomial tree rooted at 0."""
    parent, mask = None, 1
    while mask < n:
        if v & mask:
            parent = v - mask
            break
        mask <<= 1
    children = []
    m = mask >> 1
    while m:
        if v + m < n:
            children.append(v + m)
        m >>= 1
    return parent, children


def chain(n: int, v: int) -> tuple[int | None, list[int]]:
    """Parent and children of relative rank ``v`` in a chain rooted at 0 (the ring's pipeline)."""
    return (v - 1 if v > 0 else None), ([v + 1] if v + 1 < n else [])


Topology = Callable[[int, int], "tuple[int | None, list[int]]"]


def tree_broadcast(c: Ctx, buf: np.ndarray, root: int, topo: Topology = binomial) -> None:
    """Segmented, pipelined broadcast down a tree (binomial or chain)."""
    n = c.n
    if n == 1:
        return
    v = (c.rank - root) % n
    parent, children = topo(n, v)
    kids = [(k + root) % n for k in children]
    segs = c.segments(0, buf.size, buf.itemsize) or [(0, 0)]
    if parent is None:
        for i, (a, b) in enumerate(segs):
            for k in kids:
                c.e.post_send(k, c.tag(0, i), buf[a:b])
    else:
        src = (parent + root) % n
        for i, (a, b) in enumerate(segs):
            def fwd(i: int = i, a: int = a, b: int = b) -> None:
                for k in kids:
                    c.e.post_send(k, c.tag(0, i), buf[a:b])
            c.e.post_recv(src, c.tag(0, i), buf[a:b], fwd)
    c.run()


def tree_reduce(c: Ctx, buf: np.ndarray, root: int, op: str, dtype: str, topo: Topology = binomial) -> None:
    """Segmented, pipelined reduce up a tree; only ``root``'s ``buf`` changes."""
    n = c.n
    if n == 1:
        R.finish_avg(buf, 1, op, dtype)
        return
    v = (c.rank - root) % n
    parent, children = topo(n, v)
    kids = [(k + root) % n for k in children]
    if parent is None:
        work = buf
    else:
        work = c.e.scratch(buf.size, buf.dtype)
        work[...] = buf
    segs = c.segments(0, buf.size, buf.itemsize) or [(0, 0)]
    tmps = {k: c.e.scratch(work.size, work.dtype) for k in kids}
    arrived = [0] * len(segs)
    for i, (a, b) in enumerate(segs):
        def done(i=i, a=a, b=b) -> None:
            arrived[i] += 1
            if arrived[i] < len(kids):
                return
            # Children reduced in a fixed order, so the result does not depend on timing.
            R.reduce_many(work[a:b], [work[a:b]] + [tmps[k][a:b] for k in kids], op, dtype)
            if parent is not None:
                c.e.post_send((parent + root) % n, c.tag(0, i), work[a:b])
            else:
                R.finish_avg(work[a:b], n, op, dtype)
        for k in kids:
            c.e.post_recv(k, c.tag(0, i), tmps[k][a:b], done)
        if not kids:
            done()
    c.run()


def tree_all_reduce(c: Ctx, buf: np.ndarray, op: str, dtype: str) -> None:
    """Binomial reduce to rank 0 then binomial broadcast: 2·log2(n) latency terms."""
    tree_reduce(c, buf, 0, op, dtype)
    c2 = Ctx(c.e, c.rank, c.n, c.seq, c.seg_bytes, c.deadline)
    c2.tag = lambda step, seg=0: c.tag(step + 0x200, seg)  # type: ignore[method-assign]
    tree_broadcast(c2, buf, 0)


# ---------------------------------------------------------------------- the rest
def all_to_all(c: Ctx, out: np.ndarray, x: np.ndarray) -> None:
    """Every pair exchanges its chunk, all in flight at once."""
    n, r = c.n, c.rank
    m = x.size // n
    out[r * m:(r + 1) * m] = x[r * m:(r + 1) * m]
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        c.e.post_send(dst, c.tag(0), x[dst * m:(dst + 1) * m])
        c.e.post_recv(src, c.tag(0), out[src * m:(src + 1) * m])
    c.run()


def barrier(c: Ctx) -> None:
    """Dissemination barrier: ceil(log2 n) rounds of empty messages."""
    n, r, k, step = c.n, c.rank, 1, 0
    empty = np.empty(0, np.uint8)
    while k < n:
        c.e.post_send((r + k) % n, c.tag(step), empty)
        c.e.post_recv((r - k) % n, c.tag(step), empty)
        c.run()
        k <<= 1
        step += 1
