// The matmul kernels' source, shared by matmul.comp and matmul_epi.comp (the same kernels
// with a fused epilogue, MM_EPI: see the end of this comment).
// Batched matmul C[z] = A[z] @ B[z] on strided operands (so transposed views and
// broadcast batch dims need no copies).  z runs over two batch dims (z = z0 * nb1 + z1),
// each with its own stride per operand (0 = broadcast).  C is contiguous [batch, M, N].
// Every dtype is stored as itself and computed in fp32.  With the push word has_bias = 1
// C[.., m, n] = A@B + bias[off_bias + n]: a Linear layer's bias added in registers before
// the store instead of by a separate broadcast add.  With CT (a specialization constant of
// both kernels) each C[z] is stored transposed, element (m, n) at off_c + z*M*N + n*M + m: C
// is the transposed view of a contiguous [batch, N, M], so a product computed the other way
// round (b^T a^T, for speed) lands in a row-major buffer (a weight's gradient slot) without
// a copy.  The sums are the same either way.  With the push word ldc > 0 C is strided, for
// attention heads kept interleaved in a [B, T, ...] buffer: element (z0, z1, m, n) lives at
// off_c + z0 * M * ldc + z1 * N + m * ldc + n (with CT: z0 * N * ldc + z1 * M + n * ldc + m),
// so head z1 of batch z0 is a column block of rows ldc elements apart.  The bias and the row
// length are push words, not specialization constants, because every constant's value is a
// pipeline of its own, which lavapipe builds again in every process (11-95 ms a matmul pipeline).
//
// Two kernels live here, picked by the variant (see matmul.variants and matmul() in
// helios/_kernels.py):
//
// * default (GPUs): a workgroup computes a BM x BN tile of C with (BM/TM) x (BN/TN)
//   invocations, each holding a TM x TN register block; K advances BK at a time
//   through shared memory.  Tile sizes are specialization constants.
//
// * MM_SG (lavapipe and other CPU drivers): no shared memory and no barriers.  llvmpipe
//   runs a subgroup as one 8-wide SIMD vector and turns every buffer or shared-memory
//   load into a loop over the lanes (~45 instructions a lane for one load of up to 32
//   bytes), while subgroupShuffle with a constant lane is one vpermps.  (subgroupBroadcast
//   is not: llvmpipe first searches the active lanes in a loop, ~60 instructions.)  So
//   each subgroup of SG lanes computes a TM x (SG*TN) tile: lane l owns TN adjacent
//   columns and all TM rows; the A panel (TM x 8 per step) is loaded once, spread over the
//   lanes as vec4s, and handed to every lane by shuffles; B is read as vec4s along its
//   contiguous dim.  A and B are read through texel views instead of storage buffers
//   (rgba32f for fp32, rgba32ui for 16-bit): llvmpipe fetches one texel for all 8 lanes as a
//   gather, without the per-lane loop (1.25-1.33x for fp32 at 1024^3, 1.14-1.3x for 16-bit).
//   Each load then moves 4-8 useful values per lane and nothing is loaded twice inside a
//   subgroup; a tall block (32x8) loads TM + 8*TN values per K step
//   for TM*TN vector multiply-adds.  llvmpipe lowers fma() to a multiply and an add, so
//   the sums are written as such.  TM / TN are compile-time (the register block must be
//   fully unrolled: llvmpipe keeps arrays indexed by a loop variable in memory); the
//   operand layouts and the workgroup height are specialization constants, so dead
//   layout branches vanish when the pipeline is built.
//
// MM_EPI (matmul_epi.comp: two more bindings and two more push-constant words) adds a fused
// epilogue after the bias, picked by the specialization constant EPI (id 9 in both kernels);
// C is then contiguous (no CT / ldc) and E / U are contiguous like C:
//   EPI 1 (linear+residual): C = (A@B + bias) + E, the sum first rounded to the storage
//         type, so it is bit for bit the separate matmul then ew_binary's add.
//   EPI 2 (linear+gelu): U = A@B + bias (the pre-activation backward needs) and
//         C = gelu_tanh(U), with ew_unary's gelu_tanh code on the stored U.
//   EPI 3 (gelu'-scaled product): C = (A@B) * gelu_tanh_grad(E), ew_binary's gelu_tanh_bwd on
//         the stored product (E = the pre-activation of a linear+gelu).
#include "common.glsl"
#extension GL_EXT_control_flow_attributes : require

// The CPU kernel reads A and B through texel views (the addon binds a samplerBuffer as a
// uniform texel buffer): llvmpipe fetches a texel for all 8 lanes as one gather, where a
// storage-buffer load is a loop over the lanes (see MM_SG below).  A float32 operand (fp32, or
// a float32 slot of a 16-bit product: MM_AF32 / MM_BF32, the mixed storage below) is a
// samplerBuffer, an rgba32f view, 4 values a texel (MM_TEXEL_A / MM_TEXEL_B); a 16-bit one a
// usamplerBuffer, which the addon binds as an rgba32ui view: 8 packed values a texel.
#if defined(MM_SG) && (TA == T_F32 || defined(MM_AF32))
#define MM_TEXEL_A
layout(binding = 0) uniform samplerBuffer ta;
#elif defined(MM_SG)
layout(binding = 0) uniform usamplerBuffer ta;
#else
layout(std430, binding = 0) readonly buffer BA { HL_ST(TA) a[]; };
#endif
#if defined(MM_SG) && (TA == T_F32 || defined(MM_BF32))
#define MM_TEXEL_B
layout(binding = 1) uniform samplerBuffer tb;
#elif defined(MM_SG)
layout(binding = 1) uniform usamplerBuffer tb;
#else
layout(std430, binding = 1) readonly buffer BB { HL_ST(TA) b[]; };
#endif
layout(std430, binding = 2) writeonly buffer BC { HL_ST(TA) c[]; };
layout(std430, binding = 3) readonly buffer BBias { HL_ST(TA) bias[]; };
layout(push_constant) uniform P {
    uint M; uint N; uint K; uint nb1;
    uint off_a; uint off_b; uint off_c; uint off_bias;
    uint sa0; uint sa1; uint sam; uint sak;
    uint sb0; uint sb1; uint sbk; uint sbn;
#ifdef MM_EPI
    uint off_e; uint off_u;
#endif
    uint ldc;       // C's row length when strided (heads interleaved), else 0
    uint has_bias;  // 1: + bias[off_bias + n]
} p;

// v rounded to the storage type, as a store then a load would (the unfused ops read the
// product back from memory; a cast to TA is such a store).
float mm_round(float v) {
#if TA == T_F32
    return v;
#elif TA == T_F16
    return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x;
#else
    return bf16_to_f(f_to_bf16(v));
#endif
}

#if TA != T_F32
// Mixed storage (16-bit kernels): autocast's casts fused into the product.  Each slot
// flagged here holds float32 instead of TA: A, B and the bias are rounded to TA as they are
// loaded (what a cast to TA before the product stores), and C receives the TA-rounded
// result widened to float32 (what a cast back after it stores), except that linear+residual's
// sum of the rounded product and a float32 E (EF32) is stored as it is, the add of a TA
// product and a float32 residual being a float32 add.  So each value is bit for bit the
// one the separate casts give.  Offsets and strides count each slot's own elements.
// The CPU kernel's float32 A and B are variants (MM_AF32 / MM_BF32: texel views, above);
// the GPU kernel's, like every other slot's, specialization constants.
#ifndef MM_SG
layout(constant_id = 12) const int AF32 = 0;
layout(constant_id = 13) const int BF32 = 0;
layout(std430, binding = 0) readonly buffer BAF { float af[]; };
layout(std430, binding = 1) readonly buffer BBF { float bf[]; };
#endif
layout(constant_id = 14) const int CF32 = 0;
layout(constant_id = 15) const int BIASF32 = 0;
layout(constant_id = 16) const int EF32 = 0;
layout(std430, binding = 2) writeonly buffer BCF { float cf[]; };
layout(std430, binding = 3) readonly buffer BBiasF { float biasf[]; };
#endif

#ifdef MM_EPI
#if defined(MM_SG) && TA == T_F32
layout(binding = 4) uniform samplerBuffer te;  // read through a texel view, as A and B
#define LDE(i) texelFetch(te, int((i) >> 2))[(i) & 3u]
#elif TA == T_F32
layout(std430, binding = 4) readonly buffer BE { HL_ST(TA) e[]; };
#define LDE(i) HL_LDF(TA, e[i])
#else
layout(std430, binding = 4) readonly buffer BE { HL_ST(TA) e[]; };
layout(std430, binding = 4) readonly buffer BEF { float ef[]; };
#define LDE(i) (EF32 == 1 ? ef[i] : HL_LDF(TA, e[i]))
#endif
layout(std430, binding = 5) writeonly buffer BU { HL_ST(TA) u[]; };
layout(constant_id = 9) const int EPI = 0;

// The epilogue on C's element idx (z * M * N + m * N + n) holding v (bias already added);
// the pre-activation is stored only when ``inside`` (clamped rows / columns are not).
float mm_epi(float v, uint idx, bool inside) {
    v = mm_round(v);
    if (EPI == 1) return v + LDE(p.off_e + idx);
    if (EPI == 2) {
        if (inside) u[p.off_u + idx] = HL_STF(TA, v);
        return gelu_tanh(v);
    }
    if (EPI == 3) return v * gelu_tanh_grad(LDE(p.off_e + idx));
    return v;
}
#endif

// Element loads of A, B and the bias and the store of C's element i, by slot storage.
#if TA != T_F32
// (The CPU kernel's 16-bit A and B are read in its own section, by texel.)
#if defined(MM_TEXEL_A)
float mm_lda(uint i) { return mm_round(texelFetch(ta, int(i >> 2))[i & 3u]); }
#elif !defined(MM_SG)
float mm_lda(uint i) { return AF32 == 1 ? mm_round(af[i]) : HL_LDF(TA, a[i]); }
#endif
#if defined(MM_TEXEL_B)
float mm_ldb(uint i) { return mm_round(texelFetch(tb, int(i >> 2))[i & 3u]); }
#elif !defined(MM_SG)
float mm_ldb(uint i) { return BF32 == 1 ? mm_round(bf[i]) : HL_LDF(TA, b[i]); }
#endif
float mm_ldbias(uint i) { return BIASF32 == 1 ? mm_round(biasf[i]) : HL_LDF(TA, bias[i]); }
// A float32 C's value: the result rounded to TA, or linear+residual's float32 sum.
float mm_cf(float v) {
#ifdef MM_EPI
    if (EPI == 1) return v;
#endif
    return mm_round(v);
}
void mm_stc(uint i, float v) {
    if (CF32 == 1) cf[i] = mm_cf(v);
    else c[i] = HL_STF(TA, v);
}
#else
#ifndef MM_SG
float mm_lda(uint i) { return a[i]; }
float mm_ldb(uint i) { return b[i]; }
#endif
float mm_ldbias(uint i) { return bias[i]; }
void mm_stc(uint i, float v) { c[i] = v; }
#endif

// BSUM 1 (constant id 10 in both kernels; no batch, bias or epilogue; matmul_bias_grad() in
// helios/_kernels/gemm.py): B's column sums over K as well, a Linear layer's bias gradient in
// the weight gradient's dispatch (B = the output gradient).  Each column's B values are added
// k = 0 .. K-1 in order from 0.0 (the column reduction's adds, reduce.comp MODE 1), and the
// workgroups (CPU kernel: subgroups) at m0 == 0 store the in-range columns at element
// off_bias + n of binding 3 (the bias binding and offset word, free without a bias), in C's
// storage type.  The CPU kernel's lanes add the B values they load for their columns; the GPU
// kernel's invocations add their columns of each staged B tile.
layout(constant_id = 10) const int BSUM = 0;
layout(std430, binding = 3) writeonly buffer BSumOut { HL_ST(TA) bsum_out[]; };
#if TA != T_F32
layout(std430, binding = 3) writeonly buffer BSumOutF { float bsum_outf[]; };
#endif
void mm_st_bsum(uint i, float v) {
#if TA != T_F32
    if (CF32 == 1) { bsum_outf[i] = mm_round(v); return; }  // float32 slots: rounded to TA, widened
#endif
    bsum_out[i] = HL_STF(TA, v);
}

#ifndef MM_SG
// ---------------------------------------------------------------- shared-memory tiles (GPU)
layout(local_size_x_id = 3, local_size_y_id = 4) in;
layout(constant_id = 0) const int BM = 64;
layout(constant_id = 1) const int BN = 64;
layout(constant_id = 2) const int BK = 16;
layout(constant_id = 3) const int WX = 16;   // = BN / TN
layout(constant_id = 4) const int WY = 16;   // = BM / TM
layout(constant_id = 6) const int CT = 0;  // ids 5 and 7 are free (were the bias and C's row length)
const int TM = BM / WY;
const int TN = BN / WX;
const int BSN = (BN + WX * WY - 1) / (WX * WY);  // BSUM columns an invocation sums

shared float As[BK][BM];
shared float Bs[BK][BN];

void main() {
    uint z = gl_WorkGroupID.z;
    uint z0 = z / p.nb1, z1 = z - z0 * p.nb1;
    uint abase = p.off_a + z0 * p.sa0 + z1 * p.sa1;
    uint bbase = p.off_b + z0 * p.sb0 + z1 * p.sb1;
    uint m0 = gl_WorkGroupID.y * uint(BM), n0 = gl_WorkGroupID.x * uint(BN);
    uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    uint tid = ty * uint(WX) + tx;
    const uint NT = uint(WX * WY);

    float acc[TM][TN];
    [[unroll]] for (int i = 0; i < TM; ++i)
        [[unroll]] for (int j = 0; j < TN; ++j) acc[i][j] = 0.0;
    const bool sums = BSUM == 1 && gl_WorkGroupID.y == 0u;
    float bs[BSN];  // BSUM: this invocation's columns tid, tid + NT, ... of the tile
    [[unroll]] for (int j = 0; j < BSN; ++j) bs[j] = 0.0;

    for (uint k0 = 0u; k0 < p.K; k0 += uint(BK)) {
        for (uint e = tid; e < uint(BM * BK); e += NT) {
            uint mm = e / uint(BK), kk = e - mm * uint(BK);
            uint gm = m0 + mm, gk = k0 + kk;
            As[kk][mm] = (gm < p.M && gk < p.K) ? mm_lda(abase + gm * p.sam + gk * p.sak) : 0.0;
        }
        for (uint e = tid; e < uint(BN * BK); e += NT) {
            uint kk = e / uint(BN), nn = e - kk * uint(BN);
            uint gk = k0 + kk, gn = n0 + nn;
            Bs[kk][nn] = (gk < p.K && gn < p.N) ? mm_ldb(bbase + gk * p.sbk + gn * p.sbn) : 0.0;
        }
        barrier();
        if (sums) {  // zeros past K and N leave a sum as it is
            [[unroll]] for (int j = 0; j < BSN; ++j) {
                uint nn = tid + uint(j) * NT;
                if (nn < uint(BN))
                    [[unroll]] for (int kk = 0; kk < BK; ++kk) bs[j] += Bs[kk][nn];
            }
        }
        for (int kk = 0; kk < BK; ++kk) {
            float ra[TM], rb[TN];
            [[unroll]] for (int i = 0; i < TM; ++i) ra[i] = As[kk][int(ty) + i * WY];
            [[unroll]] for (int j = 0; j < TN; ++j) rb[j] = Bs[kk][int(tx) + j * WX];
            [[unroll]] for (int i = 0; i < TM; ++i)
                [[unroll]] for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
        }
        barrier();
    }
    if (sums) {
        [[unroll]] for (int j = 0; j < BSN; ++j) {
            uint nn = tid + uint(j) * NT;
            if (nn < uint(BN) && n0 + nn < p.N) mm_st_bsum(p.off_bias + n0 + nn, bs[j]);
        }
    }
    uint ldc = p.ldc > 0u ? p.ldc : (CT == 1 ? p.M : p.N);
    uint cbase = p.ldc > 0u ? p.off_c + z0 * (CT == 1 ? p.N : p.M) * ldc + z1 * (CT == 1 ? p.M : p.N)
                            : p.off_c + z * p.M * p.N;
    // No `continue` in these loops: a loop that has one is not unrolled (by spirv-opt, for the
    // PTX translation), and acc[] would stay an array in memory.
    [[unroll]] for (int i = 0; i < TM; ++i) {
        uint gm = m0 + ty + uint(i * WY);
        [[unroll]] for (int j = 0; j < TN; ++j) {
            uint gn = n0 + tx + uint(j * WX);
            if (gm < p.M && gn < p.N) {
                float v = acc[i][j] + (p.has_bias != 0u ? mm_ldbias(p.off_bias + gn) : 0.0);
#ifdef MM_EPI
                v = mm_epi(v, z * p.M * p.N + gm * p.N + gn, true);  // C contiguous (no CT / ldc)
#endif
                mm_stc(CT == 1 ? cbase + gn * ldc + gm : cbase + gm * ldc + gn, v);
            }
        }
    }
}

#else
// ---------------------------------------------------------------- subgroup register blocks (CPU)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#ifndef SG
#define SG 8        // lanes per subgroup (lavapipe: SIMD width / 32); matmul() checks the device
#endif
#ifndef TM
#define TM 8        // rows per subgroup (multiple of SG)
#endif
#ifndef TN
#define TN 8        // adjacent columns per lane (multiple of 8)
#endif
#define KB 8        // K step of the main loop (= SG: the M-contiguous A panel puts one k per lane)

layout(local_size_x = SG, local_size_y_id = 0) in;
layout(constant_id = 0) const int WY = 4;      // subgroups per workgroup, stacked along M
// Operand layouts, chosen by matmul() from strides and alignment:
//   AMODE 0: any strides (scalar loads); 1: K-contiguous (sak = 1); 2: M-contiguous
//            (sam = 1: A is a transposed view).
//   BMODE 0: any strides; 1: N-contiguous (sbn = 1); 2: K-contiguous (sbk = 1: B^T view).
//   AWIDE / BWIDE 1: the contiguous runs are 8-aligned and read as 8 values per load
//            (two rgba32f texels for fp32, one rgba32ui texel for 16-bit), else as vec4s
//            (4-aligned).
//   CVEC  1: C is written as vec4s along its contiguous dim (N % 4 == 0, or M % 4 == 0 with CT).
//   CT    1: C[z] stored transposed (and p.ldc > 0: C strided, see the top of the file).
// llvmpipe's per-lane load loop costs about the same per component whatever its width,
// so fewer, wider components per load is what makes the loads cheap.
layout(constant_id = 1) const int AMODE = 0;
layout(constant_id = 2) const int BMODE = 0;
layout(constant_id = 3) const int CVEC = 0;
layout(constant_id = 4) const int AWIDE = 0;
layout(constant_id = 5) const int BWIDE = 0;
layout(constant_id = 7) const int CT = 0;  // ids 6 and 8 are free (were the bias and C's row length)
#ifdef MM_EPI
// EVEC 1 (fp32, CVEC, E / U offsets multiples of 4): the epilogue runs on each lane's vec4s of
// 4 adjacent columns, E fetched a texel at a time and U stored as vec4s, the same arithmetic
// per element as mm_epi (on CPU drivers a buffer access costs about the same whatever its
// width, so this is 4x fewer of them).
layout(constant_id = 11) const int EVEC = 0;
#if TA == T_F32
layout(std430, binding = 5) writeonly buffer BU4 { vec4 u4[]; };
vec4 mm_epi4(vec4 v, uint idx, bool inside) {
    if (EPI == 1) return v + texelFetch(te, int((p.off_e + idx) >> 2));
    if (EPI == 2) {
        if (inside) u4[(p.off_u + idx) >> 2] = v;
        return vec4(gelu_tanh(v.x), gelu_tanh(v.y), gelu_tanh(v.z), gelu_tanh(v.w));
    }
    if (EPI == 3) {
        vec4 e4 = texelFetch(te, int((p.off_e + idx) >> 2));
        return v * vec4(gelu_tanh_grad(e4.x), gelu_tanh_grad(e4.y), gelu_tanh_grad(e4.z), gelu_tanh_grad(e4.w));
    }
    return v;
}
#endif
#endif

// Vector views of the same bindings (matmul() checks offsets and strides for alignment).
#if TA == T_F32
// fp32: texel fetches of the rgba32f views.  A texel is 4 values, so "wide" (8-value) loads
// are two fetches, and a scalar load picks one component.  (Measured at 1024^3 on lavapipe
// against the storage-buffer loads this replaced, one u64vec4 per 8 values: 1.25-1.33x in
// every layout, see bench/README.md "matmul".)
layout(std430, binding = 2) writeonly buffer BC4 { vec4 c4[]; };
vec4 lda4(uint i) { return texelFetch(ta, int(i >> 2)); }
vec4 ldb4(uint i) { return texelFetch(tb, int(i >> 2)); }
void lda8w(uint i, out vec4 lo, out vec4 hi) { lo = texelFetch(ta, int(i >> 2)); hi = texelFetch(ta, int(i >> 2) + 1); }
void ldb8w(uint i, out vec4 lo, out vec4 hi) { lo = texelFetch(tb, int(i >> 2)); hi = texelFetch(tb, int(i >> 2) + 1); }
void stc4(uint i, vec4 v) { c4[i >> 2] = v; }
float lda(uint i) { return texelFetch(ta, int(i >> 2))[i & 3u]; }
float ldb(uint i) { return texelFetch(tb, int(i >> 2))[i & 3u]; }
#else
// 16-bit storage: 4 values are two 32-bit words and 8 values a texel of four, unpacked in
// registers (no 16-bit arithmetic needed).
layout(std430, binding = 2) writeonly buffer BC4 { uvec2 c4[]; };
vec4 unpack4(uvec2 w) {
#if TA == T_F16
    return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
#else
    return vec4(uintBitsToFloat(w.x << 16), uintBitsToFloat(w.x & 0xFFFF0000u),
                uintBitsToFloat(w.y << 16), uintBitsToFloat(w.y & 0xFFFF0000u));
#endif
}
uvec2 pack4(vec4 v) {
#if TA == T_F16
    return uvec2(packHalf2x16(v.xy), packHalf2x16(v.zw));
#else
    return uvec2(f_to_bf16(v.x) | (f_to_bf16(v.y) << 16), f_to_bf16(v.z) | (f_to_bf16(v.w) << 16));
#endif
}
// A float32 A or B of the mixed storage (MM_AF32 / MM_BF32) as texels, each value rounded to TA.
vec4 round4(vec4 v) { return vec4(mm_round(v.x), mm_round(v.y), mm_round(v.z), mm_round(v.w)); }
// A 16-bit A or B: the rgba32ui texel holding element i is its 8 values i & ~7 .. (i & ~7) + 7,
// two to a word, so a 4-aligned run is half a texel and an 8-aligned run all of it.
#ifdef MM_TEXEL_A
vec4 lda4(uint i) { return round4(texelFetch(ta, int(i >> 2))); }
void lda8w(uint i, out vec4 lo, out vec4 hi) { lo = lda4(i); hi = lda4(i + 4u); }
float lda(uint i) { return mm_lda(i); }
#else
uvec4 a_texel8(uint i) { return texelFetch(ta, int(i >> 3)); }
vec4 lda4(uint i) { uvec4 t = a_texel8(i); return unpack4((i & 4u) == 0u ? t.xy : t.zw); }
void lda8w(uint i, out vec4 lo, out vec4 hi) { uvec4 t = a_texel8(i); lo = unpack4(t.xy); hi = unpack4(t.zw); }
float lda(uint i) { return half_of_word(TA, a_texel8(i)[(i >> 1) & 3u], i & 1u); }
#endif
#ifdef MM_TEXEL_B
vec4 ldb4(uint i) { return round4(texelFetch(tb, int(i >> 2))); }
void ldb8w(uint i, out vec4 lo, out vec4 hi) { lo = ldb4(i); hi = ldb4(i + 4u); }
float ldb(uint i) { return mm_ldb(i); }
#else
uvec4 b_texel8(uint i) { return texelFetch(tb, int(i >> 3)); }
vec4 ldb4(uint i) { uvec4 t = b_texel8(i); return unpack4((i & 4u) == 0u ? t.xy : t.zw); }
void ldb8w(uint i, out vec4 lo, out vec4 hi) { uvec4 t = b_texel8(i); lo = unpack4(t.xy); hi = unpack4(t.zw); }
float ldb(uint i) { return half_of_word(TA, b_texel8(i)[(i >> 1) & 3u], i & 1u); }
#endif
layout(std430, binding = 2) writeonly buffer BCF4 { vec4 cf4[]; };
void stc4(uint i, vec4 v) {
    if (CF32 == 1) cf4[i >> 2] = vec4(mm_cf(v.x), mm_cf(v.y), mm_cf(v.z), mm_cf(v.w));
    else c4[i >> 2] = pack4(v);
}
#endif

// 8 consecutive values from element i (i a multiple of 8 when wide, else of 4).
void lda8(uint i, out vec4 lo, out vec4 hi) {
    if (AWIDE == 1) lda8w(i, lo, hi);
    else { lo = lda4(i); hi = lda4(i + 4u); }
}
void ldb8(uint i, out vec4 lo, out vec4 hi) {
    if (BWIDE == 1) ldb8w(i, lo, hi);
    else { lo = ldb4(i); hi = ldb4(i + 4u); }
}

void main() {
    const uint lane = gl_SubgroupInvocationID;
    uint z = gl_WorkGroupID.z;
    uint z0 = z / p.nb1, z1 = z - z0 * p.nb1;
    uint abase = p.off_a + z0 * p.sa0 + z1 * p.sa1;
    uint bbase = p.off_b + z0 * p.sb0 + z1 * p.sb1;
    uint m0 = (gl_WorkGroupID.y * uint(WY) + gl_LocalInvocationID.y) * uint(TM);
    uint n0 = (gl_WorkGroupID.x * uint(SG) + lane) * uint(TN);
    if (m0 >= p.M) return;  // the whole subgroup leaves together: broadcasts stay defined

    // Loads are clamped into the matrix instead of branched around, so every lane stays
    // active for the broadcasts; clamped rows / columns are simply not stored.
    uint arow[TM / SG];          // AMODE 0/1: the row this lane fetches, per group of SG rows
    [[unroll]] for (int r = 0; r < TM / SG; ++r) arow[r] = abase + min(m0 + uint(r * SG) + lane, p.M - 1u) * p.sam;
    uint acol[TM / 8];           // AMODE 2: first row of each 8-row run (M % 8 == 0 when wide,
    [[unroll]] for (int q = 0; q < TM / 8; ++q)  // else M % 4 == 0 and two 4-row halves)
        acol[q] = abase + (AWIDE == 1 ? min(m0 + uint(8 * q), p.M - 8u) : m0 + uint(8 * q));
    uint bcol[TN];               // BMODE 0/2: each column; BMODE 1: each 8-column run at bcol[8*j8]
    [[unroll]] for (int j = 0; j < TN; ++j) bcol[j] = bbase + min(n0 + uint(j), p.N - 1u) * p.sbn;

    vec4 acc[TM][TN / 4];        // acc[i][j4][e]: row m0 + i, column n0 + 4 * j4 + e
    [[unroll]] for (int i = 0; i < TM; ++i)
        [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) acc[i][j4] = vec4(0.0);

    precise vec4 bs[TN / 4];     // BSUM: column sums of B, columns n0 + 4 * j4 + e
    [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) bs[j4] = vec4(0.0);

    uint kmain = p.K - p.K % uint(KB);
    for (uint k = 0u; k < kmain; k += uint(KB)) {
        // A panel TM x KB, spread over the lanes.
        vec4 av[TM / SG][2];     // AMODE 0/1: lane holds row (r*SG + lane), k .. k+7
        vec4 am[TM / 4];         // AMODE 2: lane holds k + lane, rows 4q .. 4q+3
        if (AMODE == 1) {
            [[unroll]] for (int r = 0; r < TM / SG; ++r) lda8(arow[r] + k, av[r][0], av[r][1]);
        } else if (AMODE == 2) {
            uint ko = (k + lane) * p.sak;
            [[unroll]] for (int q = 0; q < TM / 8; ++q) {
                if (AWIDE == 1) lda8w(acol[q] + ko, am[2 * q], am[2 * q + 1]);
                else {  // 4-row halves, each clamped on its own (M % 4 == 0)
                    am[2 * q] = lda4(abase + min(m0 + uint(8 * q), p.M - 4u) + ko);
                    am[2 * q + 1] = lda4(abase + min(m0 + uint(8 * q + 4), p.M - 4u) + ko);
                }
            }
        } else {
            [[unroll]] for (int r = 0; r < TM / SG; ++r)
                [[unroll]] for (int h = 0; h < 2; ++h)
                    [[unroll]] for (int e = 0; e < 4; ++e) av[r][h][e] = lda(arow[r] + (k + uint(4 * h + e)) * p.sak);
        }
        // B panel KB x TN for this lane, all loaded before the FMAs: the B values are then
        // read-only (a spilled one is a memory operand, never stored back), and each row's TN
        // accumulators stay in registers through all KB steps.
        vec4 bp[KB][TN / 4];
        if (BMODE == 1) {
            [[unroll]] for (int kk = 0; kk < KB; ++kk) {
                uint brow = (k + uint(kk)) * p.sbk;
                [[unroll]] for (int j8 = 0; j8 < TN / 8; ++j8) {
                    // N % 8 == 0 when wide: clamp the run; else N % 4 == 0: clamp each half
                    if (BWIDE == 1) ldb8w(bbase + min(n0 + uint(8 * j8), p.N - 8u) + brow, bp[kk][2 * j8], bp[kk][2 * j8 + 1]);
                    else {
                        bp[kk][2 * j8] = ldb4(bbase + min(n0 + uint(8 * j8), p.N - 4u) + brow);
                        bp[kk][2 * j8 + 1] = ldb4(bbase + min(n0 + uint(8 * j8 + 4), p.N - 4u) + brow);
                    }
                }
            }
        } else if (BMODE == 2) {
            [[unroll]] for (int j = 0; j < TN; ++j) {
                vec4 lo, hi;
                ldb8(bcol[j] + k, lo, hi);
                [[unroll]] for (int e = 0; e < 4; ++e) {
                    bp[e][j / 4][j % 4] = lo[e];
                    bp[4 + e][j / 4][j % 4] = hi[e];
                }
            }
        } else {
            [[unroll]] for (int kk = 0; kk < KB; ++kk) {
                uint brow = (k + uint(kk)) * p.sbk;
                [[unroll]] for (int j = 0; j < TN; ++j) bp[kk][j / 4][j % 4] = ldb(bcol[j] + brow);
            }
        }
        if (BSUM == 1) {
            [[unroll]] for (int kk = 0; kk < KB; ++kk)
                [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) bs[j4] += bp[kk][j4];
        }
        [[unroll]] for (int i = 0; i < TM; ++i)
            [[unroll]] for (int kk = 0; kk < KB; ++kk) {
                float ai = AMODE == 2 ? subgroupShuffle(am[i / 4][i % 4], uint(kk))
                                      : subgroupShuffle(av[i / SG][kk / 4][kk % 4], uint(i % SG));
                [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) acc[i][j4] += ai * bp[kk][j4];
            }
    }
    // K tail (K % KB values): scalar loads, one k at a time.
    for (uint k = kmain; k < p.K; ++k) {
        float at[TM / SG];
        [[unroll]] for (int r = 0; r < TM / SG; ++r) {
            uint m = min(m0 + uint(r * SG) + lane, p.M - 1u);
            at[r] = lda(abase + m * p.sam + k * p.sak);
        }
        vec4 bv[TN / 4];
        [[unroll]] for (int j = 0; j < TN; ++j) bv[j / 4][j % 4] = ldb(bcol[j] + k * p.sbk);
        if (BSUM == 1) {
            [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) bs[j4] += bv[j4];
        }
        [[unroll]] for (int i = 0; i < TM; ++i) {
            float ai = subgroupShuffle(at[i / SG], uint(i % SG));
            [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) acc[i][j4] += ai * bv[j4];
        }
    }

    if (p.has_bias != 0u) {  // this lane's TN bias values, loaded once for all TM rows
        [[unroll]] for (int j = 0; j < TN; ++j) {
            float bj = mm_ldbias(p.off_bias + min(n0 + uint(j), p.N - 1u));
            [[unroll]] for (int i = 0; i < TM; ++i) acc[i][j / 4][j % 4] += bj;
        }
    }
#ifdef MM_EPI
#if TA == T_F32
    if (EPI != 0 && EVEC == 1) {  // N % 4 == 0: a vec4 of columns is all in or all out
        [[unroll]] for (int i = 0; i < TM; ++i) {
            uint m = min(m0 + uint(i), p.M - 1u);
            [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) {
                uint n = min(n0 + uint(4 * j4), p.N - 4u);
                acc[i][j4] = mm_epi4(acc[i][j4], z * p.M * p.N + m * p.N + n,
                                     m0 + uint(i) < p.M && n0 + uint(4 * j4) < p.N);
            }
        }
    } else
#endif
    if (EPI != 0) {  // C contiguous (no CT / ldc); clamped elements are computed, never stored
        [[unroll]] for (int i = 0; i < TM; ++i) {
            uint m = min(m0 + uint(i), p.M - 1u);
            [[unroll]] for (int j = 0; j < TN; ++j) {
                uint n = min(n0 + uint(j), p.N - 1u);
                acc[i][j / 4][j % 4] = mm_epi(acc[i][j / 4][j % 4], z * p.M * p.N + m * p.N + n,
                                              m0 + uint(i) < p.M && n0 + uint(j) < p.N);
            }
        }
    }
#endif
    if (BSUM == 1 && m0 == 0u) {  // one subgroup per column block; clamped columns are not stored
        [[unroll]] for (int j = 0; j < TN; ++j) {
            uint n = n0 + uint(j);
            if (n < p.N) mm_st_bsum(p.off_bias + n, bs[j / 4][j % 4]);
        }
    }
    uint ldc = p.ldc > 0u ? p.ldc : (CT == 1 ? p.M : p.N);
    uint cbase = p.ldc > 0u ? p.off_c + z0 * (CT == 1 ? p.N : p.M) * ldc + z1 * (CT == 1 ? p.M : p.N)
                            : p.off_c + z * p.M * p.N;
    if (CT == 1) {  // column n of this lane is a run of TM rows: stored along m
        [[unroll]] for (int j = 0; j < TN; ++j) {
            uint n = n0 + uint(j);
            if (n >= p.N) break;
            uint ccol = cbase + n * ldc;
            if (CVEC == 1) {  // M % 4 == 0 and m0 % 4 == 0: a run of 4 rows is all in or all out
                [[unroll]] for (int i4 = 0; i4 < TM / 4; ++i4) {
                    uint m = m0 + uint(4 * i4);
                    if (m < p.M) stc4(ccol + m, vec4(acc[4 * i4][j / 4][j % 4], acc[4 * i4 + 1][j / 4][j % 4],
                                                     acc[4 * i4 + 2][j / 4][j % 4], acc[4 * i4 + 3][j / 4][j % 4]));
                }
            } else {
                [[unroll]] for (int i = 0; i < TM; ++i) {
                    uint m = m0 + uint(i);
                    if (m >= p.M) break;
                    mm_stc(ccol + m, acc[i][j / 4][j % 4]);
                }
            }
        }
        return;
    }
    [[unroll]] for (int i = 0; i < TM; ++i) {
        uint m = m0 + uint(i);
        if (m >= p.M) break;
        uint crow = cbase + m * ldc;
        if (CVEC == 1) {
            [[unroll]] for (int j4 = 0; j4 < TN / 4; ++j4) {
                uint n = n0 + uint(4 * j4);
                if (n < p.N) stc4(crow + n, acc[i][j4]);
            }
        } else {
            [[unroll]] for (int j = 0; j < TN; ++j) {
                uint n = n0 + uint(j);
                if (n < p.N) mm_stc(crow + n, acc[i][j / 4][j % 4]);
            }
        }
    }
}
#endif
