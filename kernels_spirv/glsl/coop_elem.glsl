// The 16-bit operand element of the cooperative-matrix kernels (matmul_coop.comp, flash_coop.comp),
// fp16 (TA=2) or bf16 (TA=3), as it sits in shared memory and in cooperative matrices:
//   ELEM           its GLSL type;  ELEM_ZERO its zero
//   elem_f(x)      its value as float
//   to_elem(v)     float v rounded to it (bf16: common.glsl's f_to_bf16, round to nearest even)
//   split2(w, ...) the two ELEMs a 32-bit word holds (low half first); pack2(lo, hi) the word
// fp16 is float16_t.  bf16 is written as float16_t too, with F16_AS_BF16: the compiler here has
// no bfloat16 type, so kernels_spirv/bf16_retype.py declares the module's 16-bit float type
// bfloat16 after compiling (SPV_KHR_bfloat16).  Such a kernel only moves, bitcasts and converts
// ELEM values and feeds them to cooperative matrices: nothing else is allowed on bf16, and a
// 16-bit float constant other than zero would change its value (bf16_retype refuses both).
// Emulated bf16 (COOP_EMU: lavapipe has no bfloat16 type) keeps the bits in uint16_t.
// Results, biases and epilogue operands in buffers are TA's storage type: OUT_T, read with
// out_f(x) and written with f_out(v) (common.glsl's conversions), so every variant stores what
// the other kernels store.
// LANE_LOOP marks a loop over a thread's elements: unrolled on a GPU (the values stay in
// registers), rolled in the emulation, where lavapipe otherwise takes seconds to build each
// pipeline; the same values either way.  Rolled loops count against lavapipe's loop limit
// (docs/devices.md, "Vulkan"): each kernel says how far its emulation stays right.
#ifndef HELIOS_COOP_ELEM_GLSL
#define HELIOS_COOP_ELEM_GLSL

#ifdef COOP_EMU
#define LANE_LOOP [[dont_unroll]]
#else
#define LANE_LOOP [[unroll]]
#endif

#if TA == T_BF16 && !defined(COOP_EMU) && !defined(F16_AS_BF16)
#error "bf16 operands (TA=3) are built with F16_AS_BF16 (or emulated with COOP_EMU)"
#elif TA != T_F16 && TA != T_BF16
#error "fp16 (TA=2) or bf16 (TA=3) operands"
#endif

#if TA == T_BF16 && defined(COOP_EMU)
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#define ELEM uint16_t
#define ELEM_ZERO uint16_t(0)
float elem_f(ELEM x) { return bf16_to_f(uint(x)); }
ELEM to_elem(float v) { return uint16_t(f_to_bf16(v)); }
void split2(uint w, out ELEM lo, out ELEM hi) { lo = uint16_t(w & 0xFFFFu); hi = uint16_t(w >> 16); }
uint pack2(ELEM lo, ELEM hi) { return uint(lo) | (uint(hi) << 16); }
#else
#define ELEM float16_t
#define ELEM_ZERO float16_t(0.0)
float elem_f(ELEM x) { return float(x); }
#if TA == T_BF16
ELEM to_elem(float v) { return unpackFloat2x16(f_to_bf16(v)).x; }  // the bits, bitcast
#else
ELEM to_elem(float v) { return float16_t(v); }
#endif
void split2(uint w, out ELEM lo, out ELEM hi) { f16vec2 v = unpackFloat2x16(w); lo = v.x; hi = v.y; }
uint pack2(ELEM lo, ELEM hi) { return packFloat2x16(f16vec2(lo, hi)); }
#endif

#define OUT_T HL_ST(TA)
#define out_f(x) HL_LDF(TA, x)
#define f_out(v) HL_STF(TA, v)

#endif
