#version 450
// out[i] = f(a[idx_a(i)], b[idx_b(i)]) with broadcasting through strides (0 = broadcast),
// up to 6-D, contiguous output.  OP (specialization constant 0) selects f (its code in the op
// table, kernels_spirv/ew_ops.py).  With COMPARE the output is bool (u8) and OP selects the
// comparison.
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

#if defined(COMPARE)
#define EW_COMPARE
#elif TA == T_U8
#define EW_BINARY_BOOL
#elif TA == T_I32 || TA == T_I64
#define EW_BINARY_INT
#else
#define EW_BINARY_FLOAT
#endif
// the op switch (fop / iop / bop / cop), generated from the op table kernels_spirv/ew_ops.py
#include "ew_ops.gen.glsl"

// VEC 4 (f32, CONTIG only): each invocation does 4 consecutive elements with vec4 loads and
// a vec4 store (binary() checks n and the offsets are multiples of 4); the op runs per
// component, so results are the same as the scalar path.
layout(constant_id = 2) const int VEC = 1;
// B_ONE (with CONTIG): b is one element at off_b, seen by every element (an in-place scale of
// a flat buffer by a device scalar, as the gradient clip does); with VEC 4 too.
layout(constant_id = 3) const bool B_ONE = false;
#if TA == T_F32 && TO == T_F32 && !defined(COMPARE)
layout(std430, binding = 0) readonly buffer BA4 { vec4 a4[]; };
layout(std430, binding = 1) readonly buffer BB4 { vec4 b4[]; };
layout(std430, binding = 2) writeonly buffer BO4 { vec4 o4[]; };
#endif
// VEC 8 (bf16, CONTIG only): 8 consecutive elements an invocation through uvec4 views (common.glsl's
// bf16_lo / bf16_hi / bf16_pair); binary() checks n and the offsets are multiples of 8.
#if TA == T_BF16 && TO == T_BF16 && !defined(COMPARE)
layout(std430, binding = 0) readonly buffer BA8 { uvec4 a8[]; };
layout(std430, binding = 1) readonly buffer BB8 { uvec4 b8[]; };
layout(std430, binding = 2) writeonly buffer BO8 { uvec4 o8[]; };
#endif

void main() {
#if TA == T_F32 && TO == T_F32 && !defined(COMPARE)
    if (VEC == 4) {
        uint j = flat_invocation() * 4u;
        if (j >= p.n) return;
        vec4 x4 = a4[(p.off_a + j) >> 2], y4 = B_ONE ? vec4(b[p.off_b]) : b4[(p.off_b + j) >> 2];
        o4[(p.off_o + j) >> 2] = vec4(fop(x4.x, y4.x), fop(x4.y, y4.y), fop(x4.z, y4.z), fop(x4.w, y4.w));
        return;
    }
#endif
#if TA == T_BF16 && TO == T_BF16 && !defined(COMPARE)
    if (VEC == 8) {
        uint j = flat_invocation() * 8u;
        if (j >= p.n) return;
        uvec4 x8 = a8[(p.off_a + j) >> 3];
        uvec4 y8 = B_ONE ? uvec4((uint(b[p.off_b]) << 16) | uint(b[p.off_b])) : b8[(p.off_b + j) >> 3];
        uvec4 r8;
        for (int k = 0; k < 4; ++k)
            r8[k] = bf16_pair(fop(bf16_lo(x8[k]), bf16_lo(y8[k])), fop(bf16_hi(x8[k]), bf16_hi(y8[k])));
        o8[(p.off_o + j) >> 3] = r8;
        return;
    }
#endif
    uint i = flat_invocation();
    if (i >= p.n) return;
    uint ia = p.off_a, ib = p.off_b;
    if (CONTIG) {
        ia += i; ib += B_ONE ? 0u : i;
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
    o[p.off_o + i] = uint8_t(cop(x, y) ? 1u : 0u);
#elif TA == T_U8
    o[p.off_o + i] = uint8_t(bop(x, y));
#elif TA == T_I32 || TA == T_I64
    o[p.off_o + i] = HL_ST(TO)(iop(x, y));
#else
    o[p.off_o + i] = HL_STF(TO, fop(x, y));
#endif
}
