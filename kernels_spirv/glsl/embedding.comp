#version 450
// Embedding rows of a table W[V, C] (rows contiguous).
// MODE 0 gather:   out[n, c] = W[idx[n], c]  (indices clamped into [0, V) for memory safety;
//                  the caller validates indices).
// MODE 1 backward: dW[v, c] = sum over j in [rowptr[v], rowptr[v+1]) of g[pos[j], c] — the
//                  positions of each row are grouped (CSR) and in order, so the sum is
//                  deterministic: no atomics, bit-identical between runs.
//                  off_i (unused: pos is bound from its start) is where dW starts in
//                  binding 3, so dW can be a slot of a larger gradient buffer.
// MODE 2 backward adding: dW[v, c] += (MODE 1's sum, rounded to TA), the sum the separate add
//                  of MODE 1's result to dW would store ("embedding_bwd+acc": a tied table's
//                  gradient, already in its slot from the LM head, gets the table's own use).
// MODE 3 gather two: out[n, c] = W[idx[n], c] + W2[pos[n % T], c]  (a token's row and its
//                  position's, "embedding+add": the sum the separate add of the two gathers
//                  stores; indices clamped as in MODE 0).
#define NEED_I64
#include "common.glsl"
layout(local_size_x = 64, local_size_y = 4) in;
layout(constant_id = 0) const int MODE = 0;

layout(std430, binding = 0) readonly buffer BW { HL_ST(TA) w[]; };
layout(std430, binding = 1) readonly buffer BI { int64_t idx[]; };
layout(std430, binding = 2) readonly buffer BR { int rowptr[]; };
layout(std430, binding = 3) buffer BO { HL_ST(TA) o[]; };
layout(std430, binding = 4) readonly buffer BW2 { HL_ST(TA) w2[]; };  // MODE 3 only
layout(std430, binding = 5) readonly buffer BP { int64_t pos[]; };     // MODE 3 only
layout(push_constant) uniform P {
    uint C; uint rows; uint V; uint off_w; uint off_i;
    uint T; uint V2; uint off_w2; uint off_p;  // MODE 3 only
} p;

void main() {
    uint c = gl_GlobalInvocationID.x;
    uint r = gl_WorkGroupID.z * (gl_NumWorkGroups.y * gl_WorkGroupSize.y) + gl_GlobalInvocationID.y;
    if (c >= p.C || r >= p.rows) return;
    if (MODE == 0) {
        int64_t v = clamp(idx[p.off_i + r], int64_t(0), int64_t(p.V) - 1);
        o[r * p.C + c] = w[p.off_w + uint(v) * p.C + c];
    } else if (MODE == 3) {
        int64_t v = clamp(idx[p.off_i + r], int64_t(0), int64_t(p.V) - 1);
        int64_t q = clamp(pos[p.off_p + r % p.T], int64_t(0), int64_t(p.V2) - 1);
        o[r * p.C + c] = HL_STF(TA, HL_LDF(TA, w[p.off_w + uint(v) * p.C + c]) + HL_LDF(TA, w2[p.off_w2 + uint(q) * p.C + c]));
    } else {
        float acc = 0.0;
        for (int j = rowptr[r]; j < rowptr[r + 1]; ++j)
            acc += HL_LDF(TA, w[p.off_w + uint(idx[j]) * p.C + c]);
        uint at = p.off_i + r * p.C + c;
        if (MODE == 2)  // rounded first, as the separate kernel stores it; addition commutes
            acc = HL_LDF(TA, o[at]) + HL_LDF(TA, HL_STF(TA, acc));
        o[at] = HL_STF(TA, acc);
    }
}
