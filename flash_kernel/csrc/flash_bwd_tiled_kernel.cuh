// FlashAttention-2 backward main kernel (Alg. 2 lines 6-20; the algorithm text and the line numbers cited
// here are in flash_bwd_common.cuh) with a configurable warp tiling of each matmul phase, set per head dim
// by BwdTiledTraits (kernel_traits.h).
//
// Why: with one m16 tile of keys per warp the backward reads (hd128) ~94 KB of shared memory per warp per
// query block through ldmatrix for 320 MMAs (14 FLOP/byte), i.e. it is bound by shared-memory bandwidth
// (128 B/clk/SM) before the tensor cores. A warp tile of m x n rows/columns loads (m + n) / (m n) fragments
// per MMA, so squarer warp tiles read less; the price is shared-memory round trips for P^T / dS^T and, with
// late loads, barriers.
#pragma once

#include "flash_bwd_common.cuh"

namespace flash {

// Write a warp's (kMTiles m16 x kNTiles n8) fp32 C fragments, times sc, as Element into a row-major
// shared-memory tile laid out as Tile: fragment (mt, i) lands at rows row0 + 16 mt + {0, 8}, columns col0 + 8 i
// (row0 and col0 already include this lane's g and 2t).
template <int kMTiles, int kNTiles, typename Tile, typename Element>
__device__ __forceinline__ void store_acc_tile(Element* s, const float (&acc)[kMTiles][kNTiles][4], int row0, int col0,
                                               float sc) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int i = 0; i < kNTiles; ++i) {
            Element* dst = s + Tile::index(row0 + mt * kMmaM, col0 + i * kMmaN);
            *reinterpret_cast<uint32_t*>(dst) = pack2<Element>(acc[mt][i][0] * sc, acc[mt][i][1] * sc);
            // 8 rows down keeps the row's swizzle
            *reinterpret_cast<uint32_t*>(dst + 8 * Tile::kStride) = pack2<Element>(acc[mt][i][2] * sc, acc[mt][i][3] * sc);
        }
    }
}

// The order in which a thread block of this kernel walks its query blocks [m_min, m_max): iteration `it`
// visits m_min + (it + rot) mod n. kRotate (the non-causal kernel): rot = n_block mod n, so that the blocks of
// one head that run together (consecutive n_block) add into different dQ tiles instead of all into the same
// one in lockstep, which is faster at every non-causal shape measured. Causal blocks already start at different
// query blocks; the Hopper kernel gains nothing from it.
struct QueryBlockOrder {
    int m_min, n, rot;
    __device__ __forceinline__ int operator()(int it) const {
        const int x = it + rot;
        return m_min + (x >= n ? x - n : x);
    }
};
template <bool kRotate>
__device__ __forceinline__ QueryBlockOrder query_block_order(int m_min, int m_max, int n_block) {
    const int n = m_max - m_min;
    return {m_min, n, kRotate && n > 0 ? n_block % n : 0};
}

// Warp tiling (knobs in BwdTiledTraits). With kSdpWarpsQ = 1 a warp owns kBlockN / kNWarps keys and every query
// of the block for S^T and dP^T, and P^T stays in registers as the A operand of dV += P^T dO; kSdpWarpsQ > 1 splits
// S^T/dP^T over queries too, so P^T goes through shared memory and dV is computed after the barrier. dK (and dV
// there) run after the barrier on their own (keys x columns) warp tile, reading dS^T (P^T) from shared memory.
// kDqWarpsM < kBlockM / 16 gives dQ warps several m16 tiles.
// kVarlenWindow (its own instantiation; the dense ones compile without its branches): per-sequence lengths and
// rows from cu_seqlens (grid.z runs over sequences; key blocks past a sequence's end do nothing) and the sliding
// window, causal as window_right = 0 (seq_bounds, flash_params.h). A key block visits only the query blocks whose
// windows reach it, [m_block_min, m_block_end), and masks the tiles that cross a window edge; keys that no query
// sees get dK = dV = 0.
template <typename Traits, bool kIsCausal, bool kVarlenWindow = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_bwd_tiled_kernel(const BwdParams params) {
    static_assert(!(kIsCausal && kVarlenWindow), "kVarlenWindow reads causal as window_right = 0");
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kNThreads = Traits::kNThreads;
    constexpr int kNWarps = Traits::kNWarps;
    using Tile = typename Traits::Tile;  // shared-memory layout of K, V, Q, dO (smem_tile.h)
    using DsTile = typename Traits::DsTile;  // dS^T and P^T: padded rows of kBlockM queries
    constexpr int kDsStride = Traits::kSmemDsStride;
    constexpr int kOutCols = Traits::kOutCols;
    constexpr int kNTilesD = kOutCols / kMmaN;  // n8 tiles of dV per warp (P^T from registers)
    constexpr int kKStepsD = kHeadDim / kMmaK;
    constexpr int kKStepsM = kBlockM / kMmaK;
    constexpr int kKStepsN = kBlockN / kMmaK;
    // S^T / dP^T warp tile: kSdpKTiles key m16 tiles x kSdpQCols queries.
    constexpr int kSdpWarpsK = kNWarps / Traits::kSdpWarpsQ;
    constexpr int kSdpKTiles = kBlockN / (kMmaM * kSdpWarpsK);
    constexpr int kSdpQCols = kBlockM / Traits::kSdpWarpsQ;
    constexpr int kNTilesM = kSdpQCols / kMmaN;  // n8 tiles of S^T / dP^T per warp (queries)
    constexpr bool kPInSmem = Traits::kSdpWarpsQ > 1;
    constexpr bool kAddrInAsm = Traits::kLdsmAddrInAsm;  // ldmatrix_tile (utils.cuh)
    // dK, and dV where P^T is in shared memory, computed after the barrier: kDkvKTiles key m16 tiles x kDkvCols.
    constexpr int kDkvWarpsK = kNWarps / Traits::kDkvWarpsD;
    constexpr int kDkvKTiles = kBlockN / (kMmaM * kDkvWarpsK);
    constexpr int kDkvCols = kOutCols / Traits::kDkvWarpsD;
    constexpr int kDkvNTiles = kDkvCols / kMmaN;
    constexpr int kDvKTiles = kPInSmem ? kDkvKTiles : 1, kDvNTiles = kPInSmem ? kDkvNTiles : kNTilesD;
    constexpr int kDqMTiles = kBlockM / (kMmaM * Traits::kDqWarpsM);
    constexpr int kDqNTiles = Traits::kDqCols / kMmaN;
    static_assert(kPInSmem || kSdpKTiles == 1, "P^T from registers: a warp's S^T tile is one m16 tile of keys");
    // Tile::step moves a lane's ldmatrix address by chunk offsets whose bits must be disjoint from the lane's own
    // column's: warps' column offsets (multiples of kOutCols, kDkvCols, kDqCols) must be powers of two.
    static_assert(!Tile::kSwizzled || ((kOutCols & (kOutCols - 1)) == 0 && (kDkvCols & (kDkvCols - 1)) == 0 &&
                                       (Traits::kDqCols & (Traits::kDqCols - 1)) == 0),
                  "swizzled tiles: warp column offsets must be powers of two");
    constexpr uint32_t kQTileBytes = Traits::kSmemQTileElems * sizeof(Element);

    extern __shared__ __align__(16) unsigned char smem_raw[];
    Element* sK = reinterpret_cast<Element*>(align_smem<Tile::kAlign>(smem_raw));  // [kBlockN][kHeadDim] as Tile
    Element* sV = sK + Traits::kSmemKVElems;                           // [kBlockN][kHeadDim] as Tile
    Element* sQ = sV + Traits::kSmemKVElems;                           // [kNStages][kBlockM][kHeadDim] as Tile
    Element* sdO = sQ + Traits::kNStages * Traits::kSmemQTileElems;    // [kDoStages][kBlockM][kHeadDim] as Tile
    Element* sdS = sdO + Traits::kDoStages * Traits::kSmemQTileElems;  // [kBlockN][kDsStride]: dS^T
    Element* sP = sdS + Traits::kSmemDsElems;                          // [kBlockN][kDsStride]: P^T (kPInSmem)
    float* sLse = reinterpret_cast<float*>(sP + Traits::kSmemPElems);  // [kNStages][kBlockM]
    float* sDelta = sLse + Traits::kNStages * kBlockM;                 // [kNStages][kBlockM]

    const int bidh = blockIdx.y / Traits::kColSplits, bidb = blockIdx.z;
    const int col0 = (blockIdx.y % Traits::kColSplits) * kOutCols;  // this block's dK/dV/dQ columns
    const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    const SeqBounds seq = kVarlenWindow ? seq_bounds(params, bidb)
                                        : SeqBounds{params.seqlen_q, params.seqlen_k, 0, 0, -1, -1};
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, d = params.d;
    const int causal_offset = seqlen_k - seqlen_q;
    const float scale_log2 = params.scale_softmax_log2;
    const int bidh_k = bidh / params.h_h_k_ratio;

    // The sequence's rows: seq.q_row0 and seq.k_row0 are 0 in the dense kernels (the batch stride places them).
    const Element* q = static_cast<const Element*>(params.q_ptr) + bidb * params.q_batch_stride + bidh * params.q_head_stride +
                       static_cast<int64_t>(seq.q_row0) * params.q_row_stride;
    const Element* dO = static_cast<const Element*>(params.do_ptr) + bidb * params.do_batch_stride +
                        bidh * params.do_head_stride + static_cast<int64_t>(seq.q_row0) * params.do_row_stride;
    const Element* k = static_cast<const Element*>(params.k_ptr) + bidb * params.k_batch_stride +
                       bidh_k * params.k_head_stride + static_cast<int64_t>(seq.k_row0) * params.k_row_stride;
    const Element* v = static_cast<const Element*>(params.v_ptr) + bidb * params.v_batch_stride +
                       bidh_k * params.v_head_stride + static_cast<int64_t>(seq.k_row0) * params.v_row_stride;
    // Into lse and delta ((B, Hq, Tq), or (Hq, total_q)) and one split of dq_accum ((B, Hq, Tq, .), or varlen's
    // (Hq, dq_accum_rows, .) with padded sequence starts).
    const int64_t row_base = kVarlenWindow ? lse_row0(params, seq, bidb, bidh)
                                           : (static_cast<int64_t>(bidb) * params.h + bidh) * seqlen_q;
    const int64_t accum_row_base = kVarlenWindow && params.cu_seqlens_q != nullptr
                                       ? bidh * dq_accum_rows(params.total_q, params.b) + dq_accum_row0(seq.q_row0, bidb)
                                       : row_base;
    const float* lse = params.lse_ptr + row_base;
    const float* delta = params.delta_ptr + row_base;
    const int split = params.deterministic ? blockIdx.x : 0;
    float* dq_accum = params.dq_accum_ptr + split * params.dq_accum_split_stride + accum_row_base * params.d_rounded;

    // ldmatrix lane addressing (see utils.cuh).
    const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;    // A from row-major [m][k]
    const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;    // B from [n][k]
    const int bt_row = (lane % 8) + ((lane / 8) % 2) * 8, bt_col = (lane / 16) * 8;  // B from [k][n] (.trans)
    const int at_row = (lane % 8) + (lane / 16) * 8, at_col = ((lane / 8) % 2) * 8;  // A from [k][m] (.trans)
    // This warp's tiles: first key (row of sK) and query (row of sQ) or column, relative to the block.
    const int sdp_key0 = (warp % kSdpWarpsK) * kSdpKTiles * kMmaM, sdp_q0 = (warp / kSdpWarpsK) * kSdpQCols;
    const int dkv_key0 = (warp % kDkvWarpsK) * kDkvKTiles * kMmaM, dkv_c0 = (warp / kDkvWarpsK) * kDkvCols;
    const int dq_q0 = (warp % Traits::kDqWarpsM) * kDqMTiles * kMmaM, dq_c0 = (warp / Traits::kDqWarpsM) * Traits::kDqCols;
    // Byte offsets, inside a tile, of this lane's first ldmatrix address per operand; Tile::step walks from them.
    const uint32_t q_b_lane = Tile::index(sdp_q0 + b_row, b_col) * sizeof(Element);            // Q_i, dO_i as B
    const uint32_t q_bt_lane = Tile::index(bt_row, col0 + bt_col) * sizeof(Element);           // dO_i as B^T
    const uint32_t dkv_bt_lane = Tile::index(bt_row, col0 + dkv_c0 + bt_col) * sizeof(Element);  // after the barrier
    const uint32_t dq_bt_lane = Tile::index(bt_row, col0 + dq_c0 + bt_col) * sizeof(Element);     // K_j as B^T
    // This lane's first dQ element (row dq_q0 + g, column col0 + dq_c0 + 2t) in a query block's dq_accum rows, which
    // are kHeadDim floats long (d_rounded: the launch dispatches on it), so every add is a constant offset from it.
    const int dq_lane = (dq_q0 + g) * kHeadDim + col0 + dq_c0 + 2 * t;
    // Traits::kDqStaged: this warp's (16 x 32) fp32 staging tile, in the P^T buffer or after sDelta (BwdDqStagedTraits);
    // the shared addresses of this lane's first C fragment (row g, column 2t) and of the first 16-byte chunk it reads
    // back (8 lanes per row, kDqStageRows rows per read), and the dq_accum element it adds to.
    using DqStage = DqStageTile<Traits::kDqCols>;
    constexpr int kDqStageRows = kWarpSize * 4 / Traits::kDqCols;
    const float* sDqStage = (Traits::kDqStageInP ? reinterpret_cast<const float*>(sP) : sDelta + Traits::kNStages * kBlockM) +
                            warp * kMmaM * Traits::kDqCols;
    const int dq_stage_row = lane / (Traits::kDqCols / 4), dq_stage_col = lane % (Traits::kDqCols / 4) * 4;
    constexpr int kPOffsetBytes = (2 * Traits::kSmemKVElems + (Traits::kNStages + Traits::kDoStages) * Traits::kSmemQTileElems +
                                   Traits::kSmemDsElems) * sizeof(Element);
    constexpr int kDqStageOffsetBytes = kPOffsetBytes + (Traits::kDqStageInP ? 0 : Traits::kSmemPElems * sizeof(Element) +
                                                                                     2 * Traits::kNStages * kBlockM * sizeof(float));
    static_assert(!Traits::kDqStaged || (Tile::kAlign % 128 == 0 && kDqStageOffsetBytes % 128 == 0),
                  "DqStageTile::step needs the staging tiles 128-byte aligned");
    const uint32_t dq_st_lane = smem_addr(sDqStage + DqStage::index(g, 2 * t));
    const uint32_t dq_ld_lane = smem_addr(sDqStage + DqStage::index(dq_stage_row, dq_stage_col));
    const int dq_stage_lane = (dq_q0 + dq_stage_row) * kHeadDim + col0 + dq_c0 + dq_stage_col;

    const int num_n_blocks = ceil_div(seqlen_k, kBlockN);
    const int m_block_max = ceil_div(seqlen_q, kBlockM);

    // Alg. 2 line 10: Q_i, dO_i, L_i and D_i via cp.async (rows past Tq zero-filled: load_lse_delta).
    auto load_q = [&](int m_block, int stage) {
        const int row0 = m_block * kBlockM;
        copy_tile_async_stepped<kBlockM, Tile, kNThreads>(
            sQ + stage * Traits::kSmemQTileElems, q + row0 * params.q_row_stride, params.q_row_stride, seqlen_q - row0, d);
    };
    auto load_do = [&](int m_block, int stage) {
        const int row0 = m_block * kBlockM;
        copy_tile_async_stepped<kBlockM, Tile, kNThreads>(
            sdO + stage * Traits::kSmemQTileElems, dO + row0 * params.do_row_stride, params.do_row_stride, seqlen_q - row0, d);
    };
    auto load_lse_delta = [&](int m_block, int stage) {
        flash::load_lse_delta<kBlockM>(sLse + stage * kBlockM, sDelta + stage * kBlockM, lse, delta, m_block * kBlockM,
                                       seqlen_q, tid);
    };
    // acc (kDkvKTiles x kDkvNTiles, this warp's dK/dV tile) += X^T Y over the block's kBlockM queries:
    // X^T (keys x queries) from sXt [kBlockN][kDsStride] (P^T or dS^T), Y (queries x head dim) from the tile
    // whose address plus dkv_bt_lane is y_at.
    auto mma_xt_y = [&](float (&acc)[kDkvKTiles][kDkvNTiles][4], const Element* sXt, uint32_t y_at) {
#pragma unroll
        for (int kk = 0; kk < kKStepsM; ++kk) {
            uint32_t a[kDkvKTiles][4];
#pragma unroll
            for (int mt = 0; mt < kDkvKTiles; ++mt) {
                ldmatrix_x4(a[mt], smem_addr(sXt + (dkv_key0 + mt * kMmaM + a_row) * kDsStride + kk * kMmaK + a_col));
            }
#pragma unroll
            for (int dp = 0; dp < kDkvNTiles / 2; ++dp) {
                uint32_t b[4];
                ldmatrix_tile<Tile, true, kAddrInAsm>(b, y_at, kk * kMmaK, dp * 16);
#pragma unroll
                for (int mt = 0; mt < kDkvKTiles; ++mt) {
                    Mma<Element>::run(acc[mt][2 * dp], a[mt], b[0], b[1]);
                    Mma<Element>::run(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
                }
            }
        }
    };

    for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
        const int key0 = n_block * kBlockN;
        const int valid_keys = min(kBlockN, seqlen_k - key0);
        // Causal: query blocks that end before the first query seeing key0 contribute nothing.
        int m_block_min = kIsCausal ? max(0, (key0 - causal_offset) / kBlockM) : 0;
        int m_block_end = m_block_max;
        if constexpr (kVarlenWindow) {
            // Query blocks wholly before the first query whose window reaches key0, or after the last one whose
            // window reaches this block's last key, contribute nothing.
            if (seq.window_right >= 0) {
                m_block_min = max(0, floor_div(key0 - causal_offset - seq.window_right, kBlockM));
            }
            if (seq.window_left >= 0) {
                m_block_end = min(m_block_end, floor_div(key0 + valid_keys - 1 + seq.window_left - causal_offset, kBlockM) + 1);
            }
        }

        // Alg. 2 lines 7-8.
        copy_tile_async_stepped<kBlockN, Tile, kNThreads>(sK, k + key0 * params.k_row_stride, params.k_row_stride,
                                                          valid_keys, d);
        copy_tile_async_stepped<kBlockN, Tile, kNThreads>(sV, v + key0 * params.v_row_stride, params.v_row_stride,
                                                          valid_keys, d);
        const QueryBlockOrder order = query_block_order<!kIsCausal>(m_block_min, m_block_end, n_block);
        if (order.n > 0) {
            load_q(order(0), 0);
            load_do(order(0), 0);
            load_lse_delta(order(0), 0);
        }
        cp_async_commit();

        float acc_dk[kDkvKTiles][kDkvNTiles][4], acc_dv[kDvKTiles][kDvNTiles][4];
#pragma unroll
        for (int mt = 0; mt < kDkvKTiles; ++mt) {
#pragma unroll
            for (int i = 0; i < kDkvNTiles; ++i) acc_dk[mt][i][0] = acc_dk[mt][i][1] = acc_dk[mt][i][2] = acc_dk[mt][i][3] = 0.f;
        }
#pragma unroll
        for (int mt = 0; mt < kDvKTiles; ++mt) {
#pragma unroll
            for (int i = 0; i < kDvNTiles; ++i) acc_dv[mt][i][0] = acc_dv[mt][i][1] = acc_dv[mt][i][2] = acc_dv[mt][i][3] = 0.f;
        }
        const uint32_t sK_warp = smem_addr(sK + Tile::index(sdp_key0 + a_row, a_col));
        const uint32_t sV_warp = smem_addr(sV + Tile::index(sdp_key0 + a_row, a_col));
        const int key_row = key0 + sdp_key0 + g;  // this thread's keys: key_row + 16 mt + {0, 8}

        for (int it = 0; it < order.n; ++it) {
            const int m_block = order(it);
            const int stage = it % Traits::kNStages;
            const int do_stage = Traits::kDoStages == 2 ? stage : 0;
            // Q_{i-1} (the other stage) was read by dK after iteration i-1's second barrier, so Q_{i+1}
            // may overwrite it only once every warp has passed this barrier.
            cp_async_wait<0>();
            __syncthreads();
            if (it + 1 < order.n) {
                load_q(order(it + 1), stage ^ 1);
                if (Traits::kDoStages == 2) load_do(order(it + 1), stage ^ 1);
                load_lse_delta(order(it + 1), stage ^ 1);
            }
            cp_async_commit();

            // This iteration's lane addresses (launder: utils.cuh).
            const uint32_t sQ_st = smem_addr(sQ) + stage * kQTileBytes, sdO_st = smem_addr(sdO) + do_stage * kQTileBytes;
            const uint32_t k_a = launder(sK_warp), v_a = launder(sV_warp), k_bt = launder(smem_addr(sK) + dq_bt_lane);
            const uint32_t q_b = launder(sQ_st + q_b_lane), do_b = launder(sdO_st + q_b_lane);
            const float* sLse_st = sLse + stage * kBlockM;
            const float* sDelta_st = sDelta + stage * kBlockM;
            const int query0 = m_block * kBlockM;

            // Alg. 2 line 11: S^T = K_j Q_i^T, (16 kSdpKTiles keys x kSdpQCols queries) per warp.
            float p[kSdpKTiles][kNTilesM][4];
#pragma unroll
            for (int mt = 0; mt < kSdpKTiles; ++mt) {
#pragma unroll
                for (int i = 0; i < kNTilesM; ++i) p[mt][i][0] = p[mt][i][1] = p[mt][i][2] = p[mt][i][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < kKStepsD; ++kk) {
                uint32_t a[kSdpKTiles][4];
#pragma unroll
                for (int mt = 0; mt < kSdpKTiles; ++mt) ldmatrix_tile<Tile, false, kAddrInAsm>(a[mt], k_a, mt * kMmaM, kk * kMmaK);
#pragma unroll
                for (int np = 0; np < kNTilesM / 2; ++np) {
                    uint32_t b[4];
                    ldmatrix_tile<Tile, false, kAddrInAsm>(b, q_b, np * 16, kk * kMmaK);
#pragma unroll
                    for (int mt = 0; mt < kSdpKTiles; ++mt) {
                        Mma<Element>::run(p[mt][2 * np], a[mt], b[0], b[1]);
                        Mma<Element>::run(p[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            // Mask keys past Tk (zero-filled K rows would otherwise give P = exp(-L), which can overflow)
            // and, on diagonal tiles, keys a query may not see.
            bool need_mask = key0 + kBlockN > seqlen_k || (kIsCausal && key0 + kBlockN - 1 > query0 + causal_offset);
            if constexpr (kVarlenWindow) {
                need_mask = need_mask ||
                            (seq.window_right >= 0 && key0 + kBlockN - 1 > query0 + causal_offset + seq.window_right) ||
                            (seq.window_left >= 0 && key0 < query0 + kBlockM - 1 + causal_offset - seq.window_left);
            }
            if (need_mask) {
#pragma unroll
                for (int mt = 0; mt < kSdpKTiles; ++mt) {
#pragma unroll
                    for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = key_row + mt * kMmaM + (e >= 2 ? 8 : 0);
                            const int query = query0 + sdp_q0 + i * kMmaN + 2 * t + (e & 1);
                            bool masked = key >= seqlen_k || (kIsCausal && key > query + causal_offset);
                            if constexpr (kVarlenWindow) {
                                masked = masked ||
                                         (seq.window_right >= 0 && key > query + causal_offset + seq.window_right) ||
                                         (seq.window_left >= 0 && key < query + causal_offset - seq.window_left);
                            }
                            if (masked) p[mt][i][e] = -INFINITY;
                        }
                    }
                }
            }
            // Alg. 2 line 12: P^T = exp2(S^T * scale * log2e - L * log2e). A thread's two query columns of an n8 tile
            // are adjacent: L_i (and D_i below) read as one 8-byte pair per tile, half the shared loads of one per column.
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) {
                const float2 lse_pair = *reinterpret_cast<const float2*>(sLse_st + sdp_q0 + i * kMmaN + 2 * t);
#pragma unroll
                for (int mt = 0; mt < kSdpKTiles; ++mt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        p[mt][i][e] = fast_exp2(fmaf(p[mt][i][e], scale_log2, -kLog2e * ((e & 1) ? lse_pair.y : lse_pair.x)));
                    }
                }
            }
            if constexpr (!kPInSmem) {
                // Alg. 2 line 13: dV_j += P^T dO_i, P^T straight from registers as the A operand.
                const uint32_t do_bt = launder(sdO_st + q_bt_lane);
#pragma unroll
                for (int kk = 0; kk < kKStepsM; ++kk) {
                    uint32_t a[4];
                    a[0] = pack2<Element>(p[0][2 * kk][0], p[0][2 * kk][1]);
                    a[1] = pack2<Element>(p[0][2 * kk][2], p[0][2 * kk][3]);
                    a[2] = pack2<Element>(p[0][2 * kk + 1][0], p[0][2 * kk + 1][1]);
                    a[3] = pack2<Element>(p[0][2 * kk + 1][2], p[0][2 * kk + 1][3]);
#pragma unroll
                    for (int dp = 0; dp < kNTilesD / 2; ++dp) {
                        uint32_t b[4];
                        ldmatrix_tile<Tile, true, kAddrInAsm>(b, do_bt, kk * kMmaK, dp * 16);
                        Mma<Element>::run(acc_dv[0][2 * dp], a, b[0], b[1]);
                        Mma<Element>::run(acc_dv[0][2 * dp + 1], a, b[2], b[3]);
                    }
                }
            }
            // Alg. 2 line 14: dP^T = V_j dO_i^T.
            float ds[kSdpKTiles][kNTilesM][4];
#pragma unroll
            for (int mt = 0; mt < kSdpKTiles; ++mt) {
#pragma unroll
                for (int i = 0; i < kNTilesM; ++i) ds[mt][i][0] = ds[mt][i][1] = ds[mt][i][2] = ds[mt][i][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < kKStepsD; ++kk) {
                uint32_t a[kSdpKTiles][4];
#pragma unroll
                for (int mt = 0; mt < kSdpKTiles; ++mt) ldmatrix_tile<Tile, false, kAddrInAsm>(a[mt], v_a, mt * kMmaM, kk * kMmaK);
#pragma unroll
                for (int np = 0; np < kNTilesM / 2; ++np) {
                    uint32_t b[4];
                    ldmatrix_tile<Tile, false, kAddrInAsm>(b, do_b, np * 16, kk * kMmaK);
#pragma unroll
                    for (int mt = 0; mt < kSdpKTiles; ++mt) {
                        Mma<Element>::run(ds[mt][2 * np], a[mt], b[0], b[1]);
                        Mma<Element>::run(ds[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            // Alg. 2 line 15: dS^T = P^T o (dP^T - D_i).
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) {
                const float2 delta_pair = *reinterpret_cast<const float2*>(sDelta_st + sdp_q0 + i * kMmaN + 2 * t);
#pragma unroll
                for (int mt = 0; mt < kSdpKTiles; ++mt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        ds[mt][i][e] = p[mt][i][e] * (ds[mt][i][e] - ((e & 1) ? delta_pair.y : delta_pair.x));
                    }
                }
            }
            // dS^T (and P^T when dV needs other warps' queries) -> shared memory, for lines 13, 16, 17
            // after the barrier. The previous iteration's readers passed this iteration's first barrier.
            store_acc_tile<kSdpKTiles, kNTilesM, DsTile>(sdS, ds, sdp_key0 + g, sdp_q0 + 2 * t, 1.f);
            if constexpr (kPInSmem) store_acc_tile<kSdpKTiles, kNTilesM, DsTile>(sP, p, sdp_key0 + g, sdp_q0 + 2 * t, 1.f);
            __syncthreads();  // dS^T (and P^T) complete

            if constexpr (kPInSmem) {
                // Alg. 2 line 13: dV_j += P^T dO_i, this warp's (keys x columns) tile.
                mma_xt_y(acc_dv, sP, launder(sdO_st + dkv_bt_lane));
            }
            if constexpr (Traits::kDoStages == 1) {
                if constexpr (kPInSmem) __syncthreads();  // every warp's last read of dO_i (dV) is done
                if (it + 1 < order.n) load_do(order(it + 1), 0);
                cp_async_commit();
            }
            // Alg. 2 line 17: dK_j += dS^T Q_i, this warp's (keys x columns) tile; here or after dQ_i's adds (kDqFirst).
            // The softmax scale is applied once, in the epilogue.
            auto dk_from_smem = [&] { mma_xt_y(acc_dk, sdS, launder(sQ_st + dkv_bt_lane)); };
            if constexpr (!Traits::kDqFirst) dk_from_smem();

            // Alg. 2 line 16: dQ_i += dS K_j, this warp's (16 kDqMTiles queries x kDqCols) tile.
            float dq[kDqMTiles][kDqNTiles][4];
#pragma unroll
            for (int mt = 0; mt < kDqMTiles; ++mt) {
#pragma unroll
                for (int i = 0; i < kDqNTiles; ++i) dq[mt][i][0] = dq[mt][i][1] = dq[mt][i][2] = dq[mt][i][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < kKStepsN; ++kk) {
                uint32_t a[kDqMTiles][4];
#pragma unroll
                for (int mt = 0; mt < kDqMTiles; ++mt) {
                    ldmatrix_x4_trans(a[mt], smem_addr(sdS + (kk * kMmaK + at_row) * kDsStride + dq_q0 + mt * kMmaM + at_col));
                }
#pragma unroll
                for (int dp = 0; dp < kDqNTiles / 2; ++dp) {
                    uint32_t b[4];
                    ldmatrix_tile<Tile, true, kAddrInAsm>(b, k_bt, kk * kMmaK, dp * 16);
#pragma unroll
                    for (int mt = 0; mt < kDqMTiles; ++mt) {
                        Mma<Element>::run(dq[mt][2 * dp], a[mt], b[0], b[1]);
                        Mma<Element>::run(dq[mt][2 * dp + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            // Add dQ_i's tile into dq_accum. Columns at or past d get exact zeros (K_j's are zero-filled) in
            // zeroed columns that the convert kernel never reads, so only rows past Tq are skipped. One uniform
            // branch on the mode, not one per add: per-add row, column and mode branches make this tail a large share
            // of the warps' stall samples.
            if constexpr (Traits::kDqStaged) {
                // One m16 tile at a time through this warp's staging tile (BwdDqStagedTraits): fragments in, whole
                // 16-byte row chunks out, so each add covers kDqStageRows rows of whole 128-byte lines. Staging the
                // whole warp tile and reading it all before the first add is slower: its adds wait on the SM's
                // global-memory queue again. Only a last, partial query block checks rows (a uniform branch): under a
                // per-add check ptxas branches around every add.
                float* dq_rows = launder(dq_accum + static_cast<int64_t>(query0) * kHeadDim + dq_stage_lane);
                const int rows_left = seqlen_q - (query0 + dq_q0 + dq_stage_row);  // this lane's rows r < rows_left exist
                const uint32_t st_at = launder(dq_st_lane), ld_at = launder(dq_ld_lane);
                auto add_dq = [&](auto add, auto checked) {
#pragma unroll
                    for (int mt = 0; mt < kDqMTiles; ++mt) {
#pragma unroll
                        for (int i = 0; i < kDqNTiles; ++i) {
#pragma unroll
                            for (int r = 0; r < 2; ++r) {
                                st_shared_f32x2(DqStage::step(st_at, 8 * r, i), dq[mt][i][2 * r], dq[mt][i][2 * r + 1]);
                            }
                        }
                        __syncwarp();
#pragma unroll
                        for (int row = 0; row < kMmaM; row += kDqStageRows) {
                            const float4 v = ld_shared_f32x4(ld_at + row * Traits::kDqCols * 4);
                            if (!decltype(checked)::value || mt * kMmaM + row < rows_left) {
                                add(dq_rows + (mt * kMmaM + row) * kHeadDim, v);
                            }
                        }
                        if (mt + 1 < kDqMTiles) __syncwarp();  // every lane read this tile before the next overwrites it
                    }
                };
                if (params.deterministic) {
                    add_dq([](float* dst, float4 v) { add_ordered(dst, v); }, std::true_type{});
                } else if (query0 + dq_q0 + kDqMTiles * kMmaM <= seqlen_q) {
                    add_dq(red_add_f32x4, std::false_type{});
                } else {
                    add_dq(red_add_f32x4, std::true_type{});
                }
            } else {
                float* dq_rows = launder(dq_accum + static_cast<int64_t>(query0) * kHeadDim + dq_lane);
                const int rows_left = seqlen_q - (query0 + dq_q0 + g);  // this lane's rows r < rows_left exist
                auto add_dq = [&](auto add) {
#pragma unroll
                    for (int mt = 0; mt < kDqMTiles; ++mt) {
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int row = mt * kMmaM + r * 8;
                            if (row < rows_left) {
#pragma unroll
                                for (int i = 0; i < kDqNTiles; ++i) {
                                    add(dq_rows + row * kHeadDim + i * kMmaN,
                                        make_float2(dq[mt][i][2 * r], dq[mt][i][2 * r + 1]));
                                }
                            }
                        }
                    }
                };
                if (params.deterministic) {
                    add_dq([](float* dst, float2 v) { add_ordered(dst, v); });
                } else {
                    add_dq(red_add_f32x2);
                }
            }
            if constexpr (Traits::kDqFirst) dk_from_smem();
        }

        // Alg. 2 line 19: stage dK_j (scaled) and dV_j through this block's K/V tiles (columns [0, kOutCols)),
        // then 16-byte stores to columns [col0, col0 + kOutCols).
        cp_async_wait<0>();  // nothing in flight may land in sK/sV after the staging stores
        __syncthreads();     // every warp finished reading sK / sV
        store_acc_tile<kDkvKTiles, kDkvNTiles, Tile>(sK, acc_dk, dkv_key0 + g, dkv_c0 + 2 * t, params.scale_softmax);
        store_acc_tile<kDvKTiles, kDvNTiles, Tile>(sV, acc_dv, (kPInSmem ? dkv_key0 : sdp_key0) + g,
                                                   (kPInSmem ? dkv_c0 : 0) + 2 * t, 1.f);
        __syncthreads();
        Element* dk = static_cast<Element*>(params.dk_ptr) + bidb * params.dk_batch_stride + bidh * params.dk_head_stride +
                      (kVarlenWindow ? static_cast<int64_t>(seq.k_row0) + key0 : key0) * params.dk_row_stride + col0;
        Element* dv = static_cast<Element*>(params.dv_ptr) + bidb * params.dv_batch_stride + bidh * params.dv_head_stride +
                      (kVarlenWindow ? static_cast<int64_t>(seq.k_row0) + key0 : key0) * params.dv_row_stride + col0;
        store_tile<kBlockN, kOutCols, Tile, kNThreads>(dk, sK, params.dk_row_stride, valid_keys, d - col0);
        store_tile<kBlockN, kOutCols, Tile, kNThreads>(dv, sV, params.dv_row_stride, valid_keys, d - col0);
        __syncthreads();  // the next K/V block's loads overwrite sK / sV
    }
}

}  // namespace flash
