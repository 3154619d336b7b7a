#version 450
// Scatter rows by sorted destination keys, deterministically and without atomics.
// keys[0..M) are destination row numbers sorted stably (equal keys keep the sources'
// order) and order[s] is the source row of sorted entry s.  The first entry of each run of
// equal keys combines the run's source rows, in order, into o[key]:
// MODE 0 (add):     o[key, c] += sum of src[order[s], c] over the run (bool: logical or);
// MODE 1 (replace): o[key, c] = src[order[last of the run], c] (the last write wins).
// Keys outside [0, nrows) are skipped (the caller validates the indices it can see).
#define NEED_I64
#include "common.glsl"
layout(local_size_x = 64, local_size_y = 4) in;
layout(constant_id = 0) const int MODE = 0;

layout(std430, binding = 0) readonly buffer BK { int64_t keys[]; };
layout(std430, binding = 1) readonly buffer BR { int order[]; };
layout(std430, binding = 2) readonly buffer BS { HL_ST(TA) src[]; };
layout(std430, binding = 3) buffer BO { HL_ST(TA) o[]; };
layout(push_constant) uniform P { uint C; uint M; uint nrows; uint off_s; uint off_o; uint off_k; uint off_r; } p;

void main() {
    uint c = gl_GlobalInvocationID.x;
    uint s = gl_WorkGroupID.z * (gl_NumWorkGroups.y * gl_WorkGroupSize.y) + gl_GlobalInvocationID.y;
    if (c >= p.C || s >= p.M) return;
    int64_t key = keys[p.off_k + s];
    if (s > 0u && keys[p.off_k + s - 1u] == key) return;
    if (key < int64_t(0) || key >= int64_t(p.nrows)) return;
    uint oi = p.off_o + uint(key) * p.C + c;
    uint e = s;
    if (MODE == 1) {
        while (e + 1u < p.M && keys[p.off_k + e + 1u] == key) ++e;
        o[oi] = src[p.off_s + uint(order[p.off_r + e]) * p.C + c];
        return;
    }
#if TA == T_I32 || TA == T_I64
    int64_t acc = int64_t(o[oi]);
    for (; e < p.M && keys[p.off_k + e] == key; ++e) acc += int64_t(src[p.off_s + uint(order[p.off_r + e]) * p.C + c]);
    o[oi] = HL_ST(TA)(acc);
#elif TA == T_U8
    uint acc = uint(o[oi]);
    for (; e < p.M && keys[p.off_k + e] == key; ++e) acc |= uint(src[p.off_s + uint(order[p.off_r + e]) * p.C + c]);
    o[oi] = uint8_t(acc != 0u ? 1u : 0u);
#else
    float acc = HL_LDF(TA, o[oi]);
    for (; e < p.M && keys[p.off_k + e] == key; ++e) acc += HL_LDF(TA, src[p.off_s + uint(order[p.off_r + e]) * p.C + c]);
    o[oi] = HL_STF(TA, acc);
#endif
}
