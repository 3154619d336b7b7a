#version 450
// Flash attention's products on cooperative matrices (GL_KHR_cooperative_matrix: tensor cores
// through a GPU's Vulkan driver) for float16 or bfloat16 operands (ELEM, coop_elem.glsl; "16-bit"
// below is the operands' type: fp16 or bf16).  It computes what flash_attn.comp's
// passes 0, 2 and 3 compute (forward; backward dQ; backward dK and dV), with the same bindings,
// push constants, block mask and causal rule, so the host swaps one kernel for the other pass by
// pass; the backward's D = rowsum(dO * O) is flash_attn.comp's pass 1 or, with flags bit 2, this
// pass 2's own (each row's from O and dO in pass 1's order, stored for pass 3).  See the top of
// flash_attn.comp for the operands, the algorithm and the mask.
//
// A workgroup owns WR = 16 * NSG rows of the pass's own operand (query rows in passes 0 and 2,
// key rows in pass 3), 16 a subgroup: one cooperative-matrix height.  Those rows (Q; Q and dO;
// K and V) are staged in shared memory once.  The streamed operand (K and V; Q, dO and their L
// and D) comes through shared memory BT rows at a time.  Every product is a 16 x 16 block of a
// subgroup's result, summed over 16-wide steps of cooperative matrices (16x16x16, 16-bit * 16-bit +
// f32) and stored in the subgroup's fp32 scratch tile (block_product):
//   pass 0:  S = Q K^T  ->  each lane takes whole rows of S: running max, rescale factor alpha,
//            P = exp2(S - max) rounded to 16 bits;  then O's block P V, added by the lanes to their
//            fp32 share of O (O = alpha * O + P V).  Cooperative-matrix accumulators cannot be
//            scaled by row (their element-to-lane mapping is the driver's), so O lives in lanes
//            and each step's P V goes through the scratch tile.
//   pass 2:  S = Q K^T, dP = dO V^T  ->  dS = P * (dP - D), 16-bit;  dQ += dS K.
//   pass 3:  S^T = K Q^T, dP^T = V dO^T  ->  P^T, dS^T, 16-bit;  dV += P^T dO, dK += dS^T Q,
//            over the query tiles of each of the G query heads sharing the K/V head in turn.
// The sums dQ, dK, dV are kept in lanes like O: each row of an output belongs to one subgroup
// and every sum runs in a fixed order, so the backward needs no atomics and reruns are
// bit-identical.  Lane l of a subgroup of SGE lanes holds elements l, l + SGE, ... of each
// row-major 16 x 16 block of its accumulator.  P and dS are rounded to 16 bits before their
// product (the operand type), as FlashAttention does for 16-bit inputs; sums, softmax and
// statistics are fp32.
//
// Tiles skipped whole: key tiles past a workgroup's last query row (causal), query tiles before
// its first key row (causal), and masked block pairs; a subgroup also skips the products of a
// tile none of its rows sees (it still takes part in the workgroup's barriers).  Rows past T are
// clamped to the last row when staged and never stored.
//
// Shared memory (all sizes from the specialization constants; helios/_kernels/coopmat.py's
// flash_shared_bytes says the same): the fixed rows NFIX x [WR][XLD] 16-bit, the streamed tile
// 2 x [BT][XLD] 16-bit, per subgroup NS fp32 scratch tiles [16][BT] and NS 16-bit tiles [16][PLD]
// (P, dS), and the row statistics.  Rows are padded by 8 halves (16 bytes: every
// cooperative-matrix load starts 16-byte aligned, and rows spread over banks).
//
// COOP_EMU (variants f16_emu_d* and bf16_emu_d*, tests only: lavapipe has no cooperative
// matrices) does the three cooperative-matrix operations of block_product with plain code of the
// same meaning, as matmul_coop.comp's COOP_EMU does; everything around them is the same code.
// Its loops over a lane's elements stay rolled (LANE_LOOP, coop_elem.glsl): the same sums in the
// same order, and lavapipe built the fp16 tests' pipelines in 10 s instead of 82 (an empty shader
// cache).  Rolled, the emulation is right only for short sequences: measured right at T = 600
// and wrong at 1,000 (head dim 64), right at 300 and wrong at 500 (head dim 128); past the loop
// limit its sums silently stop short.  The tests stay at T <= 150; the GPU variants have no
// emulated loops.
#ifndef COOP_EMU
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#include "coop_elem.glsl"   // ELEM: the fp16 / bf16 operand element; OUT_T: O, dQ, dK, dV
#ifndef HD
#define HD 64       // head dim: a multiple of 16
#endif
const float LOG2E = 1.4426950408889634;
const float LN2 = 0.6931471805599453;
const float NEG_INF = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer BQ { uvec2 q4[]; };
layout(std430, binding = 1) readonly buffer BK { uvec2 k4[]; };
layout(std430, binding = 2) readonly buffer BV { uvec2 v4[]; };
layout(std430, binding = 4) readonly buffer BDO { uvec2 do4[]; };
layout(std430, binding = 0) readonly buffer BQ8 { uvec4 q8[]; };
layout(std430, binding = 1) readonly buffer BK8 { uvec4 k8[]; };
layout(std430, binding = 2) readonly buffer BV8 { uvec4 v8[]; };
layout(std430, binding = 4) readonly buffer BDO8 { uvec4 do8[]; };
layout(std430, binding = 3) writeonly buffer BO { OUT_T o[]; };
layout(std430, binding = 5) buffer BL { float lse[]; };
layout(std430, binding = 6) readonly buffer BD { float dsum[]; };
// pass 2 with D computed here (flags bit 2): O a value a load, D stored
layout(std430, binding = 3) readonly buffer BOR { OUT_T o_in[]; };
layout(std430, binding = 6) writeonly buffer BDW { float dsum_out[]; };
layout(std430, binding = 7) writeonly buffer BDQ { OUT_T dq[]; };
layout(std430, binding = 8) writeonly buffer BDK { OUT_T dk[]; };
layout(std430, binding = 9) writeonly buffer BDV { OUT_T dv[]; };
// the block mask's aliases (flash_attn.comp: each pass reads it through a binding it leaves unused)
layout(std430, binding = 6) readonly buffer BM6 { uint bm6[]; };
layout(std430, binding = 7) readonly buffer BM7 { uint bm7[]; };
layout(std430, binding = 8) readonly buffer BM8 { uint bm8[]; };
layout(push_constant) uniform P {
    uint Tq; uint Tk; uint H; uint flags;  // bit 0 causal, bit 2 D computed by pass 2, bits 8.. block size
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

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint NT = 128;   // invocations: NSG subgroups
layout(constant_id = 1) const int MODE = 0;    // the pass: 0, 2 or 3 (flash_attn.comp's numbers)
layout(constant_id = 2) const uint BT = 32;    // streamed rows a tile: 16, 32 or 64
layout(constant_id = 3) const uint NSG = 4;    // subgroups, 16 rows each
layout(constant_id = 4) const int WIDE = 0;    // 1: every staged row starts 8-aligned (16-byte loads)

const uint SGE = NT / NSG;                     // lanes a subgroup
const uint WR = 16 * NSG;                      // the workgroup's own rows
const uint PAD = 8;
const uint XLD = HD + PAD, PLD = BT + PAD;
const uint NFIX = MODE == 0 ? 1 : 2;           // fixed operands: Q | Q, dO | K, V
const uint NS = MODE == 0 ? 1 : 2;             // scratch / 16-bit tiles a subgroup: S | S, dP
const uint PER = 256 / SGE;                    // elements of a 16 x 16 block a lane holds
const uint HB = HD / 16;                       // 16-column blocks of the head dim
shared ELEM Fx[NFIX * WR * XLD];               // fixed rows: operand f, row r at (f * WR + r) * XLD
shared ELEM St[2 * BT * XLD];                  // streamed tile: operand s, row r at (s * BT + r) * XLD
shared float Sc[NSG * NS * 16 * BT];           // scratch: subgroup g's tile s at (g * NS + s) * 16 * BT
shared ELEM Pt[NSG * NS * 16 * PLD];           // 16-bit tiles: subgroup g's tile s at (g * NS + s) * 16 * PLD
shared float Rw[NSG * 16 * 3];                 // per own row: pass 0 max, sum, alpha; pass 2 L, D
shared float Tw[2 * BT];                       // pass 3: L and D of the streamed query rows

// Operand ids (compile-time after inlining).
const int BUF_Q = 0;
const int BUF_K = 1;
const int BUF_V = 2;
const int BUF_DO = 4;
// Shared arrays a product reads.
const int SH_FX = 0;
const int SH_ST = 1;
const int SH_PT = 2;

// Rows of the operands by query head z = b * H + h, K/V head h / G (flash_attn.comp's qrow ..
// group_z: pass 3's outputs have K's heads, and its workgroup column is a K/V head).
uint qrow(uint z, uint t) { uint b = z / p.H; return p.off_q + b * p.sqb + (z - b * p.H) * p.sqh + t * p.sqt; }
uint krow(uint z, uint t) { uint b = z / p.H; return p.off_k + b * p.skb + (z - b * p.H) / p.G * p.skh + t * p.skt; }
uint vrow(uint z, uint t) { uint b = z / p.H; return p.off_v + b * p.svb + (z - b * p.H) / p.G * p.svh + t * p.svt; }
uint orow(uint z, uint t) { uint b = z / p.H; return p.off_o + b * p.sob + (z - b * p.H) * p.soh + t * p.sot; }
uint dorow(uint z, uint t) { uint b = z / p.H; return p.off_do + b * p.sdb + (z - b * p.H) * p.sdh + t * p.sdt; }
uint grow(uint off, uint z, uint t) {
    uint b = z / p.H, h = z - b * p.H;
    return off + b * p.sgb + (MODE == 3 ? h / p.G : h) * p.sgh + t * p.sgt;
}
uint group_z(uint zk) { uint hk = p.H / p.G, b = zk / hk; return b * p.H + (zk - b * hk) * p.G; }

uint row_of(const int b, uint z, uint t) {
    if (b == BUF_Q) return qrow(z, t);
    if (b == BUF_K) return krow(z, t);
    if (b == BUF_V) return vrow(z, t);
    return dorow(z, t);
}

bool causal_on() { return (p.flags & 1u) != 0u; }
bool d_here() { return (p.flags & 4u) != 0u; }

// rowsum(dO * O) of a row whose dO is staged in Fx from `at` and whose O starts at element io,
// over the head dim in order (flash_attn.comp's row_dsum_at: the same bits).
float row_dsum_staged(uint at, uint io) {
    float s = 0.0;
    for (uint d = 0u; d < uint(HD); ++d) s += elem_f(Fx[at + d]) * out_f(o_in[io + d]);
    return s;
}

// The block mask (flash_attn.comp's blk_on / next_k / next_q).
bool blk_on(uint qr, uint kr) {
    uint bs = p.flags >> 8;
    if (bs == 0u) return true;
    uint i = (qr / bs) * ((p.Tk + bs - 1u) / bs) + kr / bs;
    if (MODE == 0) return bm6[i] != 0u;
    if (MODE == 2) return bm8[i] != 0u;
    return bm7[i] != 0u;
}

uint next_k(uint qr, uint k0, uint kend) {
    uint bs = p.flags >> 8;
    while (bs != 0u && k0 < kend && !blk_on(qr, k0)) k0 = (k0 / bs + 1u) * bs;
    return min(k0, kend);
}

uint next_q(uint kr, uint q0, uint qend) {
    uint bs = p.flags >> 8;
    while (bs != 0u && q0 < qend && !blk_on(q0, kr)) q0 = (q0 / bs + 1u) * bs;
    return min(q0, qend);
}

void put4(const int arr, uint at, uvec2 w) {
    if (arr == SH_FX) { split2(w.x, Fx[at], Fx[at + 1u]); split2(w.y, Fx[at + 2u], Fx[at + 3u]); }
    else { split2(w.x, St[at], St[at + 1u]); split2(w.y, St[at + 2u], St[at + 3u]); }
}

uvec2 get4(const int b, uint i) {
    if (b == BUF_Q) return q4[i >> 2];
    if (b == BUF_K) return k4[i >> 2];
    if (b == BUF_V) return v4[i >> 2];
    return do4[i >> 2];
}

uvec4 get8(const int b, uint i) {
    if (b == BUF_Q) return q8[i >> 3];
    if (b == BUF_K) return k8[i >> 3];
    if (b == BUF_V) return v8[i >> 3];
    return do8[i >> 3];
}

// Rows t0 .. t0 + n - 1 of operand b (clamped below tlim) into shared array arr from row
// `first` on: 8 halves a load where WIDE, else 4 (row starts are always 4-aligned).
void stage(const int b, const int arr, uint first, uint z, uint t0, uint n, uint tlim) {
    const uint per = WIDE == 1 ? 8u : 4u, runs = uint(HD) / per;
    for (uint id = gl_LocalInvocationID.x; id < n * runs; id += NT) {
        uint r = id / runs, c = (id - r * runs) * per;
        uint src = row_of(b, z, min(t0 + r, tlim - 1u)) + c, at = (first + r) * XLD + c;
        if (WIDE == 1) {
            uvec4 w = get8(b, src);
            put4(arr, at, w.xy);
            put4(arr, at + 4u, w.zw);
        } else {
            put4(arr, at, get4(b, src));
        }
    }
}

// One subgroup's shared-memory writes made visible to its other lanes.
void sg_sync() {
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}

#ifdef COOP_EMU
ELEM sh(const int arr, uint i) {
    if (arr == SH_FX) return Fx[i];
    if (arr == SH_ST) return St[i];
    return Pt[i];
}
#endif

// Sc[dst + r * ldc + c] = sum over steps s < nk of (A_s B_s)[r][c], r, c < 16: A_s the 16 x 16
// row-major block of shared array ar at aoff + 16 s (row stride lda); B_s row-major at
// boff + 16 s * ldb, or with bt the transpose of the row-major block at boff + 16 s (a block of
// K, Q, V or dO rows read as K^T, ...).  One subgroup computes it; on return it is in Sc for
// every lane.
void block_product(const int ar, uint aoff, uint lda, const int br, uint boff, uint ldb, const bool bt, uint nk,
                   uint dst, uint ldc) {
#ifdef COOP_EMU
    // lane l computes elements l, l + SGE, ... of the row-major block, each summed over s and k
    // in order (a cooperative-matrix product's order within a step is the driver's)
    [[dont_unroll]] for (uint e = 0; e < PER; ++e) {
        uint x = gl_SubgroupInvocationID + e * SGE, r = x >> 4, c = x & 15u;
        float v = 0.0;
        [[dont_unroll]] for (uint s = 0; s < nk; ++s)
            [[unroll]] for (uint kk = 0; kk < 16; ++kk) {
                float bv = elem_f(bt ? sh(br, boff + 16u * s + c * ldb + kk) : sh(br, boff + (16u * s + kk) * ldb + c));
                v += elem_f(sh(ar, aoff + 16u * s + r * lda + kk)) * bv;
            }
        Sc[dst + r * ldc + c] = v;
    }
#else
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    for (uint s = 0; s < nk; ++s) {
        coopmat<ELEM, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa;
        coopmat<ELEM, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> fb;
        if (ar == SH_FX) coopMatLoad(fa, Fx, aoff + 16u * s, lda, gl_CooperativeMatrixLayoutRowMajor);
        else coopMatLoad(fa, Pt, aoff + 16u * s, lda, gl_CooperativeMatrixLayoutRowMajor);
        if (bt) coopMatLoad(fb, St, boff + 16u * s, ldb, gl_CooperativeMatrixLayoutColumnMajor);
        else coopMatLoad(fb, St, boff + 16u * s * ldb, ldb, gl_CooperativeMatrixLayoutRowMajor);
        acc = coopMatMulAdd(fa, fb, acc);
    }
    coopMatStore(acc, Sc, dst, ldc, gl_CooperativeMatrixLayoutRowMajor);
#endif
    sg_sync();
}

// The lane's sums: result a's elements of head-dim block j at acc[a * HB + j][e] (O, dQ, or dK
// and dV), a private array of spec-constant size (not a parameter: such array types do not
// match across calls).  Every loop over j and e is unrolled on a GPU (LANE_LOOP), so the sums
// stay in registers.
const uint NACC = MODE == 3 ? 2 : 1;
float acc[NACC * HB][PER];

// Block j of result a = itself * f[row] + Sc's 16 x 16 block at dst (row stride 16), for the
// lane's elements; f from Rw at fsrc (rows), or 1 where fsrc is ~0u.
void add_block(uint a, uint j, uint dst, uint fsrc) {
    LANE_LOOP for (uint e = 0; e < PER; ++e) {
        uint x = gl_SubgroupInvocationID + e * SGE;
        float f = fsrc == ~0u ? 1.0 : Rw[fsrc + (x >> 4)];
        acc[a * HB + j][e] = acc[a * HB + j][e] * f + Sc[dst + x];
    }
    sg_sync();  // the scratch block is overwritten by the next product
}

// The lane's elements of result a (rows from `row`, of an output with T rows) times f (and
// divided by Rw[lsrc + r] where lsrc != ~0u) to output `which` (0 O, 1 dQ, 2 dK, 3 dV).
void store_rows(int which, uint a, uint z, uint row, uint T, float f, uint lsrc) {
    [[unroll]] for (uint j = 0; j < HB; ++j)
        LANE_LOOP for (uint e = 0; e < PER; ++e) {
            uint x = gl_SubgroupInvocationID + e * SGE, r = x >> 4, t = row + r;
            if (t >= T) continue;
            float v = acc[a * HB + j][e] * f / (lsrc == ~0u ? 1.0 : Rw[lsrc + r]);
            uint at = (which == 0 ? orow(z, t) : grow(which == 3 ? p.off_g1 : p.off_g0, z, t)) + j * 16u + (x & 15u);
            if (which == 0) o[at] = f_out(v);
            else if (which == 1) dq[at] = f_out(v);
            else if (which == 2) dk[at] = f_out(v);
            else dv[at] = f_out(v);
        }
}

void zero_acc() {
    [[unroll]] for (uint i = 0; i < NACC * HB; ++i)
        LANE_LOOP for (uint e = 0; e < PER; ++e) acc[i][e] = 0.0;
}

void forward_pass(uint z, uint r0, uint g) {
    const uint lane = gl_SubgroupInvocationID, R0 = r0 + 16u * g;
    const uint sc = g * 16u * BT, pt = g * 16u * PLD, rw = g * 48u;  // this subgroup's tiles and row stats
    float c = p.scale * LOG2E;
    zero_acc();
    for (uint r = lane; r < 16u; r += SGE) { Rw[rw + r] = NEG_INF; Rw[rw + 16u + r] = 0.0; }
    stage(BUF_Q, SH_FX, 0u, z, r0, WR, p.Tq);
    uint kend = causal_on() ? min(p.Tk, min(r0 + WR, p.Tq)) : p.Tk;
    uint mine = causal_on() ? min(p.Tk, R0 + 16u) : p.Tk;   // keys this subgroup's rows see
    for (uint k0 = next_k(r0, 0u, kend); k0 < kend; k0 = next_k(r0, k0 + BT, kend)) {
        barrier();  // the previous tile is no longer read
        stage(BUF_K, SH_ST, 0u, z, k0, BT, p.Tk);
        stage(BUF_V, SH_ST, BT, z, k0, BT, p.Tk);
        barrier();
        if (R0 >= p.Tq || k0 >= mine) continue;  // uniform over the subgroup
        for (uint j = 0; j < BT / 16u; ++j)      // S = Q K^T
            block_product(SH_FX, g * 16u * XLD, XLD, SH_ST, j * 16u * XLD, XLD, true, HB, sc + 16u * j, BT);
        for (uint r = lane; r < 16u; r += SGE) {  // the online softmax, a row a lane
            uint lim = causal_on() ? min(p.Tk, R0 + r + 1u) : p.Tk;
            float m = Rw[rw + r], mx = m;
            for (uint j = 0; j < BT; ++j) {
                float s = k0 + j < lim ? Sc[sc + r * BT + j] * c : NEG_INF;
                Sc[sc + r * BT + j] = s;
                mx = max(mx, s);
            }
            // equal maxima (both -inf: no key seen yet) need no rescale; exp2(-inf - -inf) is NaN
            float alpha = m == mx ? 1.0 : exp2(m - mx), l = Rw[rw + 16u + r] * alpha;
            for (uint j = 0; j < BT; ++j) {
                float s = Sc[sc + r * BT + j], pj = s == NEG_INF ? 0.0 : exp2(s - mx);
                l += pj;
                Pt[pt + r * PLD + j] = to_elem(pj);
            }
            Rw[rw + r] = mx;
            Rw[rw + 16u + r] = l;
            Rw[rw + 32u + r] = alpha;
        }
        sg_sync();
        [[unroll]] for (uint j = 0; j < HB; ++j) {           // O = alpha * O + P V
            block_product(SH_PT, pt, PLD, SH_ST, BT * XLD + 16u * j, XLD, false, BT / 16u, sc, 16u);
            add_block(0u, j, sc, rw + 32u);
        }
    }
    if (R0 >= p.Tq) return;
    store_rows(0, 0u, z, R0, p.Tq, 1.0, rw + 16u);
    for (uint r = lane; r < 16u; r += SGE)
        if (R0 + r < p.Tq) lse[z * p.Tq + R0 + r] = (Rw[rw + r] + log2(Rw[rw + 16u + r])) * LN2;
}

void dq_pass(uint z, uint r0, uint g) {
    const uint lane = gl_SubgroupInvocationID, R0 = r0 + 16u * g;
    const uint sc = g * 2u * 16u * BT, pt = g * 2u * 16u * PLD, rw = g * 48u;
    float c = p.scale * LOG2E;
    zero_acc();
    for (uint r = lane; r < 16u; r += SGE) {
        uint t = min(R0 + r, p.Tq - 1u);
        Rw[rw + r] = lse[z * p.Tq + t] * LOG2E;
        if (!d_here()) Rw[rw + 16u + r] = dsum[z * p.Tq + t];
    }
    stage(BUF_Q, SH_FX, 0u, z, r0, WR, p.Tq);
    stage(BUF_DO, SH_FX, WR, z, r0, WR, p.Tq);
    if (d_here()) {  // D of the subgroup's rows from their staged dO and O
        barrier();
        for (uint r = lane; r < 16u; r += SGE) {
            float d = row_dsum_staged((WR + 16u * g + r) * XLD, orow(z, min(R0 + r, p.Tq - 1u)));
            Rw[rw + 16u + r] = d;
            if (R0 + r < p.Tq) dsum_out[z * p.Tq + R0 + r] = d;
        }
    }
    uint kend = causal_on() ? min(p.Tk, min(r0 + WR, p.Tq)) : p.Tk;
    uint mine = causal_on() ? min(p.Tk, R0 + 16u) : p.Tk;
    for (uint k0 = next_k(r0, 0u, kend); k0 < kend; k0 = next_k(r0, k0 + BT, kend)) {
        barrier();
        stage(BUF_K, SH_ST, 0u, z, k0, BT, p.Tk);
        stage(BUF_V, SH_ST, BT, z, k0, BT, p.Tk);
        barrier();
        if (R0 >= p.Tq || k0 >= mine) continue;
        for (uint j = 0; j < BT / 16u; ++j) {    // S = Q K^T, dP = dO V^T
            block_product(SH_FX, g * 16u * XLD, XLD, SH_ST, j * 16u * XLD, XLD, true, HB, sc + 16u * j, BT);
            block_product(SH_FX, (WR + g * 16u) * XLD, XLD, SH_ST, (BT + j * 16u) * XLD, XLD, true, HB,
                          sc + 16u * BT + 16u * j, BT);
        }
        for (uint x = lane; x < 16u * BT; x += SGE) {  // dS = P * (dP - D)
            uint r = x / BT, j = x - r * BT;
            uint lim = causal_on() ? min(p.Tk, R0 + r + 1u) : p.Tk;
            float pj = k0 + j < lim ? exp2(Sc[sc + x] * c - Rw[rw + r]) : 0.0;
            Pt[pt + r * PLD + j] = to_elem(pj * (Sc[sc + 16u * BT + x] - Rw[rw + 16u + r]));
        }
        sg_sync();
        [[unroll]] for (uint j = 0; j < HB; ++j) {           // dQ += dS K
            block_product(SH_PT, pt, PLD, SH_ST, 16u * j, XLD, false, BT / 16u, sc, 16u);
            add_block(0u, j, sc, ~0u);
        }
    }
    if (R0 < p.Tq) store_rows(1, 0u, z, R0, p.Tq, p.scale, ~0u);
}

void dkv_pass(uint z0, uint n0, uint g) {
    const uint lane = gl_SubgroupInvocationID, N0 = n0 + 16u * g;
    const uint sc = g * 2u * 16u * BT, pt = g * 2u * 16u * PLD;
    float c = p.scale * LOG2E;
    zero_acc();  // result 0 dK, 1 dV
    stage(BUF_K, SH_FX, 0u, z0, n0, WR, p.Tk);
    stage(BUF_V, SH_FX, WR, z0, n0, WR, p.Tk);
    // causal: queries before key n0 see none of this workgroup's keys
    uint qstart = causal_on() ? (n0 / BT) * BT : 0u;
    for (uint z = z0; z < z0 + p.G; ++z)  // the query heads sharing these keys, in order
    for (uint q0 = next_q(n0, qstart, p.Tq); q0 < p.Tq; q0 = next_q(n0, q0 + BT, p.Tq)) {
        barrier();
        stage(BUF_Q, SH_ST, 0u, z, q0, BT, p.Tq);
        stage(BUF_DO, SH_ST, BT, z, q0, BT, p.Tq);
        for (uint j = gl_LocalInvocationID.x; j < BT; j += NT) {
            uint t = min(q0 + j, p.Tq - 1u);
            Tw[j] = lse[z * p.Tq + t] * LOG2E;
            Tw[BT + j] = dsum[z * p.Tq + t];
        }
        barrier();
        // this subgroup's keys are past T, or after every query of the tile (causal)
        if (N0 >= p.Tk || (causal_on() && q0 + BT <= N0)) continue;
        for (uint j = 0; j < BT / 16u; ++j) {    // S^T = K Q^T, dP^T = V dO^T
            block_product(SH_FX, g * 16u * XLD, XLD, SH_ST, j * 16u * XLD, XLD, true, HB, sc + 16u * j, BT);
            block_product(SH_FX, (WR + g * 16u) * XLD, XLD, SH_ST, (BT + j * 16u) * XLD, XLD, true, HB,
                          sc + 16u * BT + 16u * j, BT);
        }
        for (uint x = lane; x < 16u * BT; x += SGE) {  // P^T and dS^T = P^T * (dP^T - D)
            uint i = x / BT, j = x - i * BT, t = q0 + j;
            bool live = t < p.Tq && (!causal_on() || N0 + i <= t);
            float pt_ = live ? exp2(Sc[sc + x] * c - Tw[j]) : 0.0;
            Pt[pt + i * PLD + j] = to_elem(pt_);
            Pt[pt + 16u * PLD + i * PLD + j] = to_elem(pt_ * (Sc[sc + 16u * BT + x] - Tw[BT + j]));
        }
        sg_sync();
        [[unroll]] for (uint j = 0; j < HB; ++j) {           // dV += P^T dO, dK += dS^T Q
            block_product(SH_PT, pt, PLD, SH_ST, (BT * XLD) + 16u * j, XLD, false, BT / 16u, sc, 16u);
            add_block(1u, j, sc, ~0u);
            block_product(SH_PT, pt + 16u * PLD, PLD, SH_ST, 16u * j, XLD, false, BT / 16u, sc, 16u);
            add_block(0u, j, sc, ~0u);
        }
    }
    if (N0 >= p.Tk) return;
    store_rows(2, 0u, z0, N0, p.Tk, p.scale, ~0u);
    store_rows(3, 1u, z0, N0, p.Tk, 1.0, ~0u);
}

void main() {
    uint z = gl_WorkGroupID.z, r0 = gl_WorkGroupID.y * WR, g = gl_SubgroupID;
    if (MODE == 0) forward_pass(z, r0, g);
    else if (MODE == 2) dq_pass(z, r0, g);
    else dkv_pass(group_z(z), r0, g);
}
