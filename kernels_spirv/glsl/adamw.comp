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

void main() {
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
