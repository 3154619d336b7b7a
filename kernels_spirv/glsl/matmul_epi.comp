#version 450
// matmul.glsl with a fused epilogue (EPI: + residual, gelu, * gelu'): two more bindings
// (E read, U written) and two more push-constant words (their offsets); see matmul.glsl.
#define MM_EPI
#include "matmul.glsl"
