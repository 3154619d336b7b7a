#version 450
// out[i] = f(a[idx_a(i)], b[idx_b(i)]) with broadcasting through strides (0 = broadcast),
// up to 6-D, contiguous output.  OP (specialization constant 0) selects f.  With
// COMPARE the output is bool (u8) and OP selects the comparison.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;
layout(constant_id = 1) const bool CONTIG = false;  // a and b contiguous with the output's shape

layout(std430, binding = 0) readonly buffer BA { HL_ST(TA) a[]; };
layout(std430, binding = 1) readonly buffer BB { HL_ST(TA) b[]; };
layout(std430, binding = 2) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P {
    uint n; uint ndim; uint off_a; uint off_b;
    uint off_o; float alpha; uint pad0; uint pad1;
    int shape[6]; int sa[6]; int sb[6];
} p;

#if TA == T_I32
#define CT int
#define LD(v) int(v)
#elif TA == T_I64
#define CT int64_t
#define LD(v) int64_t(v)
#elif TA == T_U8
#define CT uint
#define LD(v) uint(v)
#else
#define CT float
#define LD(v) HL_LDF(TA, v)
#endif

#if !defined(COMPARE) && TA != T_I32 && TA != T_I64 && TA != T_U8
float fop(float x, float y) {
    float r = x;
    if (OP == 0) r = x + p.alpha * y;
    else if (OP == 1) r = x - p.alpha * y;
    else if (OP == 2) r = x * y;
    else if (OP == 3) r = x / y;
    else if (OP == 4) r = pow_c(x, y);
    else if (OP == 5) r = (x != x || y != y) ? x + y : max(x, y);   // NaN propagates, as in torch.maximum
    else if (OP == 6) r = (x != x || y != y) ? x + y : min(x, y);
    else if (OP == 7) r = y * gelu_tanh_grad(x);       // (x, grad) -> grad * gelu'(x)
    else if (OP == 8) r = y * gelu_erf_grad(x);
    else if (OP == 9) r = y * x * (1.0 - x);           // (sigmoid output, grad)
    else if (OP == 10) r = y * (1.0 - x * x);          // (tanh output, grad)
    else if (OP == 11) r = x > 0.0 ? y : 0.0;          // (relu input, grad)
    else if (OP == 15) r = trunc(x / y);               // div(rounding_mode="trunc")
    else if (OP == 16) r = div_floor_f(x, y);          // div(rounding_mode="floor")
    return r;
}
#endif

// VEC 4 (f32, CONTIG only): each invocation does 4 consecutive elements with vec4 loads and
// a vec4 store (binary() checks n and the offsets are multiples of 4); the op runs per
// component, so results are the same as the scalar path.
layout(constant_id = 2) const int VEC = 1;
#if TA == T_F32 && TO == T_F32 && !defined(COMPARE)
layout(std430, binding = 0) readonly buffer BA4 { vec4 a4[]; };
layout(std430, binding = 1) readonly buffer BB4 { vec4 b4[]; };
layout(std430, binding = 2) writeonly buffer BO4 { vec4 o4[]; };
#endif

void main() {
#if TA == T_F32 && TO == T_F32 && !defined(COMPARE)
    if (VEC == 4) {
        uint j = flat_invocation() * 4u;
        if (j >= p.n) return;
        vec4 x4 = a4[(p.off_a + j) >> 2], y4 = b4[(p.off_b + j) >> 2];
        o4[(p.off_o + j) >> 2] = vec4(fop(x4.x, y4.x), fop(x4.y, y4.y), fop(x4.z, y4.z), fop(x4.w, y4.w));
        return;
    }
#endif
    uint i = flat_invocation();
    if (i >= p.n) return;
    uint ia = p.off_a, ib = p.off_b;
    if (CONTIG) {
        ia += i; ib += i;
    } else {
        uint rem = i;
        for (int d = int(p.ndim) - 1; d >= 0; --d) {
            uint q = rem / uint(p.shape[d]);
            uint c = rem - q * uint(p.shape[d]);
            ia += c * uint(p.sa[d]);
            ib += c * uint(p.sb[d]);
            rem = q;
        }
    }
    CT x = LD(a[ia]);
    CT y = LD(b[ib]);
#ifdef COMPARE
    bool r = false;
    if (OP == 0) r = x == y;
    else if (OP == 1) r = x != y;
    else if (OP == 2) r = x < y;
    else if (OP == 3) r = x <= y;
    else if (OP == 4) r = x > y;
    else if (OP == 5) r = x >= y;
    o[p.off_o + i] = uint8_t(r ? 1u : 0u);
#elif TA == T_U8
    uint r = 0u;
    if (OP == 12 || OP == 2) r = x & y;        // and (mul of bools)
    else if (OP == 13 || OP == 0) r = x | y;   // or (add of bools)
    else if (OP == 14 || OP == 1) r = x ^ y;   // xor
    else if (OP == 5) r = max(x, y);
    else if (OP == 6) r = min(x, y);
    o[p.off_o + i] = uint8_t(r);
#elif TA == T_I32 || TA == T_I64
    CT r = x;
    if (OP == 0) r = x + y;
    else if (OP == 1) r = x - y;
    else if (OP == 2) r = x * y;
    else if (OP == 3 || OP == 15) r = (y == CT(0)) ? CT(0) : x / y;  // truncating (SPIR-V SDiv)
    else if (OP == 16) {                                               // floor division
        r = (y == CT(0)) ? CT(0) : x / y;
        if (y != CT(0) && x - r * y != CT(0) && ((x < CT(0)) != (y < CT(0)))) r -= CT(1);
    }
    else if (OP == 4) {
        // integer power by squaring; a negative exponent gives 1 for base 1, +-1 for base -1,
        // else 0 (what PyTorch computes)
        r = CT(1);
        if (y < CT(0)) {
            r = (x == CT(1)) ? CT(1) : (x == CT(-1)) ? (((y & CT(1)) != CT(0)) ? CT(-1) : CT(1)) : CT(0);
        } else {
            CT base = x, e = y;
            while (e > CT(0)) {
                if ((e & CT(1)) != CT(0)) r *= base;
                base *= base;
                e >>= CT(1);
            }
        }
    }
    else if (OP == 5) r = max(x, y);
    else if (OP == 6) r = min(x, y);
    else if (OP == 12) r = x & y;
    else if (OP == 13) r = x | y;
    else if (OP == 14) r = x ^ y;
    o[p.off_o + i] = HL_ST(TO)(r);
#else
    o[p.off_o + i] = HL_STF(TO, fop(x, y));
#endif
}
