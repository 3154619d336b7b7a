#version 450
// LayerNorm over contiguous rows of length C.
// MODE 0 forward:  y = (x - mean) * rstd * w + b; also writes mean and rstd (float) per row.
// MODE 1 backward: dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)), gw = g * w.
//   With HAS_BIAS (helios.fusion "layer_norm_bwd+acc") binding 2 holds a pending gradient P
//   (contiguous rows from off_b) and dx = round(dx) + P: the separate add of the tape's
//   gradient accumulation, in the store.
// MODE 2 parameter grads: one invocation per column c sums over the rows in order:
//   o[off_dw + c] = dw[c] = sum_r g[r, c] * xhat[r, c] (PARAM_W),  o[off_db + c] = db[c] =
//   sum_r g[r, c] (PARAM_B), one pass instead of xhat, a product and two column reductions.
//   off_dw / off_db place dw and db anywhere in binding 3: the rows of one [2, C] buffer, or the
//   two parameters' slots of a flat gradient buffer.  (PARAM_W / PARAM_B, not AFFINE / HAS_BIAS,
//   say which: MODE 3 needs both pairs, as a weight may be used without its gradient.)
//   With PARTIALS (GPUs, long columns: helios._kernels.core.column_chunks) the rows are cut in
//   runs of p.chunk: workgroup q * ceil(C / WG) + b sums run q of columns b * WG.. and stores the
//   float partials part[q * 2C + c] (dw) and part[q * 2C + C + c] (db) to binding 8; MODE 4 then
//   adds each column's partials in order and stores dw and db as MODE 2 does.  Without it
//   p.chunk = rows: one run, the sums of one pass.
// MODE 3 (helios.fusion "layer_norm_bwd+params"): MODE 1 and MODE 2 in one dispatch.  row_wgs
//   workgroups run MODE 1's code (an invocation a row with ROW_PER_THREAD, else a workgroup a
//   row), writing dx to binding 3; the runs * ceil(C / WG) others run MODE 2's, an invocation a
//   column of a run, writing dw / db to binding 7 (dx's binding cannot hold them: they may go
//   into a gradient buffer), or with PARTIALS their partials to binding 8 for MODE 4.  Both parts
//   only read x, g, mean, rstd (and w, the pending gradient) and write disjoint outputs, and a
//   column's sums run over the same rows in the same order whatever WG is, so the results are
//   those of the two dispatches bit for bit.  With ROW_PER_THREAD (CPU devices) the column
//   workgroups are spread evenly among the row workgroups, not put last: a column workgroup sums
//   all the rows, several row workgroups' work, and llvmpipe hands each thread a contiguous run
//   of workgroup ids, so the last thread would get them all.  A workgroup takes one side as a
//   whole; llvmpipe still runs both sides with lanes masked, so all of each side's work is in its
//   loops, which end at once with no lane active.  Otherwise (GPUs) the column workgroups, the
//   longer ones, come first.
// RMS (F.rms_norm, MODES 0, 1, 3): RMSNorm, LayerNorm without the mean: the forward takes mean = 0
//   (y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps); mean_ is stored as 0, so MODE 2's
//   xhat = (x - mean) * rstd is RMSNorm's) and the backward drops the mean(gw) term:
//   dx = rstd * (gw - xhat * mean(gw * xhat)).
// TL (variants like f32_bf16: helios.fused_kernels "layer_norm+cast", "cast+layer_norm_bwd"): a
//   16-bit type for a float32 LayerNorm whose result only autocast products read.  MODE 0 stores y
//   rounded to TL (what the products' load, or a cast kernel, would round it to); the backward modes
//   read a TL gradient g (those products' input gradient, which a cast's backward would widen
//   exactly; on CPU drivers through an rgba32ui view).  x, w, b, mean, rstd, dx and the
//   parameter gradients stay float32, and the arithmetic is the float32 variant's, so the values
//   are the same bit for bit.
// gw is `precise`: fused into a later fma(g, w, -mean(gw)) its rounding error would survive
// where gw - mean(gw) is exactly 0 (one column), which a GPU's true fma shows and lavapipe's
// mul + add hides.
#include "common.glsl"
#ifndef TL
#define TL TA
#endif
layout(local_size_x_id = 2) in;
layout(constant_id = 0) const int MODE = 0;
layout(constant_id = 1) const bool AFFINE = true;
layout(constant_id = 2) const int WG = 256;
layout(constant_id = 3) const bool HAS_BIAS = true;
// Short rows: one invocation owns a whole row (no shared memory, no barriers: cheap on CPUs).
layout(constant_id = 4) const bool ROW_PER_THREAD = false;
// MODE 2 / 3: which parameter gradients to compute.
layout(constant_id = 5) const bool PARAM_W = true;
layout(constant_id = 6) const bool PARAM_B = true;
// MODE 2: write each run's float partial sums to binding 8 (MODE 4 adds them up).
layout(constant_id = 7) const bool PARTIALS = false;
layout(constant_id = 8) const bool RMS = false;

#ifdef ROW_TEXEL
// fp32 on CPU drivers (variant f32_tx): x and g are read through rgba32f texel views, one
// gather for the 8 lanes' rows (or columns) instead of a loop over the lanes per load.
layout(binding = 0) uniform samplerBuffer tx;
layout(binding = 1) uniform samplerBuffer tw;
layout(binding = 2) uniform samplerBuffer tb;
#define LDX(i) texelFetch(tx, int((i) >> 2))[(i) & 3u]
#define LDW(i) texelFetch(tw, int((i) >> 2))[(i) & 3u]
#define LDB(i) texelFetch(tb, int((i) >> 2))[(i) & 3u]
#if TL == TA
layout(binding = 6) uniform samplerBuffer tg;
#define LDG(i) texelFetch(tg, int((i) >> 2))[(i) & 3u]
#define LDG4(t) texelFetch(tg, int(t))
#else
// a 16-bit g through an rgba32ui view (8 values a texel, two a word): one gather for 8 lanes too
layout(binding = 6) uniform usamplerBuffer tg;
#define LDG(i) half_of_word(TL, texelFetch(tg, int((i) >> 3))[((i) >> 1) & 3u], (i) & 1u)
vec4 LDG4(uint t) {  // elements 4t .. 4t + 3 of g: half of texel t / 2
    uvec4 q = texelFetch(tg, int(t >> 1));
    uvec2 w = (t & 1u) == 0u ? q.xy : q.zw;
    return vec4(half_of_word(TL, w.x, 0u), half_of_word(TL, w.x, 1u), half_of_word(TL, w.y, 0u), half_of_word(TL, w.y, 1u));
}
#endif
#else
layout(std430, binding = 0) readonly buffer BX { HL_ST(TA) x[]; };
layout(std430, binding = 1) readonly buffer BW { HL_ST(TA) w[]; };
layout(std430, binding = 2) readonly buffer BB { HL_ST(TA) b[]; };
#define LDX(i) HL_LDF(TA, x[i])
#define LDW(i) HL_LDF(TA, w[i])
#define LDB(i) HL_LDF(TA, b[i])
#endif
#ifndef ROW_TEXEL
layout(std430, binding = 6) readonly buffer BG { HL_ST(TL) g[]; };
#define LDG(i) HL_LDF(TL, g[i])
#endif
layout(std430, binding = 3) buffer BO { HL_ST(TA) o[]; };
// MODE 0's y: in TL (the same binding as dx)
#if TL == TA
#define STY(i, v) o[i] = HL_STF(TA, v)
#else
layout(std430, binding = 3) writeonly buffer BOL { HL_ST(TL) ol[]; };
#define STY(i, v) ol[i] = HL_STF(TL, v)
#endif
layout(std430, binding = 4) buffer BM { float mean_[]; };
layout(std430, binding = 5) buffer BR { float rstd_[]; };
layout(std430, binding = 7) writeonly buffer BD { HL_ST(TA) dp[]; };  // MODE 3: dw, db
layout(std430, binding = 8) buffer BP { float part[]; };  // MODE 2 with PARTIALS, MODE 4
// off_w / off_b: w's and b's (MODE 1: the pending gradient's) offsets; off_dw / off_db (MODE 2, 3):
// where dw and db go in the parameter-gradient output; row_wgs (MODE 3): the row part's workgroups;
// chunk (MODE 2, 4): the rows of one run.
layout(push_constant) uniform P {
    uint C; uint rows; uint off_x; uint off_g; float eps; uint off_w; uint off_b;
    uint off_dw; uint off_db; uint row_wgs; uint chunk;
} p;

#include "rowblock.glsl"

// v rounded to the storage type (what a store then a load would give).
float ln_round(float v) {
#if TA == T_F32
    return v;
#elif TA == T_F16
    return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x;
#else
    return bf16_to_f(f_to_bf16(v));
#endif
}

#ifdef ROW_TEXEL
layout(std430, binding = 3) buffer BO4 { vec4 o4[]; };
// MODE 0's y as 4 elements of texel t
#if TL == TA
#define STY4(t, y) o4[t] = (y)
#else
#define STY4(t, y) { STY(4u * (t), (y).x); STY(4u * (t) + 1u, (y).y); STY(4u * (t) + 2u, (y).z); STY(4u * (t) + 3u, (y).w); }
#endif
// row_serial on whole texels: C and every offset a multiple of 4, so each texel fetch (and
// each vec4 store) is 4 elements of the row; the elements are added in the same order and
// each computed as in row_serial, so the results are the same bit for bit.
void row_serial4(uint row) {
    uint C4 = p.C >> 2, bx = (p.off_x >> 2) + row * C4, bo = row * C4;
    uint bw = p.off_w >> 2, bb = p.off_b >> 2;
    float invC = 1.0 / float(p.C);
    if (MODE == 0) {
        float s = 0.0;
        if (!RMS)
            for (uint k = 0u; k < C4; ++k) { vec4 xv = texelFetch(tx, int(bx + k)); s += xv.x; s += xv.y; s += xv.z; s += xv.w; }
        float mu = RMS ? 0.0 : s * invC;
        float v = 0.0;
        for (uint k = 0u; k < C4; ++k) {
            vec4 d = texelFetch(tx, int(bx + k)) - mu;
            v += d.x * d.x; v += d.y * d.y; v += d.z * d.z; v += d.w * d.w;
        }
        float rs = inversesqrt(v * invC + p.eps);
        for (uint k = 0u; k < C4; ++k) {
            vec4 y = (texelFetch(tx, int(bx + k)) - mu) * rs;
            if (AFFINE) y *= texelFetch(tw, int(bw + k));
            if (HAS_BIAS) y += texelFetch(tb, int(bb + k));
            STY4(bo + k, y);
        }
        mean_[row] = mu; rstd_[row] = rs;
    } else {
        uint bg = (p.off_g >> 2) + row * C4;
        float mu = mean_[row], rs = rstd_[row];
        float s1 = 0.0, s2 = 0.0;
        for (uint k = 0u; k < C4; ++k) {
            precise vec4 gw = LDG4(bg + k) * (AFFINE ? texelFetch(tw, int(bw + k)) : vec4(1.0));
            vec4 xh = (texelFetch(tx, int(bx + k)) - mu) * rs;
            s1 += gw.x; s2 += gw.x * xh.x; s1 += gw.y; s2 += gw.y * xh.y;
            s1 += gw.z; s2 += gw.z * xh.z; s1 += gw.w; s2 += gw.w * xh.w;
        }
        s1 = RMS ? 0.0 : s1 * invC; s2 *= invC;
        for (uint k = 0u; k < C4; ++k) {
            precise vec4 gw = LDG4(bg + k) * (AFFINE ? texelFetch(tw, int(bw + k)) : vec4(1.0));
            vec4 xh = (texelFetch(tx, int(bx + k)) - mu) * rs;
            precise vec4 d = rs * (gw - s1 - xh * s2);
            if (HAS_BIAS) d = d + texelFetch(tb, int(bb + bo + k));  // + the pending gradient (fp32: no rounding)
            o4[bo + k] = d;
        }
    }
}
#endif

void row_serial(uint row) {
#ifdef ROW_TEXEL
    if (((p.C | p.off_x | p.off_g | p.off_w | p.off_b) & 3u) == 0u) {
        row_serial4(row);
        return;
    }
#endif
    uint bx = p.off_x + row * p.C, bo = row * p.C;
    float invC = 1.0 / float(p.C);
    if (MODE == 0) {
        float s = 0.0;
        if (!RMS)
            for (uint k = 0u; k < p.C; ++k) s += LDX(bx + k);
        float mu = RMS ? 0.0 : s * invC;
        float v = 0.0;
        for (uint k = 0u; k < p.C; ++k) { float d = LDX(bx + k) - mu; v += d * d; }
        float rs = inversesqrt(v * invC + p.eps);
        for (uint k = 0u; k < p.C; ++k) {
            float y = (LDX(bx + k) - mu) * rs;
            if (AFFINE) y *= LDW(p.off_w + k);
            if (HAS_BIAS) y += LDB(p.off_b + k);
            STY(bo + k, y);
        }
        mean_[row] = mu; rstd_[row] = rs;
    } else {
        uint bg = p.off_g + row * p.C;
        float mu = mean_[row], rs = rstd_[row];
        float s1 = 0.0, s2 = 0.0;
        for (uint k = 0u; k < p.C; ++k) {
            precise float gw = LDG(bg + k) * (AFFINE ? LDW(p.off_w + k) : 1.0);
            float xh = (LDX(bx + k) - mu) * rs;
            s1 += gw; s2 += gw * xh;
        }
        s1 = RMS ? 0.0 : s1 * invC; s2 *= invC;
        for (uint k = 0u; k < p.C; ++k) {
            precise float gw = LDG(bg + k) * (AFFINE ? LDW(p.off_w + k) : 1.0);
            float xh = (LDX(bx + k) - mu) * rs;
            precise float d = rs * (gw - s1 - xh * s2);
            if (HAS_BIAS) d = ln_round(d) + LDB(p.off_b + bo + k);  // + the pending gradient
            o[bo + k] = HL_STF(TA, d);
        }
    }
}

// A parameter gradient's store: binding 3 in MODE 2, binding 7 in MODE 3.
void store_param(uint i, float v) {
    if (MODE == 3) dp[i] = HL_STF(TA, v);
    else o[i] = HL_STF(TA, v);
}

// Column c's sums over rows [r0, r1): to the parameter gradients, or as run q's partials.
void column_grads(uint c, uint r0, uint r1, uint q) {
    float sw = 0.0, sb = 0.0;
    uint bx = p.off_x + c, bg = p.off_g + c;
    for (uint r = r0; r < r1; ++r) {
        float gv = LDG(bg + r * p.C);
        if (PARAM_W) sw += gv * ((LDX(bx + r * p.C) - mean_[r]) * rstd_[r]);
        if (PARAM_B) sb += gv;
    }
    if (PARTIALS) {
        if (PARAM_W) part[q * 2u * p.C + c] = sw;
        if (PARAM_B) part[q * 2u * p.C + p.C + c] = sb;
        return;
    }
    if (PARAM_W) store_param(p.off_dw + c, sw);
    if (PARAM_B) store_param(p.off_db + c, sb);
}

// MODE 4: column c's partials of every run, added in run order.
void sum_partials(uint c) {
    float sw = 0.0, sb = 0.0;
    uint runs = (p.rows + p.chunk - 1u) / p.chunk;
    for (uint q = 0u; q < runs; ++q) {
        if (PARAM_W) sw += part[q * 2u * p.C + c];
        if (PARAM_B) sb += part[q * 2u * p.C + p.C + c];
    }
    if (PARAM_W) store_param(p.off_dw + c, sw);
    if (PARAM_B) store_param(p.off_db + c, sb);
}

// Row `row` by the whole workgroup (MODE 0, or the backward of MODE 1 and 3), summed through shared memory.
void row_block(uint row) {
    if (row >= p.rows) return;
    uint tid = gl_LocalInvocationID.x;
    uint bx = p.off_x + row * p.C, bo = row * p.C;
    float invC = 1.0 / float(p.C);
    if (MODE == 0) {
        float mu = 0.0;
        if (!RMS) {
            float s = 0.0;
            for (uint k = tid; k < p.C; k += uint(WG)) s += LDX(bx + k);
            mu = block_sum(s) * invC;
        }
        float v = 0.0;
        for (uint k = tid; k < p.C; k += uint(WG)) { float d = LDX(bx + k) - mu; v += d * d; }
        float rs = inversesqrt(block_sum(v) * invC + p.eps);
        for (uint k = tid; k < p.C; k += uint(WG)) {
            float y = (LDX(bx + k) - mu) * rs;
            if (AFFINE) y *= LDW(p.off_w + k);
            if (HAS_BIAS) y += LDB(p.off_b + k);
            STY(bo + k, y);
        }
        if (tid == 0u) { mean_[row] = mu; rstd_[row] = rs; }
    } else {
        uint bg = p.off_g + row * p.C;
        float mu = mean_[row], rs = rstd_[row];
        float s1 = 0.0, s2 = 0.0;
        for (uint k = tid; k < p.C; k += uint(WG)) {
            precise float gw = LDG(bg + k) * (AFFINE ? LDW(p.off_w + k) : 1.0);
            float xh = (LDX(bx + k) - mu) * rs;
            s1 += gw; s2 += gw * xh;
        }
        s1 = RMS ? 0.0 : block_sum(s1) * invC;
        s2 = block_sum(s2) * invC;
        for (uint k = tid; k < p.C; k += uint(WG)) {
            precise float gw = LDG(bg + k) * (AFFINE ? LDW(p.off_w + k) : 1.0);
            float xh = (LDX(bx + k) - mu) * rs;
            precise float d = rs * (gw - s1 - xh * s2);
            if (HAS_BIAS) d = ln_round(d) + LDB(p.off_b + bo + k);  // + the pending gradient
            o[bo + k] = HL_STF(TA, d);
        }
    }
}

// MODE 3: workgroup wg's side, rows (MODE 1's code) or a run of columns (MODE 2's).
void rows_and_columns() {
    // the flat workgroup index, as flat_invocation forms it (helios._kernels.core.groups_for)
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint blocks = (p.C + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;
    uint ncol = blocks * ((p.rows + p.chunk - 1u) / p.chunk), n = p.row_wgs + ncol;
    if (wg >= n) return;  // the padding of a 2-D grid
    bool column;
    uint cw, rw;  // the workgroup's index among the column ones, or among the row ones
    if (ROW_PER_THREAD) {
        // Workgroup wg is a column one where floor(wg * ncol / n) steps up at wg + 1; that floor
        // counts the column workgroups below wg, so it numbers the columns' and the rows' in order.
        // (wg * ncol stays below 2^32: one run of ncol <= 64 for the rows of length <= 4096 this runs on.)
        cw = wg * ncol / n;
        column = (wg + 1u) * ncol / n > cw;
        rw = wg - cw;
    } else {
        column = wg < ncol;
        cw = wg;
        rw = wg - ncol;
    }
    if (column) {
        uint q = cw / blocks, c = (cw - q * blocks) * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
        uint r0 = q * p.chunk;
        if (c < p.C && r0 < p.rows) column_grads(c, r0, min(r0 + p.chunk, p.rows), q);
    } else if (ROW_PER_THREAD) {
        uint r = rw * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
        if (r < p.rows) row_serial(r);
    } else {
        row_block(rw);
    }
}

void main() {
    if (MODE == 2) {
        uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
        uint ncol = (p.C + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;
        uint q = wg / ncol, c = (wg - q * ncol) * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
        uint r0 = q * p.chunk;
        if (c < p.C && r0 < p.rows) column_grads(c, r0, min(r0 + p.chunk, p.rows), q);
        return;
    }
    if (MODE == 4) {
        uint c = flat_invocation();
        if (c < p.C) sum_partials(c);
        return;
    }
    if (MODE == 3) {
        rows_and_columns();
        return;
    }
    if (ROW_PER_THREAD) {
        uint r = flat_invocation();
        if (r < p.rows) row_serial(r);
        return;
    }
    row_block(gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x);
}
