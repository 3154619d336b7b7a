#version 450
// arange: out[i] = start + i * step (float variants compute in float, integer ones in int64).
#define NEED_I64
#include "common.glsl"
layout(local_size_x = 256) in;
layout(std430, binding = 0) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P { uint n; float fstart; float fstep; uint pad; int64_t istart; int64_t istep; } p;

void main() {
    uint i = flat_invocation();
    if (i >= p.n) return;
#if TO == T_I32 || TO == T_I64
    o[i] = HL_ST(TO)(p.istart + int64_t(i) * p.istep);
#else
    o[i] = HL_STF(TO, p.fstart + float(i) * p.fstep);
#endif
}
