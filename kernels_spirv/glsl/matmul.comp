#version 450
// Batched matmul (C = A @ B, + bias): the source is matmul.glsl, shared with matmul_epi.comp.
#include "matmul.glsl"
