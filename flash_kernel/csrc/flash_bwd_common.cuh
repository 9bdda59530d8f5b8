// FlashAttention-2 backward (Dao, 2023, "FlashAttention-2", Algorithm 2), mma.sync on sm80+: the algorithm,
// and the two kernels every backward launch runs around its main kernel (delta before, dQ convert after).
//
// Algorithm 2 (the paper's line numbers), split over three kernels:
//   4      D = rowsum(dO o O)  (fp32, per query row)                    -> bwd_preprocess_kernel
//   6      for each K/V block j (one thread block, parallel over j, head, batch) -> flash_bwd_tiled_kernel
//   7-8      load K_j, V_j into shared memory; dK_j = dV_j = 0 (registers)
//   9        for each query block i (causal: only i that can see block j):
//  10          load Q_i, dO_i (cp.async, prefetched during block i-1), L_i, D_i
//  11          S_ij = Q_i K_j^T                    (computed transposed: S^T = K_j Q_i^T)
//  12          P_ij = exp(S_ij - L_i)             (recomputed from the forward's LSE; no T x T tensor)
//  13          dV_j += P_ij^T dO_i
//  14          dP_ij = dO_i V_j^T                  (again transposed: dP^T = V_j dO_i^T)
//  15          dS_ij = P_ij o (dP_ij - D_i)
//  16          dQ_i += dS_ij K_j                   (fp32 atomics into dq_accum; or ordered, see below)
//  17          dK_j += dS_ij^T Q_i
//  19        write dK_j (times softmax_scale), dV_j
//   -      dQ = softmax_scale * sum_splits(dq_accum) in the input dtype      -> bwd_convert_dq_kernel
// The main kernel is flash_bwd_tiled_kernel (flash_bwd_tiled_kernel.cuh, warp tiling per head dim in
// kernel_traits.h).
//
// S^T and dP^T are computed key-major, so P^T and dS^T come out of the accumulators in the A-fragment
// layout of lines 13 and 17 (straight from registers when a warp owns all queries of its keys, else
// through shared memory). Line 16 needs dS with queries as rows: dS^T is written once to shared memory and
// read back with ldmatrix.trans. The softmax scale is folded: S is scaled inside the exp2 (scale*log2e),
// and dS is left unscaled until dK's epilogue and dQ's convert kernel.
//
// Deterministic mode: num_splits thread blocks per (head, batch); block s handles K/V blocks
// s, s+S, s+2S, ... in order and owns split s of dq_accum alone, adding with plain load/store. Each dQ
// element is always added by the same thread, so the order of additions is fixed; the convert kernel
// sums the splits in index order. Result: bitwise identical gradients run to run.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "kernel_traits.h"
#include "utils.cuh"

namespace flash {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * log2e)
constexpr int kPreprocessWarps = 8;             // rows (one warp each) per preprocess thread block
constexpr int kConvertThreads = 256;
constexpr int kConvertVec = 4;                  // dq_accum floats per convert thread

// Alg. 2 line 10's L_i and D_i for the kBlockM query rows from row0, into shared memory by plain stores of
// threads 0 .. kBlockM - 1: L pre-multiplied by log2e (P = exp2(S scale log2e - L log2e)); rows past Tq get
// L = +inf (so P = 0) and D = 0.
template <int kBlockM>
__device__ __forceinline__ void load_lse_delta(float* s_lse, float* s_delta, const float* lse, const float* delta, int row0,
                                               int seqlen_q, int tid) {
    if (tid < kBlockM) {
        const bool in = row0 + tid < seqlen_q;
        s_lse[tid] = in ? lse[row0 + tid] * kLog2e : INFINITY;
        s_delta[tid] = in ? delta[row0 + tid] : 0.f;
    }
}

// Alg. 2 line 4: delta = rowsum(dO o O) in fp32, one warp per (batch, head, query) row.
template <typename Element>
__global__ void __launch_bounds__(kPreprocessWarps * kWarpSize) bwd_preprocess_kernel(const BwdParams params) {
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kPreprocessWarps + warp;  // (bidb * h + bidh) * Tq + q
    if (row >= static_cast<int64_t>(params.b) * params.h * params.seqlen_q) return;
    const int q = static_cast<int>(row % params.seqlen_q);
    const int bidh = static_cast<int>((row / params.seqlen_q) % params.h);
    const int bidb = static_cast<int>(row / (static_cast<int64_t>(params.seqlen_q) * params.h));
    const Element* dO = static_cast<const Element*>(params.do_ptr) + bidb * params.do_batch_stride +
                        q * params.do_row_stride + bidh * params.do_head_stride;
    const Element* o = static_cast<const Element*>(params.o_ptr) + bidb * params.o_batch_stride +
                       q * params.o_row_stride + bidh * params.o_head_stride;
    float acc = 0.f;
    for (int col = lane * kCopyElems; col < params.d; col += kWarpSize * kCopyElems) {
        const uint4 a = *reinterpret_cast<const uint4*>(dO + col);
        const uint4 b = *reinterpret_cast<const uint4*>(o + col);
        const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 x = unpack2<Element>(av[i]), y = unpack2<Element>(bv[i]);
            acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
        }
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (lane == 0) params.delta_ptr[row] = acc;
}

// dQ = softmax_scale * sum over splits of dq_accum, cast to the input dtype, written with dq's strides.
template <typename Element>
__global__ void __launch_bounds__(kConvertThreads) bwd_convert_dq_kernel(const BwdParams params) {
    const int vecs_per_row = params.d / kConvertVec;
    const int64_t total = static_cast<int64_t>(params.b) * params.h * params.seqlen_q * vecs_per_row;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int col = static_cast<int>(idx % vecs_per_row) * kConvertVec;
        const int64_t row = idx / vecs_per_row;  // (bidb * h + bidh) * Tq + q
        const int q = static_cast<int>(row % params.seqlen_q);
        const int bidh = static_cast<int>((row / params.seqlen_q) % params.h);
        const int bidb = static_cast<int>(row / (static_cast<int64_t>(params.seqlen_q) * params.h));
        const float* src = params.dq_accum_ptr + row * params.d_rounded + col;
        float4 acc = *reinterpret_cast<const float4*>(src);
        for (int s = 1; s < params.num_splits; ++s) {
            const float4 x = *reinterpret_cast<const float4*>(src + s * params.dq_accum_split_stride);
            acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
        }
        const float sc = params.scale_softmax;
        Element* dst = static_cast<Element*>(params.dq_ptr) + bidb * params.dq_batch_stride + q * params.dq_row_stride +
                       bidh * params.dq_head_stride + col;
        *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<Element>(acc.x * sc, acc.y * sc), pack2<Element>(acc.z * sc, acc.w * sc));
    }
}

}  // namespace flash
