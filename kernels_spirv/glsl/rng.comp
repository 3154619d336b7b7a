#version 450
// Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11).  Invocation i
// encrypts the counter (i, window, offset_lo, offset_hi) with key (seed_lo, seed_hi) and
// produces outputs 4i..4i+3, so a (seed, offset) pair fixes the stream on any device.
// MODE 0: uniform in [p0, p1)   MODE 1: normal(mean p0, std p1) by Box-Muller
// MODE 2: keep mask (u8) = uniform >= p0   (dropout with drop probability p0)
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int MODE = 0;

layout(std430, binding = 0) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P { uint n; uint seed_lo; uint seed_hi; uint off_lo; uint off_hi; float p0; float p1; uint window; uint off_o; } p;

uvec4 philox(uvec4 ctr, uvec2 key) {
    for (int r = 0; r < 10; ++r) {
        uint hi0, lo0, hi1, lo1;
        umulExtended(0xD2511F53u, ctr.x, hi0, lo0);
        umulExtended(0xCD9E8D57u, ctr.z, hi1, lo1);
        ctr = uvec4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
        key += uvec2(0x9E3779B9u, 0xBB67AE85u);
    }
    return ctr;
}

float to_unit(uint x) { return float(x >> 8) * (1.0 / 16777216.0); }  // [0, 1), 24 bits

void main() {
    uint i = flat_invocation();
    uint base = 4u * i;
    if (base >= p.n) return;
    uvec4 r = philox(uvec4(i, p.window, p.off_lo, p.off_hi), uvec2(p.seed_lo, p.seed_hi));
    float v[4];
    if (MODE == 1) {
        for (int k = 0; k < 4; k += 2) {
            float u1 = (float(r[k] >> 8) + 1.0) * (1.0 / 16777216.0);  // (0, 1]: log is finite
            float u2 = to_unit(r[k + 1]);
            float rad = sqrt(-2.0 * log(u1));
            v[k] = p.p0 + p.p1 * rad * cos(6.283185307179586 * u2);
            v[k + 1] = p.p0 + p.p1 * rad * sin(6.283185307179586 * u2);
        }
    } else {
        for (int k = 0; k < 4; ++k) {
            float u = to_unit(r[k]);
            v[k] = (MODE == 0) ? p.p0 + (p.p1 - p.p0) * u : ((u >= p.p0) ? 1.0 : 0.0);
        }
    }
    for (uint k = 0u; k < 4u && base + k < p.n; ++k) o[p.off_o + base + k] = HL_STF(TO, v[k]);
}
