#version 450
// Gather along one dim (torch.gather): for each element i of the index tensor (shape
// `shape`, strides si), pos(i) = off_x + sum over d != dim of coord_d * sx[d]
//                                + wrap(idx[i]) * sx[dim],
// wrap(v) = v + dimsize for negative v, clamped into [0, dimsize) for memory safety (the
// caller validates indices it can see).
// MODE 0: o[i] = x[pos(i)]               (o contiguous in the index's shape)
// MODE 1: o[i] = pos(i) as int64         (the destination of a scatter; TA is int64)
#define NEED_I64
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int MODE = 0;

layout(std430, binding = 0) readonly buffer BX { HL_ST(TA) x[]; };
layout(std430, binding = 1) readonly buffer BI { int64_t idx[]; };
layout(std430, binding = 2) writeonly buffer BO { HL_ST(TA) o[]; };
layout(push_constant) uniform P {
    uint n; uint ndim; uint dim; uint off_x; uint off_i; uint dimsize;
    int shape[6]; int sx[6]; int si[6];
} p;

void main() {
    uint i = flat_invocation();
    if (i >= p.n) return;
    uint px = p.off_x, pi = p.off_i, rem = i;
    for (int d = int(p.ndim) - 1; d >= 0; --d) {
        uint q = rem / uint(p.shape[d]);
        uint c = rem - q * uint(p.shape[d]);
        if (uint(d) != p.dim) px += c * uint(p.sx[d]);
        pi += c * uint(p.si[d]);
        rem = q;
    }
    int64_t v = idx[pi];
    if (v < 0) v += int64_t(p.dimsize);
    v = clamp(v, int64_t(0), int64_t(p.dimsize) - 1);
    px += uint(v) * uint(p.sx[p.dim]);
#if TA == T_I64
    if (MODE == 1) { o[i] = int64_t(px); return; }
#endif
    o[i] = x[px];
}
