#version 450
// Flash attention (FlashAttention-2's algorithm): softmax(Q K^T * scale) V without a T x T
// matrix anywhere.  Q [Tq, HD], K and V [Tk, HD] per (batch, head) pair z = b * H + h, K and V
// those of K/V head h / G (G = 1 but for grouped-query attention: see qrow); each
// operand is addressed as off + b * s_b + h * s_h + t * s_t + d (unit stride along the head
// dim, any other strides: the heads of a fused QKV projection are read in place, and a
// stride-0 dim reads one K/V for several query heads).  O, dO and the gradients are addressed
// so too, O and dO with strides of their own and dQ | dK, dV (the one or two outputs of a
// backward pass) with one set shared by the pass's outputs: O stored token-major ([B, T, H,
// HD]) is what a projection of the heads reads, and the gradients land in the fused QKV
// gradient's columns, with no copies either way.  L (the log-sum-exp of each query row,
// natural log) and D (rowsum(dO * O)) are contiguous float32 [BH, Tq].  Arithmetic is fp32
// whatever the storage type (TA).
//
// MODE (a specialization constant) picks the pass:
//   0  forward: O and L.  Key tiles stream past a tile of query rows; each row keeps a
//      running max m and sum l of exp(s - m) (the online softmax) and rescales its
//      accumulator when m grows, so the result equals softmax(S) V exactly in real numbers.
//   1  backward preprocess: D = rowsum(dO * O), one row per invocation, over the BH * Tq
//      rows as one flat range (this pass's Tq is their count, its Tk the rows of a head).
//   2  backward dQ: a tile of query rows streams key tiles: P = exp(S - L) is recomputed
//      from the saved L, dP = dO V^T, dS = P * (dP - D), dQ += dS K * scale.
//   3  backward dK, dV: a tile of key rows streams query tiles: dV += P^T dO and
//      dK += dS^T Q * scale.  With grouped-query attention (G query heads a K/V head) it
//      streams the query tiles of the group's heads one head after another, so a K/V head's
//      gradients are summed in the kernel, in a fixed order (no repeated K, V or reduction).
// Block sparsity: with a block size bs (flags >> 8, 0 = dense) a uint mask over
// (query block, key block) pairs, row-major [ceil(Tq / bs), ceil(Tk / bs)], nonzero =
// computed.  Passes 0 and 2 skip key tiles of masked blocks, pass 3 skips query tiles of
// masked blocks (the same mask read down a column).  bs is a multiple of every tile and
// row group of both kernels (64, checked by flash_attn_fwd()), so a tile never straddles
// two blocks and the skip is uniform over a subgroup or workgroup.  One word per block pair
// rather than per query block a list of allowed key blocks: the dK/dV pass reads it by
// column with the same indexing, no transposed second index, and a skipped tile costs one
// uniform load.  The mask has no binding of its own: each pass reads it through a binding
// it leaves unused (pass 0: 6, pass 2: 8, pass 3: 7), so the dense kernel keeps its layout.
// A query row whose every key is masked has no softmax; block masks are refused before
// that can happen (helios/attention.py).
// With flags bit 1, pass 1 computes D = rowsum(dO * O) - dL instead, dL (the gradient of
// L, read through binding 5, unused by that pass) entering dS = P * (dP - D + dL): the
// backward of callers that use L itself (dilated attention's softmax over patterns).
// With flags bit 2, pass 2 computes D itself, each row's from the dO row it loads and O
// (through binding 3, unused by that pass), in pass 1's order, and stores it for pass 3: one
// dispatch fewer a backward (the host then runs no pass 1; a dL needs pass 1, whose binding 5
// pass 2 uses for L).
// Passes 2 and 3 each own their outputs (a query row's dQ, a key row's dK and dV), so the
// backward needs no atomics and is deterministic.  With causal != 0 query i sees keys
// j <= i (top-left aligned, PyTorch's is_causal; flags bit 0); tiles wholly above the diagonal are
// skipped, not computed and masked.  Exponentials are exp2 of scores pre-multiplied by
// scale * log2(e).
//
// Two kernels live here, picked by the variant (see flash_attn.variants and
// flash_attn_fwd() in helios/_kernels.py):
//
// * FA_SG (lavapipe and other CPU drivers): no shared memory and no barriers, for the
//   reasons matmul.glsl gives (a subgroup is one 8-wide SIMD vector; buffer loads are
//   per-lane loops, so Q, K, V and dO are read through texel views, and a broadcast from a
//   lane is one register shuffle).  A subgroup owns
//   NR = 8 rows (one per lane) and meets tiles of SG * TN columns, TN per lane.  The two
//   products of every pass are then matmul.comp's register blocks:
//     rowdot: S[i][j] += X[row i] . Y[col j]: the 8 X values of a head-dim step are loaded
//             by row i's lane and broadcast; each lane loads its TN Y rows (8-wide loads
//             along the contiguous head dim) and keeps an NR x TN block of S.
//     accum:  A[i][c] += sum_n W[i][n] Z[n][c]: each lane owns DL = HD / 8 adjacent head-dim
//             columns of the NR x HD accumulator, W[i][n] comes by broadcast from the lane
//             that holds it, and Z[n][its columns] is a vector load.
//   Only the accumulators are indexed by compile-time constants (HD, TN are defines), so
//   they stay in registers; the head-dim and lane loops are ordinary loops.
//
// * default (GPUs): one invocation per row (a query row in passes 0 and 2, a key row in
//   pass 3), WG rows a workgroup; the tiles of the streamed operands (BKT rows) go through
//   shared memory, read by every invocation at the same address (a broadcast).  Its loops
//   carry no unroll hints: the driver's compiler unrolls them (unrolled by glslc, with the
//   register rows indexed by constants, one variant took minutes to compile).
#include "common.glsl"
#extension GL_EXT_control_flow_attributes : require

#ifndef HD
#define HD 64       // head dim: 32, 64 or 128 (a multiple of 32: each of 8 lanes owns 4k columns)
#endif
const float LOG2E = 1.4426950408889634;
const float LN2 = 0.6931471805599453;
const float NEG_INF = -1.0 / 0.0;

#ifdef FA_SG
// The CPU kernel reads Q, K, V and dO through texel views (usamplerBuffers, which the addon
// binds as rgba32ui views): llvmpipe fetches a texel for the 8 lanes as one gather, where a
// storage-buffer load is a loop over the lanes (matmul.glsl reads its operands so too).  A
// texel is 4 float32 values or 8 16-bit ones, as raw words.  O stays a storage buffer: the
// forward writes it.
layout(binding = 0) uniform usamplerBuffer tq;
layout(binding = 1) uniform usamplerBuffer tk;
layout(binding = 2) uniform usamplerBuffer tv;
layout(binding = 4) uniform usamplerBuffer tdo;
#else
layout(std430, binding = 0) readonly buffer BQ { HL_ST(TA) q[]; };
layout(std430, binding = 1) readonly buffer BK { HL_ST(TA) k[]; };
layout(std430, binding = 2) readonly buffer BV { HL_ST(TA) v[]; };
layout(std430, binding = 4) readonly buffer BDO { HL_ST(TA) dout[]; };
#endif
layout(std430, binding = 3) buffer BO { HL_ST(TA) o[]; };
layout(std430, binding = 5) buffer BL { float lse[]; };
layout(std430, binding = 6) buffer BD { float dsum[]; };
layout(std430, binding = 7) writeonly buffer BDQ { HL_ST(TA) dq[]; };
layout(std430, binding = 8) writeonly buffer BDK { HL_ST(TA) dk[]; };
layout(std430, binding = 9) writeonly buffer BDV { HL_ST(TA) dv[]; };
// the block mask's aliases (see above)
layout(std430, binding = 6) readonly buffer BM6 { uint bm6[]; };
layout(std430, binding = 7) readonly buffer BM7 { uint bm7[]; };
layout(std430, binding = 8) readonly buffer BM8 { uint bm8[]; };
layout(push_constant) uniform P {
    uint Tq; uint Tk; uint H; uint flags;  // bit 0 causal, bit 1 dL given, bits 8.. block size
    float scale;
    uint off_q; uint off_k; uint off_v; uint off_o; uint off_do;
    uint sqb; uint sqh; uint sqt;
    uint skb; uint skh; uint skt;
    uint svb; uint svh; uint svt;
    uint sob; uint soh; uint sot;     // O
    uint sdb; uint sdh; uint sdt;     // dO
    uint sgb; uint sgh; uint sgt;     // the pass's gradient outputs: dQ (pass 2) or dK and dV (pass 3)
    uint off_g0; uint off_g1;         // dQ | dK, dV
    uint G;                           // query heads per K/V head (grouped-query attention; 1: as many)
} p;

// Operand ids of the load helpers (compile-time constants after inlining, so each call
// reads one buffer directly).
const int BUF_Q = 0;
const int BUF_K = 1;
const int BUF_V = 2;
const int BUF_O = 3;
const int BUF_DO = 4;

#ifdef FA_SG
// The texel of operand b (not O) that holds element i: 4 values a texel for float32, 8 for 16-bit.
uvec4 texel_of(const int b, uint i) {
    int t = int(TA == T_F32 ? i >> 2 : i >> 3);
    if (b == BUF_Q) return texelFetch(tq, t);
    if (b == BUF_K) return texelFetch(tk, t);
    if (b == BUF_V) return texelFetch(tv, t);
    return texelFetch(tdo, t);
}

float ld1(const int b, uint i) {
    if (b == BUF_O) return HL_LDF(TA, o[i]);
#if TA == T_F32
    return uintBitsToFloat(texel_of(b, i)[i & 3u]);
#else
    return half_of_word(TA, texel_of(b, i)[(i >> 1) & 3u], i & 1u);
#endif
}
#else
float ld1(const int b, uint i) {
    if (b == BUF_Q) return HL_LDF(TA, q[i]);
    if (b == BUF_K) return HL_LDF(TA, k[i]);
    if (b == BUF_V) return HL_LDF(TA, v[i]);
    if (b == BUF_O) return HL_LDF(TA, o[i]);
    return HL_LDF(TA, dout[i]);
}
#endif

layout(constant_id = 1) const int MODE = 0;  // the pass

// Element (z, t, 0) of Q, K, V, O, dO; of a gradient output at offset off.  z = b * H + h names a
// query head; K and V (and pass 3's outputs, dK and dV) have H / G heads, query head h reading
// K/V head h / G (grouped-query attention: transformers' repeat_kv pairing).
uint qrow(uint z, uint t) { uint b = z / p.H; return p.off_q + b * p.sqb + (z - b * p.H) * p.sqh + t * p.sqt; }
uint krow(uint z, uint t) { uint b = z / p.H; return p.off_k + b * p.skb + (z - b * p.H) / p.G * p.skh + t * p.skt; }
uint vrow(uint z, uint t) { uint b = z / p.H; return p.off_v + b * p.svb + (z - b * p.H) / p.G * p.svh + t * p.svt; }
uint orow(uint z, uint t) { uint b = z / p.H; return p.off_o + b * p.sob + (z - b * p.H) * p.soh + t * p.sot; }
uint dorow(uint z, uint t) { uint b = z / p.H; return p.off_do + b * p.sdb + (z - b * p.H) * p.sdh + t * p.sdt; }
uint grow(uint off, uint z, uint t) {
    uint b = z / p.H, h = z - b * p.H;
    return off + b * p.sgb + (MODE == 3 ? h / p.G : h) * p.sgh + t * p.sgt;
}

// The first query head (its z) of the group sharing K/V head zk = b * (H / G) + j: pass 3 runs
// one workgroup column per K/V head and sums the group's G query heads into its dK, dV.
uint group_z(uint zk) { uint hk = p.H / p.G, b = zk / hk; return b * p.H + (zk - b * hk) * p.G; }

// rowsum(dO * O) of row t of head z (the backward's D), over the head dim in order, a value a load.
float row_dsum_at(uint z, uint t) {
    uint io = orow(z, t), id = dorow(z, t);
    float s = 0.0;
    for (uint d = 0u; d < uint(HD); ++d) s += ld1(BUF_DO, id + d) * ld1(BUF_O, io + d);
    return s;
}

// The same of flat row r (pass 1, whose Tk is the rows of a head).
float row_dsum_scalar(uint r) {
    uint z = r / p.Tk;
    return row_dsum_at(z, r - z * p.Tk);
}

bool causal_on() { return (p.flags & 1u) != 0u; }
bool d_here() { return (p.flags & 4u) != 0u; }  // pass 2 computes and stores D (see the top)

// Whether the block holding query row qr and key row kr is computed (always, without a mask).
bool blk_on(uint qr, uint kr) {
    uint bs = p.flags >> 8;
    if (bs == 0u) return true;
    uint i = (qr / bs) * ((p.Tk + bs - 1u) / bs) + kr / bs;
    if (MODE == 0) return bm6[i] != 0u;
    if (MODE == 2) return bm8[i] != 0u;
    return bm7[i] != 0u;
}

// The first key row >= k0 (a tile start) of a block the query rows from qr see, or kend
// past the last: the key loops step by it, a masked block costing one uniform load
// however many tiles it spans.
uint next_k(uint qr, uint k0, uint kend) {
    uint bs = p.flags >> 8;
    while (bs != 0u && k0 < kend && !blk_on(qr, k0)) k0 = (k0 / bs + 1u) * bs;
    return min(k0, kend);
}

// The same for the query loop of the dK / dV pass, key rows from kr.
uint next_q(uint kr, uint q0, uint qend) {
    uint bs = p.flags >> 8;
    while (bs != 0u && q0 < qend && !blk_on(q0, kr)) q0 = (q0 / bs + 1u) * bs;
    return min(q0, qend);
}

#ifdef FA_SG
// ---------------------------------------------------------------- subgroup register blocks (CPU)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_ballot : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#define SG 8        // lanes per subgroup; flash_attn_fwd() checks the device
#define NR 8        // rows a subgroup owns: one per lane
#ifndef TN
#define TN 8        // tile columns per lane
#endif
#define TC (SG * TN)
#define DL (HD / SG)

layout(local_size_x = SG, local_size_y_id = 0) in;
layout(constant_id = 0) const int WY = 4;      // subgroups per workgroup
// 1: every row start is 8-aligned: 8 16-bit values per load (one texel), as matmul.glsl's
// AWIDE; else two 4-value loads (row starts are always 4-aligned).  fp32 takes two texels either way.
layout(constant_id = 2) const int WIDE = 0;

#if TA == T_F32
layout(std430, binding = 3) buffer BO4 { vec4 o4[]; };
layout(std430, binding = 7) writeonly buffer BDQ4 { vec4 dq4[]; };
layout(std430, binding = 8) writeonly buffer BDK4 { vec4 dk4[]; };
layout(std430, binding = 9) writeonly buffer BDV4 { vec4 dv4[]; };
vec4 pk4(vec4 x) { return x; }
#else
// 16-bit storage: 4 values are two 32-bit words, 8 values a texel of four, unpacked in
// registers (no 16-bit arithmetic needed), as in matmul.glsl.
layout(std430, binding = 3) buffer BO4 { uvec2 o4[]; };
layout(std430, binding = 7) writeonly buffer BDQ4 { uvec2 dq4[]; };
layout(std430, binding = 8) writeonly buffer BDK4 { uvec2 dk4[]; };
layout(std430, binding = 9) writeonly buffer BDV4 { uvec2 dv4[]; };
vec4 un4(uvec2 w) {
#if TA == T_F16
    return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
#else
    return vec4(uintBitsToFloat(w.x << 16), uintBitsToFloat(w.x & 0xFFFF0000u),
                uintBitsToFloat(w.y << 16), uintBitsToFloat(w.y & 0xFFFF0000u));
#endif
}
uvec2 pk4(vec4 x) {
#if TA == T_F16
    return uvec2(packHalf2x16(x.xy), packHalf2x16(x.zw));
#else
    return uvec2(f_to_bf16(x.x) | (f_to_bf16(x.y) << 16), f_to_bf16(x.z) | (f_to_bf16(x.w) << 16));
#endif
}
#endif

// 4 values from element i (a multiple of 4) of operand b (Q, K, V or dO).
vec4 ld4(const int b, uint i) {
    uvec4 t = texel_of(b, i);
#if TA == T_F32
    return uintBitsToFloat(t);
#else
    return un4((i & 4u) == 0u ? t.xy : t.zw);
#endif
}

// 8 values from element i (a multiple of 8 when WIDE, else of 4).
void ld8(const int b, uint i, out vec4 lo, out vec4 hi) {
#if TA == T_F32
    lo = ld4(b, i);
    hi = ld4(b, i + 4u);
#else
    if (WIDE == 1) {
        uvec4 t = texel_of(b, i);
        lo = un4(t.xy);
        hi = un4(t.zw);
    } else {
        lo = ld4(b, i);
        hi = ld4(b, i + 4u);
    }
#endif
}

// s[i][j] += X[row i] . Y[row j] over the head dim.  Row i of X starts at xs on lane i
// (each lane passes its own row); this lane's TN rows of Y start at ys[j].
void rowdot(const int xb, uint xs, const int yb, uint ys[TN], inout float s[NR][TN]) {
    for (uint d = 0u; d < uint(HD); d += 8u) {
        vec4 x[2];
        ld8(xb, xs + d, x[0], x[1]);
        vec4 y[TN][2];
        [[unroll]] for (int j = 0; j < TN; ++j) ld8(yb, ys[j] + d, y[j][0], y[j][1]);
        [[unroll]] for (int i = 0; i < NR; ++i)
            [[unroll]] for (int e = 0; e < 8; ++e) {
                float xi = subgroupBroadcast(x[e / 4][e % 4], uint(i));
                [[unroll]] for (int j = 0; j < TN; ++j) s[i][j] += xi * y[j][e / 4][e % 4];
            }
    }
}

// acc[i][c] += sum_n w[i][n] * Z[n][lane * DL + c] over the tile's columns n = c0 + l * TN + j
// held by lanes lfirst <= l < lanes (slot j; the other lanes' weights are all 0).  Row n of Z starts at zs + n * zt; rows at or past
// nlim are clamped to the last one (their weights are 0).  Lane l's TN rows of Z are loaded
// first, so each accumulator row stays in registers through the TN steps that update it.
void accum(const int zb, uint zs, uint zt, uint c0, uint nlim, uint lfirst, uint lanes, float w[NR][TN],
           inout float acc[NR][DL]) {
    uint col = zs + gl_SubgroupInvocationID * uint(DL);
    for (uint l = lfirst; l < lanes; ++l) {
        vec4 zv[TN][DL / 4];
        [[unroll]] for (int j = 0; j < TN; ++j) {
            uint n = min(c0 + l * uint(TN) + uint(j), nlim - 1u);
            if (DL % 8 == 0) {
                [[unroll]] for (int c8 = 0; c8 < DL / 8; ++c8) ld8(zb, col + n * zt + uint(8 * c8), zv[j][2 * c8], zv[j][2 * c8 + 1]);
            } else {
                [[unroll]] for (int c4 = 0; c4 < DL / 4; ++c4) zv[j][c4] = ld4(zb, col + n * zt + uint(4 * c4));
            }
        }
        [[unroll]] for (int i = 0; i < NR; ++i)
            [[unroll]] for (int j = 0; j < TN; ++j) {
                // l is the same on every lane: a broadcast from a dynamically uniform lane
                float wi = subgroupBroadcast(w[i][j], l);
                [[unroll]] for (int c = 0; c < DL; ++c) acc[i][c] += wi * zv[j][c / 4][c % 4];
            }
    }
}

void zero_acc(out float acc[NR][DL]) {
    [[unroll]] for (int i = 0; i < NR; ++i)
        [[unroll]] for (int c = 0; c < DL; ++c) acc[i][c] = 0.0;
}

void zero_tile(out float s[NR][TN]) {
    [[unroll]] for (int i = 0; i < NR; ++i)
        [[unroll]] for (int j = 0; j < TN; ++j) s[i][j] = 0.0;
}

// Row i of acc (this lane's DL columns, times f) to row t of head z of output `which` (0 O,
// 1 dQ, 2 dK, 3 dV), whose rows start 4-aligned (checked by the launcher).
void store_row(int which, uint z, uint t, float acc[NR][DL], int i, float f) {
    uint row = which == 0 ? orow(z, t) : grow(which == 3 ? p.off_g1 : p.off_g0, z, t);
    uint base = row + gl_SubgroupInvocationID * uint(DL);
    [[unroll]] for (int c4 = 0; c4 < DL / 4; ++c4) {
        vec4 x = vec4(acc[i][4 * c4], acc[i][4 * c4 + 1], acc[i][4 * c4 + 2], acc[i][4 * c4 + 3]) * f;
        uint e = (base >> 2) + uint(c4);
        if (which == 0) o4[e] = pk4(x);
        else if (which == 1) dq4[e] = pk4(x);
        else if (which == 2) dk4[e] = pk4(x);
        else dv4[e] = pk4(x);
    }
}

void forward_pass() {
    const uint lane = gl_SubgroupInvocationID;
    uint z = gl_WorkGroupID.z;
    uint m0 = (gl_WorkGroupID.y * uint(WY) + gl_LocalInvocationID.y) * uint(NR);
    if (m0 >= p.Tq) return;  // the whole subgroup leaves together: broadcasts stay defined
    uint xs = qrow(z, min(m0 + lane, p.Tq - 1u));
    float c = p.scale * LOG2E;
    float acc[NR][DL];
    zero_acc(acc);
    float mrow[NR], lrow[NR];  // running max (log2 units, same on all lanes); this lane's part of the sum
    [[unroll]] for (int i = 0; i < NR; ++i) { mrow[i] = NEG_INF; lrow[i] = 0.0; }
    uint kend = causal_on() ? min(p.Tk, m0 + uint(NR)) : p.Tk;
    for (uint k0 = next_k(m0, 0u, kend); k0 < kend; k0 = next_k(m0, k0 + uint(TC), kend)) {
        uint ys[TN];
        [[unroll]] for (int j = 0; j < TN; ++j) ys[j] = krow(z, min(k0 + lane * uint(TN) + uint(j), p.Tk - 1u));
        float s[NR][TN];
        zero_tile(s);
        rowdot(BUF_Q, xs, BUF_K, ys, s);
        [[unroll]] for (int i = 0; i < NR; ++i) {
            uint lim = causal_on() ? min(p.Tk, m0 + uint(i) + 1u) : p.Tk;  // row i sees keys < lim
            float mx = NEG_INF;
            [[unroll]] for (int j = 0; j < TN; ++j) {
                s[i][j] = k0 + lane * uint(TN) + uint(j) < lim ? s[i][j] * c : NEG_INF;
                mx = max(mx, s[i][j]);
            }
            float mnew = max(mrow[i], subgroupMax(mx));
            // equal maxima (both -inf included: no key seen yet) need no rescale; exp2 of
            // -inf - -inf would be NaN
            float alpha = mrow[i] == mnew ? 1.0 : exp2(mrow[i] - mnew);
            mrow[i] = mnew;
            lrow[i] *= alpha;
            [[unroll]] for (int cc = 0; cc < DL; ++cc) acc[i][cc] *= alpha;
            [[unroll]] for (int j = 0; j < TN; ++j) {
                s[i][j] = s[i][j] == NEG_INF ? 0.0 : exp2(s[i][j] - mnew);
                lrow[i] += s[i][j];
            }
        }
        uint lanes = min(uint(SG), (kend - k0 + uint(TN) - 1u) / uint(TN));
        accum(BUF_V, vrow(z, 0u), p.svt, k0, p.Tk, 0u, lanes, s, acc);
    }
    [[unroll]] for (int i = 0; i < NR; ++i) {
        uint t = m0 + uint(i);
        if (t >= p.Tq) break;  // uniform: the whole subgroup stops
        float l = subgroupAdd(lrow[i]);
        store_row(0, z, t, acc, i, 1.0 / l);
        if (lane == 0u) lse[z * p.Tq + t] = (mrow[i] + log2(l)) * LN2;
    }
}

void dq_pass() {
    const uint lane = gl_SubgroupInvocationID;
    uint z = gl_WorkGroupID.z;
    uint m0 = (gl_WorkGroupID.y * uint(WY) + gl_LocalInvocationID.y) * uint(NR);
    if (m0 >= p.Tq) return;
    uint mine = min(m0 + lane, p.Tq - 1u);
    uint xq = qrow(z, mine), xd = dorow(z, mine);
    float my_l = lse[z * p.Tq + mine] * LOG2E, my_d;
    if (d_here()) {
        my_d = row_dsum_at(z, mine);
        if (m0 + lane < p.Tq) dsum[z * p.Tq + mine] = my_d;
    } else {
        my_d = dsum[z * p.Tq + mine];
    }
    float c = p.scale * LOG2E;
    float acc[NR][DL];
    zero_acc(acc);
    uint kend = causal_on() ? min(p.Tk, m0 + uint(NR)) : p.Tk;
    for (uint k0 = next_k(m0, 0u, kend); k0 < kend; k0 = next_k(m0, k0 + uint(TC), kend)) {
        uint yk[TN], yv[TN];
        [[unroll]] for (int j = 0; j < TN; ++j) {
            uint n = min(k0 + lane * uint(TN) + uint(j), p.Tk - 1u);
            yk[j] = krow(z, n);
            yv[j] = vrow(z, n);
        }
        float s[NR][TN], dp[NR][TN];
        zero_tile(s);
        zero_tile(dp);
        rowdot(BUF_Q, xq, BUF_K, yk, s);
        rowdot(BUF_DO, xd, BUF_V, yv, dp);
        [[unroll]] for (int i = 0; i < NR; ++i) {
            uint lim = causal_on() ? min(p.Tk, m0 + uint(i) + 1u) : p.Tk;
            float li = subgroupBroadcast(my_l, uint(i)), di = subgroupBroadcast(my_d, uint(i));
            [[unroll]] for (int j = 0; j < TN; ++j) {
                float pij = k0 + lane * uint(TN) + uint(j) < lim ? exp2(s[i][j] * c - li) : 0.0;
                s[i][j] = pij * (dp[i][j] - di);  // dS
            }
        }
        uint lanes = min(uint(SG), (kend - k0 + uint(TN) - 1u) / uint(TN));
        accum(BUF_K, krow(z, 0u), p.skt, k0, p.Tk, 0u, lanes, s, acc);
    }
    [[unroll]] for (int i = 0; i < NR; ++i) {
        uint t = m0 + uint(i);
        if (t >= p.Tq) break;
        store_row(1, z, t, acc, i, p.scale);
    }
}

void dkv_pass() {
    const uint lane = gl_SubgroupInvocationID;
    uint z0 = group_z(gl_WorkGroupID.z);
    uint n0 = (gl_WorkGroupID.y * uint(WY) + gl_LocalInvocationID.y) * uint(NR);
    if (n0 >= p.Tk) return;
    uint mine = min(n0 + lane, p.Tk - 1u);
    uint xk = krow(z0, mine), xv = vrow(z0, mine);
    float c = p.scale * LOG2E;
    float gk[NR][DL], gv[NR][DL];
    zero_acc(gk);
    zero_acc(gv);
    // causal: queries before key n0 see none of this subgroup's keys
    uint qstart = causal_on() ? (n0 / uint(TC)) * uint(TC) : 0u;
    for (uint z = z0; z < z0 + p.G; ++z)  // the query heads sharing these keys, in order
    for (uint q0 = next_q(n0, qstart, p.Tq); q0 < p.Tq; q0 = next_q(n0, q0 + uint(TC), p.Tq)) {
        uint yq[TN], yd[TN];
        float lq[TN], dq_[TN];
        [[unroll]] for (int j = 0; j < TN; ++j) {
            uint t = min(q0 + lane * uint(TN) + uint(j), p.Tq - 1u);
            yq[j] = qrow(z, t);
            yd[j] = dorow(z, t);
            lq[j] = lse[z * p.Tq + t] * LOG2E;
            dq_[j] = dsum[z * p.Tq + t];
        }
        float st[NR][TN], dpt[NR][TN];  // S^T and dP^T: key rows i, query columns j
        zero_tile(st);
        zero_tile(dpt);
        rowdot(BUF_K, xk, BUF_Q, yq, st);
        rowdot(BUF_V, xv, BUF_DO, yd, dpt);
        [[unroll]] for (int i = 0; i < NR; ++i)
            [[unroll]] for (int j = 0; j < TN; ++j) {
                uint t = q0 + lane * uint(TN) + uint(j);
                bool live = t < p.Tq && (!causal_on() || n0 + uint(i) <= t);
                float pt = live ? exp2(st[i][j] * c - lq[j]) : 0.0;
                st[i][j] = pt;
                dpt[i][j] = pt * (dpt[i][j] - dq_[j]);  // dS^T
            }
        uint lanes = min(uint(SG), (p.Tq - q0 + uint(TN) - 1u) / uint(TN));
        // causal: lanes whose queries all come before key n0 hold only zeros
        uint lfirst = causal_on() && q0 < n0 ? (n0 - q0) / uint(TN) : 0u;
        accum(BUF_DO, dorow(z, 0u), p.sdt, q0, p.Tq, lfirst, lanes, st, gv);
        accum(BUF_Q, qrow(z, 0u), p.sqt, q0, p.Tq, lfirst, lanes, dpt, gk);
    }
    [[unroll]] for (int i = 0; i < NR; ++i) {
        uint t = n0 + uint(i);
        if (t >= p.Tk) break;
        store_row(2, z0, t, gk, i, p.scale);
        store_row(3, z0, t, gv, i, 1.0);
    }
}

uint flat_row() {
    return (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * uint(SG * WY) + gl_LocalInvocationIndex;
}

float row_dsum(uint r) { return row_dsum_scalar(r); }

#else
// ---------------------------------------------------------------- shared-memory tiles (GPU)
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const int WG = 64;     // rows (invocations) per workgroup
// 1 (the preprocess pass only): O's and dO's rows start 8-aligned, so row_dsum reads them 16
// bytes a load; the other passes load scalars either way.
layout(constant_id = 2) const int WIDE = 0;
#if TA == T_F32
layout(std430, binding = 3) readonly buffer BOW { vec4 o_w[]; };
layout(std430, binding = 4) readonly buffer BDOW { vec4 do_w[]; };
#else
layout(std430, binding = 3) readonly buffer BOW { uvec4 o_w[]; };
layout(std430, binding = 4) readonly buffer BDOW { uvec4 do_w[]; };
#define DOT2(wa, wb) s += half_of_word(TA, wa, 0u) * half_of_word(TA, wb, 0u); \
                     s += half_of_word(TA, wa, 1u) * half_of_word(TA, wb, 1u);
#endif

// row_dsum_scalar's sums in its order.  One thread a row: 16-byte loads cut its 2 x HD scalar
// loads, which touch 32 rows' lines a warp instruction, to 2 x HD / 8 (16-bit) or 2 x HD / 4 (fp32).
float row_dsum(uint r) {
    if (WIDE == 1) {
        uint z = r / p.Tk, t = r - z * p.Tk;
        uint io = orow(z, t), id = dorow(z, t);
        float s = 0.0;
#if TA == T_F32
        for (uint d = 0u; d < uint(HD); d += 4u) {
            vec4 a = do_w[(id + d) >> 2], b = o_w[(io + d) >> 2];
            s += a.x * b.x;
            s += a.y * b.y;
            s += a.z * b.z;
            s += a.w * b.w;
        }
#else
        for (uint d = 0u; d < uint(HD); d += 8u) {
            uvec4 a = do_w[(id + d) >> 3], b = o_w[(io + d) >> 3];
            DOT2(a.x, b.x)
            DOT2(a.y, b.y)
            DOT2(a.z, b.z)
            DOT2(a.w, b.w)
        }
#endif
        return s;
    }
    return row_dsum_scalar(r);
}

#define BKT (2048 / HD)                        // streamed rows per tile: 2 x 8 KiB of fp32 tiles

shared float ta[BKT][HD];
shared float tb[BKT][HD];
shared float tl[BKT];
shared float td[BKT];

// Load rows t0 .. t0+BKT-1 (clamped below tlim) of two operands into ta and tb, and with
// stats, L and D of those query rows into tl, td.
void load_tiles(const int a, const int b, uint z, uint t0, uint tlim, bool stats) {
    barrier();  // the previous tile is no longer read
    for (uint e = gl_LocalInvocationID.x; e < uint(BKT * HD); e += uint(WG)) {
        uint j = e / uint(HD), d = e - j * uint(HD);
        uint t = min(t0 + j, tlim - 1u);
        uint ra = a == BUF_K ? krow(z, t) : qrow(z, t);
        uint rb = b == BUF_V ? vrow(z, t) : dorow(z, t);
        ta[j][d] = ld1(a, ra + d);
        tb[j][d] = ld1(b, rb + d);
    }
    if (stats) {
        for (uint j = gl_LocalInvocationID.x; j < uint(BKT); j += uint(WG)) {
            uint t = min(t0 + j, tlim - 1u);
            tl[j] = lse[z * p.Tq + t] * LOG2E;
            td[j] = dsum[z * p.Tq + t];
        }
    }
    barrier();
}

void forward_pass() {
    uint z = gl_WorkGroupID.z;
    uint r0 = gl_WorkGroupID.y * uint(WG);
    uint r = r0 + gl_LocalInvocationID.x, rc = min(r, p.Tq - 1u);
    float c = p.scale * LOG2E;
    float qr[HD], acc[HD];
    uint xs = qrow(z, rc);
    for (int d = 0; d < HD; ++d) { qr[d] = ld1(BUF_Q, xs + uint(d)) * c; acc[d] = 0.0; }
    float m = NEG_INF, l = 0.0;
    uint lim = causal_on() ? min(p.Tk, rc + 1u) : p.Tk;
    uint kend = causal_on() ? min(p.Tk, min(r0 + uint(WG), p.Tq)) : p.Tk;  // the same for the whole workgroup
    for (uint k0 = next_k(r0, 0u, kend); k0 < kend; k0 = next_k(r0, k0 + uint(BKT), kend)) {
        load_tiles(BUF_K, BUF_V, z, k0, p.Tk, false);
        float sv[BKT];
        float mx = m;
        for (int j = 0; j < BKT; ++j) {
            float s = 0.0;
            for (int d = 0; d < HD; ++d) s += qr[d] * ta[j][d];
            sv[j] = k0 + uint(j) < lim ? s : NEG_INF;
            mx = max(mx, sv[j]);
        }
        float alpha = m == mx ? 1.0 : exp2(m - mx);
        m = mx;
        l *= alpha;
        for (int d = 0; d < HD; ++d) acc[d] *= alpha;
        for (int j = 0; j < BKT; ++j) {
            float pj = sv[j] == NEG_INF ? 0.0 : exp2(sv[j] - m);
            l += pj;
            for (int d = 0; d < HD; ++d) acc[d] += pj * tb[j][d];
        }
    }
    if (r < p.Tq) {
        uint ob = orow(z, r);
        for (int d = 0; d < HD; ++d) o[ob + uint(d)] = HL_STF(TA, acc[d] / l);
        lse[z * p.Tq + r] = (m + log2(l)) * LN2;
    }
}

void dq_pass() {
    uint z = gl_WorkGroupID.z;
    uint r0 = gl_WorkGroupID.y * uint(WG);
    uint r = r0 + gl_LocalInvocationID.x, rc = min(r, p.Tq - 1u);
    float c = p.scale * LOG2E;
    float qr[HD], gr[HD], acc[HD];
    uint xq = qrow(z, rc), xd = dorow(z, rc);
    for (int d = 0; d < HD; ++d) {
        qr[d] = ld1(BUF_Q, xq + uint(d)) * c;
        gr[d] = ld1(BUF_DO, xd + uint(d));
        acc[d] = 0.0;
    }
    float li = lse[z * p.Tq + rc] * LOG2E, di;
    if (d_here()) {  // row_dsum_at's sum, from the dO row loaded above
        uint io = orow(z, rc);
        di = 0.0;
        for (int d = 0; d < HD; ++d) di += gr[d] * ld1(BUF_O, io + uint(d));
        if (r < p.Tq) dsum[z * p.Tq + r] = di;
    } else {
        di = dsum[z * p.Tq + rc];
    }
    uint lim = causal_on() ? min(p.Tk, rc + 1u) : p.Tk;
    uint kend = causal_on() ? min(p.Tk, min(r0 + uint(WG), p.Tq)) : p.Tk;
    for (uint k0 = next_k(r0, 0u, kend); k0 < kend; k0 = next_k(r0, k0 + uint(BKT), kend)) {
        load_tiles(BUF_K, BUF_V, z, k0, p.Tk, false);
        for (int j = 0; j < BKT; ++j) {
            float s = 0.0, dp = 0.0;
            for (int d = 0; d < HD; ++d) { s += qr[d] * ta[j][d]; dp += gr[d] * tb[j][d]; }
            float pj = k0 + uint(j) < lim ? exp2(s - li) : 0.0;
            float ds = pj * (dp - di);
            for (int d = 0; d < HD; ++d) acc[d] += ds * ta[j][d];
        }
    }
    if (r < p.Tq) {
        uint ob = grow(p.off_g0, z, r);
        for (int d = 0; d < HD; ++d) dq[ob + uint(d)] = HL_STF(TA, acc[d] * p.scale);
    }
}

void dkv_pass() {
    uint z0 = group_z(gl_WorkGroupID.z);
    uint n0 = gl_WorkGroupID.y * uint(WG);
    uint n = n0 + gl_LocalInvocationID.x, nc = min(n, p.Tk - 1u);
    float c = p.scale * LOG2E;
    float kr[HD], vr[HD], gk[HD], gv[HD];
    uint xk = krow(z0, nc), xv = vrow(z0, nc);
    for (int d = 0; d < HD; ++d) {
        kr[d] = ld1(BUF_K, xk + uint(d)) * c;
        vr[d] = ld1(BUF_V, xv + uint(d));
        gk[d] = 0.0;
        gv[d] = 0.0;
    }
    uint qstart = causal_on() ? (n0 / uint(BKT)) * uint(BKT) : 0u;
    for (uint z = z0; z < z0 + p.G; ++z)  // the query heads sharing these keys, in order
    for (uint q0 = next_q(n0, qstart, p.Tq); q0 < p.Tq; q0 = next_q(n0, q0 + uint(BKT), p.Tq)) {
        load_tiles(BUF_Q, BUF_DO, z, q0, p.Tq, true);
        for (int j = 0; j < BKT; ++j) {
            uint t = q0 + uint(j);
            float s = 0.0, dp = 0.0;
            for (int d = 0; d < HD; ++d) { s += kr[d] * ta[j][d]; dp += vr[d] * tb[j][d]; }
            float pj = t < p.Tq && (!causal_on() || nc <= t) ? exp2(s - tl[j]) : 0.0;
            float ds = pj * (dp - td[j]);
            for (int d = 0; d < HD; ++d) { gv[d] += pj * tb[j][d]; gk[d] += ds * ta[j][d]; }
        }
    }
    if (n < p.Tk) {
        uint ok = grow(p.off_g0, z0, n), ov = grow(p.off_g1, z0, n);
        for (int d = 0; d < HD; ++d) {
            dk[ok + uint(d)] = HL_STF(TA, gk[d] * p.scale);
            dv[ov + uint(d)] = HL_STF(TA, gv[d]);
        }
    }
}

uint flat_row() {
    return (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * uint(WG) + gl_LocalInvocationID.x;
}
#endif

void main() {
    if (MODE == 0) forward_pass();
    else if (MODE == 2) dq_pass();
    else if (MODE == 3) dkv_pass();
    else {
        // D = rowsum(dO * O), one flat row of the BH * Tq rows (this pass's Tq) each
        uint r = flat_row();
        if (r >= p.Tq) return;
        float s = row_dsum(r);
        if ((p.flags & 2u) != 0u) s -= lse[r];  // dL, bound where L is in the other passes
        dsum[r] = s;
    }
}
