#version 450
// Batched matmul C[z] = A[z] @ B[z] on strided operands (so transposed views and
// broadcast batch dims need no copies).  z runs over two batch dims (z = z0 * nb1 + z1),
// each with its own stride per operand (0 = broadcast).  C is contiguous [batch, M, N].
//
// Tiling: a workgroup computes a BM x BN tile of C with (BM/TM) x (BN/TN) invocations,
// each holding a TM x TN register block; K advances BK at a time through shared memory.
#include "common.glsl"
layout(local_size_x_id = 3, local_size_y_id = 4) in;
layout(constant_id = 0) const int BM = 64;
layout(constant_id = 1) const int BN = 64;
layout(constant_id = 2) const int BK = 16;
layout(constant_id = 3) const int WX = 16;   // = BN / TN
layout(constant_id = 4) const int WY = 16;   // = BM / TM
const int TM = BM / WY;
const int TN = BN / WX;

layout(std430, binding = 0) readonly buffer BA { HL_ST(TA) a[]; };
layout(std430, binding = 1) readonly buffer BB { HL_ST(TA) b[]; };
layout(std430, binding = 2) writeonly buffer BC { HL_ST(TA) c[]; };
layout(push_constant) uniform P {
    uint M; uint N; uint K; uint nb1;
    uint off_a; uint off_b; uint off_c; uint pad;
    uint sa0; uint sa1; uint sam; uint sak;
    uint sb0; uint sb1; uint sbk; uint sbn;
} p;

shared float As[BK][BM];
shared float Bs[BK][BN];

void main() {
    uint z = gl_WorkGroupID.z;
    uint z0 = z / p.nb1, z1 = z - z0 * p.nb1;
    uint abase = p.off_a + z0 * p.sa0 + z1 * p.sa1;
    uint bbase = p.off_b + z0 * p.sb0 + z1 * p.sb1;
    uint m0 = gl_WorkGroupID.y * uint(BM), n0 = gl_WorkGroupID.x * uint(BN);
    uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    uint tid = ty * uint(WX) + tx;
    const uint NT = uint(WX * WY);

    float acc[TM][TN];
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0;

    for (uint k0 = 0u; k0 < p.K; k0 += uint(BK)) {
        for (uint e = tid; e < uint(BM * BK); e += NT) {
            uint mm = e / uint(BK), kk = e - mm * uint(BK);
            uint gm = m0 + mm, gk = k0 + kk;
            As[kk][mm] = (gm < p.M && gk < p.K) ? HL_LDF(TA, a[abase + gm * p.sam + gk * p.sak]) : 0.0;
        }
        for (uint e = tid; e < uint(BN * BK); e += NT) {
            uint kk = e / uint(BN), nn = e - kk * uint(BN);
            uint gk = k0 + kk, gn = n0 + nn;
            Bs[kk][nn] = (gk < p.K && gn < p.N) ? HL_LDF(TA, b[bbase + gk * p.sbk + gn * p.sbn]) : 0.0;
        }
        barrier();
        for (int kk = 0; kk < BK; ++kk) {
            float ra[TM], rb[TN];
            for (int i = 0; i < TM; ++i) ra[i] = As[kk][int(ty) + i * WY];
            for (int j = 0; j < TN; ++j) rb[j] = Bs[kk][int(tx) + j * WX];
            for (int i = 0; i < TM; ++i)
                for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
        }
        barrier();
    }
    uint cbase = p.off_c + z * p.M * p.N;
    for (int i = 0; i < TM; ++i) {
        uint gm = m0 + ty + uint(i * WY);
        if (gm >= p.M) continue;
        for (int j = 0; j < TN; ++j) {
            uint gn = n0 + tx + uint(j * WX);
            if (gn < p.N) c[cbase + gm * p.N + gn] = HL_STF(TA, acc[i][j]);
        }
    }
}
