// The v4 backward main kernel (Alg. 2 lines 6-20; the algorithm text and line numbers are in
// flash_bwd_common.cuh). By default every head dim runs flash_bwd_tiled_kernel; this one is launched only with
// FLASH_BWD_TILED_ALL=0 or FLASH_BWD_HD128_VARIANT=0 (kernel_traits.h), for one GPU comparison, then deleted.
//
// Warp w owns key rows [16w, 16w+16) of block j. Computing S^T and dP^T key-major puts P^T and dS^T in
// registers in exactly the A-fragment layout of lines 13 and 17, so dK_j and dV_j accumulate on chip
// with no shared-memory round trip; only dS^T goes through shared memory, for line 16.
#pragma once

#include "flash_bwd_common.cuh"

namespace flash {

template <typename Traits, bool kIsCausal>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_bwd_kernel(const BwdParams params) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kNThreads = Traits::kNThreads;
    constexpr int kStride = Traits::kSmemStride;
    constexpr int kDsStride = Traits::kSmemDsStride;
    constexpr int kNTilesM = kBlockM / kMmaN;   // n8 tiles of S^T / dP^T per warp (queries)
    constexpr int kOutCols = Traits::kOutCols;
    constexpr int kNTilesD = kOutCols / kMmaN;  // n8 tiles of dK / dV per warp
    constexpr int kKStepsD = kHeadDim / kMmaK;
    constexpr int kKStepsM = kBlockM / kMmaK;
    constexpr int kKStepsN = kBlockN / kMmaK;
    constexpr int kDqNTiles = Traits::kDqCols / kMmaN;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    Element* sK = reinterpret_cast<Element*>(smem_raw);                // [kBlockN][kStride]
    Element* sV = sK + Traits::kSmemKVElems;                           // [kBlockN][kStride]
    Element* sQ = sV + Traits::kSmemKVElems;                           // [kNStages][kBlockM][kStride]
    Element* sdO = sQ + Traits::kNStages * Traits::kSmemQTileElems;    // [kNStages][kBlockM][kStride]
    Element* sdS = sdO + Traits::kNStages * Traits::kSmemQTileElems;   // [kBlockN][kDsStride]: dS^T
    float* sLse = reinterpret_cast<float*>(sdS + Traits::kSmemDsElems);  // [kNStages][kBlockM], LSE * log2e
    float* sDelta = sLse + Traits::kNStages * kBlockM;                 // [kNStages][kBlockM]

    const int bidh = blockIdx.y / Traits::kColSplits, bidb = blockIdx.z;
    const int col0 = (blockIdx.y % Traits::kColSplits) * kOutCols;  // this block's dK/dV/dQ columns
    const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    const int seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k, d = params.d;
    const int causal_offset = seqlen_k - seqlen_q;
    const float scale_log2 = params.scale_softmax_log2;
    const int bidh_k = bidh / params.h_h_k_ratio;

    const Element* q = static_cast<const Element*>(params.q_ptr) + bidb * params.q_batch_stride + bidh * params.q_head_stride;
    const Element* dO = static_cast<const Element*>(params.do_ptr) + bidb * params.do_batch_stride + bidh * params.do_head_stride;
    const Element* k = static_cast<const Element*>(params.k_ptr) + bidb * params.k_batch_stride + bidh_k * params.k_head_stride;
    const Element* v = static_cast<const Element*>(params.v_ptr) + bidb * params.v_batch_stride + bidh_k * params.v_head_stride;
    const int64_t row_base = (static_cast<int64_t>(bidb) * params.h + bidh) * seqlen_q;  // into (B, Hq, Tq)
    const float* lse = params.lse_ptr + row_base;
    const float* delta = params.delta_ptr + row_base;
    const int split = params.deterministic ? blockIdx.x : 0;
    float* dq_accum = params.dq_accum_ptr + split * params.dq_accum_split_stride + row_base * params.d_rounded;

    // ldmatrix lane addressing (see utils.cuh).
    const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;    // A from row-major [m][k]
    const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;    // B from [n][k]
    const int bt_row = (lane % 8) + ((lane / 8) % 2) * 8, bt_col = (lane / 16) * 8;  // B from [k][n] (.trans)
    const int at_row = (lane % 8) + (lane / 16) * 8, at_col = ((lane / 8) % 2) * 8;  // A from [k][m] (.trans)
    const int dq_mt = warp % Traits::kDqWarpsM, dq_cg = warp / Traits::kDqWarpsM;   // this warp's dQ tile

    const int num_n_blocks = ceil_div(seqlen_k, kBlockN);
    const int m_block_max = ceil_div(seqlen_q, kBlockM);

    // Alg. 2 line 10: Q_i, dO_i via cp.async; L_i (pre-multiplied by log2e) and D_i via plain stores.
    // Rows past Tq get L = +inf (so P = 0) and D = 0.
    auto load_q_block = [&](int m_block, int stage) {
        const int row0 = m_block * kBlockM;
        copy_tile_async<kBlockM, kHeadDim, kStride, kNThreads>(sQ + stage * Traits::kSmemQTileElems,
                                                               q + row0 * params.q_row_stride, params.q_row_stride,
                                                               seqlen_q - row0, d);
        copy_tile_async<kBlockM, kHeadDim, kStride, kNThreads>(sdO + stage * Traits::kSmemQTileElems,
                                                               dO + row0 * params.do_row_stride, params.do_row_stride,
                                                               seqlen_q - row0, d);
        if (tid < kBlockM) {
            const bool in = row0 + tid < seqlen_q;
            sLse[stage * kBlockM + tid] = in ? lse[row0 + tid] * kLog2e : INFINITY;
            sDelta[stage * kBlockM + tid] = in ? delta[row0 + tid] : 0.f;
        }
    };

    for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
        const int key0 = n_block * kBlockN;
        const int valid_keys = min(kBlockN, seqlen_k - key0);
        // Causal: query blocks that end before the first query seeing key0 contribute nothing.
        const int m_block_min = kIsCausal ? max(0, (key0 - causal_offset) / kBlockM) : 0;

        // Alg. 2 lines 7-8.
        copy_tile_async<kBlockN, kHeadDim, kStride, kNThreads>(sK, k + key0 * params.k_row_stride, params.k_row_stride, valid_keys, d);
        copy_tile_async<kBlockN, kHeadDim, kStride, kNThreads>(sV, v + key0 * params.v_row_stride, params.v_row_stride, valid_keys, d);
        if (m_block_min < m_block_max) load_q_block(m_block_min, 0);
        cp_async_commit();

        float acc_dk[kNTilesD][4], acc_dv[kNTilesD][4];
#pragma unroll
        for (int i = 0; i < kNTilesD; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;
        }
        const uint32_t sK_warp = smem_addr(sK + (warp * kMmaM + a_row) * kStride + a_col);
        const uint32_t sV_warp = smem_addr(sV + (warp * kMmaM + a_row) * kStride + a_col);
        const int key_row = key0 + warp * kMmaM + g;  // this thread's keys: key_row and key_row + 8

        for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
            const int stage = (m_block - m_block_min) % Traits::kNStages;
            // Prefetch i+1 into the other stage: last read in iteration i-1, before its second barrier.
            if (m_block + 1 < m_block_max) load_q_block(m_block + 1, stage ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();

            const Element* sQ_st = sQ + stage * Traits::kSmemQTileElems;
            const Element* sdO_st = sdO + stage * Traits::kSmemQTileElems;
            const float* sLse_st = sLse + stage * kBlockM;
            const float* sDelta_st = sDelta + stage * kBlockM;
            const int query0 = m_block * kBlockM;

            // Alg. 2 line 11: S^T = K_j Q_i^T, (16 keys x kBlockM queries) per warp.
            float p[kNTilesM][4];
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKStepsD; ++kk) {
                uint32_t a[4];
                ldmatrix_x4(a, sK_warp + kk * kMmaK * sizeof(Element));
#pragma unroll
                for (int np = 0; np < kNTilesM / 2; ++np) {
                    uint32_t b[4];
                    ldmatrix_x4(b, smem_addr(sQ_st + (np * 16 + b_row) * kStride + kk * kMmaK + b_col));
                    Mma<Element>::run(p[2 * np], a, b[0], b[1]);
                    Mma<Element>::run(p[2 * np + 1], a, b[2], b[3]);
                }
            }
            // Mask keys past Tk (zero-filled K rows would otherwise give P = exp(-L), which can overflow)
            // and, on diagonal tiles, keys a query may not see.
            const bool need_mask =
                key0 + kBlockN > seqlen_k || (kIsCausal && key0 + kBlockN - 1 > query0 + causal_offset);
            if (need_mask) {
#pragma unroll
                for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key_row + (e >= 2 ? 8 : 0);
                        const int query = query0 + i * kMmaN + 2 * t + (e & 1);
                        if (key >= seqlen_k || (kIsCausal && key > query + causal_offset)) p[i][e] = -INFINITY;
                    }
                }
            }
            // Alg. 2 line 12: P^T = exp2(S^T * scale * log2e - L * log2e).
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) p[i][e] = fast_exp2(fmaf(p[i][e], scale_log2, -sLse_st[i * kMmaN + 2 * t + (e & 1)]));
            }
            // Alg. 2 line 13: dV_j += P^T dO_i, P^T straight from registers as the A operand.
#pragma unroll
            for (int kk = 0; kk < kKStepsM; ++kk) {
                uint32_t a[4];
                a[0] = pack2<Element>(p[2 * kk][0], p[2 * kk][1]);
                a[1] = pack2<Element>(p[2 * kk][2], p[2 * kk][3]);
                a[2] = pack2<Element>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
                a[3] = pack2<Element>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < kNTilesD / 2; ++dp) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, smem_addr(sdO_st + (kk * kMmaK + bt_row) * kStride + col0 + dp * 16 + bt_col));
                    Mma<Element>::run(acc_dv[2 * dp], a, b[0], b[1]);
                    Mma<Element>::run(acc_dv[2 * dp + 1], a, b[2], b[3]);
                }
            }
            // Alg. 2 line 14: dP^T = V_j dO_i^T.
            float ds[kNTilesM][4];
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) ds[i][0] = ds[i][1] = ds[i][2] = ds[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKStepsD; ++kk) {
                uint32_t a[4];
                ldmatrix_x4(a, sV_warp + kk * kMmaK * sizeof(Element));
#pragma unroll
                for (int np = 0; np < kNTilesM / 2; ++np) {
                    uint32_t b[4];
                    ldmatrix_x4(b, smem_addr(sdO_st + (np * 16 + b_row) * kStride + kk * kMmaK + b_col));
                    Mma<Element>::run(ds[2 * np], a, b[0], b[1]);
                    Mma<Element>::run(ds[2 * np + 1], a, b[2], b[3]);
                }
            }
            // Alg. 2 line 15: dS^T = P^T o (dP^T - D_i).
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[i][e] = p[i][e] * (ds[i][e] - sDelta_st[i * kMmaN + 2 * t + (e & 1)]);
            }
            // Alg. 2 line 17: dK_j += dS^T Q_i (softmax_scale applied once in the epilogue).
#pragma unroll
            for (int kk = 0; kk < kKStepsM; ++kk) {
                uint32_t a[4];
                a[0] = pack2<Element>(ds[2 * kk][0], ds[2 * kk][1]);
                a[1] = pack2<Element>(ds[2 * kk][2], ds[2 * kk][3]);
                a[2] = pack2<Element>(ds[2 * kk + 1][0], ds[2 * kk + 1][1]);
                a[3] = pack2<Element>(ds[2 * kk + 1][2], ds[2 * kk + 1][3]);
                // dS^T -> shared memory for line 16 (the previous iteration's readers passed this
                // iteration's first barrier).
                const int r = warp * kMmaM + g;
                const int c = kk * kMmaK + 2 * t;
                *reinterpret_cast<uint32_t*>(sdS + r * kDsStride + c) = a[0];
                *reinterpret_cast<uint32_t*>(sdS + (r + 8) * kDsStride + c) = a[1];
                *reinterpret_cast<uint32_t*>(sdS + r * kDsStride + c + 8) = a[2];
                *reinterpret_cast<uint32_t*>(sdS + (r + 8) * kDsStride + c + 8) = a[3];
#pragma unroll
                for (int dp = 0; dp < kNTilesD / 2; ++dp) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, smem_addr(sQ_st + (kk * kMmaK + bt_row) * kStride + col0 + dp * 16 + bt_col));
                    Mma<Element>::run(acc_dk[2 * dp], a, b[0], b[1]);
                    Mma<Element>::run(acc_dk[2 * dp + 1], a, b[2], b[3]);
                }
            }
            __syncthreads();  // dS^T complete; also every read of this stage's Q_i / dO_i / L_i / D_i is done

            // Alg. 2 line 16: dQ_i += dS K_j, this warp's (16 queries x kDqCols) tile.
            float dq[kDqNTiles][4];
#pragma unroll
            for (int i = 0; i < kDqNTiles; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKStepsN; ++kk) {
                uint32_t a[4];
                ldmatrix_x4_trans(a, smem_addr(sdS + (kk * kMmaK + at_row) * kDsStride + dq_mt * kMmaM + at_col));
#pragma unroll
                for (int dp = 0; dp < kDqNTiles / 2; ++dp) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, smem_addr(sK + (kk * kMmaK + bt_row) * kStride + col0 + dq_cg * Traits::kDqCols +
                                                   dp * 16 + bt_col));
                    Mma<Element>::run(dq[2 * dp], a, b[0], b[1]);
                    Mma<Element>::run(dq[2 * dp + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int query = query0 + dq_mt * kMmaM + g + r * 8;
                if (query < seqlen_q) {
                    float* dst_row = dq_accum + static_cast<int64_t>(query) * params.d_rounded;
#pragma unroll
                    for (int i = 0; i < kDqNTiles; ++i) {
                        const int col = col0 + dq_cg * Traits::kDqCols + i * kMmaN + 2 * t;
                        if (col < d) {
                            float2* dst = reinterpret_cast<float2*>(dst_row + col);
                            const float2 val = make_float2(dq[i][2 * r], dq[i][2 * r + 1]);
                            if (params.deterministic) {
                                const float2 old = *dst;  // this block owns the split: ordered, no atomics
                                *dst = make_float2(old.x + val.x, old.y + val.y);
                            } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                                atomicAdd(dst, val);  // one 8-byte red.global.add.v2.f32 on sm90
#else
                                atomicAdd(&dst->x, val.x);
                                atomicAdd(&dst->y, val.y);
#endif
                            }
                        }
                    }
                }
            }
        }

        // Alg. 2 line 19: stage dK_j (scaled) and dV_j through this block's K/V tiles (columns [0, kOutCols)),
        // then 16-byte stores to columns [col0, col0 + kOutCols).
        cp_async_wait<0>();  // nothing in flight may land in sK/sV after the staging stores
        __syncthreads();     // every warp finished reading sK / sV
        {
            const int r = warp * kMmaM + g;
            const float sc = params.scale_softmax;
#pragma unroll
            for (int i = 0; i < kNTilesD; ++i) {
                const int c = i * kMmaN + 2 * t;
                *reinterpret_cast<uint32_t*>(sK + r * kStride + c) = pack2<Element>(acc_dk[i][0] * sc, acc_dk[i][1] * sc);
                *reinterpret_cast<uint32_t*>(sK + (r + 8) * kStride + c) = pack2<Element>(acc_dk[i][2] * sc, acc_dk[i][3] * sc);
                *reinterpret_cast<uint32_t*>(sV + r * kStride + c) = pack2<Element>(acc_dv[i][0], acc_dv[i][1]);
                *reinterpret_cast<uint32_t*>(sV + (r + 8) * kStride + c) = pack2<Element>(acc_dv[i][2], acc_dv[i][3]);
            }
        }
        __syncthreads();
        Element* dk = static_cast<Element*>(params.dk_ptr) + bidb * params.dk_batch_stride + bidh * params.dk_head_stride +
                      key0 * params.dk_row_stride + col0;
        Element* dv = static_cast<Element*>(params.dv_ptr) + bidb * params.dv_batch_stride + bidh * params.dv_head_stride +
                      key0 * params.dv_row_stride + col0;
        store_tile<kBlockN, kOutCols, kStride, kNThreads>(dk, sK, params.dk_row_stride, valid_keys, d - col0);
        store_tile<kBlockN, kOutCols, kStride, kNThreads>(dv, sV, params.dv_row_stride, valid_keys, d - col0);
        __syncthreads();  // the next K/V block's loads overwrite sK / sV
    }
}

}  // namespace flash
