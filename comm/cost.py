"""Algorithm choice by a latency + bandwidth (alpha-beta) cost model.

t(message of S bytes over one hop) = alpha + S * beta.  For n ranks (p = largest power of
two <= n, L = log2 p):

===================  =====================================================================
all_reduce ring      2(n-1)·alpha + 2(n-1)/n·S·beta
all_reduce tree      2·ceil(log2 n)·(alpha + S·beta)                 (binomial reduce + bcast)
all_reduce h-d       2L·alpha + 2(p-1)/p·S·beta  [+ 2(alpha + S·beta) when n != p]
all_gather ring      (n-1)·alpha + (n-1)/n·S·beta                    (S = gathered bytes)
all_gather h-d       L·alpha + (p-1)/p·S·beta  [+ alpha + S/n·beta + alpha + S·beta]
broadcast tree       ceil(log2 n)·(alpha + S·beta)
broadcast ring       (n-2+k)·(alpha + S/k·beta), k segments         (pipelined chain)
===================  =====================================================================

plus a reduction term gamma per reduced byte: the pipelined ring overlaps it with the
transfer of the next segment (its per-byte cost is max(beta, gamma)), while the tree and
halving-doubling reduce whole blocks between steps and pay it on top.  So small messages
go to the tree or halving-doubling (few latency terms) and large ones to the pipelined
ring (least bytes per link, reduction hidden).  alpha and beta are per transport and can be
overridden with ``HELIOS_COMM_ALPHA_US`` and ``HELIOS_COMM_GBPS`` after measuring.
"""

from __future__ import annotations

import math
import os

# Measured orders of magnitude on loopback with this implementation (per message: a
# Python-level send/receive and a system call or two; bandwidth of one stream).
_DEFAULTS = {"tcp": (60e-6, 1 / 2.0e9), "shm": (15e-6, 1 / 5.0e9), "ibverbs": (20e-6, 1 / 10e9)}
GAMMA = 1 / 2.0e9  # seconds per byte of a numpy reduction (one core)


def params(transport: str) -> tuple[float, float]:
    """(alpha seconds, beta seconds per byte) of a transport, with environment overrides."""
    alpha, beta = _DEFAULTS.get(transport, _DEFAULTS["tcp"])
    if os.environ.get("HELIOS_COMM_ALPHA_US"):
        alpha = float(os.environ["HELIOS_COMM_ALPHA_US"]) * 1e-6
    if os.environ.get("HELIOS_COMM_GBPS"):
        beta = 1 / (float(os.environ["HELIOS_COMM_GBPS"]) * 1e9)
    return alpha, beta


def estimate(op: str, algorithm: str, nbytes: int, n: int, transport: str, seg_bytes: int = 1 << 20,
             ab: tuple[float, float] | None = None) -> float:
    """Modelled seconds of ``op`` with ``algorithm`` on ``n`` ranks for ``nbytes``
    (``ab``: measured (alpha, beta) instead of the transport's defaults)."""
    a, b = ab if ab is not None else params(transport)
    S = float(nbytes)
    if n <= 1:
        return 0.0
    p = 1 << (n.bit_length() - 1)
    L = math.log2(p)
    fix = n != p
    lg = math.ceil(math.log2(n))
    if op == "all_reduce":
        g = GAMMA
        if algorithm == "ring":
            return 2 * (n - 1) * a + (n - 1) / n * S * (max(b, g) + b)
        if algorithm == "tree":
            return 2 * lg * (a + S * b) + lg * S * g
        return 2 * L * a + 2 * (p - 1) / p * S * b + (p - 1) / p * S * g + (2 * (a + S * b) + S * g if fix else 0.0)
    if op in ("all_gather", "reduce_scatter"):
        red = GAMMA if op == "reduce_scatter" else 0.0
        if algorithm == "ring":
            return (n - 1) * a + (n - 1) / n * S * max(b, red)
        return L * a + (p - 1) / p * S * (b + red) + ((2 * a + S / n * b + S * b) if fix else 0.0)
    if op in ("broadcast", "reduce"):
        if algorithm == "tree":
            return lg * (a + S * b)
        k = max(1, math.ceil(S / seg_bytes))
        return (n - 2 + k) * (a + S / k * b)
    return 0.0


CHOICES = {
    "all_reduce": ("tree", "halving_doubling", "ring"),
    "all_gather": ("halving_doubling", "ring"),
    "reduce_scatter": ("halving_doubling", "ring"),
    "broadcast": ("tree", "ring"),
    "reduce": ("tree", "ring"),
}


def choose(op: str, nbytes: int, n: int, transport: str, seg_bytes: int = 1 << 20,
           ab: tuple[float, float] | None = None) -> str:
    """The cheapest algorithm for ``op`` by the model (ties go to the first listed)."""
    cands = CHOICES.get(op)
    if not cands:
        return "ring"
    return min(cands, key=lambda alg: estimate(op, alg, nbytes, n, transport, seg_bytes, ab))


# ------------------------------------------------------------------ two levels (hosts)
# Across hosts, a rank's link is the host's: the L ranks of a host share it.  Per host and
# all_reduce of S bytes, the flat ring (ranks of a host adjacent) crosses each host boundary
# once per step, so the host's link carries 2(n-1)/n·S; the hierarchical algorithm
# (intra-host reduce-scatter, L concurrent inter-host all-reduces of S/L, intra-host
# all-gather) carries 2(h-1)/h·S.  Model, with (alpha_s, beta_s) inside a host and
# (alpha_i, beta_i) the link between hosts:
#
#   flat          best flat algorithm on n = L·h ranks at (alpha_i, beta_i)
#   hierarchical  2·(alpha_s + (L-1)/L·S·beta_s)                       (shm reduce-scatter, all-gather)
#                 + best flat algorithm on h ranks for S/L bytes at (alpha_i, L·beta_i)
#
# (the L inter-host exchanges run at once over the one link, so each sees 1/L of it).  A large
# all_reduce goes in P pieces, pipelined (comm/hierarchical.py): the host's shared memory and
# the link work at once, so its time is that of the busier of the two plus one piece of the
# other (the first reduce-scatter before the link starts, the last all-gather after it ends).
def estimate_flat_multihost(op: str, nbytes: int, n: int, inter: tuple[float, float],
                            seg_bytes: int = 1 << 20) -> tuple[str, float]:
    """(algorithm, seconds): the best flat algorithm over ``n`` ranks on links ``inter``."""
    cands = CHOICES.get(op, ("ring",))
    t = {alg: estimate(op, alg, nbytes, n, "tcp", seg_bytes, inter) for alg in cands}
    best = min(cands, key=lambda alg: t[alg])
    return best, t[best]


def estimate_hierarchical(op: str, nbytes: int, local: int, hosts: int, intra: tuple[float, float],
                          inter: tuple[float, float], seg_bytes: int = 1 << 20) -> tuple[str, float]:
    """(inter-host algorithm, seconds) of the hierarchical ``op`` (see above)."""
    a_s, b_s = intra
    P = pieces(nbytes, local) if op == "all_reduce" else 1
    S = float(nbytes) / P  # one piece
    inner = 2 * (a_s + (local - 1) / local * S * b_s)
    if op == "broadcast":
        inner = a_s + S * b_s + a_s + (local - 1) / local * S * b_s
    elif op in ("reduce_scatter", "all_gather"):
        inner /= 2
    a_i, b_i = inter
    alg, t = estimate_flat_multihost(op, int(S / local), hosts, (a_i, local * b_i), seg_bytes)
    if P == 1:
        return alg, inner + t
    return alg, P * max(inner, t) + min(inner, t)


# A pipelined hierarchical all_reduce's pieces: at least PIECE_BYTES of each local rank's shard a
# piece (smaller ones pay the levels' latencies more than the overlap gains), at most MAX_PIECES.
# 64 MiB on 2 namespace hosts x 4 ranks at 1 Gbit/s (bench/multihost.py): 1, 4, 8, 16 pieces ran
# 743, 638, 590, 575 ms.
PIECE_BYTES = 512 << 10
MAX_PIECES = 16


def pieces(nbytes: int, local: int) -> int:
    """How many pieces a hierarchical all_reduce of ``nbytes`` over hosts of ``local`` ranks pipelines
    (``HELIOS_COMM_HIER_PIECES`` overrides; 1: the three levels one after another)."""
    v = os.environ.get("HELIOS_COMM_HIER_PIECES", "").strip()
    if v.isdigit() and int(v) >= 1:
        return int(v)
    return max(1, min(MAX_PIECES, nbytes // local // PIECE_BYTES))


def choose_multihost(op: str, nbytes: int, local: int, hosts: int, intra: tuple[float, float],
                     inter: tuple[float, float], seg_bytes: int = 1 << 20) -> tuple[bool, str]:
    """(hierarchical?, algorithm): the hierarchical form and its inter-host algorithm, or the best flat one."""
    flat_alg, tf = estimate_flat_multihost(op, nbytes, local * hosts, inter, seg_bytes)
    hier_alg, th = estimate_hierarchical(op, nbytes, local, hosts, intra, inter, seg_bytes)
    return (True, hier_alg) if th <= tf else (False, flat_alg)
