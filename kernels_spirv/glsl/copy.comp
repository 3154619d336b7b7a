#version 450
// Strided copy with dtype conversion: o[off_o + idx_o(i)] = convert(a[off_a + idx_a(i)]),
// up to 8-D.  Used for contiguous(), .to(dtype), writes into views (cat, slice assignment).
#include "common.glsl"
layout(local_size_x = 256) in;
// VEC 4 / 8 (a copy without conversion of a 4- or 2-byte dtype: f32, i32, f16, bf16): each
// invocation moves the 16 bytes of VEC consecutive elements as one uvec4.  copy_into() picks it
// when the innermost dim is contiguous on both sides, a multiple of VEC long, and every other
// stride and both offsets are multiples of VEC, so the elements are adjacent and 16-byte aligned
// on both sides.  llvmpipe runs each buffer access as a per-lane loop, so 16 bytes per access
// and a fraction of the index arithmetic is what makes the copy cheaper; a GPU moves 16 bytes a
// thread.
layout(constant_id = 0) const int VEC = 1;

layout(std430, binding = 0) readonly buffer BA { HL_ST(TA) a[]; };
layout(std430, binding = 1) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P {
    uint n; uint ndim; uint off_a; uint off_o;
    int shape[8]; int sa[8]; int so[8];
} p;

#define WIDE_COPY (TA == TO && TA != T_I64 && TA != T_U8)
#if WIDE_COPY
layout(std430, binding = 0) readonly buffer BA16 { uvec4 a16[]; };
layout(std430, binding = 1) writeonly buffer BO16 { uvec4 o16[]; };
#endif
// VEC 8 between float32 and bfloat16 (autocast's casts): 8 elements an invocation, two vec4s on
// the float32 side and one uvec4 on the bfloat16 side (common.glsl's bf16_lo / bf16_hi /
// bf16_pair), each element converted as one at a time; the same alignment rules with 8.
#if TA == T_F32 && TO == T_BF16
layout(std430, binding = 0) readonly buffer BAF { vec4 af4[]; };
layout(std430, binding = 1) writeonly buffer BOB { uvec4 ob8[]; };
#elif TA == T_BF16 && TO == T_F32
layout(std430, binding = 0) readonly buffer BAB { uvec4 ab8[]; };
layout(std430, binding = 1) writeonly buffer BOF { vec4 of4[]; };
#endif

void main() {
    uint i = flat_invocation() * uint(VEC);
    if (i >= p.n) return;
    uint ia = p.off_a, io = p.off_o;
    uint rem = i;
    for (int d = int(p.ndim) - 1; d >= 0; --d) {
        uint q = rem / uint(p.shape[d]);
        uint k = rem - q * uint(p.shape[d]);
        ia += k * uint(p.sa[d]);
        io += k * uint(p.so[d]);
        rem = q;
    }
#if WIDE_COPY
    if (VEC > 1) o16[io / uint(VEC)] = a16[ia / uint(VEC)];
    else o[io] = a[ia];
#elif TA == TO
    o[io] = a[ia];
#elif (TA == T_I32 || TA == T_I64) && (TO == T_I32 || TO == T_I64)
    o[io] = HL_ST(TO)(a[ia]);
#elif TO == T_U8 && (TA == T_I32 || TA == T_I64)
    o[io] = uint8_t(a[ia] != HL_ST(TA)(0) ? 1u : 0u);
#elif (TO == T_I32 || TO == T_I64) && TA == T_U8
    o[io] = HL_ST(TO)(uint(a[ia]));
#elif TA == T_F32 && TO == T_BF16
    if (VEC == 8) {
        vec4 lo = af4[ia >> 2], hi = af4[(ia >> 2) + 1u];
        ob8[io >> 3] = uvec4(bf16_pair(lo.x, lo.y), bf16_pair(lo.z, lo.w), bf16_pair(hi.x, hi.y), bf16_pair(hi.z, hi.w));
    } else {
        o[io] = HL_STF(TO, HL_LDF(TA, a[ia]));
    }
#elif TA == T_BF16 && TO == T_F32
    if (VEC == 8) {
        uvec4 w = ab8[ia >> 3];
        of4[io >> 2] = vec4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
        of4[(io >> 2) + 1u] = vec4(bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w));
    } else {
        o[io] = HL_STF(TO, HL_LDF(TA, a[ia]));
    }
#else
    o[io] = HL_STF(TO, HL_LDF(TA, a[ia]));
#endif
}
