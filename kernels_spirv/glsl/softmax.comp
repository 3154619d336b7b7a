#version 450
// Row-wise softmax family over contiguous rows of length R (row r at off + r*R).
// MODE 0: softmax(x)   MODE 1: log_softmax(x)
// MODE 2: softmax backward  (y, g) -> y * (g - sum(g*y))
// MODE 3: log_softmax backward (y, g) -> g - exp(y) * sum(g)
// One workgroup per row; partial results combine through shared memory.
// Attention: every input is first multiplied by `scale` (forward modes; the backward
// modes multiply their result by it), and with causal_q > 0 row r sees only columns
// k <= r % causal_q (a causal mask over [.., Tq, Tk] scores): the others come out as
// softmax 0 / log_softmax -inf / gradient 0 and are never loaded.  This is the same
// arithmetic as x * scale, then where(mask, ., -inf), then softmax (exp(-inf) adds 0).
// TO (variants like bf16_f32): the output's type where it is not the input's, autocast's casts
// in the kernel (the forward reads 16-bit scores into float32 probabilities, the backward writes
// the float32 gradient rounded to the scores' 16-bit type); the arithmetic is float32 either way.
#include "common.glsl"
#ifndef TO
#define TO TA
#endif
layout(local_size_x_id = 1) in;
layout(constant_id = 0) const int MODE = 0;
layout(constant_id = 1) const int WG = 256;
// Short rows: one invocation owns a whole row (no shared memory, no barriers: cheap on CPUs).
layout(constant_id = 2) const bool ROW_PER_THREAD = false;

#ifdef ROW_TEXEL
// fp32 on CPU drivers (variant f32_tx): x and g are read through rgba32f texel views, one
// gather for the 8 lanes' rows instead of a loop over the lanes per load (same values).
layout(binding = 0) uniform samplerBuffer tx;
layout(binding = 1) uniform samplerBuffer tg;
#define LDX(i) texelFetch(tx, int((i) >> 2))[(i) & 3u]
#define LDG(i) texelFetch(tg, int((i) >> 2))[(i) & 3u]
#else
layout(std430, binding = 0) readonly buffer BX { HL_ST(TA) x[]; };
layout(std430, binding = 1) readonly buffer BG { HL_ST(TA) g[]; };
#define LDX(i) HL_LDF(TA, x[i])
#define LDG(i) HL_LDF(TA, g[i])
#endif
layout(std430, binding = 2) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P { uint R; uint rows; uint off_x; uint off_g; float scale; uint causal_q; } p;

// Columns [0, live_cols(row)) are unmasked.
uint live_cols(uint row) { return p.causal_q == 0u ? p.R : min(p.R, row % p.causal_q + 1u); }
float masked_out() { return MODE == 1 ? -1.0 / 0.0 : 0.0; }

#include "rowblock.glsl"

#if defined(ROW_TEXEL) && TO == T_F32
layout(std430, binding = 2) writeonly buffer BO4 { vec4 o4[]; };
// row_serial on whole texels (R and the offsets multiples of 4): the live columns' whole texels
// a vec4 at a time, then the rest one by one, each value computed as row_serial computes it and
// added in the same order, so the results are the same bit for bit.
void row_serial4(uint row) {
    uint R4 = p.R >> 2, bx4 = (p.off_x >> 2) + row * R4, bg4 = (p.off_g >> 2) + row * R4, bo4 = row * R4;
    uint bx = p.off_x + row * p.R, bg = p.off_g + row * p.R, bo = row * p.R;
    uint L = live_cols(row), L4 = L >> 2;
    if (MODE <= 1) {
        float m = -1.0 / 0.0;
        for (uint k = 0u; k < L4; ++k) {
            vec4 v = texelFetch(tx, int(bx4 + k)) * p.scale;
            m = max(m, v.x); m = max(m, v.y); m = max(m, v.z); m = max(m, v.w);
        }
        for (uint k = 4u * L4; k < L; ++k) m = max(m, LDX(bx + k) * p.scale);
        float s = 0.0;
        for (uint k = 0u; k < L4; ++k) {
            vec4 e = exp(texelFetch(tx, int(bx4 + k)) * p.scale - m);
            s += e.x; s += e.y; s += e.z; s += e.w;
        }
        for (uint k = 4u * L4; k < L; ++k) s += exp(LDX(bx + k) * p.scale - m);
        if (MODE == 0) {
            float inv = 1.0 / s;
            for (uint k = 0u; k < L4; ++k) o4[bo4 + k] = exp(texelFetch(tx, int(bx4 + k)) * p.scale - m) * inv;
            for (uint k = 4u * L4; k < L; ++k) o[bo + k] = HL_STF(TO, exp(LDX(bx + k) * p.scale - m) * inv);
        } else {
            float lse = m + log(s);
            for (uint k = 0u; k < L4; ++k) o4[bo4 + k] = texelFetch(tx, int(bx4 + k)) * p.scale - lse;
            for (uint k = 4u * L4; k < L; ++k) o[bo + k] = HL_STF(TO, LDX(bx + k) * p.scale - lse);
        }
    } else {
        float s = 0.0;
        for (uint k = 0u; k < L4; ++k) {
            vec4 gv = texelFetch(tg, int(bg4 + k));
            vec4 t = (MODE == 2) ? gv * texelFetch(tx, int(bx4 + k)) : gv;
            s += t.x; s += t.y; s += t.z; s += t.w;
        }
        for (uint k = 4u * L4; k < L; ++k) {
            float gv = LDG(bg + k);
            s += (MODE == 2) ? gv * LDX(bx + k) : gv;
        }
        for (uint k = 0u; k < L4; ++k) {
            vec4 y = texelFetch(tx, int(bx4 + k)), gv = texelFetch(tg, int(bg4 + k));
            o4[bo4 + k] = ((MODE == 2) ? y * (gv - s) : gv - exp(y) * s) * p.scale;
        }
        for (uint k = 4u * L4; k < L; ++k) {
            float y = LDX(bx + k), gv = LDG(bg + k);
            o[bo + k] = HL_STF(TO, ((MODE == 2) ? y * (gv - s) : gv - exp(y) * s) * p.scale);
        }
    }
    for (uint k = L; k < p.R; ++k) o[bo + k] = HL_STF(TO, MODE <= 1 ? masked_out() : 0.0);
}
#endif

void row_serial(uint row) {
#if defined(ROW_TEXEL) && TO == T_F32
    if (((p.R | p.off_x | p.off_g) & 3u) == 0u) {
        row_serial4(row);
        return;
    }
#endif
    uint bx = p.off_x + row * p.R, bg = p.off_g + row * p.R, bo = row * p.R;
    uint L = live_cols(row);
    if (MODE <= 1) {
        float m = -1.0 / 0.0;
        for (uint k = 0u; k < L; ++k) m = max(m, LDX(bx + k) * p.scale);
        float s = 0.0;
        for (uint k = 0u; k < L; ++k) s += exp(LDX(bx + k) * p.scale - m);
        if (MODE == 0) {
            float inv = 1.0 / s;
            for (uint k = 0u; k < L; ++k) o[bo + k] = HL_STF(TO, exp(LDX(bx + k) * p.scale - m) * inv);
        } else {
            float lse = m + log(s);
            for (uint k = 0u; k < L; ++k) o[bo + k] = HL_STF(TO, LDX(bx + k) * p.scale - lse);
        }
    } else {
        float s = 0.0;
        for (uint k = 0u; k < L; ++k) {
            float gv = LDG(bg + k);
            s += (MODE == 2) ? gv * LDX(bx + k) : gv;
        }
        for (uint k = 0u; k < L; ++k) {
            float y = LDX(bx + k), gv = LDG(bg + k);
            o[bo + k] = HL_STF(TO, ((MODE == 2) ? y * (gv - s) : gv - exp(y) * s) * p.scale);
        }
    }
    for (uint k = L; k < p.R; ++k) o[bo + k] = HL_STF(TO, MODE <= 1 ? masked_out() : 0.0);
}

void main() {
    if (ROW_PER_THREAD) {
        uint r = flat_invocation();
        if (r < p.rows) row_serial(r);
        return;
    }
    uint row = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (row >= p.rows) return;
    uint tid = gl_LocalInvocationID.x;
    uint bx = p.off_x + row * p.R, bg = p.off_g + row * p.R, bo = row * p.R;
    uint L = live_cols(row);
    if (MODE <= 1) {
        float m = -1.0 / 0.0;
        for (uint k = tid; k < L; k += uint(WG)) m = max(m, LDX(bx + k) * p.scale);
        m = block_max(m);
        float s = 0.0;
        for (uint k = tid; k < L; k += uint(WG)) s += exp(LDX(bx + k) * p.scale - m);
        s = block_sum(s);
        if (MODE == 0) {
            float inv = 1.0 / s;
            for (uint k = tid; k < L; k += uint(WG)) o[bo + k] = HL_STF(TO, exp(LDX(bx + k) * p.scale - m) * inv);
        } else {
            float lse = m + log(s);
            for (uint k = tid; k < L; k += uint(WG)) o[bo + k] = HL_STF(TO, LDX(bx + k) * p.scale - lse);
        }
    } else {
        float s = 0.0;
        for (uint k = tid; k < L; k += uint(WG)) {
            float gv = LDG(bg + k);
            s += (MODE == 2) ? gv * LDX(bx + k) : gv;
        }
        s = block_sum(s);
        for (uint k = tid; k < L; k += uint(WG)) {
            float y = LDX(bx + k), gv = LDG(bg + k);
            o[bo + k] = HL_STF(TO, ((MODE == 2) ? y * (gv - s) : gv - exp(y) * s) * p.scale);
        }
    }
    for (uint k = L + tid; k < p.R; k += uint(WG)) o[bo + k] = HL_STF(TO, MODE <= 1 ? masked_out() : 0.0);
}
