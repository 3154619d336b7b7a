// Shared by every Helios kernel: storage types by dtype tag, conversions, indexing.
//
// A kernel variant picks the storage type of each operand slot with -DTA=..., -DTB=...,
// -DTC=..., -DTO=... set to one of the tags below; arithmetic happens in the compute
// type CT (float for float slots).  16-bit floats are only *stored* as 16 bits
// (GL_EXT_shader_16bit_storage), so devices without 16-bit arithmetic run them too.
#ifndef HELIOS_COMMON_GLSL
#define HELIOS_COMMON_GLSL

#define T_F32 1
#define T_F16 2
#define T_BF16 3
#define T_I32 4
#define T_I64 5
#define T_U8 6

#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#if defined(NEED_I64) || TA == T_I64 || TB == T_I64 || TC == T_I64 || TO == T_I64
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#endif

// bfloat16 travels as uint16 bits; 16-bit values may only live in buffers, so these
// work on 32-bit uints and the load/store macros convert at the buffer access.
float bf16_to_f(uint v) { return uintBitsToFloat(v << 16); }

uint f_to_bf16(float f) {
    if (isnan(f)) return 0x7FC0u;
    uint u = floatBitsToUint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    return u >> 16;
}

// bfloat16 8 at a time: a uvec4 view of a bf16 buffer holds elements 8j..8j+7 in word k's low
// (element 2k) and high (2k + 1) halves; the conversions are bf16_to_f / f_to_bf16, as one at a time.
// (One 16-byte access a lane: one load on CPU drivers instead of 8, a 16-byte access on GPUs.)
float bf16_lo(uint w) { return uintBitsToFloat(w << 16); }
float bf16_hi(uint w) { return uintBitsToFloat(w & 0xFFFF0000u); }
uint bf16_pair(float lo, float hi) { return f_to_bf16(lo) | (f_to_bf16(hi) << 16); }
// Half h (0: low, 1: high) of a word holding two 16-bit values of type t (T_F16 or T_BF16), as
// float: an element of a 16-bit texel view (the CPU-driver matmul and flash kernels' scalar loads).
float half_of_word(int t, uint w, uint h) {
    if (t == T_F16) return unpackHalf2x16(w >> (16u * h)).x;
    return h == 0u ? bf16_lo(w) : bf16_hi(w);
}

// Storage type and load/store for slot X = A, B, C, O.
#define HL_ST_1 float
#define HL_ST_2 float16_t
#define HL_ST_3 uint16_t
#define HL_ST_4 int
#define HL_ST_5 int64_t
#define HL_ST_6 uint8_t
#define HL_ST2(t) HL_ST_##t
#define HL_ST(t) HL_ST2(t)

// Load into float / store from float, per tag.
#define HL_LDF_1(v) (v)
#define HL_LDF_2(v) float(v)
#define HL_LDF_3(v) bf16_to_f(uint(v))
#define HL_LDF_4(v) float(v)
#define HL_LDF_5(v) float(v)
#define HL_LDF_6(v) float(uint(v))
#define HL_STF_1(v) (v)
#define HL_STF_2(v) float16_t(v)
#define HL_STF_3(v) uint16_t(f_to_bf16(v))
#define HL_STF_4(v) int(v)
#define HL_STF_5(v) int64_t(v)
#define HL_STF_6(v) uint8_t(uint((v) != 0.0))
#define HL_LDF2(t, v) HL_LDF_##t(v)
#define HL_LDF(t, v) HL_LDF2(t, v)
#define HL_STF2(t, v) HL_STF_##t(v)
#define HL_STF(t, v) HL_STF2(t, v)

// 1-D index of this invocation over a 2-D grid of workgroups (x is capped at 65535).
// A macro, not a function: gl_WorkGroupSize is only known after the kernel's own
// local_size layout, which comes after this include.
#define flat_invocation() ((gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * gl_WorkGroupSize.x + gl_LocalInvocationID.x)

// gelu's tanh approximation and exact form; erf by Abramowitz-Stegun 7.1.26 (|err| < 1.5e-7).
const float SQRT_2_OVER_PI = 0.7978845608028654;
const float INV_SQRT2 = 0.7071067811865476;
float erf_approx(float x) {
    float s = sign(x);
    x = abs(x);
    float t = 1.0 / (1.0 + 0.3275911 * x);
    float y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-x * x);
    return s * y;
}
float tanh_safe(float x) {
    // tanh(x) = 1 - 2/(exp(2x)+1); stable for large |x| (exp overflow gives 1).
    float e = exp(-2.0 * abs(x));
    return sign(x) * (1.0 - e) / (1.0 + e);
}
float gelu_tanh(float x) { return 0.5 * x * (1.0 + tanh_safe(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))); }
float gelu_erf(float x) { return 0.5 * x * (1.0 + erf_approx(x * INV_SQRT2)); }
float gelu_tanh_grad(float x) {
    float u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    float t = tanh_safe(u);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
}
float gelu_erf_grad(float x) {
    return 0.5 * (1.0 + erf_approx(x * INV_SQRT2)) + x * 0.3989422804014327 * exp(-0.5 * x * x);
}
float sigmoid_f(float x) { return x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)); }

// x ** y with the C library's (and PyTorch's) special cases.  GLSL's pow is undefined for
// x < 0 and for x == 0 with y <= 0, so the sign, zeros, infinities and NaN are settled here
// and pow only ever sees a finite positive base: a finite negative base with a non-integer
// exponent is NaN, an odd integer exponent keeps the base's sign (-0 and -inf included),
// y == 0 and x == 1 give 1 even against NaN.
// ax ** y for a finite ax > 0 as 2 ** (y * log2 ax), with the exponent split into an integer
// (exact, by ldexp) and a fraction in [-0.5, 0.5]: GLSL's exp2 may be off by 3 + 2|t| ulp, so
// the plain pow(2, 100) was 1e-5 wrong on an NVIDIA GPU, while exp2 of the fraction is within
// 4 ulp.  Beyond the float range the result is inf or 0 outright (ldexp would be undefined).
float pow_pos(float ax, float y) {
    float t = y * log2(ax);
    if (t >= 128.0) return uintBitsToFloat(0x7F800000u);
    if (t < -150.0) return 0.0;
    float n = floor(t + 0.5);
    int half_n = int(n) / 2;  // two steps, so neither scale leaves the float range
    return ldexp(ldexp(exp2(t - n), half_n), int(n) - half_n);
}

float pow_c(float x, float y) {
    const float INF = uintBitsToFloat(0x7F800000u);
    if (y == 0.0 || x == 1.0) return 1.0;
    if (isnan(x) || isnan(y)) return uintBitsToFloat(0x7FC00000u);
    if (y == 1.0) return x;
    if (y == 2.0) return x * x;
    float ax = abs(x);
    if (isinf(y)) {
        if (ax == 1.0) return 1.0;
        return ((ax < 1.0) == (y > 0.0)) ? 0.0 : INF;
    }
    bool neg = (floatBitsToUint(x) & 0x80000000u) != 0u;
    bool y_int = floor(y) == y;
    bool y_odd = y_int && abs(y) < 16777216.0 && mod(abs(y), 2.0) == 1.0;
    float r;
    if (ax == 0.0) r = y > 0.0 ? 0.0 : INF;
    else if (isinf(ax)) r = y > 0.0 ? INF : 0.0;
    else if (neg && !y_int) return uintBitsToFloat(0x7FC00000u);
    else r = pow_pos(ax, y);
    return (neg && y_odd) ? -r : r;
}

// x ** p for a scalar exponent, as PyTorch computes it: exponents 0.5, -0.5, -1, -2, 2 and 3
// by sqrt, 1/sqrt, 1/x, 1/(x*x), x*x and x*x*x (so sqrt(-inf) is NaN, not pow's +inf, and
// x ** 3 rounds like x*x*x), any other by pow_c.
float pow_scalar(float x, float p) {
    const float NAN = uintBitsToFloat(0x7FC00000u);
    if (p == 0.5) return x < 0.0 ? NAN : sqrt(x);
    if (p == -0.5) return x < 0.0 ? NAN : 1.0 / sqrt(x);
    if (p == -1.0) return 1.0 / x;
    if (p == -2.0) return 1.0 / (x * x);
    if (p == 3.0) return x * x * x;
    return pow_c(x, p);
}

// floor(a / b) as PyTorch's div(rounding_mode="floor") gives it for floats (Python's //):
// the rounded quotient's floor, corrected to the exact floor by the signs of a - q*b and
// a - (q+1)*b (each one fma, so exact in sign); an infinite a is NaN, a finite a over an
// infinite b of the other sign is -1.
float div_floor_f(float a, float b) {
    if (b == 0.0) return a / b;
    if (isnan(a) || isnan(b) || isinf(a)) return uintBitsToFloat(0x7FC00000u);
    if (isinf(b)) return (a != 0.0 && ((a < 0.0) != (b < 0.0))) ? -1.0 : a / b;
    float q = floor(a / b);
    if (abs(q) < 8388608.0) {
        float s = b > 0.0 ? 1.0 : -1.0;
        precise float r0 = fma(-q, b, a);
        precise float r1 = fma(-(q + 1.0), b, a);
        if (s * r0 < 0.0) q -= 1.0;
        else if (s * r1 >= 0.0) q += 1.0;
    }
    return q == 0.0 ? (a / b) * 0.0 : q;
}

#endif
