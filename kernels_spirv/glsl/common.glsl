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

#endif
