#version 450
// Strided copy with dtype conversion: o[off_o + idx_o(i)] = convert(a[off_a + idx_a(i)]),
// up to 8-D.  Used for contiguous(), .to(dtype), writes into views (cat, slice assignment).
#include "common.glsl"
layout(local_size_x = 256) in;
// VEC 4 (f32 -> f32 only): each invocation copies 4 consecutive elements as one vec4.
// copy_into() picks it when the innermost dim is contiguous on both sides, a multiple of
// 4 long, and every other stride and both offsets are multiples of 4, so the 4 elements
// are adjacent and 16-byte aligned on both sides.  llvmpipe runs each buffer access as a
// per-lane loop, so 4 values per access and a quarter of the index arithmetic is what
// makes the copy cheaper.
layout(constant_id = 0) const int VEC = 1;

layout(std430, binding = 0) readonly buffer BA { HL_ST(TA) a[]; };
layout(std430, binding = 1) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P {
    uint n; uint ndim; uint off_a; uint off_o;
    int shape[8]; int sa[8]; int so[8];
} p;

#if TA == T_F32 && TO == T_F32
layout(std430, binding = 0) readonly buffer BA4 { vec4 a4[]; };
layout(std430, binding = 1) writeonly buffer BO4 { vec4 o4[]; };
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
#if TA == T_F32 && TO == T_F32
    if (VEC == 4) o4[io >> 2] = a4[ia >> 2];
    else o[io] = a[ia];
#elif TA == TO
    o[io] = a[ia];
#elif (TA == T_I32 || TA == T_I64) && (TO == T_I32 || TO == T_I64)
    o[io] = HL_ST(TO)(a[ia]);
#elif TO == T_U8 && (TA == T_I32 || TA == T_I64)
    o[io] = uint8_t(a[ia] != HL_ST(TA)(0) ? 1u : 0u);
#elif (TO == T_I32 || TO == T_I64) && TA == T_U8
    o[io] = HL_ST(TO)(uint(a[ia]));
#else
    o[io] = HL_STF(TO, HL_LDF(TA, a[ia]));
#endif
}
