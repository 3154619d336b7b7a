#version 450
// Inclusive scan (cumsum, cumprod) along one dim of a contiguous tensor seen as
// [outer, n, inner]: row r = (o, i) runs over o * n * inner + k * inner + i, k in [0, n).
// REVERSE scans from the end (k = n-1 down to 0): the backward of cumsum.
// Short rows: one invocation owns a row.  Long rows: a workgroup shares a row; each
// invocation scans a contiguous chunk, the chunk totals are combined in shared memory
// in order, then each chunk is rescanned from its prefix (the order of the arithmetic
// is fixed: results are identical between runs).
// Floats accumulate in float32, integers (and bool) in int64 (the output is int64).
#define NEED_I64
#include "common.glsl"
layout(local_size_x_id = 2) in;
layout(constant_id = 0) const int OP = 0;          // 0 sum, 1 product
layout(constant_id = 1) const bool REVERSE = false;
layout(constant_id = 2) const int WG = 64;
layout(constant_id = 3) const bool ROW_PER_THREAD = true;

#if TO == T_I64
#define AT int64_t
#define LDA(v) int64_t(v)
#define STA(v) (v)
#else
#define AT float
#define LDA(v) HL_LDF(TA, v)
#define STA(v) HL_STF(TO, v)
#endif

layout(std430, binding = 0) readonly buffer BX { HL_ST(TA) x[]; };
layout(std430, binding = 1) writeonly buffer BO { HL_ST(TO) o[]; };
layout(push_constant) uniform P { uint n; uint rows; uint inner; uint off_x; } p;

shared AT part[WG];

AT combine(AT a, AT b) { return OP == 0 ? a + b : a * b; }
AT identity() { return OP == 0 ? AT(0) : AT(1); }
uint at(uint k) { return REVERSE ? p.n - 1u - k : k; }

void main() {
    uint gid = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (ROW_PER_THREAD) {
        uint r = gid * uint(WG) + gl_LocalInvocationID.x;
        if (r >= p.rows) return;
        uint base = (r / p.inner) * p.n * p.inner + (r % p.inner);
        AT acc = identity();
        for (uint k = 0u; k < p.n; ++k) {
            uint e = base + at(k) * p.inner;
            acc = combine(acc, LDA(x[p.off_x + e]));
            o[e] = STA(acc);
        }
        return;
    }
    uint r = gid;
    if (r >= p.rows) return;
    uint t = gl_LocalInvocationID.x;
    uint base = (r / p.inner) * p.n * p.inner + (r % p.inner);
    uint chunk = (p.n + uint(WG) - 1u) / uint(WG);
    uint lo = min(t * chunk, p.n), hi = min(lo + chunk, p.n);
    AT acc = identity();
    for (uint k = lo; k < hi; ++k) acc = combine(acc, LDA(x[p.off_x + base + at(k) * p.inner]));
    part[t] = acc;
    barrier();
    if (t == 0u) {
        AT run = identity();
        for (int q = 0; q < WG; ++q) {
            AT v = part[q];
            part[q] = run;
            run = combine(run, v);
        }
    }
    barrier();
    acc = part[t];
    for (uint k = lo; k < hi; ++k) {
        uint e = base + at(k) * p.inner;
        acc = combine(acc, LDA(x[p.off_x + e]));
        o[e] = STA(acc);
    }
}
