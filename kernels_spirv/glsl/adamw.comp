#version 450
// Fused AdamW over a flat range of float32 parameters (one dispatch per parameter group),
// in the operation order of PyTorch's single-tensor AdamW:
//   p *= 1 - lr * wd;  m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
//   p -= step_size * m / (sqrt(v) / sqrt(1 - b2^t) + eps),  step_size = lr / (1 - b1^t)
#include "common.glsl"
layout(local_size_x = 256) in;

layout(std430, binding = 0) buffer BP { float p[]; };
layout(std430, binding = 1) readonly buffer BG { float g[]; };
layout(std430, binding = 2) buffer BM { float m[]; };
layout(std430, binding = 3) buffer BV { float v[]; };
layout(push_constant) uniform P {
    uint n; uint off; uint pad0; uint pad1;
    float lr; float b1; float b2; float eps;
    float wd; float step_size; float bc2_sqrt; float pad2;
} pc;

// VEC 4: each invocation updates 4 consecutive elements with vec4 loads and stores (the
// caller checks n, off and the bindings are multiples of 4 elements).  The arithmetic is the
// scalar path's per component, so the results are the same bit for bit; on CPU drivers a
// buffer access costs about the same whatever its width, so this is ~4x fewer of them.
layout(constant_id = 0) const int VEC = 1;
layout(std430, binding = 0) buffer BP4 { vec4 p4[]; };
layout(std430, binding = 1) readonly buffer BG4 { vec4 g4[]; };
layout(std430, binding = 2) buffer BM4 { vec4 m4[]; };
layout(std430, binding = 3) buffer BV4 { vec4 v4[]; };

void main() {
    if (VEC == 4) {
        uint j = flat_invocation() * 4u;
        if (j >= pc.n) return;
        uint k = (pc.off + j) >> 2;
        vec4 gi = g4[k], m0 = m4[k];
        vec4 pi = p4[k] * (1.0 - pc.lr * pc.wd);
        vec4 mi = m0 + (gi - m0) * (1.0 - pc.b1);
        vec4 vi = v4[k] * pc.b2 + (1.0 - pc.b2) * gi * gi;
        m4[k] = mi;
        v4[k] = vi;
        p4[k] = pi - pc.step_size * (mi / (sqrt(vi) / pc.bc2_sqrt + pc.eps));
        return;
    }
    uint i = flat_invocation();
    if (i >= pc.n) return;
    uint k = pc.off + i;
    float gi = g[k];
    float pi = p[k] * (1.0 - pc.lr * pc.wd);
    float mi = m[k] + (gi - m[k]) * (1.0 - pc.b1);   // lerp, as torch does
    float vi = v[k] * pc.b2 + (1.0 - pc.b2) * gi * gi;
    m[k] = mi;
    v[k] = vi;
    p[k] = pi - pc.step_size * (mi / (sqrt(vi) / pc.bc2_sqrt + pc.eps));
}
