// FlashAttention-2 forward (Algorithm 1) on Hopper: wgmma (sm_90a) instead of mma.sync.
//
// Same algorithm, masking and outputs as flash_fwd_kernel.cuh (which has the line-by-line Algorithm 1 text);
// what changes is who does the matmuls and where their operands live:
//   - S = Q K^T: one warpgroup-wide wgmma per 16 columns of the head dim, both operands read by the tensor
//     cores straight from the swizzled shared-memory tiles through descriptors (no ldmatrix, no fragment
//     registers for Q or K), fp32 accumulators in registers: 64 query rows x kBlockN keys per warpgroup.
//   - O += P V: P stays in registers (the accumulator layout of S is wgmma's register A layout, as with
//     mma.sync), V is read from shared memory as an N-major B operand (the transpose is the descriptor's, not
//     an ldmatrix.trans).
//   - The two warpgroups of a block own 64 query rows each (split-Q, nothing exchanged), and the matmuls of
//     one overlap the softmax of the other.
// K/V tiles are double-buffered with cp.async issued by all threads; each writer fences its copies into
// the async proxy (wgmma's view of shared memory) before the barrier that publishes the stage.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "hopper_kernel_traits.h"
#include "utils.cuh"
#include "wgmma.cuh"

namespace flash {

template <typename Traits, bool kIsCausal>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    flash_fwd_hopper_kernel(const FwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kNThreads = Traits::kNThreads;
    constexpr int kNStages = Traits::kNStages;
    constexpr int kNTilesN = kBlockN / kMmaN;    // n8 column tiles of S per warp
    constexpr int kNTilesD = kHeadDim / kMmaN;   // n8 column tiles of O per warp
    constexpr int kKStepsD = kHeadDim / kMmaK;   // k16 steps of Q K^T
    constexpr int kKStepsN = kBlockN / kMmaK;    // k16 steps of P V
    constexpr uint32_t kQColBlockBytes = kBlockM * kSwizzleRowBytes;   // one 64-column block of Q
    constexpr uint32_t kKVColBlockBytes = kBlockN * kSwizzleRowBytes;  // one 64-column block of K or V
    constexpr uint32_t kKStepBytesN = kMmaK * kSwizzleRowBytes;        // 16 keys of V

    // The swizzle atoms must be 1024-aligned; the launch adds that much slack to the allocation.
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t pad = (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
    unsigned char* smem = smem_raw + pad;
    const uint32_t sQ = smem_addr(smem);
    const uint32_t sK = sQ + Traits::kSmemQBytes;                     // [kNStages][swizzled kBlockN x kHeadDim]
    const uint32_t sV = sK + kNStages * Traits::kSmemKVTileBytes;     // [kNStages][swizzled kBlockN x kHeadDim]

    // Causal: the query blocks with the most keys start first, so the last wave is made of short blocks.
    const int m_block = kIsCausal ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
    const int bidh = blockIdx.y;
    const int bidb = blockIdx.z;
    const int tid = threadIdx.x;
    const int seqlen_q = params.seqlen_q;
    const int seqlen_k = params.seqlen_k;
    const int causal_offset = seqlen_k - seqlen_q;  // query i sees keys j <= i + causal_offset
    const int row0 = m_block * kBlockM;
    const int valid_rows = min(kBlockM, seqlen_q - row0);

    const Element* q = static_cast<const Element*>(params.q_ptr) + bidb * params.q_batch_stride +
                       bidh * params.q_head_stride + row0 * params.q_row_stride;
    const int bidh_k = bidh / params.h_h_k_ratio;  // GQA/MQA: the kv head of this query head
    const Element* k = static_cast<const Element*>(params.k_ptr) + bidb * params.k_batch_stride + bidh_k * params.k_head_stride;
    const Element* v = static_cast<const Element*>(params.v_ptr) + bidb * params.v_batch_stride + bidh_k * params.v_head_stride;
    Element* o = static_cast<Element*>(params.o_ptr) + bidb * params.o_batch_stride + bidh * params.o_head_stride +
                 row0 * params.o_row_stride;
    float* lse = params.lse_ptr + (static_cast<int64_t>(bidb) * params.h + bidh) * seqlen_q + row0;

    int n_block_max = ceil_div(seqlen_k, kBlockN);
    if (kIsCausal) n_block_max = min(n_block_max, ceil_div(row0 + kBlockM + causal_offset, kBlockN));
    if (n_block_max <= 0) {
        write_rows_without_keys<kBlockM, kHeadDim, kNThreads>(o, params.o_row_stride, lse, valid_rows, params.d);
        return;
    }

    // Q_i and K_0, V_0: one commit group.
    copy_tile_swizzled<kBlockM, kHeadDim, kNThreads>(sQ, q, params.q_row_stride, valid_rows, params.d);
    copy_tile_swizzled<kBlockN, kHeadDim, kNThreads>(sK, k, params.k_row_stride, seqlen_k, params.d);
    copy_tile_swizzled<kBlockN, kHeadDim, kNThreads>(sV, v, params.v_row_stride, seqlen_k, params.d);
    cp_async_commit();

    // Warpgroup wg owns block rows [64 wg, 64 wg + 64); inside it warp w owns 16 rows, and this thread
    // rows `my_row` and `my_row + 8` (g = lane / 4; columns 8j + 2t + {0, 1} of every n8 tile j).
    const int wg = tid / kWarpgroupThreads;
    const int lane = tid % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    const int my_row = wg * kWarpgroupRows + ((tid % kWarpgroupThreads) / kWarpSize) * kMmaM + g;

    float acc_o[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};  // this thread's partial sums, quad-reduced at the end
    const float scale_log2 = params.scale_softmax_log2;

    // K-major descriptors of this warpgroup's 64 Q rows; K and V descriptors are per stage.
    const uint64_t desc_q = make_smem_desc_sw128(sQ + wg * kWarpgroupRows * kSwizzleRowBytes, 16, kSwizzleAtomBytes);

    for (int n_block = 0; n_block < n_block_max; ++n_block) {
        const int stage = n_block % kNStages;
        if (n_block + 1 < n_block_max) {
            // Prefetch j+1 into the stage read kNStages - 1 iterations ago (see flash_fwd_kernel.cuh).
            const int next = (n_block + 1) % kNStages;
            const int key0 = (n_block + 1) * kBlockN;
            copy_tile_swizzled<kBlockN, kHeadDim, kNThreads>(sK + next * Traits::kSmemKVTileBytes,
                                                             k + key0 * params.k_row_stride, params.k_row_stride,
                                                             seqlen_k - key0, params.d);
            copy_tile_swizzled<kBlockN, kHeadDim, kNThreads>(sV + next * Traits::kSmemKVTileBytes,
                                                             v + key0 * params.v_row_stride, params.v_row_stride,
                                                             seqlen_k - key0, params.d);
        }
        cp_async_commit();  // possibly empty, so that wait<1> always means "stage j has landed"
        cp_async_wait<1>();
        fence_view_async_shared();
        __syncthreads();

        // S = Q_i K_j^T: kKStepsD wgmmas, K-major A and B.
        const uint64_t desc_k = make_smem_desc_sw128(sK + stage * Traits::kSmemKVTileBytes, 16, kSwizzleAtomBytes);
        float s[kBlockN / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKStepsD; ++kk) {
            const uint32_t k_offset = (kk / 4) * kKVColBlockBytes + (kk % 4) * 32;
            Wgmma<Element, kBlockN>::template ss<0>(s, desc_advance(desc_q, (kk / 4) * kQColBlockBytes + (kk % 4) * 32),
                                                    desc_advance(desc_k, k_offset), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(s);

        // Masking only where the tile crosses the sequence end or (causal) the diagonal.
        const int key0 = n_block * kBlockN;
        if (key0 + kBlockN > seqlen_k || (kIsCausal && key0 + kBlockN - 1 > row0 + causal_offset)) {
#pragma unroll
            for (int i = 0; i < kNTilesN; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = key0 + i * kMmaN + 2 * t + (e & 1);
                    const int row = row0 + my_row + (e >= 2 ? 8 : 0);
                    if (col >= seqlen_k || (kIsCausal && col > row + causal_offset)) s[4 * i + e] = -INFINITY;
                }
            }
        }

        // Online softmax in base 2 (flash_fwd_kernel.cuh); r = 0: row my_row, r = 1: row my_row + 8.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int i = 0; i < kNTilesN; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
            mx = quad_max(mx);
            const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
            const float correction = fast_exp2(row_max[r] * scale_log2 - max_scaled);
            row_max[r] = mx;
            row_sum[r] *= correction;
#pragma unroll
            for (int i = 0; i < kNTilesD; ++i) {
                acc_o[4 * i + 2 * r] *= correction;
                acc_o[4 * i + 2 * r + 1] *= correction;
            }
#pragma unroll
            for (int i = 0; i < kNTilesN; ++i) {
                s[4 * i + 2 * r] = fast_exp2(fmaf(s[4 * i + 2 * r], scale_log2, -max_scaled));
                s[4 * i + 2 * r + 1] = fast_exp2(fmaf(s[4 * i + 2 * r + 1], scale_log2, -max_scaled));
                row_sum[r] += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
            }
        }

        // O += P V_j: the accumulators of S columns 16kk..16kk+15 are the register A operand of k-step kk.
        uint32_t p[kKStepsN][4];
#pragma unroll
        for (int kk = 0; kk < kKStepsN; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) p[kk][r] = pack2<Element>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        }
        const uint64_t desc_v = make_smem_desc_sw128(sV + stage * Traits::kSmemKVTileBytes, kKVColBlockBytes, kSwizzleAtomBytes);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKStepsN; ++kk) {
            Wgmma<Element, kHeadDim>::template rs<1>(acc_o, p[kk], desc_advance(desc_v, kk * kKStepBytesN), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc_o);
        if (kNStages == 2) __syncthreads();  // stage j is refilled by the prefetch of iteration j+1
    }

    // O = O / l, LSE = m * scale + log(l). O goes through this warpgroup's own rows of sQ (only its own wgmmas
    // read them, and they have completed), in the swizzled layout, so the global stores are 16-byte rows.
    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(row_sum[r]);
        const bool empty = l == 0.f || l != l;  // no visible key: O stays 0, LSE = +inf
        inv_sum[r] = empty ? 0.f : 1.f / l;
        const float lse_row = empty ? INFINITY : row_max[r] * params.scale_softmax + logf(l);
        if (t == 0 && my_row + 8 * r < valid_rows) lse[my_row + 8 * r] = lse_row;
    }
#pragma unroll
    for (int i = 0; i < kNTilesD; ++i) {
        const int c = i, within = 2 * t * static_cast<int>(sizeof(Element));  // chunk i, columns 8i + 2t, +1
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = my_row + 8 * r;
            *reinterpret_cast<uint32_t*>(smem + swizzled_chunk_offset<kBlockM>(row, c) + within) =
                pack2<Element>(acc_o[4 * i + 2 * r] * inv_sum[r], acc_o[4 * i + 2 * r + 1] * inv_sum[r]);
        }
    }
    __syncthreads();
    store_tile_swizzled<kBlockM, kHeadDim, kNThreads>(o, smem, params.o_row_stride, valid_rows, params.d);
#else
    __trap();  // built without sm_90a: the launcher never picks this kernel (hopper_kernel_traits.h)
#endif
}

}  // namespace flash
