#version 450
// Rotary position embedding (RoPE) over the last dim of x [B, H, T, D], rows of the tables
// cos and sin [T', D] (the sign of rotate_half already on sin's first half):
//   forward (ROPE_BWD undefined):  o[b,h,t,d] = x[d] * cos[t,d] + x[(d - D/2) mod D] * sin[t,d]
//   backward (ROPE_BWD):          dx[b,h,t,j] = g[j] * cos[t,j] + g[k] * sin[t,k],  k = (j + D/2) mod D
// which is x * cos + roll(x, D/2, -1) * sin and its gradient as the separate ops compute them
// (helios.functional.rotary): each product rounded to the tables' dtype TO (the promoted one),
// in the backward each term then rounded to x's dtype TX (the promotion's cast) and the sum in
// TX, each product and sum `precise` (no contraction into an fma).  x, g and dx are any strided
// views (strides in elements); the tables have unit column strides.
// TG (default TO) is the output's and its gradient's storage: a 16-bit TG with float32 tables is
// "rotary+cast", the float32 result stored rounded to TG as a cast after it stores it, and its
// gradient read as the float32 values the cast's backward widens it to.
#include "common.glsl"
layout(local_size_x = 256) in;

#ifndef TG
#define TG TO
#endif
#ifdef ROPE_BWD
#define TI TG
#define TR TX
#else
#define TI TX
#define TR TG
#endif
layout(std430, binding = 0) readonly buffer BI { HL_ST(TI) xi[]; };
layout(std430, binding = 1) readonly buffer BC { HL_ST(TO) tc[]; };
layout(std430, binding = 2) readonly buffer BS { HL_ST(TO) ts[]; };
layout(std430, binding = 3) writeonly buffer BR { HL_ST(TR) o[]; };
layout(push_constant) uniform P {
    uint n; uint D; uint H; uint T;
    uint off_i; uint si_b; uint si_h; uint si_t; uint si_d;
    uint off_c; uint off_s; uint s_tab;
    uint off_o; uint so_b; uint so_h; uint so_t; uint so_d;
} p;

// v rounded to tag t's type, as a store then a load would (the separate ops store each result).
float round_to(int t, float v) {
    if (t == T_F16) return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x;
    if (t == T_BF16) return bf16_to_f(f_to_bf16(v));
    return v;
}

void main() {
    uint i = flat_invocation();
    if (i >= p.n) return;
    uint d = i % p.D, r = i / p.D;
    uint t = r % p.T; r /= p.T;
    uint h = r % p.H, b = r / p.H;
    uint ib = p.off_i + b * p.si_b + h * p.si_h + t * p.si_t;
    uint tb = t * p.s_tab;
    uint half_d = p.D / 2u;
#ifdef ROPE_BWD
    uint k = (d + half_d) % p.D;  // the element whose rotated value sat at d
    precise float c1 = round_to(TX, round_to(TO, HL_LDF(TI, xi[ib + d * p.si_d]) * HL_LDF(TO, tc[p.off_c + tb + d])));
    precise float c2 = round_to(TX, round_to(TO, HL_LDF(TI, xi[ib + k * p.si_d]) * HL_LDF(TO, ts[p.off_s + tb + k])));
    precise float v = c1 + c2;
#else
    uint k = (d + p.D - half_d) % p.D;  // roll(x, D/2): position d holds x[d - D/2]
    precise float a = round_to(TO, HL_LDF(TI, xi[ib + d * p.si_d]) * HL_LDF(TO, tc[p.off_c + tb + d]));
    precise float c = round_to(TO, HL_LDF(TI, xi[ib + k * p.si_d]) * HL_LDF(TO, ts[p.off_s + tb + d]));
    precise float v = a + c;
#endif
    o[p.off_o + b * p.so_b + h * p.so_h + t * p.so_t + d * p.so_d] = HL_STF(TR, v);
}
