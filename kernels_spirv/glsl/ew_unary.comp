#version 450
// out[i] = f(a[idx(i)]) for a strided (up to 6-D) input and a contiguous output.
// OP (specialization constant 0) selects f; p0, p1 are scalar parameters.
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

#if TA != T_I32 && TA != T_I64
// sin and cos with their own range reduction: GLSL's are only specified on [-pi, pi] (lavapipe's
// lose every digit past |x| ~ 1e8, a GPU's may be far coarser), so x is reduced to r in
// [-pi/4, pi/4] and a quadrant q by Payne-Hanek against the bits of 2/pi (integer arithmetic,
// exact: no reliance on a fused fma, which drivers may split) and r goes through Cephes'
// sinf/cosf polynomials (about 2 ulp over the whole float range).
const uint TWO_OVER_PI[8] = uint[8](0u, 0xA2F9836Eu, 0x4E441529u, 0xFC2757D1u, 0xF534DDC0u, 0xDB629599u,
                                    0x3C439041u, 0xFE5163ABu);  // a zero word, then 224 bits of 2/pi

float reduce_pio2(float x, out int q) {
    float ax = abs(x);
    float r;
    if (ax <= 0.78539816) {
        r = ax;
        q = 0;
    } else {
        // ax = m * 2^e; ax * 2/pi mod 4 = (m * P) * 2^-94 mod 4, P the 96 bits of 2/pi from
        // weight 2^(1-e) on (earlier bits add multiples of 4, later ones less than 2^-68).
        uint bits = floatBitsToUint(ax);
        int e = int(bits >> 23) - 150;
        uint m = (bits & 0x7FFFFFu) | 0x800000u;
        int p0 = e + 30;
        int wi = p0 >> 5;
        int sh = p0 & 31;
        uint w0 = TWO_OVER_PI[wi], w1 = TWO_OVER_PI[wi + 1], w2 = TWO_OVER_PI[wi + 2];
        if (sh != 0) {
            w0 = (w0 << sh) | (w1 >> (32 - sh));
            w1 = (w1 << sh) | (w2 >> (32 - sh));
            w2 = (w2 << sh) | (TWO_OVER_PI[wi + 3] >> (32 - sh));
        }
        uint h0, l0, h1, l1;
        umulExtended(m, w2, h0, l0);
        umulExtended(m, w1, h1, l1);
        l1 += h0;
        h1 += (l1 < h0) ? 1u : 0u;
        uint l2 = m * w0 + h1;
        q = int(l2 >> 30);
        uint fh = (l2 << 2) | (l1 >> 30);  // the fraction's top 64 of 94 bits
        uint fl = (l1 << 2) | (l0 >> 30);
        bool up = (fh & 0x80000000u) != 0u;  // fraction >= 1/2: r = (f - 1) * pi/2 in the next quadrant
        if (up) {
            fh = ~fh;
            fl = ~fl + 1u;
            if (fl == 0u) fh += 1u;
            q += 1;
        }
        float f = 0.0;
        if (fh != 0u) {
            int lz = 31 - findMSB(fh);
            uint top = lz == 0 ? fh : (fh << lz) | (fl >> (32 - lz));
            f = ldexp(float(top), -32 - lz);
        } else if (fl != 0u) {
            int lz = 31 - findMSB(fl);
            f = ldexp(float(fl << lz), -64 - lz);
        }
        r = fma(f, 1.5707964, f * -4.371139e-08);
        if (up) r = -r;
    }
    if (x < 0.0) {
        r = -r;
        q = -q;
    }
    q &= 3;
    return r;
}

float sin_poly(float r) {
    float s = r * r;
    return fma(r * s, fma(s, fma(s, -1.9515295891e-4, 8.3321608736e-3), -1.6666654611e-1), r);
}

float cos_poly(float r) {
    float s = r * r;
    return fma(s * s, fma(s, fma(s, 2.443315711809948e-5, -1.388731625493765e-3), 4.166664568298827e-2), fma(-0.5, s, 1.0));
}

float sin_c(float x) {
    if (isinf(x) || isnan(x)) return uintBitsToFloat(0x7FC00000u);
    if (x == 0.0) return x;  // keeps -0
    int q;
    float r = reduce_pio2(x, q);
    float v = (q & 1) == 0 ? sin_poly(r) : cos_poly(r);
    return (q & 2) == 0 ? v : -v;
}

float cos_c(float x) {
    if (isinf(x) || isnan(x)) return uintBitsToFloat(0x7FC00000u);
    int q;
    float r = reduce_pio2(x, q);
    float v = (q & 1) == 0 ? cos_poly(r) : sin_poly(r);
    return ((q + 1) & 2) == 0 ? v : -v;
}

float fop(float x) {
    float r = x;
    if (OP == 0) r = -x;
    else if (OP == 1) r = exp(x);
    // log, sqrt and inversesqrt are undefined in GLSL for x < 0 (and log, inversesqrt at 0):
    // the IEEE results are spelled out, so no device returns something else there
    else if (OP == 2) r = x < 0.0 ? uintBitsToFloat(0x7FC00000u) : x == 0.0 ? uintBitsToFloat(0xFF800000u) : log(x);
    else if (OP == 3) r = x < 0.0 ? uintBitsToFloat(0x7FC00000u) : x == 0.0 ? x : sqrt(x);
    else if (OP == 4) r = x < 0.0 ? uintBitsToFloat(0x7FC00000u) : x == 0.0 ? 1.0 / x : inversesqrt(x);
    else if (OP == 5) r = tanh_safe(x);
    else if (OP == 6) r = sigmoid_f(x);
    // NaN stays NaN: GLSL's max may drop it, and a driver may turn the bare select into max
    // (NVIDIA's did: relu(NaN) was 0), so NaN is tested for first
    else if (OP == 7) r = isnan(x) ? x : (x < 0.0 ? 0.0 : x);
    else if (OP == 8) r = gelu_tanh(x);
    else if (OP == 9) r = gelu_erf(x);
    else if (OP == 10) r = abs(x);
    else if (OP == 11) r = x + p.p0;
    else if (OP == 12) r = x * p.p0;
    else if (OP == 13) r = pow_scalar(x, p.p0);
    else if (OP == 14) r = p.p0 - x;
    else if (OP == 15) r = p.p0 / x;
    else if (OP == 16) r = (x != x || p.p0 != p.p0 || p.p1 != p.p1) ? x + p.p0 + p.p1  // NaN in, NaN out
                          : min(max(x, p.p0), p.p1);                                   // lo > hi gives hi, as PyTorch
    else if (OP == 17) r = sin_c(x);
    else if (OP == 18) r = cos_c(x);
    else if (OP == 19) r = x * x;
    else if (OP == 20) r = 1.0 / x;
    else if (OP == 21) r = x * p.p0 + p.p1;
    else if (OP == 22) r = x / p.p0;
    return r;
}
#endif

// VEC 4 (f32 -> f32, contiguous only): 4 aligned elements an invocation through vec4
// views; the op runs per component, so results equal the scalar path.
layout(constant_id = 2) const int VEC = 1;
#if TA == T_F32 && TO == T_F32
layout(std430, binding = 0) readonly buffer BA4 { vec4 a4[]; };
layout(std430, binding = 1) writeonly buffer BO4 { vec4 o4[]; };
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
#if TA == T_I32 || TA == T_I64
    // integer unary ops (neg, abs, add/mul by an integer scalar) stay exact
#if TA == T_I32
    int x = a[ia]; int r = x; int s0 = int(p.p0); int s1 = int(p.p1);
#else
    int64_t x = a[ia]; int64_t r = x; int64_t s0 = int64_t(p.p0); int64_t s1 = int64_t(p.p1);
#endif
    if (OP == 0) r = -x;
    else if (OP == 10) r = abs(x);
    else if (OP == 11) r = x + s0;
    else if (OP == 12) r = x * s0;
    else if (OP == 14) r = s0 - x;
    else if (OP == 16) r = min(max(x, s0), s1);
    o[p.off_o + i] = HL_ST(TO)(r);
#else
    o[p.off_o + i] = HL_STF(TO, fop(HL_LDF(TA, a[ia])));
#endif
}
