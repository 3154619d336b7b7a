"""GEMM kernel configurations and the ladder of named variants.

A :class:`GemmConfig` fully determines one kernel: the algorithm (``kind``), the
input/output dtypes, the layout of B, and the tile/pipeline shape.  The kernel
computes ``C[M,N] = A[M,K] @ B[K,N]`` with A row-major (K contiguous) and fp32
accumulation.  ``b_major`` says how B is stored:

* ``"n"`` -- B is ``K x N`` row-major (N contiguous, "N-major"), the numpy default;
* ``"k"`` -- B is stored transposed, ``N x K`` with K contiguous ("K-major"), as a
  ``torch.nn.Linear`` weight is.

Every kind reads either layout directly, except fp8: ``wgmma`` has no transpose for
8-bit types, so ``wgmma_fp8`` takes B K-major only.  The ladder's wgmma rungs are
K-major (a Linear weight); ``cfg.with_(b_major="n")`` gives the N-major twin
(``imm-trans-b = 1``, see ``gen_wgmma``).

Kernels assume ``M % bm == N % bn == K % bk == 0``; :func:`helios.cuda_ptx.gemm`
pads with zeros to get there (zero rows/columns do not change the product).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from helios.errors import DTypeError, ShapeError

MAX_DYN_SMEM = 227 * 1024  # dynamic shared memory an sm_90 CTA may opt into

# dtype name -> (bytes per element, PTX type name)
IN_DTYPES = {"bf16": (2, "bf16"), "fp16": (2, "f16"), "e4m3": (1, "e4m3")}
OUT_DTYPES = {"f32": 4, "bf16": 2}
# The names gemm()/emulate_gemm() accept for out_dtype -> the config's name.
OUT_ALIASES = {"float32": "f32", "f32": "f32", "bfloat16": "bf16", "bf16": "bf16"}
KINDS = ("simt", "mma_sync", "wgmma")


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM kernel: algorithm, dtypes, B layout, tiles and pipeline.

    ``kind``: ``simt`` (CUDA cores), ``mma_sync`` (sm_80 tensor cores, ldmatrix,
    cp.async) or ``wgmma`` (sm_90a warpgroup MMA fed by TMA).  For ``wgmma``,
    ``consumers`` is the number of math warpgroups (each owns ``bm/consumers`` rows
    of the tile); ``producer`` adds a warpgroup that only issues TMA loads (warp
    specialisation) and ``maxnreg`` = (producer, consumer) register budgets applied
    with ``setmaxnreg``.  ``inflight`` (wgmma, 0 or 1) is how many k-tiles of wgmma a
    consumer leaves running while it hands the previous tile's ring slot back
    (``wgmma.wait_group 1`` instead of 0): the tensor cores then never wait for the
    release, at the cost of holding one more slot.  ``group_m`` > 0 hands tiles to CTAs in
    groups of that many tile-rows (:func:`ops.tile_origin`) for L2 reuse; 0 = row by row.
    ``persistent`` (warp-specialised wgmma only) launches one CTA per SM, each walking
    the tiles ``ctaid, ctaid + nctaid, ...`` with its ring running on from tile to tile:
    the producer loads the next tile while the consumers store this one, and no CTA
    launch or pipeline fill is paid per tile.  ``tma_store`` (wgmma only) writes C through
    shared memory and TMA bulk stores instead of ``st.global`` from registers, so the
    consumers go back to their next tile while the copy engine writes this one.
    ``cluster`` = 2 (warp-specialised wgmma only) launches CTAs in clusters of two that
    take vertically adjacent tiles (rows ``m0`` and ``m0 + bm``, same columns): they need
    the same B tile, so each CTA's producer loads half of it and multicasts that half into
    both CTAs' shared memory (``.multicast::cluster``), halving B's traffic from L2.
    ``bias`` (16-bit wgmma with ``tma_store``) adds an N-vector of the input dtype to every row
    of C in the epilogue, in fp32 before C is rounded to the output dtype: a Linear layer's
    ``x @ W^T + b`` in one kernel.  It takes two more parameters, the vector's address and
    length (columns past it add 0).
    ``round_out`` (16-bit wgmma with ``tma_store`` and an ``f32`` C) rounds each fp32 result to the
    input dtype and stores it widened back to fp32: autocast's product in the 16-bit dtype with the
    cast of its result to float32 (a float32 parameter's or input's gradient) in the same kernel,
    bit for bit the two.
    ``residual`` (with ``round_out``, unbatched) adds a float32 M x N matrix to each rounded result
    before it is stored: a projection's product added to the float32 residual stream, the add in
    the product's epilogue instead of a kernel of its own (the same float32 sum).  It takes four more
    parameters: the matrix's address, row pitch (elements, even), rows and columns (the real M and
    N: rows and columns past them add 0).
    ``batched`` = d > 0 (persistent wgmma with ``tma_store``, no clusters) computes a batch of
    products in one launch: ``d`` batch dimensions (1..3, TMA's rank limit of 5 less the two matrix
    dimensions), each operand's tensor maps ``2 + d``-dimensional with the batch indices as their
    outer coordinates, so every operand has its own batch strides.  The tile walk runs over
    (batch, tile) with the batch outermost.  Kernel parameters ``batch0 .. batch{d-1}`` (the
    extents, outermost first) and ``batch_mask`` follow: bit ``2 i`` (A) or ``2 i + 1`` (B) is set
    when that operand has batch dimension ``i``; a broadcast operand (its bit clear) always loads
    batch coordinate 0 of a map whose extent there is 1 (TMA strides of 0 are not relied on).
    """

    name: str
    kind: str
    in_dtype: str = "bf16"
    out_dtype: str = "f32"
    b_major: str = "n"
    a_major: str = "k"
    bm: int = 64
    bn: int = 64
    bk: int = 16
    stages: int = 1
    warps_m: int = 1
    warps_n: int = 1
    consumers: int = 1
    producer: bool = False
    maxnreg: tuple[int, int] | None = None
    inflight: int = 0
    group_m: int = 0
    persistent: bool = False
    tma_store: bool = False
    cluster: int = 1
    bias: bool = False
    round_out: bool = False
    residual: bool = False
    batched: int = 0

    # -- derived --------------------------------------------------------------------
    @property
    def in_bytes(self) -> int:
        """Bytes per input element."""
        return IN_DTYPES[self.in_dtype][0]

    @property
    def target(self) -> str:
        """PTX ``.target``: wgmma and setmaxnreg exist only on the arch-specific sm_90a."""
        return "sm_90a" if self.kind == "wgmma" else "sm_80"

    @property
    def version(self) -> str:
        """PTX ISA version: 8.0 is the first with wgmma; 7.0 covers sm_80."""
        return "8.0" if self.kind == "wgmma" else "7.0"

    @property
    def threads(self) -> int:
        """Threads per CTA."""
        if self.kind == "simt":
            return 256
        if self.kind == "mma_sync":
            return 32 * self.warps_m * self.warps_n
        return 128 * (self.consumers + (1 if self.producer else 0))

    @property
    def kernel_name(self) -> str:
        """The ``.entry`` name: encodes everything that changes the code."""
        return (
            f"helios_gemm_{self.kind}_{self.in_dtype}_{self.out_dtype}_b{self.b_major}"
            f"{'_am' if self.a_major == 'm' else ''}"
            f"_{self.bm}x{self.bn}x{self.bk}_s{self.stages}_c{self.consumers}{'_ws' if self.producer else ''}"
            f"{f'_f{self.inflight}' if self.inflight else ''}{f'_g{self.group_m}' if self.group_m else ''}"
            f"{'_p' if self.persistent else ''}{'_ts' if self.tma_store else ''}"
            f"{f'_x{self.cluster}' if self.cluster > 1 else ''}{'_bias' if self.bias else ''}"
            f"{'_r' if self.round_out else ''}{'_res' if self.residual else ''}"
            f"{f'_B{self.batched}' if self.batched else ''}"
        )

    def flops(self, m: int, n: int, k: int) -> int:
        """Multiply-adds counted as two FLOPs."""
        return 2 * m * n * k

    def validate(self) -> None:
        """Raise if the configuration cannot be generated (says which field and why)."""
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.in_dtype not in IN_DTYPES:
            raise DTypeError(f"in_dtype must be one of {sorted(IN_DTYPES)}, got {self.in_dtype!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise DTypeError(f"out_dtype must be one of {sorted(OUT_DTYPES)}, got {self.out_dtype!r}")
        if self.b_major not in ("k", "n"):
            raise ValueError(f"b_major must be 'k' or 'n', got {self.b_major!r}")
        if self.a_major not in ("k", "m"):
            raise ValueError(f"a_major must be 'k' or 'm', got {self.a_major!r}")
        if self.a_major == "m" and (self.kind != "wgmma" or self.in_bytes != 2 or self.cluster > 1):
            raise ValueError("a_major='m' (A stored K x M, read with imm-trans-a) is generated for 16-bit wgmma "
                             "configs without clusters only")
        if self.in_dtype == "e4m3" and self.kind != "wgmma":
            raise DTypeError(
                f"fp8 e4m3 is generated only for kind='wgmma' (K-major operands), got kind={self.kind!r}; "
                "use a wgmma config such as variants()['wgmma_fp8']"
            )
        if self.in_dtype == "e4m3" and self.b_major != "k":
            raise DTypeError(
                "fp8 e4m3 wgmma reads B K-major only (imm-trans-b exists for 16-bit types alone); "
                "use b_major='k' and pass B stored N x K (gemm() transposes a K x N B on the host for fp8)"
            )
        if self.kind == "simt" and (self.bm, self.bn, self.bk) != (64, 64, 16):
            raise ShapeError(f"simt kernel is 64x64x16 per CTA, got {self.bm}x{self.bn}x{self.bk}")
        if self.kind == "mma_sync" and (
            self.bm % (16 * self.warps_m) or self.bn % (16 * self.warps_n) or self.bk % 16 or self.bk & (self.bk - 1)
        ):
            raise ShapeError(
                f"mma_sync tile {self.bm}x{self.bn}x{self.bk} must split into {self.warps_m}x{self.warps_n} "
                "warps of multiples of 16, with bk a power of two >= 16"
            )
        if not 0 <= self.group_m <= 64:
            raise ValueError(f"group_m must be in [0, 64] (0 = no grouping), got {self.group_m}")
        if self.inflight and self.kind != "wgmma":
            raise ValueError("inflight applies to the wgmma kinds only")
        if self.kind == "wgmma":
            row_elems = 128 // self.in_bytes  # one 128-byte swizzle row
            if self.bk != row_elems:
                raise ShapeError(f"wgmma bk must be one 128-byte swizzle row = {row_elems} elements")
            if self.bm % (64 * self.consumers):
                raise ShapeError(f"bm={self.bm} must be a multiple of 64 * consumers={self.consumers}")
            if not (8 <= self.bn <= 256 and self.bn % 64 == 0):
                raise ShapeError(f"wgmma bn must be 64, 128, 192 or 256, got {self.bn}")
            if self.inflight not in (0, 1) or self.inflight >= self.stages:
                raise ValueError(f"inflight must be 0 or 1 and below stages={self.stages}, got {self.inflight}")
            if self.maxnreg is not None and not self.producer:
                raise ValueError("setmaxnreg budgets need the warp-specialised producer layout")
        if self.tma_store and self.kind != "wgmma":
            raise ValueError("tma_store applies to the wgmma kinds only")
        if self.bias and not (self.kind == "wgmma" and self.tma_store and self.in_bytes == 2):
            raise ValueError("bias (an N-vector added in the epilogue) is generated for 16-bit wgmma configs with "
                             "tma_store only")
        if self.round_out and not (self.kind == "wgmma" and self.tma_store and self.in_bytes == 2
                                   and self.out_dtype == "f32"):
            raise ValueError("round_out (fp32 C rounded to the input dtype) is generated for 16-bit wgmma configs "
                             "with tma_store and out_dtype 'f32' only")
        if self.residual and not (self.round_out and not self.batched):
            raise ValueError("residual (a float32 matrix added to the rounded results) is generated for unbatched "
                             "round_out configs only")
        if not 0 <= self.batched <= 3:
            raise ValueError(f"batched must be 0..3 batch dimensions (TMA maps have at most 5), got {self.batched}")
        if self.batched and not (self.kind == "wgmma" and self.persistent and self.tma_store and self.cluster == 1):
            raise ValueError("batched products are generated for persistent wgmma configs with tma_store and no "
                             "clusters only (their tile walk carries the batch index; C is stored by coordinates)")
        if self.persistent and not (self.kind == "wgmma" and self.producer):
            raise ValueError("persistent needs the warp-specialised wgmma layout (kind='wgmma', producer=True)")
        if self.cluster not in (1, 2):
            raise ValueError(f"cluster must be 1 or 2 (CTAs sharing one B tile), got {self.cluster}")
        if self.cluster > 1 and not (self.kind == "wgmma" and self.producer):
            raise ValueError("cluster multicast needs the warp-specialised wgmma layout (kind='wgmma', producer=True)")
        if self.cluster > 1 and self.b_major == "n" and self.bn % (64 * self.cluster):
            raise ShapeError(f"N-major B is multicast in 64-column boxes split between the {self.cluster} CTAs "
                             f"of a cluster: bn={self.bn} must be a multiple of {64 * self.cluster}")

    def with_(self, **kw: object) -> GemmConfig:
        """A copy with fields replaced (the name is kept unless given)."""
        return replace(self, **kw)


def _ladder() -> dict[str, GemmConfig]:
    v = [
        GemmConfig("simt", "simt", bm=64, bn=64, bk=16, stages=1),
        GemmConfig("mma_sync", "mma_sync", bm=128, bn=128, bk=32, stages=3, warps_m=2, warps_n=2),
        GemmConfig("wgmma_tma", "wgmma", b_major="k", bm=64, bn=128, bk=64, stages=1, consumers=1),
        GemmConfig("wgmma_pipe", "wgmma", b_major="k", bm=128, bn=128, bk=64, stages=4, consumers=1, inflight=1,
                   group_m=8),
        GemmConfig(
            "wgmma_ws", "wgmma", b_major="k", bm=128, bn=256, bk=64, stages=4, consumers=2,
            producer=True, maxnreg=(40, 232), inflight=1, group_m=8,
        ),
        GemmConfig(
            "wgmma_fp8", "wgmma", in_dtype="e4m3", b_major="k", bm=128, bn=256, bk=128, stages=4,
            consumers=2, producer=True, maxnreg=(40, 232), inflight=1, group_m=8,
        ),
        GemmConfig(
            "wgmma_persistent", "wgmma", b_major="k", bm=128, bn=256, bk=64, stages=4, consumers=2,
            producer=True, maxnreg=(40, 232), inflight=1, group_m=8, persistent=True, tma_store=True,
        ),
        GemmConfig(
            "wgmma_cluster", "wgmma", b_major="k", bm=128, bn=256, bk=64, stages=4, consumers=2,
            producer=True, maxnreg=(40, 232), inflight=1, group_m=8, persistent=True, tma_store=True, cluster=2,
        ),
    ]
    return {c.name: c for c in v}


LADDER = _ladder()


def out_dtype_name(out_dtype: str) -> str:
    """The config's name for an ``out_dtype`` accepted by the public calls (``float32``/``f32``,
    ``bfloat16``/``bf16``); :class:`DTypeError` for anything else."""
    if out_dtype not in OUT_ALIASES:
        raise DTypeError(f"out_dtype must be one of {sorted(OUT_ALIASES)}, got {out_dtype!r}")
    return OUT_ALIASES[out_dtype]


def with_dtypes(cfg: GemmConfig, in_dtype: str | None, out_dtype: str) -> GemmConfig:
    """``cfg`` with the caller's input dtype (None keeps the variant's) and output dtype."""
    if in_dtype is not None and in_dtype != cfg.in_dtype:
        cfg = cfg.with_(in_dtype=in_dtype)
    return cfg.with_(out_dtype=out_dtype_name(out_dtype))


def variants() -> dict[str, GemmConfig]:
    """The ladder of selectable GEMM variants, by name, in increasing sophistication."""
    return dict(LADDER)
