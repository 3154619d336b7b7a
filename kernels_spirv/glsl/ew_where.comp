#version 450
// out[i] = cond[idx_c(i)] != 0 ? a[idx_a(i)] : b[idx_b(i)], broadcasting through strides.
#include "common.glsl"
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer BC { uint8_t c[]; };
layout(std430, binding = 1) readonly buffer BA { HL_ST(TA) a[]; };
layout(std430, binding = 2) readonly buffer BB { HL_ST(TA) b[]; };
layout(std430, binding = 3) writeonly buffer BO { HL_ST(TA) o[]; };
layout(push_constant) uniform P {
    uint n; uint ndim; uint off_c; uint off_a; uint off_b; uint off_o;
    int shape[6]; int sc[6]; int sa[6]; int sb[6];
} p;

void main() {
    uint i = flat_invocation();
    if (i >= p.n) return;
    uint ic = p.off_c, ia = p.off_a, ib = p.off_b;
    uint rem = i;
    for (int d = int(p.ndim) - 1; d >= 0; --d) {
        uint q = rem / uint(p.shape[d]);
        uint k = rem - q * uint(p.shape[d]);
        ic += k * uint(p.sc[d]);
        ia += k * uint(p.sa[d]);
        ib += k * uint(p.sb[d]);
        rem = q;
    }
    o[p.off_o + i] = uint(c[ic]) != 0u ? a[ia] : b[ib];
}
