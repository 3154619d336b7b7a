#version 450
// Batched fp16 matmul on cooperative matrices (GL_KHR_cooperative_matrix: tensor cores on
// NVIDIA, WMMA on AMD RDNA3, XMX on Intel Arc), fp32 sums.  It computes what matmul.glsl's
// shared-memory kernel computes, with the same bindings, push constants and epilogues
// (matmul_epi's E / U bindings and offset words are always there; unused ones repeat C), so
// the host swaps one kernel for the other: C[z] = A[z] @ B[z] (+ bias) on strided operands,
// two batch dims z = z0 * nb1 + z1 with a stride each (0 = broadcast), C contiguous,
// transposed (CT) or heads interleaved in rows (CLD); see the top of matmul.glsl.
//
// The host (helios/_kernels/coopmat.py) picks the tile from the shapes the device lists
// (vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR), all specialization constants:
//   * a workgroup of NT = WGM * WGN subgroups computes a BM x BN tile of C; subgroup s owns a
//     (BM / WGM) x (BN / WGN) block of it as FM x FN accumulators of CM x CN (the listed shape);
//   * K advances BK at a time through shared memory, double buffered: the next K slice is read
//     from global memory into registers while this one is multiplied, then stored to the
//     other stage (one barrier a step);
//   * AMODE / BMODE say how the operands are read: 1 = along their K-contiguous rows (A
//     row-major, B^T), 2 = along their M- / N-contiguous rows (A^T, B row-major), as 8 halves
//     (16 bytes) a load, staged in that orientation and loaded into cooperative matrices as
//     row- or column-major; 0 = any strides, one element a load.  The host asks for 1 / 2 only
//     where the other stride and the offset are multiples of 8 (every run starts 16-byte
//     aligned); a run that crosses the matrix's edge along its dim (K, M or N not a multiple of
//     8: the tied head's vocabulary) is read one element a load up to the edge, zeros after;
//   * edge tiles (ragged M, N, K) load zeros outside the matrix and store only inside it.
// The product goes through a per-subgroup fp32 scratch tile in shared memory (a cooperative
// matrix's element-to-lane mapping is the driver's), where each lane adds the bias, runs the
// epilogue and stores in-range elements.
// Epilogues (EPI, id 9, as matmul.glsl): 1 = + E after rounding, 2 = U = pre-activation and
// C = gelu_tanh(U), 3 = C = product * gelu_tanh'(E).  BSUM (id 10): B's column sums over K as
// well, k = 0 .. K-1 in order from 0.0 in fp32 (reduce.comp MODE 1's order), stored by the
// workgroups of the first row of tiles through binding 3 (the bias's, unused then) at off_bias +
// n, as matmul.glsl stores them: a Linear's bias gradient, wherever its slot is (no batch).
// Built for Vulkan 1.3 (SPIR-V 1.6, the Vulkan memory model) by a compiler that knows
// GL_KHR_cooperative_matrix (kernels_spirv/build.py).
//
// COOP_EMU (variant f16_emu, for tests only: tests/test_coopmat_gpu.py runs it on lavapipe, which
// has no cooperative matrices) does the three cooperative-matrix operations with plain code of the
// same meaning: a load notes where its tile starts in shared memory (and the layout says how it
// lies there), a multiply-add reads both tiles from there, and lane l of a subgroup owns
// accumulator elements l, l + SG, l + 2 SG, ... of the row-major CM x CN tile.  Everything around
// them (staging, double buffering, edges, epilogues, bias sums, stores) is the same code.
#ifndef COOP_EMU
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#include "coop_elem.glsl"   // ELEM: the fp16 / bf16 operand element; OUT_T: C, bias, E, U

layout(std430, binding = 0) readonly buffer BA { ELEM a[]; };
layout(std430, binding = 0) readonly buffer BA8 { uvec4 a8[]; };   // 8 halves a load
layout(std430, binding = 1) readonly buffer BB { ELEM b[]; };
layout(std430, binding = 1) readonly buffer BB8 { uvec4 b8[]; };
layout(std430, binding = 2) writeonly buffer BC { OUT_T c[]; };
layout(std430, binding = 3) readonly buffer BBias { OUT_T bias[]; };
layout(std430, binding = 3) writeonly buffer BSumOut { OUT_T bsum_out[]; };   // BSUM's column sums
layout(std430, binding = 4) readonly buffer BE { OUT_T e[]; };
layout(std430, binding = 5) writeonly buffer BU { OUT_T u[]; };
layout(push_constant) uniform P {
    uint M; uint N; uint K; uint nb1;
    uint off_a; uint off_b; uint off_c; uint off_bias;
    uint sa0; uint sa1; uint sam; uint sak;
    uint sb0; uint sb1; uint sbk; uint sbn;
    uint off_e; uint off_u;
} p;

layout(local_size_x_id = 3) in;
layout(constant_id = 0) const uint BM = 128;
layout(constant_id = 1) const uint BN = 128;
layout(constant_id = 2) const uint BK = 32;
layout(constant_id = 3) const uint NT = 128;     // invocations: WGM * WGN subgroups
layout(constant_id = 4) const uint WGM = 2;      // subgroups along M
layout(constant_id = 5) const int HAS_BIAS = 0;
layout(constant_id = 6) const int CT = 0;
layout(constant_id = 7) const int CLD = 0;
layout(constant_id = 8) const uint WGN = 2;      // subgroups along N
layout(constant_id = 9) const int EPI = 0;
layout(constant_id = 10) const int BSUM = 0;
layout(constant_id = 11) const uint CM = 16;     // the cooperative-matrix shape (M x N x K)
layout(constant_id = 12) const uint CN = 16;
layout(constant_id = 13) const uint CK = 16;
layout(constant_id = 14) const int AMODE = 0;
layout(constant_id = 15) const int BMODE = 0;
// Mixed storage (ids 16-20, matmul.glsl's AF32 .. EF32: autocast's casts fused into the product):
// each slot flagged holds float32 instead of TA.  A, B and the bias are rounded to TA as they are
// loaded (what a cast before the product stores), C receives the TA-rounded result widened to
// float32 (what a cast after it stores) except linear+residual's sum with a float32 E, stored as
// it is, and the bias sums are rounded and widened; so each value is bit for bit the one the
// separate casts give.  U stays TA.  Offsets and strides count each slot's own elements.
layout(constant_id = 16) const int AF32 = 0;
layout(constant_id = 17) const int BF32 = 0;
layout(constant_id = 18) const int CF32 = 0;
layout(constant_id = 19) const int BIASF32 = 0;
layout(constant_id = 20) const int EF32 = 0;
layout(std430, binding = 0) readonly buffer BAF { float af[]; };
layout(std430, binding = 0) readonly buffer BAF4 { vec4 af4[]; };
layout(std430, binding = 1) readonly buffer BBF { float bf[]; };
layout(std430, binding = 1) readonly buffer BBF4 { vec4 bf4[]; };
layout(std430, binding = 2) writeonly buffer BCF { float cf[]; };
layout(std430, binding = 3) readonly buffer BBiasF { float biasf[]; };
layout(std430, binding = 3) writeonly buffer BSumOutF { float bsum_outf[]; };
layout(std430, binding = 4) readonly buffer BEF { float ef[]; };

const uint PAD = 8;                              // halves a staged row is padded by (bank spread)
const uint WM = BM / WGM, WN = BN / WGN;         // one subgroup's block
const uint FM = WM / CM, FN = WN / CN;           // its accumulators
// A stage: row-major [BM][BK + PAD] (AMODE 0 / 1) or column-major [BK][BM + PAD] (AMODE 2).
const uint A_LD = AMODE == 2 ? BM + PAD : BK + PAD;
const uint A_STAGE = AMODE == 2 ? BK * (BM + PAD) : BM * (BK + PAD);
// B stage: row-major [BK][BN + PAD] (BMODE 0 / 2) or column-major [BN][BK + PAD] (BMODE 1).
const uint B_LD = BMODE == 1 ? BK + PAD : BN + PAD;
const uint B_STAGE = BMODE == 1 ? BN * (BK + PAD) : BK * (BN + PAD);
shared ELEM As[2 * A_STAGE];
shared ELEM Bs[2 * B_STAGE];
shared float Cs[WGM * WGN * CM * CN];            // one CM x CN scratch tile per subgroup

// The next K slice in flight: 8-wide runs (AMODE / BMODE 1, 2) or single elements (0).
const uint A_RUNS = BM * BK / 8 / NT, B_RUNS = BN * BK / 8 / NT;
const uint A_ONE = BM * BK / NT, B_ONE = BN * BK / NT;
uvec4 ra8[A_RUNS];
uvec4 rb8[B_RUNS];
ELEM ra1[A_ONE];
ELEM rb1[B_ONE];

uint abase, bbase, m0, n0, tid;

// The staging loops are LANE_LOOPs (coop_elem.glsl): rolled, the emulation is right up to
// K ~ 4,000 (measured: 4,096 right, 8,192 not); the tests' K stay under 300.

// Eight float32 values (a run of a float32 A or B) rounded to ELEM, as a 16-byte run of them.
uvec4 pack8(vec4 x, vec4 y) {
    return uvec4(pack2(to_elem(x.x), to_elem(x.y)), pack2(to_elem(x.z), to_elem(x.w)),
                 pack2(to_elem(y.x), to_elem(y.y)), pack2(to_elem(y.z), to_elem(y.w)));
}

// A run of 8 of A / B from element g whose first n (1 .. 7) are inside the matrix, one element a
// load (rounded to ELEM from float32 slots), zeros after them: the edge of a dim that is not a
// multiple of 8.  A loop, not unrolled: edge runs are few, and the emulation's pipelines build
// faster without seven copies of the load.
uvec4 a_edge(uint g, uint n) {
    uvec4 w = uvec4(0u);
    [[dont_unroll]] for (uint j = 0; j < n; ++j) {
        ELEM e = AF32 == 1 ? to_elem(af[g + j]) : a[g + j];
        w[j >> 1] |= (j & 1u) == 0u ? pack2(e, ELEM_ZERO) : pack2(ELEM_ZERO, e);
    }
    return w;
}

uvec4 b_edge(uint g, uint n) {
    uvec4 w = uvec4(0u);
    [[dont_unroll]] for (uint j = 0; j < n; ++j) {
        ELEM e = BF32 == 1 ? to_elem(bf[g + j]) : b[g + j];
        w[j >> 1] |= (j & 1u) == 0u ? pack2(e, ELEM_ZERO) : pack2(ELEM_ZERO, e);
    }
    return w;
}

// Global -> registers: the K slice at k0 (zeros outside the matrix).
void load_slice(uint k0) {
    if (AMODE == 0) {
        LANE_LOOP for (uint i = 0; i < A_ONE; ++i) {
            uint id = tid + i * NT, r = id / BK, kk = id - r * BK;   // row-major stage
            uint gm = m0 + r, gk = k0 + kk;
            uint g = abase + gm * p.sam + gk * p.sak;
            ra1[i] = gm < p.M && gk < p.K ? (AF32 == 1 ? to_elem(af[g]) : a[g]) : ELEM_ZERO;
        }
    } else {
        const uint runs = (AMODE == 1 ? BK : BM) / 8;                 // runs per staged row
        LANE_LOOP for (uint i = 0; i < A_RUNS; ++i) {
            uint id = tid + i * NT, r = id / runs, q = (id - r * runs) * 8;
            bool in_ = AMODE == 1 ? m0 + r < p.M && k0 + q < p.K : k0 + r < p.K && m0 + q < p.M;
            uint g = AMODE == 1 ? abase + (m0 + r) * p.sam + k0 + q : abase + (k0 + r) * p.sak + m0 + q;
            uint left = AMODE == 1 ? p.K - k0 - q : p.M - m0 - q;     // (when in_) the run's elements inside
            ra8[i] = !in_ ? uvec4(0u) : left < 8u ? a_edge(g, left)
                   : AF32 == 1 ? pack8(af4[g >> 2], af4[(g >> 2) + 1u]) : a8[g >> 3];
        }
    }
    if (BMODE == 0) {
        LANE_LOOP for (uint i = 0; i < B_ONE; ++i) {
            uint id = tid + i * NT, kk = id / BN, nn = id - kk * BN;   // row-major stage
            uint gk = k0 + kk, gn = n0 + nn;
            uint g = bbase + gk * p.sbk + gn * p.sbn;
            rb1[i] = gk < p.K && gn < p.N ? (BF32 == 1 ? to_elem(bf[g]) : b[g]) : ELEM_ZERO;
        }
    } else {
        const uint runs = (BMODE == 1 ? BK : BN) / 8;
        LANE_LOOP for (uint i = 0; i < B_RUNS; ++i) {
            uint id = tid + i * NT, r = id / runs, q = (id - r * runs) * 8;
            bool in_ = BMODE == 1 ? n0 + r < p.N && k0 + q < p.K : k0 + r < p.K && n0 + q < p.N;
            uint g = BMODE == 1 ? bbase + (n0 + r) * p.sbn + k0 + q : bbase + (k0 + r) * p.sbk + n0 + q;
            uint left = BMODE == 1 ? p.K - k0 - q : p.N - n0 - q;
            rb8[i] = !in_ ? uvec4(0u) : left < 8u ? b_edge(g, left)
                   : BF32 == 1 ? pack8(bf4[g >> 2], bf4[(g >> 2) + 1u]) : b8[g >> 3];
        }
    }
}

// Registers -> shared stage s.
void store_slice(uint s) {
    if (AMODE == 0) {
        LANE_LOOP for (uint i = 0; i < A_ONE; ++i) {
            uint id = tid + i * NT, r = id / BK, kk = id - r * BK;
            As[s * A_STAGE + r * A_LD + kk] = ra1[i];
        }
    } else {
        const uint runs = (AMODE == 1 ? BK : BM) / 8;
        LANE_LOOP for (uint i = 0; i < A_RUNS; ++i) {
            uint id = tid + i * NT, r = id / runs, q = (id - r * runs) * 8;
            uint at = s * A_STAGE + r * A_LD + q;
            [[unroll]] for (uint h = 0; h < 4; ++h) {
                split2(ra8[i][h], As[at + 2 * h], As[at + 2 * h + 1]);
            }
        }
    }
    if (BMODE == 0) {
        LANE_LOOP for (uint i = 0; i < B_ONE; ++i) {
            uint id = tid + i * NT, kk = id / BN, nn = id - kk * BN;
            Bs[s * B_STAGE + kk * B_LD + nn] = rb1[i];
        }
    } else {
        const uint runs = (BMODE == 1 ? BK : BN) / 8;
        LANE_LOOP for (uint i = 0; i < B_RUNS; ++i) {
            uint id = tid + i * NT, r = id / runs, q = (id - r * runs) * 8;
            uint at = s * B_STAGE + r * B_LD + q;
            [[unroll]] for (uint h = 0; h < 4; ++h) {
                split2(rb8[i][h], Bs[at + 2 * h], Bs[at + 2 * h + 1]);
            }
        }
    }
}

// v rounded to C's type, as a store then a load would (the unfused ops read the product back).
float round16(float v) { return out_f(f_out(v)); }

// matmul.glsl's epilogue on C's element idx (z * M * N + m * N + n) holding v (bias added).
float epilogue(float v, uint idx) {
    v = round16(v);
    if (EPI == 1) return v + (EF32 == 1 ? ef[p.off_e + idx] : out_f(e[p.off_e + idx]));
    if (EPI == 2) {
        u[p.off_u + idx] = f_out(v);
        return gelu_tanh(v);
    }
    if (EPI == 3) return v * gelu_tanh_grad(EF32 == 1 ? ef[p.off_e + idx] : out_f(e[p.off_e + idx]));
    return v;
}

// BSUM: this invocation's columns of the staged slice added to their running sums, k in order.
const uint BS_N = (BN + NT - 1) / NT;   // BSUM columns per invocation
float bs[BS_N];                          // their running sums

void column_sums(uint s) {
    [[unroll]] for (uint j = 0; j < BS_N; ++j) {
        uint nn = tid + j * NT;
        if (nn >= BN) break;
        for (uint kk = 0; kk < BK; ++kk)   // zeros past K leave a sum as it is
            bs[j] += elem_f(BMODE == 1 ? Bs[s * B_STAGE + nn * B_LD + kk] : Bs[s * B_STAGE + kk * B_LD + nn]);
    }
}

#ifdef COOP_EMU
const uint SGE = NT / (WGM * WGN), PER = CM * CN / SGE;  // lanes a subgroup, accumulator elements a lane
float accv[FM * FN * PER];
uint fa_at[FM], fb_at[FN];                                // where each A / B tile starts in As / Bs

float a_elem(uint at, uint r, uint c) { return elem_f(AMODE == 2 ? As[at + c * A_LD + r] : As[at + r * A_LD + c]); }
float b_elem(uint at, uint r, uint c) { return elem_f(BMODE == 1 ? Bs[at + c * B_LD + r] : Bs[at + r * B_LD + c]); }

void emu_mul_add(uint i, uint j) {
    for (uint q = 0; q < PER; ++q) {
        uint e = gl_SubgroupInvocationID + q * SGE, r = e / CN, c = e - r * CN;
        float v = accv[(i * FN + j) * PER + q];
        for (uint k = 0; k < CK; ++k) v += a_elem(fa_at[i], r, k) * b_elem(fb_at[j], k, c);
        accv[(i * FN + j) * PER + q] = v;
    }
}
#endif

void main() {
    uint z = gl_WorkGroupID.z;
    uint z0 = z / p.nb1, z1 = z - z0 * p.nb1;
    abase = p.off_a + z0 * p.sa0 + z1 * p.sa1;
    bbase = p.off_b + z0 * p.sb0 + z1 * p.sb1;
    m0 = gl_WorkGroupID.y * BM;
    n0 = gl_WorkGroupID.x * BN;
    tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID;
    const uint wm = (sg / WGN) * WM, wn = (sg % WGN) * WN;
    const bool sums = BSUM == 1 && gl_WorkGroupID.y == 0u;
    [[unroll]] for (uint j = 0; j < BS_N; ++j) bs[j] = 0.0;

#ifdef COOP_EMU
    for (uint i = 0; i < FM * FN * PER; ++i) accv[i] = 0.0;
#else
    coopmat<float, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator> acc[FM * FN];
    [[unroll]] for (uint i = 0; i < FM * FN; ++i)
        acc[i] = coopmat<float, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator>(0.0);
#endif

    uint steps = (p.K + BK - 1) / BK;
    load_slice(0u);
    store_slice(0u);
    barrier();
    for (uint t = 0; t < steps; ++t) {
        uint s = t & 1u;
        if (t + 1u < steps) load_slice((t + 1u) * BK);   // in flight while this slice is multiplied
        if (sums) column_sums(s);
        [[unroll]] for (uint kk = 0; kk < BK; kk += CK) {
#ifdef COOP_EMU
            [[unroll]] for (uint i = 0; i < FM; ++i)
                fa_at[i] = s * A_STAGE + (AMODE == 2 ? kk * A_LD + wm + i * CM : (wm + i * CM) * A_LD + kk);
            [[unroll]] for (uint j = 0; j < FN; ++j)
                fb_at[j] = s * B_STAGE + (BMODE == 1 ? (wn + j * CN) * B_LD + kk : kk * B_LD + wn + j * CN);
            [[unroll]] for (uint i = 0; i < FM; ++i)
                [[unroll]] for (uint j = 0; j < FN; ++j) emu_mul_add(i, j);
#else
            coopmat<ELEM, gl_ScopeSubgroup, CM, CK, gl_MatrixUseA> fa[FM];
            coopmat<ELEM, gl_ScopeSubgroup, CK, CN, gl_MatrixUseB> fb[FN];
            [[unroll]] for (uint i = 0; i < FM; ++i) {
                uint row = wm + i * CM;
                if (AMODE == 2)
                    coopMatLoad(fa[i], As, s * A_STAGE + kk * A_LD + row, A_LD, gl_CooperativeMatrixLayoutColumnMajor);
                else
                    coopMatLoad(fa[i], As, s * A_STAGE + row * A_LD + kk, A_LD, gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (uint j = 0; j < FN; ++j) {
                uint col = wn + j * CN;
                if (BMODE == 1)
                    coopMatLoad(fb[j], Bs, s * B_STAGE + col * B_LD + kk, B_LD, gl_CooperativeMatrixLayoutColumnMajor);
                else
                    coopMatLoad(fb[j], Bs, s * B_STAGE + kk * B_LD + col, B_LD, gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (uint i = 0; i < FM; ++i)
                [[unroll]] for (uint j = 0; j < FN; ++j)
                    acc[i * FN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * FN + j]);
#endif
        }
        if (t + 1u < steps) store_slice(s ^ 1u);   // the other stage: last read a step ago
        barrier();
    }

    if (sums) {
        [[unroll]] for (uint j = 0; j < BS_N; ++j) {
            uint n = n0 + tid + j * NT;
            if (tid + j * NT < BN && n < p.N) {
                if (CF32 == 1) bsum_outf[p.off_bias + n] = round16(bs[j]);
                else bsum_out[p.off_bias + n] = f_out(bs[j]);
            }
        }
    }
    uint ldc = CLD > 0 ? uint(CLD) : (CT == 1 ? p.M : p.N);
    uint cbase = CLD > 0 ? p.off_c + z0 * (CT == 1 ? p.N : p.M) * ldc + z1 * (CT == 1 ? p.M : p.N)
                         : p.off_c + z * p.M * p.N;
    const uint scratch = sg * CM * CN;
    [[unroll]] for (uint i = 0; i < FM; ++i)
        [[unroll]] for (uint j = 0; j < FN; ++j) {
#ifdef COOP_EMU
            for (uint q = 0; q < PER; ++q) Cs[scratch + gl_SubgroupInvocationID + q * SGE] = accv[(i * FN + j) * PER + q];
#else
            coopMatStore(acc[i * FN + j], Cs, scratch, CN, gl_CooperativeMatrixLayoutRowMajor);
#endif
            barrier();
            for (uint x = gl_SubgroupInvocationID; x < CM * CN; x += gl_SubgroupSize) {
                uint r = x / CN, q = x - r * CN;
                uint gm = m0 + wm + i * CM + r, gn = n0 + wn + j * CN + q;
                if (gm >= p.M || gn >= p.N) continue;
                float v = Cs[scratch + x] + (HAS_BIAS == 0 ? 0.0 : BIASF32 == 1 ? round16(biasf[p.off_bias + gn])
                                                                  : out_f(bias[p.off_bias + gn]));
                if (EPI != 0) v = epilogue(v, z * p.M * p.N + gm * p.N + gn);  // C contiguous (no CT / CLD)
                uint at = CT == 1 ? cbase + gn * ldc + gm : cbase + gm * ldc + gn;
                if (CF32 == 1) cf[at] = EPI == 1 ? v : round16(v);  // linear+residual's float32 sum as it is
                else c[at] = f_out(v);
            }
            barrier();   // the scratch tile is reused by the next accumulator
        }
}
