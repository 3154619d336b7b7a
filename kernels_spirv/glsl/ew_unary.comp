#version 450
// out[i] = f(a[idx(i)]) for a strided (up to 6-D) input and a contiguous output.
// OP (specialization constant 0) selects f (its code in the op table, kernels_spirv/ew_ops.py);
// p0, p1 are scalar parameters.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;
layout(constant_id = 1) const bool CONTIG = false;  // input is contiguous: skip index math

layout(std430, binding = 0) readonly buffer BA { HL_ST(TA) a[]; };
layout(std430, binding = 1) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P {
    uint n; uint ndim; uint off_a; uint off_o;
    float p0; float p1; uint pad0; uint pad1;
    int shape[6]; int sa[6];
} p;

#if TA == T_I32
#define CT int
#define EW_UNARY_INT
#elif TA == T_I64
#define CT int64_t
#define EW_UNARY_INT
#else
#define EW_UNARY_FLOAT
#endif
// the op switch (fop / iop), generated from the op table kernels_spirv/ew_ops.py
#include "ew_ops.gen.glsl"

// VEC 4 (f32 -> f32, contiguous only): 4 aligned elements an invocation through vec4
// views; the op runs per component, so results equal the scalar path.
layout(constant_id = 2) const int VEC = 1;
#if TA == T_F32 && TO == T_F32
layout(std430, binding = 0) readonly buffer BA4 { vec4 a4[]; };
layout(std430, binding = 1) writeonly buffer BO4 { vec4 o4[]; };
#endif
// VEC 8 (bf16 -> bf16, contiguous only): 8 aligned elements an invocation through uvec4 views
// (common.glsl's bf16_lo / bf16_hi / bf16_pair), the op per element as on the scalar path.
#if TA == T_BF16 && TO == T_BF16
layout(std430, binding = 0) readonly buffer BA8 { uvec4 a8[]; };
layout(std430, binding = 1) writeonly buffer BO8 { uvec4 o8[]; };
#endif

void main() {
#if TA == T_F32 && TO == T_F32
    if (VEC == 4) {
        uint j = flat_invocation() * 4u;
        if (j >= p.n) return;
        vec4 x4 = a4[(p.off_a + j) >> 2];
        o4[(p.off_o + j) >> 2] = vec4(fop(x4.x), fop(x4.y), fop(x4.z), fop(x4.w));
        return;
    }
#endif
#if TA == T_BF16 && TO == T_BF16
    if (VEC == 8) {
        uint j = flat_invocation() * 8u;
        if (j >= p.n) return;
        uvec4 x8 = a8[(p.off_a + j) >> 3];
        uvec4 r8;
        for (int k = 0; k < 4; ++k) r8[k] = bf16_pair(fop(bf16_lo(x8[k])), fop(bf16_hi(x8[k])));
        o8[(p.off_o + j) >> 3] = r8;
        return;
    }
#endif
    uint i = flat_invocation();
    if (i >= p.n) return;
    uint ia = p.off_a;
    if (CONTIG) {
        ia += i;
    } else {
        uint rem = i;
        for (int d = int(p.ndim) - 1; d >= 0; --d) {
            uint q = rem / uint(p.shape[d]);
            ia += (rem - q * uint(p.shape[d])) * uint(p.sa[d]);
            rem = q;
        }
    }
#ifdef EW_UNARY_INT
    // integer unary ops (neg, abs, add/mul by an integer scalar...) stay exact
    o[p.off_o + i] = HL_ST(TO)(iop(a[ia]));
#else
    o[p.off_o + i] = HL_STF(TO, fop(HL_LDF(TA, a[ia])));
#endif
}
