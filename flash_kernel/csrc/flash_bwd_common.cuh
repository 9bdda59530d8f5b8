// FlashAttention-2 backward (Dao, 2023, "FlashAttention-2", Algorithm 2), mma.sync on sm80+: the algorithm,
// and the two kernels every backward launch runs around its main kernel (delta before, dQ convert after).
//
// Algorithm 2 (the paper's line numbers), split over three kernels:
//   4      D = rowsum(dO o O)  (fp32, per query row); dq_accum = 0     -> bwd_preprocess_kernel
//   6      for each K/V block j (one thread block, parallel over j, head, batch) -> flash_bwd_tiled_kernel
//   7-8      load K_j, V_j into shared memory; dK_j = dV_j = 0 (registers)
//   9        for each query block i (causal: only i that can see block j):
//  10          load Q_i, dO_i (cp.async, prefetched during block i-1), L_i, D_i
//  11          S_ij = Q_i K_j^T                    (computed transposed: S^T = K_j Q_i^T)
//  12          P_ij = exp(S_ij - L_i)             (recomputed from the forward's LSE; no T x T tensor)
//  13          dV_j += P_ij^T dO_i
//  14          dP_ij = dO_i V_j^T                  (again transposed: dP^T = V_j dO_i^T)
//  15          dS_ij = P_ij o (dP_ij - D_i)
//  16          dQ_i += dS_ij K_j                   (fp32 reduce-adds into dq_accum; or ordered, see below)
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

#include "dq_accum_layout.h"  // dq_accum_chunk: the Hopper backward's dq_accum rows
#include "flash_params.h"
#include "kernel_traits.h"
#include "utils.cuh"

namespace flash {

// The two row kernels around the main one (preprocess, dQ convert): a thread block of kRowKernelThreads takes
// kRows query rows of one (batch, head) (grid: row blocks x heads x batch, so no thread divides a flat index),
// kRowThreads threads per row, each moving 16 bytes of the input dtype per step, in kSteps unrolled steps whose
// loads are all issued before their use: one step at head dims 32, 64, 128 and 256; two at 65-96, whose 80 or 96
// columns (10 or 12 vectors) keep all 8 threads of the first step busy (16 threads in one step would leave 6 or 4
// of them idle).
constexpr int kRowKernelThreads = 256;
template <int kHeadDim>
struct RowKernelShape {
    static constexpr int kRowThreads = kHeadDim <= 32 ? 4 : kHeadDim <= 96 ? 8 : kHeadDim <= 128 ? 16 : 32;
    static constexpr int kRows = kRowKernelThreads / kRowThreads;
    static constexpr int kSteps = ceil_div(kHeadDim, kRowThreads * kCopyElems);  // 16-byte vectors of a row per thread
};
// A row kernel thread's place: thread `sub` of query row `q` of head bidh, batch (kVarlen: sequence) bidb. kVarlen:
// the sequence has seqlen_q rows from packed row q_row0 (cu_seqlens_q); dense: params.seqlen_q rows, placed by the
// batch stride (the dense instantiations compile without the varlen branches).
template <bool kVarlen>
struct RowThread {
    int sub, q, bidh, bidb;
    int seqlen_q, q_row0;  // kVarlen only
    __device__ __forceinline__ int rows(const BwdParams& p) const { return kVarlen ? seqlen_q : p.seqlen_q; }
    __device__ __forceinline__ int64_t q_row(const BwdParams& p) const {  // into q, o, do, dq's rows
        return kVarlen ? static_cast<int64_t>(q_row0) + q : static_cast<int64_t>(q);
    }
    __device__ __forceinline__ int64_t row(const BwdParams& p) const {  // into lse, delta: (B, Hq, Tq) or (Hq, total_q)
        if constexpr (kVarlen) return static_cast<int64_t>(bidh) * p.total_q + q_row0 + q;
        return (static_cast<int64_t>(bidb) * p.h + bidh) * p.seqlen_q + q;
    }
    __device__ __forceinline__ int64_t accum_row(const BwdParams& p) const {  // into a split of dq_accum (flash_params.h)
        if constexpr (kVarlen) return bidh * dq_accum_rows(p.total_q, p.b) + dq_accum_row0(q_row0, bidb) + q;
        return row(p);
    }
};
template <int kHeadDim, bool kVarlen>
__device__ __forceinline__ RowThread<kVarlen> row_thread(const BwdParams& p) {
    using Shape = RowKernelShape<kHeadDim>;
    RowThread<kVarlen> th{static_cast<int>(threadIdx.x % Shape::kRowThreads),
                          static_cast<int>(blockIdx.x * Shape::kRows + threadIdx.x / Shape::kRowThreads),
                          static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z), 0, 0};
    if constexpr (kVarlen) {
        th.q_row0 = p.cu_seqlens_q[th.bidb];
        th.seqlen_q = p.cu_seqlens_q[th.bidb + 1] - th.q_row0;
    }
    return th;
}

// Alg. 2 line 10's L_i and D_i for the kBlockM query rows from row0, into shared memory by 4-byte cp.async of
// threads 0 .. kBlockM - 1 (the caller commits the group): no thread waits for the global loads before the barrier
// that publishes the stage. L stays in natural-log units (readers compute P = exp2(S scale log2e - L log2e)). Rows
// past Tq read as zeros: their Q_i and dO_i rows are zero-filled as well, so their P is finite and their dS and dV
// contributions are zero.
template <int kBlockM>
__device__ __forceinline__ void load_lse_delta(float* s_lse, float* s_delta, const float* lse, const float* delta, int row0,
                                               int seqlen_q, int tid) {
    if (tid < kBlockM) {
        const bool in = row0 + tid < seqlen_q;
        cp_async_4(smem_addr(s_lse + tid), lse + row0 + tid, in);
        cp_async_4(smem_addr(s_delta + tid), delta + row0 + tid, in);
    }
}

// float <-> Element by the intrinsics: the build defines __CUDA_NO_HALF_CONVERSIONS__ and
// __CUDA_NO_BFLOAT16_CONVERSIONS__ (torch's extension flags), which remove the implicit conversions.
__host__ __device__ __forceinline__ void from_float(float x, __nv_bfloat16& e) { e = __float2bfloat16_rn(x); }
__host__ __device__ __forceinline__ void from_float(float x, __half& e) { e = __float2half_rn(x); }
__host__ __device__ __forceinline__ float to_float(__nv_bfloat16 e) { return __bfloat162float(e); }
__host__ __device__ __forceinline__ float to_float(__half e) { return __half2float(e); }

// One row of BwdParams::ld_mma: x as three values of Element whose sum is x to about 24 bits (an infinite x: x, 0,
// 0), then five zeros; one 16-byte store.
template <typename Element>
__host__ __device__ __forceinline__ void store_ld_mma_row(Element* dst, float x) {
    alignas(16) Element row[8];
    from_float(x, row[0]);
    const float r1 = std::isfinite(x) ? x - to_float(row[0]) : 0.f;  // exact: row[0] is x rounded
    from_float(r1, row[1]);
    from_float(r1 - to_float(row[1]), row[2]);
    for (int i = 3; i < 8; ++i) from_float(0.f, row[i]);
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(row);
}

// Alg. 2 line 4: D = rowsum(dO o O) in fp32; and dq_accum's rows of kAccumCols floats (BwdParams::dq_accum_cols)
// zeroed here (every split), which spares a separate memset of the same bytes, as does the Hopper causal kernel's
// tile counter. Rows are RowKernelShape's: at hd128 16 threads per row, 16 rows per block. The zero stores go out
// first, while the row's loads are in flight. kVarlen: rows of packed sequences (cu_seqlens_q), a row block past its
// sequence's end writes nothing.
template <typename Element, int kHeadDim, bool kVarlen, int kAccumCols>
__global__ void __launch_bounds__(kRowKernelThreads) bwd_preprocess_kernel(const BwdParams params) {
    using Shape = RowKernelShape<kHeadDim>;
    static_assert(kAccumCols <= kHeadDim && kAccumCols % 4 == 0, "dq_accum rows of whole float4s, within the row");
    constexpr int kZeroSteps = ceil_div(kAccumCols, Shape::kRowThreads * 4);  // float4 zero stores per thread
    const auto th = row_thread<kHeadDim, kVarlen>(params);
    const bool valid = th.q < th.rows(params);  // no early return: the row's threads reduce by shuffles below
    // The persistent Hopper causal kernel's tile counter (bwd_tile_scheduler.h), which runs after this kernel.
    if (params.tile_counter != nullptr && (blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x) == 0) {
        *params.tile_counter = 0;
    }
    if (valid) {
        const int64_t accum_row = th.accum_row(params);
        for (int split = 0; split < params.num_splits; ++split) {
            float* dst = params.dq_accum_ptr + split * params.dq_accum_split_stride + accum_row * kAccumCols;
#pragma unroll
            for (int step = 0; step < kZeroSteps; ++step) {
                const int col = th.sub * 4 + step * Shape::kRowThreads * 4;
                if (col < kAccumCols) *reinterpret_cast<float4*>(dst + col) = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
    float acc = 0.f;
    if (valid) {
        const Element* dO = static_cast<const Element*>(params.do_ptr) + th.bidb * params.do_batch_stride +
                            th.q_row(params) * params.do_row_stride + th.bidh * params.do_head_stride;
        const Element* o = static_cast<const Element*>(params.o_ptr) + th.bidb * params.o_batch_stride +
                           th.q_row(params) * params.o_row_stride + th.bidh * params.o_head_stride;
        uint4 dO_vec[Shape::kSteps], o_vec[Shape::kSteps];  // columns col(step) .. col(step) + 7, zeros past d
#pragma unroll
        for (int step = 0; step < Shape::kSteps; ++step) {
            const int col = (th.sub + step * Shape::kRowThreads) * kCopyElems;
            dO_vec[step] = o_vec[step] = make_uint4(0, 0, 0, 0);
            if (col < params.d) {
                dO_vec[step] = *reinterpret_cast<const uint4*>(dO + col);
                o_vec[step] = *reinterpret_cast<const uint4*>(o + col);
            }
        }
#pragma unroll
        for (int step = 0; step < Shape::kSteps; ++step) {
            const uint4 a = dO_vec[step], b = o_vec[step];
            const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 x = unpack2<Element>(av[i]), y = unpack2<Element>(bv[i]);
                acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
            }
        }
    }
#pragma unroll
    for (int offset = Shape::kRowThreads / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (valid && th.sub == 0) params.delta_ptr[th.row(params)] = acc;
    if constexpr (!kVarlen) {  // the binding makes ld_mma for dense calls whose Hopper kernel reads it
        if (valid && th.sub == 0 && params.ld_mma_ptr != nullptr) {
            Element* dst = static_cast<Element*>(params.ld_mma_ptr) + ld_mma_row(params, th.bidb, th.bidh, th.q);
            store_ld_mma_row(dst, -params.lse_ptr[th.row(params)] / params.scale_softmax);
            store_ld_mma_row(dst + params.ld_mma_rows * 8, -acc);  // slice 1
        }
    }
}

// dQ = softmax_scale * sum over splits of dq_accum (rows of kAccumCols floats), cast to the input dtype, written
// with dq's strides; 8 columns (two float4 loads per split, one 16-byte store) per thread and step.
// kSwizzledChunks: dq_accum in the Hopper backward's layout (dq_accum_chunk_in; one split). kVarlen: as in
// bwd_preprocess_kernel.
template <typename Element, int kHeadDim, bool kSwizzledChunks, bool kVarlen, int kAccumCols>
__global__ void __launch_bounds__(kRowKernelThreads) bwd_convert_dq_kernel(const BwdParams params) {
    using Shape = RowKernelShape<kHeadDim>;
    const auto th = row_thread<kHeadDim, kVarlen>(params);
    if (th.q >= th.rows(params)) return;
    const float* src = params.dq_accum_ptr + th.accum_row(params) * kAccumCols;
    Element* dst = static_cast<Element*>(params.dq_ptr) + th.bidb * params.dq_batch_stride +
                   th.q_row(params) * params.dq_row_stride + th.bidh * params.dq_head_stride;
    const float sc = params.scale_softmax;
#pragma unroll
    for (int step = 0; step < Shape::kSteps; ++step) {
        const int col = (th.sub + step * Shape::kRowThreads) * kCopyElems;
        if (col >= params.d) break;
        const int lo_col = kSwizzledChunks ? 4 * dq_accum_chunk_in<kAccumCols>(col / 4, th.q) : col;
        const int hi_col = kSwizzledChunks ? 4 * dq_accum_chunk_in<kAccumCols>(col / 4 + 1, th.q) : col + 4;
        float4 lo = *reinterpret_cast<const float4*>(src + lo_col), hi = *reinterpret_cast<const float4*>(src + hi_col);
        for (int split = 1; split < params.num_splits; ++split) {
            const float* other = src + split * params.dq_accum_split_stride + col;
            const float4 a = *reinterpret_cast<const float4*>(other), b = *reinterpret_cast<const float4*>(other + 4);
            lo.x += a.x; lo.y += a.y; lo.z += a.z; lo.w += a.w;
            hi.x += b.x; hi.y += b.y; hi.z += b.z; hi.w += b.w;
        }
        *reinterpret_cast<uint4*>(dst + col) =
            make_uint4(pack2<Element>(lo.x * sc, lo.y * sc), pack2<Element>(lo.z * sc, lo.w * sc),
                       pack2<Element>(hi.x * sc, hi.y * sc), pack2<Element>(hi.z * sc, hi.w * sc));
    }
}

}  // namespace flash
