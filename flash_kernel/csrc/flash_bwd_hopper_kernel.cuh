// FlashAttention-2 backward main kernel (Alg. 2 lines 6-20, text in flash_bwd_common.cuh) on Hopper: every
// matmul a wgmma (sm_90a), the operands read by the tensor cores from swizzled shared memory through descriptors
// (hopper_utils.cuh: SW128, or SW64 for Q, dO, K and V at hd81-96), or from registers for P^T and dS^T. Same
// masking, bounds and outputs as flash_bwd_tiled_kernel; the preprocess (D) and dQ-convert kernels around it are the
// same too.
//
// Per thread block: K_j, V_j (kBlockN = 128 keys); warpgroup wg owns keys [64 wg, 64 wg + 64). Per query block
// i (kBlockM queries; Q_i and dO_i by TMA, L_i and D_i by cp.async, in two stages: block i+2 is loaded into block
// i's stage once iteration i is over):
//   line 11  S^T  = K_wg Q_i^T        ss: A = K rows (K-major), B = Q_i (K-major)        64 x kBlockM, registers
//   line 14  dP^T = V_wg dO_i^T       ss: A = V rows (K-major), B = dO_i (K-major)       64 x kBlockM, registers
//            (one wgmma group each: the softmax recompute of P^T runs while dP^T is on the tensor cores)
//   line 12  P^T  = exp2(S^T scale log2e - L_i log2e), masked
//   line 15  dS^T = P^T o (dP^T - D_i)
//   line 13  dV  += P^T dO_i           rs: A = P^T from registers, B = dO_i (N-major)      64 x hd
//   line 17  dK  += dS^T Q_i           rs: A = dS^T from registers, B = Q_i (N-major)      64 x hd
//            dS^T -> shared memory (swizzled, keys x queries); block barrier
//   line 16  dQ_i += dS_i K_j          ss: A = dS^T read M-major (transposed by the instruction), B = K (N-major);
//            each warpgroup 64 queries x kDqCols over all 128 keys (hopper_bwd_traits.h), staged in shared
//            memory (fp32, two stages by iteration parity) and added into dq_accum by one bulk reduce of the TMA
//            unit, issued by iteration i+1 once its dP^T is on the tensor cores (or after the loop).
// At kBlockM = 64 (kIssueNextSEarly) S^T_{i+1} is issued at the end of iteration i, after the dQ_i stores, so the
// barrier that closes the iteration and the next block's loads run under a matmul.
// kDqBeforeDk (a build switch, hopper_bwd_traits.h) takes FA3's order: dV before the dS^T barrier, then dQ_i and dK
// as two more wgmma groups, so that the dQ_i stores run while dK is on the tensor cores; dK_i completes (behind
// S^T_{i+1} at kBlockM = 64) before the barrier that closes the iteration.
// Line 19 after the loop, dK_j and dV_j through shared memory to global: one thread block per tile stages them in
// the K and V tiles and stores 16-byte rows from its threads; the persistent kernel (Traits::persistent: hd64, and
// hd81-96 non-causal; bwd_tile_scheduler.h) stages them in the next query block's sdQ stage (hd64) or their own tiles
// and lets TMA stores run on, while its next tile's K_j, V_j and first Q_i / dO_i land.
// Q_i and dO_i serve both as K-major (lines 11, 14) and N-major (13, 17) operands of the same swizzled tile,
// as K and V do in the forward. The non-deterministic mode only: deterministic backward runs the sm80 kernel
// (flash_bwd_launch_template.cuh), whose ordered splits need one writer per dq_accum element.
// Varlen and sliding window (kVarlenOrLocal, its own instantiation; hopper_seqlen.h): the grid covers max_seqlen_k's
// key blocks per sequence, and a block past its sequence's keys exits. Q, dO, K and V are read from the packed
// tensors at rows offset by the sequence's start, so rows past its end hold the next sequence's data: queries past
// len_q are masked (P = 0, so dS = 0 and nothing reaches dK, dV or dQ), as are keys past len_k and outside the
// window; only the query blocks that see one of the block's keys are visited. dQ_i goes to the sequence's padded
// rows of dq_accum (dq_accum_row0), dK and dV to the sequence's own rows.
#pragma once

#include <climits>
#include <cmath>
#include <type_traits>

#include "block_trace.h"
#include "bwd_tile_scheduler.h"
#include "causal_order.h"
#include "flash_bwd_common.cuh"
#include "hopper_bwd_traits.h"
#include "hopper_seqlen.h"
#include "hopper_tma.h"
#include "utils.cuh"
#include "wgmma.cuh"

namespace flash {

// Tensor maps of the backward's operands (hopper_tma.h): Q and dO in boxes of kBlockM rows, K and V of kBlockN.
struct BwdTensorMaps : QkvTensorMaps {
    CUtensorMap dO, dk, dv;
    CUtensorMap do_tail;  // dO's narrower last column block (TileLayout), as QkvTensorMaps' tails
};

// kVarlenOrLocal: the varlen / sliding-window kernel (kIsCausal false; causal is its window's right bound).
template <typename Traits, bool kIsCausal, bool kVarlenOrLocal = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_hopper_kernel(const __grid_constant__ BwdParams params, const __grid_constant__ BwdTensorMaps maps,
                            const __grid_constant__ BwdTiles tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kNStages = Traits::kNStages;
    constexpr int kNTilesM = kBlockM / kMmaN;    // n8 column tiles (queries) of S^T / dP^T per warp
    constexpr int kDkvDim = Traits::kDkvDim;     // dK's and dV's columns (their wgmmas' N); past it: zeros
    constexpr int kNTilesD = kDkvDim / kMmaN;    // n8 column tiles of dK / dV per warp
    constexpr int kKStepsD = Traits::kSumDim / kMmaK;  // k16 steps of lines 11 and 14 (to kSumDim, not the tile width)
    constexpr int kKStepsM = kBlockM / kMmaK;    // k16 steps of lines 13 and 17 (queries)
    constexpr int kKStepsDq = kBlockN / kMmaK;   // k16 steps of line 16 (keys)
    // Q, dO, K and V in the SwizzleSpan of the traits (SW128: column blocks of 64, SW64: of 32; hopper_utils.cuh);
    // a tile width that is not whole blocks ends in a narrower block of its own span (TileLayout: hd65-80's 16
    // columns in SW32), which the products over the head dim take as a k-step (S^T, dP^T) or a wgmma (dV, dK, dQ)
    // of their own.
    // dS^T always in SW128.
    constexpr int kSpan = Traits::kSpanBytes;
    using Span = SwizzleSpan<kSpan>;
    using KVLayout = TileLayout<kBlockN, kHeadDim, kSpan>;
    using QLayout = TileLayout<kBlockM, kHeadDim, kSpan>;
    using TailSpan = typename KVLayout::TailSpan;
    constexpr int kTailSpan = TailSpan::kBytes;
    constexpr bool kTail = KVLayout::kTailCols > 0;
    constexpr int kFullKSteps = KVLayout::kFullKSteps;  // k16 steps of S^T and dP^T in the whole column blocks
    constexpr int kDkvFullCols = kDkvDim < KVLayout::kFullCols ? kDkvDim : KVLayout::kFullCols;  // dK's, dV's N there
    constexpr int kLayoutCols = kTail ? kHeadDim : 0;   // swizzled_chunk_offset's kCols: the narrower block's too
    constexpr uint32_t kKVColBlockBytes = kBlockN * Span::kBytes;      // one column block of K or V
    constexpr uint32_t kQColBlockBytes = kBlockM * Span::kBytes;       // one column block of Q_i or dO_i
    constexpr uint32_t kKStepRowsBytes = kMmaK * Span::kBytes;         // 16 rows of N-major Q_i, dO_i or K
    constexpr uint32_t kDsColBlockBytes = kBlockN * kSwizzleRowBytes;  // one 64-query column block of dS^T
    constexpr uint32_t kDsKStepBytes = kMmaK * kSwizzleRowBytes;       // 16 keys of dS^T (M-major)

    extern __shared__ __align__(16) unsigned char smem_raw[];
    // The tiles' swizzle is relative to 1024-aligned addresses; the launch allocates kSwizzleAtomBytes of slack.
    unsigned char* smem = align_smem<kSwizzleAtomBytes>(smem_raw);
    const uint32_t sK = smem_addr(smem);                            // [swizzled kBlockN x kHeadDim]
    const uint32_t sV = sK + Traits::kSmemKVBytes;                  // [swizzled kBlockN x kHeadDim]
    const uint32_t sQ = sV + Traits::kSmemKVBytes;                  // [kNStages][swizzled kBlockM x kHeadDim]
    const uint32_t sdO = sQ + kNStages * Traits::kSmemQBytes;  // [kNStages][swizzled kBlockM x kHeadDim]
    const uint32_t sdS = sdO + kNStages * Traits::kSmemQBytes; // [swizzled kBlockN x kBlockM]: dS^T
    // The persistent kernel's own tiles for dK_j and dV_j (Traits::kSmemDkvBytes, in K's layout), between the tiles
    // and L_i; none in a kernel that runs one block per tile.
    constexpr bool kPersistent = !kVarlenOrLocal && Traits::persistent(kIsCausal);
    static_assert(!(kPersistent && kTail), "the persistent epilogue's TMA stores take whole column blocks");
    constexpr int kSmemDkvBytes = kPersistent ? Traits::kSmemDkvBytes : 0;
    const uint32_t sDkv = sK + Traits::kSmemTileBytes;
    float* sLse = reinterpret_cast<float*>(smem + Traits::kSmemTileBytes + kSmemDkvBytes);  // [kNStages][kBlockM]: L_i
    float* sDelta = sLse + kNStages * kBlockM;                              // [kNStages][kBlockM]: D_i
    // FLASH_BWD_LD_IN_MMA (Traits::kLdInMma) in its place: [kNStages][L_i's, D_i's kBlockM rows of ld_mma, 16 bytes
    // each], then kBlockM rows of zeros: B of the k16 step that adds -L_i / scale to S^T and -D_i to dP^T.
    constexpr bool kLdInMma = Traits::kLdInMma && !kVarlenOrLocal;
    constexpr uint32_t kLdRowsBytes = kBlockM * 16;
    const uint32_t sLd = smem_addr(sLse);
    const uint32_t sLdZero = sLd + 2 * kNStages * kLdRowsBytes;
    // [kDqStages][kBlockM][kDqRow]: fp32 dQ_i, 16-byte chunks swizzled
    float* sdQ = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sLse) + Traits::kSmemRowStatBytes);
    const uint32_t sdQ_addr = smem_addr(sdQ);
    constexpr int kDqRow = Traits::kQKDim;     // floats per row of sdQ and of dq_accum (BwdParams::dq_accum_cols)
    const uint32_t full_kv = sdQ_addr + Traits::kDqStages * Traits::kSmemDqBytes;  // mbarriers: K_j and V_j landed,
    auto full_qdo = [&](int stage) { return full_kv + 8 * (1 + stage); };  // Q_i and dO_i of a stage landed

    // The block's first tile: tile blockIdx.x of the persistent schedule (bwd_tile_scheduler.h), or its grid's.
    // Causal: from 2048 keys, longest key blocks first, (batch, head) pairs in L2-sized groups (causal_order.h).
    const BlockCoord first = kPersistent ? bwd_tile_coord(tiles, blockIdx.x)
                                         : bwd_block_coord<kIsCausal>(params.bwd_causal_group, params.num_sms);
    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid / kWarpgroupThreads, 0);  // warp-uniform: descriptors in uniform registers
    const int lane = tid % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    // This thread's accumulator rows (keys of S^T, dP^T, dK, dV; queries of dQ): wg_row and wg_row + 8 of its
    // warpgroup's 64, columns 8i + 2t + {0, 1} of every n8 tile i (wgmma.cuh); its keys are block rows
    // key_row and key_row + 8 (K_j, dS^T, dK_j and dV_j rows).
    const int wg_row = ((tid % kWarpgroupThreads) / kWarpSize) * kMmaM + g;
    const int key_row = wg * kWarpgroupRows + wg_row;
    // The order of these loads steers nvcc's reassociation of the tiles' index arithmetic, as does that of the
    // descriptors below (desc_k and desc_v after desc_kt): in this order the dense one-block kernels are those of a
    // kernel without the persistent path (hd80 and hd96 instruction for instruction; hd128 but for a few uniform
    // instructions in another order). One instruction more shifts their main loop and costs hd80 and hd96 1-2%
    // (docs/results.md section 44); bench/sass_diff.py shows what an edit moves.
    const SeqBounds dense_sq{params.seqlen_q, params.seqlen_k, 0, 0, -1, -1};  // a dense call's one sequence
    const KeyWindow window = key_window(params);
    const int d = params.d;
    const float scale_log2 = params.scale_softmax_log2;

    // The tiles of this block: the dense kernel is persistent (Traits::persistent; bwd_tile_scheduler.h: tiles from
    // blockIdx.x on), or runs tile blockIdx.x; kVarlenOrLocal runs one tile per block, its grid's.
    using QIndex = std::conditional_t<kPersistent, uint32_t, int>;
    // The block's place in its tiles, in shared memory rather than registers (the main loop has none to spare): the
    // tile, and the query blocks and K_j / V_j loads issued for earlier tiles. Every thread reads it at a tile's start
    // and after its main loop, where thread 0 writes it for the next tile between two barriers.
    struct TileState {
        int tile;
        uint32_t q_loads;   // query blocks loaded for the earlier tiles
        uint32_t kv_phase;  // full_kv's: K_j / V_j loads for the earlier tiles, mod 2
        int zero;           // 0, read after each main loop: see the epilogue
    };
    __shared__ TileState state;
    // A tile's sequence (its rows in the packed tensors, its lengths), its key block and the query blocks
    // [m_min, m_max) that see one of its keys.
    struct TileView {
        int n_block, bidh, bidb, bidh_k, batch_coord, key0, valid_keys, m_min, m_max;
        int causal_offset;   // query i sees keys j <= i + causal_offset
        SeqBounds sq;
        const float* lse;    // its rows of lse and delta ((B, Hq, Tq), or (Hq, total_q))
        const float* delta;
        float* dq_accum;     // its rows of dq_accum (varlen: the sequence's padded rows; flash_params.h)
    };
    auto view_of = [&](const BlockCoord& c) {
        TileView v;
        v.n_block = c.block;
        v.bidh = c.head;
        v.bidb = c.batch;
        v.sq = dense_sq;
        if constexpr (kVarlenOrLocal) {  // through a shuffle, as wg: block-uniform values the compiler then keeps uniform
            v.sq = seq_bounds(params, v.bidb);
            v.sq.seqlen_q = __shfl_sync(0xffffffffu, v.sq.seqlen_q, 0);
            v.sq.seqlen_k = __shfl_sync(0xffffffffu, v.sq.seqlen_k, 0);
            v.sq.q_row0 = __shfl_sync(0xffffffffu, v.sq.q_row0, 0);
            v.sq.k_row0 = __shfl_sync(0xffffffffu, v.sq.k_row0, 0);
        }
        v.batch_coord = kVarlenOrLocal ? tma_batch(params, v.bidb) : v.bidb;  // the tensor maps' batch coordinate
        v.bidh_k = v.bidh / params.h_h_k_ratio;
        v.key0 = v.n_block * kBlockN;
        v.valid_keys = min(kBlockN, v.sq.seqlen_k - v.key0);
        const int64_t row_base = kVarlenOrLocal ? lse_row0(params, v.sq, v.bidb, v.bidh)
                                                : (static_cast<int64_t>(v.bidb) * params.h + v.bidh) * v.sq.seqlen_q;
        v.lse = params.lse_ptr + row_base;
        v.delta = params.delta_ptr + row_base;
        // Rows of params.dq_accum_cols = kDqRow floats (run_bwd_hopper checks it), read from the parameters like the
        // other strides: as a constant it moves every head dim's code, which times 1-2% apart (results.md, section 57).
        v.dq_accum = params.dq_accum_ptr + (kVarlenOrLocal && params.cu_seqlens_q != nullptr
                                                ? v.bidh * dq_accum_rows(params.total_q, params.b) + dq_accum_row0(v.sq.q_row0, v.bidb)
                                                : row_base) * params.dq_accum_cols;
        v.causal_offset = v.sq.seqlen_k - v.sq.seqlen_q;
        if constexpr (kVarlenOrLocal) {  // the query blocks that see one of keys [key0, key0 + valid_keys)
            v.m_min = v.m_max = 0;
            if (v.valid_keys > 0) {
                query_block_range<kBlockM>(window, v.causal_offset, v.sq.seqlen_q, v.key0, v.key0 + v.valid_keys - 1,
                                           v.m_min, v.m_max);
            }
        } else {
            v.m_max = ceil_div(v.sq.seqlen_q, kBlockM);
            // Causal: query blocks that end before the first query seeing key0 contribute nothing.
            v.m_min = kIsCausal ? max(0, (v.key0 - v.causal_offset) / kBlockM) : 0;
        }
        return v;
    };

    auto tile_view = [&](int tile) { return view_of(bwd_tile_coord(tiles, tile)); };  // a persistent block's tile
    const TileView first_view = view_of(first);

    // Thread 0 issues the TMA loads, each arming its tile's "full" mbarrier with the tile's bytes.
    const bool loader = tid == 0;
    if (loader) {
        if constexpr (kPersistent) state = {static_cast<int>(blockIdx.x), 0, 0, 0};
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.dO);
        if constexpr (kPersistent) {
            prefetch_tensor_map(&maps.k);
            prefetch_tensor_map(&maps.v);
        }
        mbarrier_init(full_kv, 2);  // two arrivals (K and V), plus their bytes
        for (int stage = 0; stage < kNStages; ++stage) mbarrier_init(full_qdo(stage), 2);  // Q_i and dO_i
        fence_mbarrier_init();
    }
    if constexpr (kLdInMma) {
        uint4* zeros = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(sLse) + 2 * kNStages * kLdRowsBytes);
        for (int i = tid; i < kBlockM; i += Traits::kNThreads) zeros[i] = make_uint4(0u, 0u, 0u, 0u);
        fence_view_async_shared();  // read by wgmmas (the async proxy)
    }
    __syncthreads();

    // The query blocks a block loads are numbered over its tiles: the q-th goes to stage q % kNStages, its load the
    // (q / kNStages)-th of that stage's mbarrier; and its dQ_i to sdQ stage q % kDqStages.
    // Alg. 2 line 10: Q_i and dO_i by TMA (loader; rows past Tq come back as zeros), L_i and D_i by 4-byte
    // cp.async (load_lse_delta, flash_bwd_common.cuh). Issued two query blocks ahead (one per stage); S^T waits
    // for Q_i's mbarrier, the softmax for L_i and D_i behind the barrier that ends the iteration before.
    auto load_q_do = [&](const TileView& v, int m_block, int stage) {
        const int row0 = m_block * kBlockM;
        if (loader) {
            if constexpr (kLdInMma) {
                // The block's rows of both ld_mma slices, counted on the stage's mbarrier before Q_i's arrival.
                const unsigned char* rows = static_cast<const unsigned char*>(params.ld_mma_ptr) +
                                            ld_mma_row(params, v.bidb, v.bidh, row0) * Traits::kElemBytes;
                const uint32_t dst = sLd + stage * 2 * kLdRowsBytes;
                mbarrier_expect_tx(full_qdo(stage), 2 * kLdRowsBytes);
                bulk_load(dst, rows, kLdRowsBytes, full_qdo(stage));
                bulk_load(dst + kLdRowsBytes, rows + params.ld_mma_rows * 16, kLdRowsBytes, full_qdo(stage));  // slice 1
            }
            tma_load_rows<kBlockM, kHeadDim, kSpan>(sQ + stage * Traits::kSmemQBytes, &maps.q, &maps.q_tail,
                                                    v.sq.q_row0 + row0, v.bidh, v.batch_coord, full_qdo(stage));
            tma_load_rows<kBlockM, kHeadDim, kSpan>(sdO + stage * Traits::kSmemQBytes, &maps.dO, &maps.do_tail,
                                                    v.sq.q_row0 + row0, v.bidh, v.batch_coord, full_qdo(stage));
        }
        if constexpr (!kLdInMma) {
            load_lse_delta<kBlockM>(sLse + stage * kBlockM, sDelta + stage * kBlockM, v.lse, v.delta, row0,
                                    v.sq.seqlen_q, tid);
        }
        cp_async_commit();
    };
    // Alg. 2 lines 7-8 (a key block no query sees loads nothing and writes zeros), and its first two query blocks,
    // from the q-th on.
    auto load_tile = [&](const TileView& v, QIndex q) {
        if (v.m_min >= v.m_max) return;
        if (loader) {
            if constexpr (!kPersistent) {
                prefetch_tensor_map(&maps.k);
                prefetch_tensor_map(&maps.v);
            }
            tma_load_rows<kBlockN, kHeadDim, kSpan>(sK, &maps.k, &maps.k_tail, v.sq.k_row0 + v.key0, v.bidh_k,
                                                    v.batch_coord, full_kv);
            tma_load_rows<kBlockN, kHeadDim, kSpan>(sV, &maps.v, &maps.v_tail, v.sq.k_row0 + v.key0, v.bidh_k,
                                                    v.batch_coord, full_kv);
        }
        load_q_do(v, v.m_min, q % kNStages);
        if (v.m_min + 1 < v.m_max) load_q_do(v, v.m_min + 1, (q + 1) % kNStages);
    };

    // dQ_i of query block m_block, staged in its sdQ stage, added into dq_accum by the TMA unit: one bulk reduce-add
    // of the tile's rows (as many as Tq has) from thread 0, in the chunk-swizzled layout that dq_accum shares with sdQ
    // (dq_accum_chunk, dq_accum_layout.h). The threads' own adds (16-byte red.global.add from sdQ) would take issue
    // slots and LSU bandwidth from the softmax's warps. Thread 0 waits for the reduce's shared-memory reads before
    // the barrier that precedes the stage's next stores, two query blocks later (or as the block exits).
    // The byte offset in sdQ of the stage that the q-th query block's dQ_i takes.
    auto sdq_stage = [](QIndex q) -> uint32_t { return (q % Traits::kDqStages) * Traits::kSmemDqBytes; };

    // K-major descriptors of this warpgroup's 64 key rows of K and V (lines 11, 14); the dQ operands (line 16):
    // the 64-query column block dq_row0 / 64 of dS^T (M-major) and K's columns from dq_col0 (N-major).
    const int dq_row0 = Traits::kDqSplitQueries ? wg * kWarpgroupRows : 0;
    const int dq_col0 = Traits::kDqSplitQueries ? 0 : wg * Traits::kDqCols;
    const uint64_t desc_ds = make_smem_desc_sw128(sdS + (dq_row0 / kSwizzleBlockElems) * kDsColBlockBytes,
                                                  kDsColBlockBytes, kSwizzleAtomBytes);
    const uint64_t desc_kt = make_smem_desc<kSpan>(sK + (dq_col0 / Span::kBlockElems) * kKVColBlockBytes,
                                                   kKVColBlockBytes, Span::kAtomBytes);
    const uint32_t wg_rows_bytes = wg * kWarpgroupRows * Span::kBytes;
    const uint64_t desc_k = make_smem_desc<kSpan>(sK + wg_rows_bytes, 16, Span::kAtomBytes);
    const uint64_t desc_v = make_smem_desc<kSpan>(sV + wg_rows_bytes, 16, Span::kAtomBytes);
    // The narrower last column block's (kTail): K-major for lines 11 and 14, and K N-major for dQ's last warpgroup.
    const uint32_t wg_tail_bytes = wg * kWarpgroupRows * kTailSpan;
    const uint64_t desc_k_tail =
        make_smem_desc<kTailSpan>(sK + KVLayout::kTailOffset + wg_tail_bytes, 16, TailSpan::kAtomBytes);
    const uint64_t desc_v_tail =
        make_smem_desc<kTailSpan>(sV + KVLayout::kTailOffset + wg_tail_bytes, 16, TailSpan::kAtomBytes);
    // The descriptor of the narrower last block of the Q_i or dO_i tile at `tile`, K-major or (n_major) N-major.
    auto rows_tail_desc = [](uint32_t tile, auto n_major) {
        constexpr uint32_t kLbo = decltype(n_major)::value ? kBlockM * kTailSpan : 16;
        return make_smem_desc<kTailSpan>(tile + QLayout::kTailOffset, kLbo, TailSpan::kAtomBytes);
    };

    // kLdInMma: the k16 step after them, ones x the stage's rows of one ld_mma slice (`which`: 0 for L_i, 1 for D_i)
    // and the zeros: a plain K-major operand of 8-row core matrices 128 bytes apart, the zeros its other 8 columns.
    constexpr uint32_t kOnes = 0x3F803F80u;  // two bf16 1.0s (Traits::kLdInMma: bf16 only)
    const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
    auto ld_desc = [&](int stage, int which) {
        const uint32_t rows = sLd + stage * 2 * kLdRowsBytes + which * kLdRowsBytes;
        return make_smem_desc_plain(rows, sLdZero - rows, 128);
    };
    // Lines 11 and 14 are the same product over the head dim, (64 keys of K or V) x (kBlockM rows of Q_i or dO_i)^T,
    // both operands K-major: one wgmma group into acc. The k-steps past the whole column blocks read the narrower last
    // one (the *_tail descriptors); kLdInMma, one more step adds -L_i / scale or -D_i to every row (desc_ld).
    auto issue_over_d = [&](float (&acc)[kBlockM / 2], uint64_t desc_kv, uint64_t desc_kv_tail, uint64_t desc_rows,
                            uint64_t desc_rows_tail, uint64_t desc_ld) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKStepsD; ++kk) {
            constexpr int kSteps = Span::kKStepsPerBlock;  // k16 steps per column block
            if (kk < kFullKSteps) {
                Wgmma<Element, kBlockM>::template ss<0>(
                    acc, desc_advance(desc_kv, (kk / kSteps) * kKVColBlockBytes + (kk % kSteps) * 32),
                    desc_advance(desc_rows, (kk / kSteps) * kQColBlockBytes + (kk % kSteps) * 32), kk > 0);
            } else {
                Wgmma<Element, kBlockM>::template ss<0>(acc, desc_advance(desc_kv_tail, (kk - kFullKSteps) * 32),
                                                        desc_advance(desc_rows_tail, (kk - kFullKSteps) * 32), kk > 0);
            }
        }
        if constexpr (kLdInMma) Wgmma<Element, kBlockM>::template rs<0>(acc, ones, desc_ld, 1);
        wgmma_commit();
    };
    // L_i or D_i of this thread's query column 8i + 2t + (e & 1), through the 8-byte pair of columns 8i + 2t and
    // 8i + 2t + 1, which the compiler loads once for the four e (half the shared-memory loads of one float each).
    auto query_value = [&](const float* v, int i, int e) {
        const float2 pair = *reinterpret_cast<const float2*>(v + i * kMmaN + 2 * t);
        return (e & 1) ? pair.y : pair.x;
    };
    // Line 11, S^T = K Q_i^T into s, once Q_i of the q-th query block (in `stage`) has landed.
    auto issue_s = [&](float (&s)[kBlockM / 2], QIndex q, int stage) {
        mbarrier_wait(full_qdo(stage), (q / kNStages) & 1);
        const uint32_t sQ_st = sQ + stage * Traits::kSmemQBytes;
        issue_over_d(s, desc_k, desc_k_tail, make_smem_desc<kSpan>(sQ_st, 16, Span::kAtomBytes),
                     rows_tail_desc(sQ_st, std::false_type{}), ld_desc(stage, 0));
    };

    BlockTrace<FLASH_BWD_TRACE != 0> trace;  // FLASH_BWD_TRACE: thread 0 stamps each tile's phases (block_trace.h)
    // A persistent block issues its first tile's loads here and each later tile's as the tile before ends; one block
    // per tile issues them at the top of the loop below.
    if constexpr (kPersistent) load_tile(first_view, 0);
    for (;;) {
        const TileState here = kPersistent ? state : TileState{static_cast<int>(blockIdx.x), 0, 0, 0};
        // A persistent block derives its tile's view again from `state`: carried across the epilogue in registers
        // instead, the view costs the hd64 causal backward about 8% at 4k keys (docs/results.md sections 43-44).
        const TileView v = kPersistent ? tile_view(here.tile) : first_view;
        const int n_block = v.n_block, bidh = v.bidh, bidb = v.bidb;
        const SeqBounds& sq = v.sq;
        const int seqlen_q = sq.seqlen_q, seqlen_k = sq.seqlen_k;
        const int causal_offset = v.causal_offset;  // query i sees keys j <= i + causal_offset
        const int key0 = v.key0;
        const int m_block_min = v.m_min, m_block_max = v.m_max;
        if (kVarlenOrLocal && key0 >= seqlen_k) return;  // past this sequence's keys (the grid covers max_seqlen_k)
        // Causal: the tile after this one, taken now (an atomic) and published once the main loop is over.
        int next = 0;
        if (kIsCausal && kPersistent && tid == 0) next = bwd_next_tile<kIsCausal>(params, here.tile);
        if (tid == 0) trace.start();
        float* dq_accum = v.dq_accum;
        auto reduce_dq = [&](int m_block) {
            if (tid == 0) {
                const int row0 = m_block * kBlockM;
                const uint32_t dq_stage = sdq_stage(here.q_loads + (m_block - m_block_min));
                bulk_reduce_add_f32(dq_accum + static_cast<int64_t>(row0) * kDqRow, sdQ_addr + dq_stage,
                                    min(kBlockM, seqlen_q - row0) * kDqRow * static_cast<int>(sizeof(float)));
                bulk_commit_group();
            }
        };

        float acc_dk[kDkvDim / 2], acc_dv[kDkvDim / 2];  // 64 keys x kDkvDim per warpgroup
        float s[kBlockM / 2];  // S^T, then P^T (kIssueNextSEarly: S^T_i issued by iteration i-1, or before the loop)
#pragma unroll
        for (int i = 0; i < kDkvDim / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

        if (kPersistent || m_block_min < m_block_max) {
            if constexpr (!kPersistent) load_tile(v, 0);
            if (m_block_min < m_block_max) mbarrier_wait(full_kv, here.kv_phase);
            cp_async_wait<0>();
            __syncthreads();  // L_i and D_i of both stages visible to every thread; `state` read by every thread
            if (m_block_min < m_block_max) {
                if (tid == 0) trace.stamp(0);
                if constexpr (Traits::kIssueNextSEarly) {
                    issue_s(s, here.q_loads, here.q_loads % kNStages);
                    wgmma_wait<0>();
                    pin_registers(s);
                }
            }
        }
        if (tid == 0) trace.stamp(1);
        // Per query block the tensor cores see, in order: S^T_i (here, unless kIssueNextSEarly: then at the end of the
        // iteration before), dP^T_i; dV_j and dK_j; dQ_i. One block barrier in the middle (dS^T complete in sdS for
        // dQ_i) and one at the end (dQ_i complete in sdQ for the reduce; this stage free for block i+2).
        for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
            const QIndex q = here.q_loads + (m_block - m_block_min);  // this query block's number (load_q_do)
            const int stage = q % kNStages;
            const uint32_t sQ_st = sQ + stage * Traits::kSmemQBytes, sdO_st = sdO + stage * Traits::kSmemQBytes;
            const float* sLse_st = sLse + stage * kBlockM;
            const float* sDelta_st = sDelta + stage * kBlockM;
            const int query0 = m_block * kBlockM;
            const uint32_t dq_off = sdq_stage(q);

            // Line 14: dP^T = V dO_i^T, one group behind S^T (dO_i landed with Q_i: one mbarrier for both).
            if constexpr (!Traits::kIssueNextSEarly) issue_s(s, q, stage);
            float dp[kBlockM / 2];
            issue_over_d(dp, desc_v, desc_v_tail, make_smem_desc<kSpan>(sdO_st, 16, Span::kAtomBytes),
                         rows_tail_desc(sdO_st, std::false_type{}), ld_desc(stage, 1));

            // Iteration i-1's dQ tile, complete in sdQ since the barrier that closed iteration i-1.
            if (m_block > m_block_min) reduce_dq(m_block - 1);

            // Line 12 while dP^T runs: mask keys past Tk (zero-filled K rows would give P = exp(-L), which can
            // overflow) and, on diagonal blocks, keys a query may not see; then P^T = exp2(S^T scale log2e - L log2e).
            if constexpr (!Traits::kIssueNextSEarly) {
                wgmma_wait<1>();
                pin_registers(s);
            }
            if constexpr (kVarlenOrLocal) {
                // Also queries past len_q: their Q and dO rows are the next sequence's, not zeros.
                if (key0 + kBlockN > seqlen_k || query0 + kBlockM > seqlen_q || key0 + kBlockN - 1 > query0 + causal_offset + window.right ||
                    key0 < query0 + kBlockM - 1 + causal_offset - window.left) {
                    // Element (i, e) is key `key` and query q_e + 8i. It is visible iff lo_e <= 8i <= hi_e, from
                    // key - right <= q + co (the window's right side), q + co - left <= key, q < len_q, and key < len_k:
                    // two compares per element against per-thread bounds.
                    int lo[4], hi[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + key_row + (e >= 2 ? 8 : 0);
                        const int q_e = query0 + 2 * t + (e & 1);
                        lo[e] = key >= seqlen_k ? INT_MAX : key - causal_offset - window.right - q_e;
                        hi[e] = min(seqlen_q - 1, key - causal_offset + window.left) - q_e;
                    }
#pragma unroll
                    for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            if (i * kMmaN < lo[e] || i * kMmaN > hi[e]) s[4 * i + e] = -INFINITY;
                        }
                    }
                }
            } else if (key0 + kBlockN > seqlen_k || (kIsCausal && key0 + kBlockN - 1 > query0 + causal_offset)) {
#pragma unroll
                for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + key_row + (e >= 2 ? 8 : 0);
                        const int query = query0 + i * kMmaN + 2 * t + (e & 1);
                        if (key >= seqlen_k || (kIsCausal && key > query + causal_offset)) s[4 * i + e] = -INFINITY;
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if constexpr (kLdInMma) {
                        s[4 * i + e] = fast_exp2(s[4 * i + e] * scale_log2);  // S^T already less L_i / scale
                    } else {
                        s[4 * i + e] = fast_exp2(fmaf(s[4 * i + e], scale_log2, -kLog2e * query_value(sLse_st, i, e)));
                    }
                }
            }
            // P^T as the register A operand of line 13 (the accumulators of query columns 16kk..16kk+15 are k-step
            // kk), packed while dP^T may still run.
            uint32_t p_frag[kKStepsM][4], ds_frag[kKStepsM][4];
#pragma unroll
            for (int kk = 0; kk < kKStepsM; ++kk) {
#pragma unroll
                for (int r = 0; r < 4; ++r) p_frag[kk][r] = pack2<Element>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
            }
            // Line 15: dS^T = P^T o (dP^T - D_i).
            wgmma_wait<0>();
            pin_registers(dp);
#pragma unroll
            for (int i = 0; i < kNTilesM; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if constexpr (kLdInMma) {
                        dp[4 * i + e] = s[4 * i + e] * dp[4 * i + e];  // dP^T already less D_i
                    } else {
                        dp[4 * i + e] = s[4 * i + e] * (dp[4 * i + e] - query_value(sDelta_st, i, e));
                    }
                }
            }
            // dS^T as the register A operand of line 17, and into shared memory for line 16 (keys x queries;
            // iteration i-1's dQ reads of sdS completed before the barrier that closed it).
#pragma unroll
            for (int kk = 0; kk < kKStepsM; ++kk) {
#pragma unroll
                for (int r = 0; r < 4; ++r) ds_frag[kk][r] = pack2<Element>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
            }
            // ds_frag[kk] (the warp's 16 keys x queries 16kk..16kk+15) by one stmatrix, as the forward stores P: one
            // 16-byte store per lane and k16 step where 4-byte stores take four, on the MIO queue the backward waits on.
#pragma unroll
            for (int kk = 0; kk < kKStepsM; ++kk) stmatrix_k_step<kBlockN>(sdS, key_row - g, kk, lane, ds_frag[kk]);

            // Lines 13 and 17: dV += P^T dO_i, dK += dS^T Q_i (dK's softmax scale is applied in the epilogue);
            // kDqBeforeDk: dV here, dK behind dQ_i (hopper_bwd_traits.h).
            const uint64_t desc_do_n = make_smem_desc<kSpan>(sdO_st, kQColBlockBytes, Span::kAtomBytes);
            const uint64_t desc_q_n = make_smem_desc<kSpan>(sQ_st, kQColBlockBytes, Span::kAtomBytes);
            // k-step kk of acc (dK or dV) += frag (dS^T or P^T) x the rows' tile (Q_i or dO_i, N-major): one wgmma over
            // its whole column blocks, and (kDkvDim past them) one over its narrower last block.
            auto dkv_step = [&](float (&acc)[kDkvDim / 2], const uint32_t (&frag)[4], uint32_t tile, uint64_t desc_n,
                                int kk) {
                if constexpr (kDkvDim > kDkvFullCols) {
                    Wgmma<Element, kDkvFullCols>::template rs<1>(*reinterpret_cast<float(*)[kDkvFullCols / 2]>(acc),
                                                                 frag, desc_advance(desc_n, kk * kKStepRowsBytes), 1);
                    Wgmma<Element, kDkvDim - kDkvFullCols>::template rs<1>(
                        *reinterpret_cast<float(*)[(kDkvDim - kDkvFullCols) / 2]>(acc + kDkvFullCols / 2), frag,
                        desc_advance(rows_tail_desc(tile, std::true_type{}), kk * kMmaK * kTailSpan), 1);
                } else {
                    Wgmma<Element, kDkvDim>::template rs<1>(acc, frag, desc_advance(desc_n, kk * kKStepRowsBytes), 1);
                }
            };
            auto issue_dk = [&]() {
#pragma unroll
                for (int kk = 0; kk < kKStepsM; ++kk) dkv_step(acc_dk, ds_frag[kk], sQ_st, desc_q_n, kk);
            };
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kKStepsM; ++kk) dkv_step(acc_dv, p_frag[kk], sdO_st, desc_do_n, kk);
            if constexpr (!Traits::kDqBeforeDk) issue_dk();
            wgmma_commit();

            // Line 16 once both warpgroups' dS^T are in shared memory: dQ_i (this warpgroup's tile) = dS K. Past
            // this barrier dQ_i's stage is free: the reduce of iteration i-2 has read it (that of i-1 may still read
            // the other stage).
            if (tid == 0) {
                // Persistent: a tile's first dQ_i takes the stage that the tile before staged dK_j / dV_j in.
                if (kPersistent && Traits::kDkvInSdq && m_block == m_block_min) bulk_wait_group_read<0>();
                else bulk_wait_group_read<Traits::kDqStages - 1>();
            }
            fence_view_async_shared();
            __syncthreads();
            // This warpgroup's dQ_i into dq, kCols columns: issued, completed (kDqBeforeDk: with dK behind it) and
            // stored. The last warpgroup's are Traits::kDqColsLast, fewer where FLASH_BWD_NARROW_DQ leaves out K's zero
            // columns; each width has an array of its own (one array for both makes ptxas serialize the wgmmas).
            // desc_b: K's columns from dq_col0 (N-major), whose 16 keys are k_step_bytes apart.
            auto dq_tile = [&](auto& dq, uint64_t desc_b, uint32_t k_step_bytes) {
                constexpr int kCols = 2 * static_cast<int>(std::extent_v<std::remove_reference_t<decltype(dq)>>);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kKStepsDq; ++kk) {
                    Wgmma<Element, kCols>::template ss<1, 1>(dq, desc_advance(desc_ds, kk * kDsKStepBytes),
                                                             desc_advance(desc_b, kk * k_step_bytes), kk > 0);
                }
                wgmma_commit();
                if constexpr (Traits::kDqBeforeDk) {
                    // Line 17 as the third group: dV and dQ_i complete, dK += dS^T Q_i runs under the dQ_i stores below.
                    issue_dk();
                    wgmma_commit();
                    wgmma_wait<1>();
                    pin_registers(acc_dv);
                    pin_registers(dq);
                    pin_registers(p_frag);
                } else {
                    wgmma_wait<0>();
                    pin_registers(acc_dv);
                    pin_registers(acc_dk);
                    pin_registers(dq);
                    pin_registers(p_frag);
                    pin_registers(ds_frag);
                }
                // To this warpgroup's part of dQ_i's sdQ stage (rows dq_row0 + wg_row + {0, 8}, columns dq_col0 + 8i + 2t
                // + {0, 1}); columns past d_rounded (hd96 on the 128-wide tiles) are K's zero columns and stay out. Then
                // visible to the TMA unit (the async proxy), which the next iteration's reduce, or the one after the
                // loop, is.
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = dq_row0 + wg_row + 8 * r;
#pragma unroll
                    for (int i = 0; i < kCols / kMmaN; ++i) {
                        const int col = dq_col0 + i * kMmaN + 2 * t;
                        if (col < kDqRow) {  // 8-byte stores by asm: through a float2 pointer nvcc splits half of them
                            st_shared_f32x2(
                                sdQ_addr + 4 * (row * kDqRow + 4 * dq_accum_chunk_in<kDqRow>(col / 4, row) + col % 4) + dq_off,
                                dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
                        }
                    }
                }
            };
            if (Traits::kDqColsLast == Traits::kDqCols || wg < Traits::kNWarpgroups - 1) {
                float dq[Traits::kDqCols / 2];
                dq_tile(dq, desc_kt, kKStepRowsBytes);
            } else if constexpr (kTail) {
                // The last warpgroup's columns are K's narrower last block (Traits::kDqColsLast of them).
                float dq[Traits::kDqColsLast / 2];
                const uint64_t desc_kt_tail =
                    make_smem_desc<kTailSpan>(sK + KVLayout::kTailOffset, kBlockN * kTailSpan, TailSpan::kAtomBytes);
                dq_tile(dq, desc_kt_tail, kMmaK * kTailSpan);
            } else {
                float dq[Traits::kDqColsLast / 2];
                dq_tile(dq, desc_kt, kKStepRowsBytes);
            }
            fence_view_async_shared();
            if constexpr (Traits::kDqBeforeDk) {
                // dK_i (Q_i from this stage, dS^T from ds_frag) completes before the barrier below, after which the
                // stage takes block i+2, and before the loop's back edge or the epilogue's reads of acc_dk.
                if (m_block + 1 == m_block_max) {
                    wgmma_wait<0>();
                    pin_registers(acc_dk);
                    pin_registers(ds_frag);
                    break;
                }
                if constexpr (Traits::kIssueNextSEarly) issue_s(s, q + 1, stage ^ 1);  // behind dK_i, under the barrier
                wgmma_wait<Traits::kIssueNextSEarly ? 1 : 0>();
                pin_registers(acc_dk);
                pin_registers(ds_frag);
            } else {
                if (m_block + 1 == m_block_max) break;  // the barrier after the loop closes the last iteration
                if constexpr (Traits::kIssueNextSEarly) issue_s(s, q + 1, stage ^ 1);  // under the barrier below
            }
            // Close the iteration: sdQ holds dQ_i; every wgmma that read sdS or this stage's Q_i / dO_i completed (so
            // the stage takes block i+2); L_{i+1} and D_{i+1} landed (this thread's cp.asyncs, then everyone's).
            cp_async_wait<0>();
            __syncthreads();
            if (m_block + kNStages < m_block_max) load_q_do(v, m_block + kNStages, stage);
            // S^T_{i+1} complete before the loop's back edge: where an accumulator is in flight across it, ptxas
            // serializes every wgmma of the kernel (C7515: the loop's register moves define the accumulator).
            if constexpr (Traits::kIssueNextSEarly) {
                wgmma_wait<0>();
                pin_registers(s);
            }
        }

        // Line 19: dK_j (times the softmax scale) and dV_j into a swizzled tile in K's layout at dst (dK_j) and dst +
        // kSmemKVBytes (dV_j): this thread's rows row and row + 8, its column pairs 8i + 2tq.
        auto stage_dkv = [&](unsigned char* dst, int row, int tq) {
#pragma unroll
            for (int i = 0; i < kNTilesD; ++i) {
                const int within = 2 * tq * static_cast<int>(sizeof(Element));
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const uint32_t off = swizzled_chunk_offset<kBlockN, kSpan, kLayoutCols>(row + 8 * r, i) + within;
                    *reinterpret_cast<uint32_t*>(dst + off) = pack2<Element>(acc_dk[4 * i + 2 * r] * params.scale_softmax,
                                                                             acc_dk[4 * i + 2 * r + 1] * params.scale_softmax);
                    *reinterpret_cast<uint32_t*>(dst + Traits::kSmemKVBytes + off) =
                        pack2<Element>(acc_dv[4 * i + 2 * r], acc_dv[4 * i + 2 * r + 1]);
                }
            }
        };

        if constexpr (!kPersistent) {
            // dK_j and dV_j through the K and V tiles (every wgmma reading them completed), then 16-byte rows to
            // global memory.
            if (tid == 0) trace.stamp(2);
            __syncthreads();
            if (m_block_min < m_block_max) reduce_dq(m_block_max - 1);
            stage_dkv(smem, key_row, t);
            __syncthreads();
            Element* dk = static_cast<Element*>(params.dk_ptr) + bidb * params.dk_batch_stride + bidh * params.dk_head_stride +
                          (sq.k_row0 + key0) * params.dk_row_stride;
            Element* dv = static_cast<Element*>(params.dv_ptr) + bidb * params.dv_batch_stride + bidh * params.dv_head_stride +
                          (sq.k_row0 + key0) * params.dv_row_stride;
            using OutTile = SwizzledSpanTile<kBlockN, kSpan, kLayoutCols>;  // the K and V tiles' layout: dK_j, dV_j
            const Element* sdk = reinterpret_cast<const Element*>(smem);
            const Element* sdv = sdk + Traits::kSmemKVBytes / Traits::kElemBytes;
            store_tile<kBlockN, kHeadDim, OutTile, Traits::kNThreads>(dk, sdk, params.dk_row_stride, v.valid_keys, d);
            store_tile<kBlockN, kHeadDim, OutTile, Traits::kNThreads>(dv, sdv, params.dv_row_stride, v.valid_keys, d);
            if (tid == 0) {
                trace.stamp(3);
                bulk_wait_group_read<0>();  // the block's shared memory outlives the last reduce's reads
                trace.stamp(4);
                trace.write(params.block_trace, params.block_trace_rows, kVarlenOrLocal ? -1 : here.tile, bidb, bidh,
                            n_block, m_block_max - m_block_min);
            }
            break;
        }

        // Persistent: publish the next tile. Past the barrier every wgmma of this tile completed: K_j, V_j, the
        // Q_i / dO_i stages and sdS are free for the next tile's loads, which land while this one's epilogue runs.
        if (tid == 0) {
            trace.stamp(2);
            TileState after = state;
            if constexpr (!kIsCausal) next = bwd_next_tile<kIsCausal>(params, after.tile);
            after.tile = next;
            if (m_block_min < m_block_max) {
                after.q_loads += m_block_max - m_block_min;
                after.kv_phase ^= 1;
            }
            state = after;
        }
        __syncthreads();
        const TileState after = state;
        if (m_block_min < m_block_max) reduce_dq(m_block_max - 1);
        if (after.tile < tiles.num_tiles) load_tile(tile_view(after.tile), after.q_loads);
        // dK_j and dV_j go to the sdQ stage of the next query block (q_last + 1, or this tile's first where it has
        // none), whose reduce is complete once all but the newest bulk group have read (that newest: the last dQ_i's
        // reduce, which runs on; with no query block, the tile before's dK / dV stores out of this very stage); or to
        // their own buffer, which the tile before's stores have read by then too.
        if (tid == 0) {
            trace.stamp(3);
            if (m_block_min < m_block_max) bulk_wait_group_read<1>();
            else bulk_wait_group_read<0>();
        }
        __syncthreads();
        const uint32_t stage_off = sdq_stage(after.q_loads);
        unsigned char* dkv_tile = Traits::kDkvInSdq ? reinterpret_cast<unsigned char*>(sdQ) + stage_off
                                                    : smem + Traits::kSmemTileBytes;
        const uint32_t dkv = Traits::kDkvInSdq ? sdQ_addr + stage_off : sDkv;  // dkv_tile's shared-memory address
        // This thread's rows and column pairs through a 0 the compiler cannot see (a volatile load), so that it
        // computes them here: hoisted out of the tile loop, they would hold registers through the main loop.
        const int zero = *static_cast<volatile int*>(&state.zero);
        stage_dkv(dkv_tile, key_row + zero, t + zero);
        fence_view_async_shared();
        __syncthreads();
        // Written by the TMA unit (the maps' bounds leave out keys past Tk and columns past d); the next tile's first
        // dQ_i, where it takes this stage, waits for their reads (bulk_wait_group_read<0> in its first iteration).
        if (tid == 0) {
            tma_store_rows<kBlockN, kHeadDim, kSpan>(&maps.dk, dkv, key0, bidh, v.batch_coord);
            tma_store_rows<kBlockN, kHeadDim, kSpan>(&maps.dv, dkv + Traits::kSmemKVBytes, key0, bidh, v.batch_coord);
            bulk_commit_group();
            trace.stamp(4);
            trace.write(params.block_trace, params.block_trace_rows, here.tile, bidb, bidh, n_block,
                        m_block_max - m_block_min);
        }
        if (after.tile >= tiles.num_tiles) {
            if (tid == 0) bulk_wait_group_read<0>();  // the block's shared memory outlives the stores' reads
            break;
        }
    }
#else
    __trap();  // built without sm_90a: the launcher never picks this kernel (hopper_bwd_traits.h)
#endif
}

}  // namespace flash
