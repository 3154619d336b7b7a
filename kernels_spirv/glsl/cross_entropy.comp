#version 450
// Cross entropy over contiguous rows of logits x[N, V] with int64 targets t[N].
// MODE 0 forward:  loss[n] = logsumexp(x[n]) - x[n, t[n]]  (0 where t[n] < 0: ignored);
//                  lse[n] saved for backward.
// MODE 1 backward: dx[n, j] = (exp(x[n, j] - lse[n]) - [j == t[n]]) * gl[n]  (0 for ignored rows),
//                  gl = upstream gradient of loss[n] times the push constant ``scale``
//                  (a mean's 1/n, rounded to float32: the product the separate multiply
//                  stored); with GL_ONE every row reads gl[0] (a mean's one upstream value,
//                  not expanded into N copies first).
#define NEED_I64
#include "common.glsl"
layout(local_size_x_id = 1) in;
layout(constant_id = 0) const int MODE = 0;
layout(constant_id = 1) const int WG = 256;
// Short rows: one invocation owns a whole row (no shared memory, no barriers: cheap on CPUs).
layout(constant_id = 2) const bool ROW_PER_THREAD = false;
layout(constant_id = 3) const bool GL_ONE = false;

layout(std430, binding = 0) readonly buffer BX { HL_ST(TA) x[]; };
layout(std430, binding = 1) readonly buffer BT { int64_t t[]; };
layout(std430, binding = 2) buffer BL { float lse[]; };
layout(std430, binding = 3) writeonly buffer BO { float loss[]; };
layout(std430, binding = 4) readonly buffer BG { float gl[]; };
layout(std430, binding = 5) writeonly buffer BD { HL_ST(TA) dx[]; };
// ld: dx's row stride (V, or V padded to a multiple of 8 so that the products reading dx, the
// LM head's backward, load its rows 16 bytes at a time)
layout(push_constant) uniform P { uint V; uint rows; uint off_x; uint off_t; float scale; uint ld; } p;

#include "rowblock.glsl"

void row_serial(uint row) {
    uint bx = p.off_x + row * p.V;
    int64_t tg = t[p.off_t + row];
    bool valid = tg >= 0 && tg < int64_t(p.V);
    if (MODE == 0) {
        float m = -1.0 / 0.0;
        for (uint k = 0u; k < p.V; ++k) m = max(m, HL_LDF(TA, x[bx + k]));
        float s = 0.0;
        for (uint k = 0u; k < p.V; ++k) s += exp(HL_LDF(TA, x[bx + k]) - m);
        float l = m + log(s);
        lse[row] = l;
        loss[row] = valid ? l - HL_LDF(TA, x[bx + uint(tg)]) : 0.0;
    } else {
        float l = lse[row];
        float gv = valid ? gl[GL_ONE ? 0u : row] * p.scale : 0.0;
        for (uint k = 0u; k < p.V; ++k) {
            float pr = exp(HL_LDF(TA, x[bx + k]) - l);
            float onehot = (valid && int64_t(k) == tg) ? 1.0 : 0.0;
            dx[row * p.ld + k] = HL_STF(TA, (pr - onehot) * gv);
        }
    }
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
    uint bx = p.off_x + row * p.V;
    int64_t tg = t[p.off_t + row];
    if (MODE == 0) {
        float m = -1.0 / 0.0;
        for (uint k = tid; k < p.V; k += uint(WG)) m = max(m, HL_LDF(TA, x[bx + k]));
        m = block_max(m);
        float s = 0.0;
        for (uint k = tid; k < p.V; k += uint(WG)) s += exp(HL_LDF(TA, x[bx + k]) - m);
        s = block_sum(s);
        if (tid == 0u) {
            float l = m + log(s);
            lse[row] = l;
            bool valid = tg >= 0 && tg < int64_t(p.V);
            loss[row] = valid ? l - HL_LDF(TA, x[bx + uint(tg)]) : 0.0;
        }
    } else {
        float l = lse[row];
        bool valid = tg >= 0 && tg < int64_t(p.V);
        float gv = valid ? gl[GL_ONE ? 0u : row] * p.scale : 0.0;
        for (uint k = tid; k < p.V; k += uint(WG)) {
            float pr = exp(HL_LDF(TA, x[bx + k]) - l);
            float onehot = (valid && int64_t(k) == tg) ? 1.0 : 0.0;
            dx[row * p.ld + k] = HL_STF(TA, (pr - onehot) * gv);
        }
    }
}
