"""Which kernel a Vulkan device's matmul runs on: the cooperative-matrix kernel (matmul_coop.comp,
tensor cores through GL_KHR_cooperative_matrix) or the shared-memory kernel, and the coopmat
kernel's tile; the same for float16 flash attention (flash_coop.comp or flash_attn.comp, and the
plan of each pass: :func:`choose_flash`, :func:`flash_choice_for`).

The addon lists what ``vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR`` says of a device
(its facts' ``"cooperative_matrix"``: one dict per shape, empty where the device has no usable
VK_KHR_cooperative_matrix: lavapipe, older GPUs).  :func:`choose` is the decision, pure: the
listed shapes, the operands' dtype and the product's size in, a :class:`Choice` out, so tests
hand it any device's list.  gemm.matmul asks :func:`choice_for` (the runtime's facts) and says
the choice once per kind at ``HELIOS_DEBUG=1``; helios-doctor lists what each device offers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# The kernel's fixed costs: its staged rows are padded by 8 halves, and the epilogue's scratch
# tile per subgroup is fp32 (matmul_coop.comp).
_PAD = 8
# Tiles tried, biggest first: (BM, BN, BK, subgroups along M, subgroups along N).  The large
# tile reuses each staged slice for 4x4 accumulators a subgroup; products under 128 rows or
# columns take the small one, so fewer workgroups compute padding.
_TILES = ((128, 128, 32, 2, 2), (64, 64, 32, 2, 2))
# Below this many rows or columns the product is mostly padding in a cooperative-matrix tile.
MIN_DIM = 16
KERNEL = "matmul_coop"


@dataclass(frozen=True)
class CoopShape:
    """One cooperative-matrix shape a device lists: C[m x n] += A[m x k] @ B[k x n], component types
    as short names ("f16", "f32", "bf16", "i8", ...), and its scope ("subgroup", "workgroup", ...)."""

    m: int
    n: int
    k: int
    a: str
    b: str
    c: str
    result: str
    scope: str

    def label(self) -> str:
        """"16x16x16 f16*f16+f32 (subgroup)" (A*B+C; the result's type where it differs from C's)."""
        res = "" if self.result == self.c else f"->{self.result}"
        return f"{self.m}x{self.n}x{self.k} {self.a}*{self.b}+{self.c}{res} ({self.scope})"


@dataclass(frozen=True)
class Tile:
    """The coopmat kernel's workgroup tile: BM x BN outputs, K in slices of BK, wgm x wgn subgroups of
    ``subgroup`` invocations, each holding (BM/wgm) x (BN/wgn) outputs as accumulators of ``shape``."""

    bm: int
    bn: int
    bk: int
    wgm: int
    wgn: int
    subgroup: int
    shape: CoopShape

    @property
    def threads(self) -> int:
        """Invocations per workgroup."""
        return self.wgm * self.wgn * self.subgroup

    def shared_bytes(self) -> int:
        """Shared memory the kernel declares (two stages of A and B in either orientation, fp16, plus one
        fp32 scratch tile per subgroup)."""
        a = max(self.bm * (self.bk + _PAD), self.bk * (self.bm + _PAD))
        b = max(self.bn * (self.bk + _PAD), self.bk * (self.bn + _PAD))
        return 2 * 2 * (a + b) + 4 * self.wgm * self.wgn * self.shape.m * self.shape.n

    def fits(self, max_shared: int) -> bool:
        """Whether the shape divides the tile, every invocation stages whole runs of 8 and single
        elements alike, and the shared memory fits."""
        s, t = self.shape, self.threads
        return (self.bm % (self.wgm * s.m) == 0 and self.bn % (self.wgn * s.n) == 0 and self.bk % s.k == 0
                and self.bk % 8 == 0 and all(x * self.bk % (8 * t) == 0 for x in (self.bm, self.bn))
                and self.shared_bytes() <= max_shared)

    def spec(self, has_bias: int = 0, ct: int = 0, cld: int = 0, epi: int = 0, bsum: int = 0, amode: int = 0,
             bmode: int = 0, mixed: tuple | None = None) -> tuple:
        """matmul_coop.comp's specialization constants 0-15 (matmul.glsl's ids where they mean the same:
        HAS_BIAS 5, CT 6, CLD 7, EPI 9, BSUM 10); ``amode`` / ``bmode`` how A and B are read (the
        kernel's top comment); ``mixed`` the float32 slots (AF32, BF32, CF32, BIASF32, EF32 as
        matmul.glsl's: ids 16-20, absent for a plain product)."""
        return (self.bm, self.bn, self.bk, self.threads, self.wgm, has_bias, ct, cld, self.wgn, epi, bsum,
                self.shape.m, self.shape.n, self.shape.k, amode, bmode) + tuple(mixed or ())

    def grid(self, M: int, N: int, batch: int) -> tuple:
        """Workgroups of an M x N output (times ``batch`` matrices)."""
        return (-(-N // self.bn), -(-M // self.bm), batch)

    def label(self) -> str:
        """"128x128x32 tiles of 2x2 subgroups, 16x16x16 f16*f16+f32 (subgroup)"."""
        return f"{self.bm}x{self.bn}x{self.bk} tiles of {self.wgm}x{self.wgn} subgroups, {self.shape.label()}"


@dataclass(frozen=True)
class Choice:
    """``kernel`` ("matmul_coop" or "matmul"), its ``tile`` (None for "matmul") and why."""

    kernel: str
    tile: Tile | None
    reason: str

    @property
    def coopmat(self) -> bool:
        """Whether the cooperative-matrix kernel runs it."""
        return self.tile is not None

    def line(self, device: str, dtype: str) -> str:
        """The HELIOS_DEBUG line: which kernel a ``dtype`` matmul on ``device`` runs and why."""
        what = f"{KERNEL}, {self.tile.label()}" if self.tile else "matmul (shared-memory kernel)"
        return f"helios: matmul {dtype} on {device}: {what}: {self.reason}"


def load_modes(M: int, N: int, K: int, offsets: tuple, a_strides: tuple, b_strides: tuple) -> tuple:
    """(AMODE, BMODE) of matmul_coop: 1 reads A's rows (``sak`` 1) / B^T's rows (``sbk`` 1) along K, 2 reads
    A^T's rows along M / B's rows along N, 8 halves a load; where the other stride, the offset and
    the batch strides are all multiples of 8 (every run then starts 16-byte aligned; the kernel
    reads a run that crosses the edge of a dim one element a load); else 0, one element a load.
    ``offsets`` = (A's, B's); ``a_strides`` = (sam, sak, *batch strides), ``b_strides`` = (sbk,
    sbn, *batch strides).  (M, N and K no longer decide: a ragged K of 33 reads four runs of 8
    and one element.)"""
    def by8(*xs):
        return all(x % 8 == 0 for x in xs)

    (oa, ob), (sam, sak, *ca), (sbk, sbn, *cb) = offsets, a_strides, b_strides
    amode = 1 if sak == 1 and by8(sam, oa, *ca) else 2 if sam == 1 and by8(sak, oa, *ca) else 0
    bmode = 1 if sbk == 1 and by8(sbn, ob, *cb) else 2 if sbn == 1 and by8(sbk, ob, *cb) else 0
    return amode, bmode


def shapes_of(info: dict) -> list[CoopShape]:
    """The cooperative-matrix shapes of a device's facts (the addon's ``"cooperative_matrix"`` list of
    dicts with m, n, k, a, b, c, result, scope); [] where it lists none or does not say."""
    return [CoopShape(int(d["m"]), int(d["n"]), int(d["k"]), str(d["a"]), str(d["b"]), str(d["c"]),
                      str(d["result"]), str(d["scope"])) for d in info.get("cooperative_matrix", ()) or ()]


# The operand dtypes the cooperative-matrix kernel has a variant for, and their component names.
OPERAND_TYPES = {"float16": "f16", "bfloat16": "bf16"}


def _fp32_sums(s: CoopShape, operand: str = "f16") -> bool:
    """Whether ``s`` is a subgroup-scope shape of ``operand`` x ``operand`` with float32 sums."""
    return s.scope == "subgroup" and s.a == s.b == operand and s.c == s.result == "f32"


def choose(shapes: list[CoopShape], dtype: str, M: int, N: int, K: int, subgroup_size: int,
           max_shared: int = 49152, kernel_built: bool = True) -> Choice:
    """The kernel of an ``M x N x K`` product of ``dtype`` operands (a Helios dtype name) on a device
    listing ``shapes`` with subgroups of ``subgroup_size`` and ``max_shared`` bytes of shared memory.

    The coopmat kernel takes float16 or bfloat16 operands with float32 sums on a subgroup-scope
    shape of that type: 16x16x16 where listed (every vendor's tensor-core shape), else the largest
    listed shape that divides a tile; the tile is the largest of :data:`_TILES` that fits.
    ``kernel_built`` False (no compiler for its SPIR-V) keeps the shared-memory kernel.  Every "no"
    says why."""
    if not shapes:
        return Choice("matmul", None, "the device lists no cooperative-matrix shapes")
    operand = OPERAND_TYPES.get(dtype)
    if operand is None:
        return Choice("matmul", None, f"{dtype} operands: the cooperative-matrix kernel takes float16 or bfloat16")
    usable = [s for s in shapes if _fp32_sums(s, operand)]
    if not usable:
        listed = ", ".join(sorted({s.label() for s in shapes}))
        return Choice("matmul", None,
                      f"no subgroup-scope {operand}*{operand}+f32 shape (fp32 sums) among those listed: {listed}")
    if not kernel_built:
        return Choice("matmul", None, f"{KERNEL} is not built: no shader compiler here knows GL_KHR_cooperative_matrix")
    if min(M, N) < MIN_DIM:
        return Choice("matmul", None, f"{min(M, N)} rows or columns: a cooperative-matrix tile would be mostly padding")
    usable.sort(key=lambda s: ((s.m, s.n, s.k) == (16, 16, 16), s.m * s.n * s.k), reverse=True)
    tiles = _TILES if min(M, N) >= _TILES[0][0] else _TILES[1:]
    for shape in usable:
        for bm, bn, bk, wgm, wgn in tiles:
            tile = Tile(bm, bn, bk, wgm, wgn, subgroup_size, shape)
            if subgroup_size > 0 and tile.fits(max_shared):
                why = "16x16x16 listed" if (shape.m, shape.n, shape.k) == (16, 16, 16) else "the largest listed shape that fits"
                return Choice(KERNEL, tile, f"{dtype} operands, fp32 sums, {why}")
    return Choice("matmul", None, f"no tile fits: subgroups of {subgroup_size}, {max_shared} bytes of shared memory")


def kernel_built(name: str = KERNEL) -> bool:
    """Whether cooperative-matrix kernel ``name``'s SPIR-V (matmul_coop's, or flash_coop's) is there or
    can be compiled here (a compiler that knows the extension)."""
    from helios.kernels_spirv import registry

    return registry.can_build(name)


_said: set = set()  # HELIOS_DEBUG lines already printed
_memo: dict = {}  # _for_device's answers by (facts' id, switch, *key), with the facts they were for
_NONE = Choice("matmul", None, "the device lists no cooperative-matrix shapes")
_enabled = os.environ.get("HELIOS_COOPMAT", "1") != "0"
_OFF = "cooperative matrices switched off (HELIOS_COOPMAT=0 or coopmat.set_enabled)"


def set_enabled(on: bool) -> bool:
    """Let matmuls use the cooperative-matrix kernel (True, the default; ``HELIOS_COOPMAT=0`` starts
    with False) or keep every one on the shared-memory kernel, e.g. to compare the two; returns
    the previous setting."""
    global _enabled
    was, _enabled = _enabled, bool(on)
    return was


def _lists_shapes(rt) -> bool:
    """Whether runtime ``rt``'s device lists cooperative-matrix shapes (the choices' fast way out)."""
    return bool((getattr(rt, "info", None) or {}).get("cooperative_matrix"))


def _for_device(rt, key: tuple, off, decide, line):
    """The part :func:`choice_for` and :func:`flash_choice_for` share, for a device that lists shapes:
    the answer remembered for ``key`` (and the switch), ``off`` where cooperative matrices are
    switched off, or ``decide(shapes, subgroup_size, max_shared)``; at ``HELIOS_DEBUG >= 1`` the
    answer's ``line(answer, device name)`` is printed once."""
    info = rt.info
    key = (id(info), _enabled) + key
    hit = _memo.get(key)
    if hit is not None and hit[0] is info:
        ch = hit[1]
    elif not _enabled:
        ch = off
    else:
        lim = info.get("limits", {})
        ch = decide(shapes_of(info), int(lim.get("subgroup_size", 0)), int(lim.get("max_shared_memory", 0)))
    _memo[key] = (info, ch)
    if getattr(rt, "debug", 0):
        text = line(ch, getattr(rt, "name", "?"))
        if text not in _said:
            _said.add(text)
            print(text, file=sys.stderr)
    return ch


def required_subgroup(rt, size: int) -> int:
    """The subgroup size to require of ``rt``'s driver for a kernel planned for subgroups of ``size``
    lanes: ``size`` where the device can require it (Vulkan 1.3's subgroupSizeControl for compute:
    limits min_subgroup_size..max_subgroup_size), else 0, the driver's choice (the size it reports,
    which the plan was made for).  Drivers that pick a size per shader (Intel's SIMD8/16/32, AMD's
    wave32/64) could otherwise run a kernel in subgroups of another size than its lane shares
    assume."""
    lim = rt.info.get("limits", {})
    lo, hi = int(lim.get("min_subgroup_size", 0)), int(lim.get("max_subgroup_size", 0))
    return size if 0 < lo <= size <= hi else 0


def choice_for(rt, dtype: str, M: int, N: int, K: int) -> Choice:
    """:func:`choose` for runtime ``rt``'s device (its facts' shapes, subgroup size and shared
    memory); prints the choice once per kind at ``HELIOS_DEBUG >= 1`` where the device lists shapes
    (a device listing none, lavapipe, has no choice to make and prints nothing)."""
    if not _lists_shapes(rt):
        return _NONE
    small = min(M, N)  # choose() looks at M and N only through MIN_DIM and the large tile's side
    return _for_device(rt, ("matmul", dtype, small < MIN_DIM, small >= _TILES[0][0]), Choice("matmul", None, _OFF),
                       lambda shapes, sg, shared: choose(shapes, dtype, M, N, K, sg, shared,
                                                         dtype not in OPERAND_TYPES or kernel_built()),
                       lambda ch, device: ch.line(device, dtype))


# -- flash attention on cooperative matrices (flash_coop.comp) -------------------------------------

FLASH_KERNEL = "flash_coop"
FLASH_HEAD_DIMS = (32, 64, 128)  # its variants (flash_coop.variants)
# Plans tried, largest first: (subgroups a workgroup, streamed rows a tile).  More subgroups share
# each staged tile among more rows; longer tiles mean fewer barriers.  Every workgroup's rows (16
# a subgroup) and every tile divide 64, the block size of a block mask.
_FLASH_PLANS = ((4, 64), (4, 32), (2, 64), (2, 32), (4, 16), (2, 16), (1, 32), (1, 16))
_FLASH_PASSES = (0, 2, 3)  # flash_attn.comp's numbers: forward, dQ, dK and dV


def flash_shared_bytes(head_dim: int, mode: int, nsg: int, bt: int) -> int:
    """Shared memory flash_coop.comp declares for one pass (``mode`` 0, 2 or 3) with ``nsg``
    subgroups and tiles of ``bt`` streamed rows: its fixed rows, streamed tile, per-subgroup fp32
    scratch and fp16 tiles, and row statistics (the arrays at the kernel's top)."""
    xld, pld = head_dim + _PAD, bt + _PAD
    nfix = ns = 1 if mode == 0 else 2
    return (2 * nfix * 16 * nsg * xld + 2 * 2 * bt * xld + 4 * nsg * ns * 16 * bt + 2 * nsg * ns * 16 * pld
            + 4 * nsg * 48 + 4 * 2 * bt)


@dataclass(frozen=True)
class FlashPlan:
    """One pass of flash_coop: ``nsg`` subgroups of ``subgroup`` lanes own 16 rows each, the other
    operand streams through in tiles of ``bt`` rows."""

    mode: int
    nsg: int
    bt: int
    subgroup: int

    @property
    def rows(self) -> int:
        """The rows a workgroup owns."""
        return 16 * self.nsg

    def spec(self, wide: bool) -> tuple:
        """flash_coop.comp's specialization constants 0-4: invocations, MODE, BT, NSG, WIDE (16-byte
        loads: every staged row starts 8-aligned)."""
        return (self.nsg * self.subgroup, self.mode, self.bt, self.nsg, int(wide))

    def label(self) -> str:
        """"4 subgroups x 16 rows, 32-row tiles"."""
        return f"{self.nsg} subgroups x 16 rows, {self.bt}-row tiles"


@dataclass(frozen=True)
class FlashChoice:
    """``kernel`` ("flash_coop" or "flash_attn"), the plan of each pass (empty for "flash_attn") and why."""

    kernel: str
    plans: tuple
    reason: str

    @property
    def coopmat(self) -> bool:
        """Whether the cooperative-matrix kernel runs the passes."""
        return bool(self.plans)

    def plan(self, mode: int) -> FlashPlan:
        """The plan of pass ``mode``."""
        return next(p for p in self.plans if p.mode == mode)

    def line(self, device: str, dtype: str, head_dim: int) -> str:
        """The HELIOS_DEBUG line: which kernel ``dtype`` attention with this head dim runs on ``device`` and why."""
        what = (f"{FLASH_KERNEL}, " + "; ".join(f"pass {p.mode}: {p.label()}" for p in self.plans) if self.plans
                else "flash_attn (shared-memory kernel)")
        return f"helios: flash attention {dtype} d{head_dim} on {device}: {what}: {self.reason}"


def choose_flash(shapes: list[CoopShape], dtype: str, head_dim: int, subgroup_size: int, max_shared: int = 49152,
                 kernel_built: bool = True) -> FlashChoice:
    """The kernel of flash attention with ``dtype`` operands and head dim ``head_dim`` on a device listing
    ``shapes`` (subgroups of ``subgroup_size``, ``max_shared`` bytes of shared memory): flash_coop
    where it lists a 16x16x16 subgroup shape of ``dtype`` (float16 or bfloat16) with fp32 sums and
    every pass has a plan that fits (the first of :data:`_FLASH_PLANS`), else flash_attn; every
    "no" says why."""
    def no(why):
        return FlashChoice("flash_attn", (), why)

    if not shapes:
        return no("the device lists no cooperative-matrix shapes")
    operand = OPERAND_TYPES.get(dtype)
    if operand is None:
        return no(f"{dtype} operands: the cooperative-matrix flash kernel takes float16 or bfloat16")
    if head_dim not in FLASH_HEAD_DIMS:
        return no(f"head dim {head_dim}: its variants are {FLASH_HEAD_DIMS}")
    if not any(_fp32_sums(s, operand) and (s.m, s.n, s.k) == (16, 16, 16) for s in shapes):
        return no(f"no subgroup-scope 16x16x16 {operand}*{operand}+f32 shape listed")
    if not kernel_built:
        return no(f"{FLASH_KERNEL} is not built: no shader compiler here knows GL_KHR_cooperative_matrix")
    if subgroup_size <= 0 or 256 % subgroup_size:
        return no(f"subgroups of {subgroup_size} lanes: a lane must hold a whole share of a 16x16 block")
    plans = []
    for mode in _FLASH_PASSES:
        fit = [(n, bt) for n, bt in _FLASH_PLANS if flash_shared_bytes(head_dim, mode, n, bt) <= max_shared]
        if not fit:
            return no(f"no plan of pass {mode} fits {max_shared} bytes of shared memory at head dim {head_dim}")
        plans.append(FlashPlan(mode, fit[0][0], fit[0][1], subgroup_size))
    return FlashChoice(FLASH_KERNEL, tuple(plans), f"{dtype} operands, 16x16x16 listed")


_FLASH_NONE = FlashChoice("flash_attn", (), "the device lists no cooperative-matrix shapes")


def flash_choice_for(rt, dtype: str, head_dim: int) -> FlashChoice:
    """:func:`choose_flash` for runtime ``rt``'s device; prints the choice once per kind at
    ``HELIOS_DEBUG >= 1`` where the device lists shapes (as :func:`choice_for`)."""
    if not _lists_shapes(rt):
        return _FLASH_NONE
    return _for_device(rt, ("flash", dtype, head_dim), FlashChoice("flash_attn", (), _OFF),
                       lambda shapes, sg, shared: choose_flash(shapes, dtype, head_dim, sg, shared,
                                                               dtype not in OPERAND_TYPES or kernel_built(FLASH_KERNEL)),
                       lambda ch, device: ch.line(device, dtype, head_dim))
