#version 450
// Stable sort of independent rows by bitonic merging of (key, position) pairs.
//
// Each row of n keys is padded to P = next power of two; the order is total (key, then the
// original position, padding last), so the bitonic network gives exactly a stable sort:
// ties keep their original order in both directions.  Floats: NaN sorts as the largest
// value (last ascending, first descending), as in PyTorch.
//
// The working buffers key[rows * P] (the dtype's storage) and pos[rows * P] (int) hold the
// pairs.  A workgroup owns a block of 512 consecutive elements (a block never straddles
// two rows when P >= 512, and holds 512 / P whole rows when P < 512):
//   MODE 0: load the block from the input x (contiguous rows of n), set pos = column, and
//           run every stage with k <= min(P, 512) in shared memory;
//   MODE 1: one global compare-exchange step (k, j) with j >= 512 (one pair an invocation);
//   MODE 2: the steps j = 256 .. 1 of stage k in shared memory.
#define NEED_I64
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int MODE = 0;
layout(constant_id = 1) const bool DESC = false;

#if TA == T_F32 || TA == T_F16 || TA == T_BF16
#define KT float
#define KLD(v) HL_LDF(TA, v)
#define KST(v) HL_STF(TA, v)
#define KEY_IS_FLOAT 1
#elif TA == T_I32
#define KT int
#define KLD(v) (v)
#define KST(v) (v)
#elif TA == T_I64
#define KT int64_t
#define KLD(v) (v)
#define KST(v) (v)
#else
#define KT uint
#define KLD(v) uint(v)
#define KST(v) uint8_t(v)
#endif

layout(std430, binding = 0) buffer BK { HL_ST(TA) key[]; };
layout(std430, binding = 1) buffer BP { int pos[]; };
layout(std430, binding = 2) readonly buffer BX { HL_ST(TA) x[]; };
layout(push_constant) uniform P { uint total; uint P; uint n; uint k; uint j; uint off_x; } p;

shared KT sk[512];
shared int sp[512];

bool key_before(KT a, KT b) {
#ifdef KEY_IS_FLOAT
    bool an = isnan(a), bn = isnan(b);
    if (an || bn) return DESC ? (an && !bn) : (!an && bn);
#endif
    return DESC ? a > b : a < b;
}

// Whether (ka, ia) comes strictly before (kb, ib); padding (position >= n) is last.
bool before(KT ka, int ia, KT kb, int ib) {
    if (ia >= int(p.n)) return false;
    if (ib >= int(p.n)) return true;
    if (key_before(ka, kb)) return true;
    if (key_before(kb, ka)) return false;
    return ia < ib;
}

uint group_id() { return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; }

// One compare-exchange in shared memory: local pair (i, i + j) of the block at `base`.
void exchange_local(uint base, uint t, uint k, uint j) {
    uint i = 2u * j * (t / j) + (t % j);
    uint l = i + j;
    if (base + l < p.total) {
        bool asc = (((base + i) % p.P) & k) == 0u;
        KT ki = sk[i], kl = sk[l];
        int ii = sp[i], il = sp[l];
        if (asc ? before(kl, il, ki, ii) : before(ki, ii, kl, il)) {
            sk[i] = kl; sk[l] = ki; sp[i] = il; sp[l] = ii;
        }
    }
}

void main() {
    uint t = gl_LocalInvocationID.x;
    if (MODE == 1) {
        uint g = group_id() * 256u + t;
        if (2u * g >= p.total) return;
        uint i = 2u * p.j * (g / p.j) + (g % p.j);
        uint l = i + p.j;
        bool asc = ((i % p.P) & p.k) == 0u;
        KT ki = KLD(key[i]), kl = KLD(key[l]);
        int ii = pos[i], il = pos[l];
        if (asc ? before(kl, il, ki, ii) : before(ki, ii, kl, il)) {
            key[i] = KST(kl); key[l] = KST(ki);
            pos[i] = il; pos[l] = ii;
        }
        return;
    }
    uint base = group_id() * 512u;
    for (uint h = 0u; h < 2u; ++h) {
        uint e = t + h * 256u, f = base + e;
        if (f < p.total) {
            if (MODE == 0) {
                uint col = f % p.P, row = f / p.P;
                sp[e] = int(col);
                sk[e] = col < p.n ? KLD(x[p.off_x + row * p.n + col]) : KT(0);
            } else {
                sk[e] = KLD(key[f]);
                sp[e] = pos[f];
            }
        } else {
            sk[e] = KT(0);
            sp[e] = 0x7FFFFFFF;
        }
    }
    barrier();
    if (MODE == 0) {
        uint kmax = min(p.P, 512u);
        for (uint k = 2u; k <= kmax; k <<= 1) {
            for (uint j = k >> 1; j > 0u; j >>= 1) {
                exchange_local(base, t, k, j);
                barrier();
            }
        }
    } else {
        for (uint j = 256u; j > 0u; j >>= 1) {
            exchange_local(base, t, p.k, j);
            barrier();
        }
    }
    for (uint h = 0u; h < 2u; ++h) {
        uint e = t + h * 256u, f = base + e;
        if (f < p.total) {
            key[f] = KST(sk[e]);
            pos[f] = sp[e];
        }
    }
}
