#version 450
// Reductions: sum, max, min, argmax, argmin over one axis of a strided view.
//
// MODE 0 (rows): element (r, k) of row r lives at off + r*s_row + k*s_k.  Workgroup w
//   reduces chunk (w % nchunks) of row (w / nchunks) cooperatively (shared-memory tree)
//   and writes out[w].  Several chunks per row spread a long row over many workgroups;
//   the caller reduces the partials with a second pass (HAS_IDX_IN carries arg indices).
// MODE 1 (columns): element (o, k, i) lives at off + o*s_row + k*s_k + i*s_in.  Each
//   invocation owns one output (o, i) and walks k: coalesced when i is the fast axis.  With
//   nchunks > 1 (GPUs: few outputs over long columns would leave most of the device idle) the
//   k axis is cut in nchunks runs of `chunk`: invocation q * n + j (n = rows * inner outputs)
//   walks run q of output j and writes partial q * n + j; the caller reduces the [nchunks, n]
//   partials with a second MODE 1 pass (HAS_IDX_IN carries arg indices), in order: no atomics.
// MODE 2 (short rows on CPU devices): MODE 0 with one chunk a row, but one invocation reduces a
//   whole row, combining TREE partials in registers in exactly the order MODE 0's workgroup of
//   TREE invocations combines them in shared memory: the same bits, without MODE 0's barriers
//   and shared-memory traffic, which llvmpipe runs lane by lane (figures: ROWS_PER_GROUP in
//   helios/_kernels/reductions.py).
// Values accumulate in float for float inputs and in int64 for integer/bool inputs.
// OP 5 (sumsq, floats): a sum of the squared values, each square rounded to float before it
//   is added, as a separate x * x then sum would (helios.fusion "sum_squares").
// CLIP (MODE 0, one row, one chunk; floats): the gradient clip's scalar chain on the sum s,
//   with max_norm in `scale`: o[off_o] = norm = sqrt(s), o[off_o + 1] = coef =
//   clamp(max_norm / (norm + 1e-6), max=1), with ew_unary's sqrt, add_s, rdiv_s and clamp
//   code (helios.optim.clip_grad_norm_; helios.fusion "clip_coef").
#define NEED_I64
#include "common.glsl"
layout(local_size_x_id = 2) in;
layout(constant_id = 0) const int OP = 0;        // 0 sum, 1 max, 2 min, 3 argmax, 4 argmin
layout(constant_id = 1) const int MODE = 0;
layout(constant_id = 2) const int WG = 256;
layout(constant_id = 3) const bool HAS_IDX_IN = false;
layout(constant_id = 4) const bool CLIP = false;
layout(constant_id = 5) const int TREE = 16;     // MODE 2: the width of the tree replayed (MODE 0's WG)

#if TA == T_F32 || TA == T_F16 || TA == T_BF16
#define VT float
#define LD(v) HL_LDF(TA, v)
#define VT_ST float
#define LOWEST (-1.0 / 0.0)
#define HIGHEST (1.0 / 0.0)
#define IS_NAN(v) isnan(v)
#else
#define VT int64_t
#define LD(v) int64_t(v)
#define VT_ST int64_t
#define LOWEST int64_t(0x8000000000000000ul)
#define HIGHEST int64_t(0x7FFFFFFFFFFFFFFFul)
#define IS_NAN(v) false
#endif

layout(std430, binding = 0) readonly buffer BA { HL_ST(TA) a[]; };
layout(std430, binding = 1) readonly buffer BI { int64_t idx_in[]; };
layout(std430, binding = 2) writeonly buffer BO { VT_ST o[]; };
layout(std430, binding = 3) writeonly buffer BX { int64_t idx_out[]; };
layout(push_constant) uniform P {
    uint R; uint rows; uint inner; uint nchunks;
    uint chunk; uint off; uint s_row; uint s_k;
    uint s_in; float scale; uint off_idx; uint off_o;  // off_o: where out[0] lives in binding 2
} p;

shared VT s_val[WG];
shared int64_t s_idx[WG];

// Does candidate (v, i) beat the current best (b, bi)?  NaN wins (as in torch.max);
// ties go to the lower index (first occurrence).
bool better(VT v, int64_t i, VT b, int64_t bi) {
    if (IS_NAN(v)) return !IS_NAN(b) || i < bi;
    if (IS_NAN(b)) return false;
    bool want_max = (OP == 1 || OP == 3);
    if (v == b) return i < bi;
    return want_max ? v > b : v < b;
}

VT init_val() { return (OP == 0 || OP == 5) ? VT(0) : ((OP == 1 || OP == 3) ? LOWEST : HIGHEST); }

// An element as the reduction adds it: squared (and rounded to float) for sumsq.
VT load_val(uint i) {
    precise VT v = LD(a[i]);
    if (OP == 5) v = v * v;
    return v;
}

// Fold candidate (v, vi) into the running (acc, bi) as MODE 0's accumulation and tree do.
void fold(inout VT acc, inout int64_t bi, VT v, int64_t vi) {
    if (OP == 0 || OP == 5) acc += v;
    else if (better(v, vi, acc, bi)) { acc = v; bi = vi; }
}

// MODE 2: row r's reduction, bit for bit MODE 0's with WG = TREE and one chunk.
void reduce_row_in_registers(uint r) {
    uint base = p.off + r * p.s_row;
    VT part[TREE];
    int64_t part_idx[TREE];
    for (uint t = 0u; t < uint(TREE); ++t) {  // invocation t of MODE 0's workgroup
        VT acc = init_val();
        int64_t bi = int64_t(0x7FFFFFFFFFFFFFFFul);
        for (uint k = t; k < p.R; k += uint(TREE)) {
            int64_t ki = HAS_IDX_IN ? idx_in[p.off_idx + r * p.s_row + k * p.s_k] : int64_t(k);
            fold(acc, bi, load_val(base + k * p.s_k), ki);
        }
        part[t] = acc;
        part_idx[t] = bi;
    }
    for (uint s = uint(TREE) / 2u; s > 0u; s >>= 1)
        for (uint t = 0u; t < s; ++t) {
            VT acc = part[t];
            int64_t bi = part_idx[t];
            fold(acc, bi, part[t + s], part_idx[t + s]);
            part[t] = acc;
            part_idx[t] = bi;
        }
    VT v = part[0];
#if TA == T_F32 || TA == T_F16 || TA == T_BF16
    if (OP == 0 || OP == 5) v *= p.scale;
#endif
    o[p.off_o + r] = v;
    if (OP == 3 || OP == 4) idx_out[r] = part_idx[0];
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    if (MODE == 2) {
        uint r = flat_invocation();
        if (r < p.rows) reduce_row_in_registers(r);
        return;
    }
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (MODE == 1) {
        uint gidx = wg * uint(WG) + tid;
        uint n = p.rows * p.inner;
        if (gidx >= n * p.nchunks) return;
        uint q = gidx / n, j = gidx - q * n;
        uint or_ = j / p.inner, ii = j - or_ * p.inner;
        uint rel = or_ * p.s_row + ii * p.s_in;
        uint k0 = q * p.chunk;
        uint k1 = min(k0 + p.chunk, p.R);
        VT acc = init_val();
        int64_t bi = int64_t(0x7FFFFFFFFFFFFFFFul);
        for (uint k = k0; k < k1; ++k) {
            VT v = load_val(p.off + rel + k * p.s_k);
            if (OP == 0 || OP == 5) acc += v;
            else {
                int64_t ki = HAS_IDX_IN ? idx_in[p.off_idx + rel + k * p.s_k] : int64_t(k);
                if (better(v, ki, acc, bi)) { acc = v; bi = ki; }
            }
        }
#if TA == T_F32 || TA == T_F16 || TA == T_BF16
        if (OP == 0 || OP == 5) acc *= p.scale;
#endif
        o[p.off_o + gidx] = acc;
        if (OP == 3 || OP == 4) idx_out[gidx] = bi;
        return;
    }
    if (wg >= p.rows * p.nchunks) return;
    uint r = wg / p.nchunks, c = wg - r * p.nchunks;
    uint k0 = c * p.chunk;
    uint k1 = min(k0 + p.chunk, p.R);
    uint base = p.off + r * p.s_row;
    VT acc = init_val();
    int64_t bi = int64_t(0x7FFFFFFFFFFFFFFFul);
    for (uint k = k0 + tid; k < k1; k += uint(WG)) {
        VT v = load_val(base + k * p.s_k);
        if (OP == 0 || OP == 5) acc += v;
        else {
            int64_t ki = HAS_IDX_IN ? idx_in[p.off_idx + r * p.s_row + k * p.s_k] : int64_t(k);
            if (better(v, ki, acc, bi)) { acc = v; bi = ki; }
        }
    }
    s_val[tid] = acc;
    s_idx[tid] = bi;
    barrier();
    for (uint s = uint(WG) / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            if (OP == 0 || OP == 5) s_val[tid] += s_val[tid + s];
            else if (better(s_val[tid + s], s_idx[tid + s], s_val[tid], s_idx[tid])) {
                s_val[tid] = s_val[tid + s];
                s_idx[tid] = s_idx[tid + s];
            }
        }
        barrier();
    }
    if (tid == 0u) {
        VT v = s_val[0];
#if TA == T_F32 || TA == T_F16 || TA == T_BF16
        if (CLIP) {  // ew_unary's OP 3 (sqrt), 11 (+ p0), 15 (p0 / x) and 16 (clamp), in turn
            precise float norm = v < 0.0 ? uintBitsToFloat(0x7FC00000u) : v == 0.0 ? v : sqrt(v);
            precise float d = norm + 1e-6;
            precise float c = p.scale / d;
            c = (c != c) ? c + LOWEST + 1.0 : min(max(c, LOWEST), 1.0);
            o[p.off_o] = norm;
            o[p.off_o + 1u] = c;
            return;
        }
        if (OP == 0 || OP == 5) v *= p.scale;
#endif
        o[p.off_o + wg] = v;
        if (OP == 3 || OP == 4) idx_out[wg] = s_idx[0];
    }
}
