// FlashAttention-2 forward (Algorithm 1) on Hopper: wgmma (sm_90a) instead of mma.sync, ping-pong warpgroups.
//
// Same algorithm, masking and outputs as flash_fwd_kernel.cuh (which has the line-by-line Algorithm 1 text);
// what changes is who does the matmuls, where their operands live, and who loads them:
//   - S = Q K^T: one warpgroup-wide wgmma per 16 columns of the head dim, both operands read by the tensor
//     cores straight from the swizzled shared-memory tiles through descriptors (no ldmatrix, no fragment
//     registers for Q or K), fp32 accumulators in registers: 64 query rows x kBlockN keys per warpgroup.
//   - O += P V: P stays in registers (the accumulator layout of S is wgmma's register A layout, as with
//     mma.sync), V is read from shared memory as an N-major B operand (the transpose is the descriptor's).
//     Traits::kPSmem: P goes to the warpgroup's own tile in shared memory instead, which the wgmma reads as a
//     K-major A operand, as it reads Q.
//   - Q_i, K_j and V_j arrive by TMA (hopper_tma.h: one instruction per column block) into kNStages stages
//     each for K and V; each stage has a "full" mbarrier (its bytes landed) and an "empty" one (every consumer
//     thread, or warp, is done reading it), so no block-wide barrier couples the warpgroups.
//   - Warp specialization (FA3 paper, section 3.1): one producer warpgroup issues every load and claims the
//     tiles, on 24 registers (setmaxnreg), and hands the consumer warpgroups, which compute, the rest of the
//     register file. Loads issued by consumer threads between their turns would put the loads' empty-stage waits
//     and the tile claims on some warp's path to its softmax.
//   - Ping-pong (FA3 paper, section 3.1): the warpgroups (two, or three at hd64) take turns in a
//     ring to issue their matmuls (named barriers), so the tensor cores run one warpgroup's GEMMs while the
//     others do their softmax. Each turn issues O += P_{j-1} V_{j-1} and S_j = Q K_j^T together, so one wait
//     covers both and the softmax of S_j runs while the other warpgroups' pairs are on the tensor cores.
//   - Intra-warpgroup overlap (FA3 paper, section 3.2; Traits::kIntraWgOverlap, where acc_o, S_j and P_{j-1} fit
//     the consumer's registers together: hopper_kernel_traits.h): a turn commits S_j and then O += P_{j-1} V_{j-1}
//     as two wgmma groups and waits for S_j alone, so the softmax of S_j (mask, m_i, exponentials, l_i) also runs
//     while the warpgroup's own P V is on the tensor cores. O's rescale and P_j's packing into the A-operand
//     registers, which that P V reads, wait for it; so does a share of the exponentials
//     (fwd_exp_tiles_before_wait), which ptxas then interleaves with the rescale and the packing on the SFU's latency.
//   - Narrowed last block (fwd_narrow_last_block, hopper_kernel_traits.h): a tile's last key block computes S, its
//     softmax and P V only over whole 64-key steps up to the last key some row of the tile sees, in a copy of the
//     turn after the main loop.
//   - Persistent (fwd_tile_scheduler.h): one block per SM runs query-block tiles one after another. The K/V
//     stages and their barrier phases run on across tiles; the producer loads the next tile's first K as soon as
//     its stage is free and its Q once the tile's last S released it, and warpgroup 0 starts the next tile while
//     the others finish this one. O is stored straight from the accumulators (sQ holds the next Q by then).
//   - Varlen and sliding window (kVarlenOrLocal, its own instantiation; the dense ones compile without it): tiles
//     of (query block, head, sequence) whose rows and key blocks come from cu_seqlens and the window
//     (hopper_seqlen.h, fwd_local_tile). TMA reads the packed tensors at rows offset by the sequence's start; rows
//     of K past the sequence's end are the next sequence's keys and are masked like the window's bounds; only key
//     blocks that some row of the tile sees are loaded and computed. The producer hands each tile's bounds to the
//     consumers with its index; tiles whose rows see no key are skipped, and those rows (O = 0, LSE = +inf) are
//     written after the main tiles.
#pragma once

#include <cmath>
#include <type_traits>

#include "flash_params.h"
#include "fwd_tile_scheduler.h"
#include "hopper_kernel_traits.h"
#include "hopper_seqlen.h"
#include "hopper_tma.h"
#include "utils.cuh"
#include "wgmma.cuh"

namespace flash {

// Named barriers of the kernel (0 is __syncthreads, used once, after the mbarriers are initialised).
constexpr int kBarTurnWg0 = 1;  // + wg: "warpgroup wg may issue its matmuls"
// A turn barrier: the warpgroup whose turn it is syncs, the one before it arrives.
constexpr int kTurnBarThreads = 2 * kWarpgroupThreads;

// Calls f with std::integral_constant<int, n>: the fewest n8 column tiles of S, whole kFwdNarrowStepTiles steps below
// kNTiles or all kNTiles, that hold `tiles` of them (FLASH_FWD_NARROW_LAST_BLOCK: the n8 tiles a narrowed key block
// computes), trying the steps from kStep up. kWithAll = false: the caller knows that a narrower step holds them, and
// all kNTiles is not compiled.
template <int kNTiles, bool kWithAll = true, int kStep = kFwdNarrowStepTiles, typename F>
__device__ __forceinline__ void with_s_tiles(int tiles, F&& f) {
    if constexpr (kStep < kNTiles) {
        if (tiles <= kStep) return f(std::integral_constant<int, kStep>{});
        with_s_tiles<kNTiles, kWithAll, kStep + kFwdNarrowStepTiles>(tiles, f);
    } else if constexpr (kWithAll) {
        f(std::integral_constant<int, kNTiles>{});
    }
}

// kVarlenOrLocal: the varlen / sliding-window kernel (kIsCausal false; causal is its window's right bound).
template <typename Traits, bool kIsCausal, bool kVarlenOrLocal = false>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    flash_fwd_hopper_kernel(const __grid_constant__ FwdParams params, const __grid_constant__ QkvTensorMaps maps,
                            const __grid_constant__ FwdTiles tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kNStages = Traits::kNStages;
    constexpr int kNTilesN = kBlockN / kMmaN;    // n8 column tiles of S per warp
    constexpr int kVDim = Traits::kVDim;         // O's columns (P V's N); the tile's past it are zeros
    constexpr int kNTilesD = kVDim / kMmaN;      // n8 column tiles of O per warp
    constexpr int kKStepsD = Traits::kQKDim / kMmaK;  // k16 steps of Q K^T (to d_rounded, not the tile width)
    constexpr int kKStepsN = kBlockN / kMmaK;    // k16 steps of P V
    // Q, K and V in the SwizzleSpan of the traits (SW128: column blocks of 64, SW64: of 32; hopper_utils.cuh); a
    // tile width that is not whole blocks ends in a narrower block of its own span (TileLayout: hd65-80's 16 columns
    // in SW32). V's tiles may have a width and span of their own (Traits::kVWidth, kVSpanBytes).
    constexpr int kSpan = Traits::kSpanBytes;
    using Span = SwizzleSpan<kSpan>;
    using KLayout = TileLayout<kBlockN, kHeadDim, kSpan>;
    using QLayout = TileLayout<kBlockM, kHeadDim, kSpan>;
    using TailSpan = typename KLayout::TailSpan;
    constexpr int kTailSpan = TailSpan::kBytes;
    constexpr int kFullKSteps = KLayout::kFullKSteps;  // k16 steps of Q K^T in the whole column blocks
    constexpr int kVWidth = Traits::kVWidth;
    constexpr int kVSpan = Traits::kVSpanBytes;
    using VSpan = SwizzleSpan<kVSpan>;
    using VLayout = TileLayout<kBlockN, kVWidth, kVSpan>;
    using VTailSpan = typename VLayout::TailSpan;
    constexpr int kVTailSpan = VTailSpan::kBytes;
    constexpr int kVFullCols = kVDim < VLayout::kFullCols ? kVDim : VLayout::kFullCols;  // P V's N in V's whole blocks
    constexpr uint32_t kQColBlockBytes = kBlockM * Span::kBytes;   // one column block of Q
    constexpr uint32_t kKColBlockBytes = kBlockN * Span::kBytes;   // one column block of K
    constexpr uint32_t kVColBlockBytes = kBlockN * VSpan::kBytes;  // one column block of V
    constexpr uint32_t kKStepBytesN = kMmaK * VSpan::kBytes;       // 16 keys of V
    constexpr int kNConsumerThreads = Traits::kNConsumerThreads;
    constexpr int kNTileSlots = Traits::kNTileSlots;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    // The tiles' swizzle is relative to 1024-aligned addresses; the launch allocates kSwizzleAtomBytes of slack.
    unsigned char* smem = align_smem<kSwizzleAtomBytes>(smem_raw);
    const uint32_t sQ = smem_addr(smem);                              // swizzled kBlockM x kHeadDim
    const uint32_t sK = sQ + Traits::kSmemQBytes;                     // [kNStages][swizzled kBlockN x kHeadDim]
    const uint32_t sV = sK + kNStages * Traits::kSmemKTileBytes;      // [kNStages][swizzled kBlockN x kVWidth]
    const uint32_t sP = sV + kNStages * Traits::kSmemVTileBytes;      // kPSmem: [warpgroup][swizzled 64 x kBlockN]
    const uint32_t bars = sQ + Traits::kSmemTileBytes;                // Traits::kNMbarriers mbarriers of 8 bytes
    const uint32_t full_q = bars + 8 * 4 * kNStages;
    const uint32_t empty_q = full_q + 8;
    auto full_k = [&](int stage) { return bars + 8 * stage; };
    auto full_v = [&](int stage) { return bars + 8 * (kNStages + stage); };
    auto empty_k = [&](int stage) { return bars + 8 * (2 * kNStages + stage); };
    auto empty_v = [&](int stage) { return bars + 8 * (3 * kNStages + stage); };
    // The tiles' indices, from the producer (fwd_tile_scheduler.h) to the consumers: the tile_iter-th in slot
    // tile_iter % kNTileSlots, with a full and an empty mbarrier per slot. kVarlenOrLocal: the tile's LocalTile, a
    // slot of kLocalTileInts ints (the launch adds their bytes to the shared memory).
    static_assert(!(kIsCausal && kVarlenOrLocal), "the varlen / local kernel takes causal as its window");
    constexpr int kSlotInts = kVarlenOrLocal ? kLocalTileInts : 1;
    auto full_tile = [&](int slot) { return empty_q + 8 + 8 * slot; };
    auto empty_tile = [&](int slot) { return empty_q + 8 + 8 * (kNTileSlots + slot); };
    volatile int* tile_slots = reinterpret_cast<volatile int*>(smem + Traits::kSmemTileBytes + 8 * Traits::kNMbarriers);

    const int tid = threadIdx.x;
    const int seqlen_q = params.seqlen_q;
    const int seqlen_k = params.seqlen_k;
    const int causal_offset = seqlen_k - seqlen_q;  // query i sees keys j <= i + causal_offset

    // Thread 0 initialises the barriers; the producer warpgroup's first thread does every load (one TMA per column
    // block, which arms the "full" barrier with its bytes) and claims the tiles.
    if (tid == 0) {
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        mbarrier_init(full_q, 1);
        // One arrival per consumer thread (per consumer warp: Traits::kArrivePerWarp): its tile's last S read Q.
        mbarrier_init(empty_q, Traits::kEmptyArrivals);
        for (int stage = 0; stage < kNStages; ++stage) {
            mbarrier_init(full_k(stage), 1);  // the producer's arrival, plus the tile's bytes
            mbarrier_init(full_v(stage), 1);
            mbarrier_init(empty_k(stage), Traits::kEmptyArrivals);  // likewise: its wgmmas read the stage
            mbarrier_init(empty_v(stage), Traits::kEmptyArrivals);
        }
        for (int slot = 0; slot < kNTileSlots; ++slot) {
            mbarrier_init(full_tile(slot), 1);                   // the producer wrote the slot
            mbarrier_init(empty_tile(slot), kNConsumerThreads);  // every consumer thread read it
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the only block-wide barrier

    // The stages run on across tiles: K/V tile n_block of a tile whose first K/V tile is this block's kv_base-th
    // has running index kv = kv_base + n_block, lives in stage kv % kNStages and completes its barriers' phase
    // kv / kNStages.
    // (Producer.) K or V tile n_block of (head_k, batch), running index kv, once every consumer released the tile its
    // stage held kNStages tiles earlier; `full` and `empty` are the operand's stage-0 mbarriers. key0: the
    // sequence's first row (varlen), else 0.
    // is_v: std::true_type for V's tiles (kVWidth wide in kVSpan), std::false_type for K's.
    auto load = [&](auto is_v, const CUtensorMap* map, const CUtensorMap* tail_map, uint32_t stage_tiles,
                    uint32_t full, uint32_t empty, int kv, int n_block, int head_k, int batch, int key0) {
        constexpr bool kV = decltype(is_v)::value;
        constexpr uint32_t kStageBytes = kV ? Traits::kSmemVTileBytes : Traits::kSmemKTileBytes;
        const int stage = kv % kNStages;
        if (kv >= kNStages) mbarrier_wait(empty + 8 * stage, (kv / kNStages - 1) & 1);
        tma_load_rows<kBlockN, kV ? kVWidth : kHeadDim, kV ? kVSpan : kSpan>(
            stage_tiles + stage * kStageBytes, map, tail_map, key0 + n_block * kBlockN, head_k, batch,
            full + 8 * stage);
    };
    auto load_k = [&](int kv, int n_block, int head_k, int batch, int key0 = 0) {
        load(std::false_type{}, &maps.k, &maps.k_tail, sK, full_k(0), empty_k(0), kv, n_block, head_k, batch, key0);
    };
    auto load_v = [&](int kv, int n_block, int head_k, int batch, int key0 = 0) {
        load(std::true_type{}, &maps.v, &maps.v_tail, sV, full_v(0), empty_v(0), kv, n_block, head_k, batch, key0);
    };
    // The key blocks of the tile whose first row is row0: all of them, or causal up to the diagonal of its last row
    // (>= 1: fwd_tiles).
    auto key_blocks = [&](int row0) {
        const int n = ceil_div(seqlen_k, kBlockN);
        return kIsCausal ? min(n, ceil_div(row0 + kBlockM + causal_offset, kBlockN)) : n;
    };
    // The producer warpgroup: its first thread publishes each tile to the consumers, then loads it: K_0, Q (once the
    // tile before released it), then V_0, K_1, V_1, ... as their stages free up. Issue order per stage is kv order,
    // so each wait is at most one phase ahead, and the consumers never wait for a load issued after one of these
    // waits for them. It claims the next causal tile once this one is loaded, about kNStages turns
    // before the consumers finish it: claims come in about the order the SMs free up, as the hardware would hand
    // out whole blocks (claiming a whole tile ahead is slower at hd128). Its other 127 threads only hand their
    // registers back.
    if (tid >= kNConsumerThreads) {
        setmaxnreg_dec<Traits::kProducerRegs>();
        if (tid != kNConsumerThreads) return;
        int kv = 0;  // K/V tiles loaded before the current tile
        for (int tile = blockIdx.x, tile_iter = 0;; ++tile_iter) {
            if constexpr (kVarlenOrLocal) {
                // The next tile with a key block; its bounds go to the consumers in the slot.
                LocalTile lt{};
                for (; tile < tiles.num_tiles; tile = fwd_next_tile<false, true>(params, tile)) {
                    lt = fwd_local_tile<kBlockM, kBlockN>(tiles, params, tile);
                    if (lt.n_min < lt.n_max) break;
                }
                lt.tile = tile;
                const int slot = tile_iter % kNTileSlots;
                if (tile_iter >= kNTileSlots) mbarrier_wait(empty_tile(slot), (tile_iter / kNTileSlots - 1) & 1);
                const int fields[kLocalTileInts] = {lt.tile, lt.head, lt.batch, lt.row0, lt.n_min, lt.n_max,
                                                    lt.q0,   lt.k0,   lt.len_q, lt.len_k};
#pragma unroll
                for (int f = 0; f < kLocalTileInts; ++f) tile_slots[slot * kSlotInts + f] = fields[f];
                mbarrier_arrive(full_tile(slot));
                if (tile >= tiles.num_tiles) return;
                const int head_k = tiles.q_per_kv_head.div(lt.head);
                const int batch = tma_batch(params, lt.batch);
                const int n_blocks = lt.n_max - lt.n_min;
                load_k(kv, lt.n_min, head_k, batch, lt.k0);
                if (tile_iter > 0) mbarrier_wait(empty_q, (tile_iter - 1) & 1);
                tma_load_rows<kBlockM, kHeadDim, kSpan>(sQ, &maps.q, &maps.q_tail, lt.q0 + lt.row0, lt.head, batch,
                                                        full_q);
                for (int j = 0; j < n_blocks; ++j) {
                    if (j > 0) load_k(kv + j, lt.n_min + j, head_k, batch, lt.k0);
                    load_v(kv + j, lt.n_min + j, head_k, batch, lt.k0);
                }
                kv += n_blocks;
                tile = fwd_next_tile<false, true>(params, tile);
                continue;
            }
            const int slot = tile_iter % kNTileSlots;
            if (tile_iter >= kNTileSlots) mbarrier_wait(empty_tile(slot), (tile_iter / kNTileSlots - 1) & 1);
            tile_slots[slot] = tile;
            mbarrier_arrive(full_tile(slot));  // release: the consumers' wait (acquire) sees the slot's store
            if (tile >= tiles.num_tiles) return;
            const BlockCoord c = fwd_tile_coord<kIsCausal>(tiles, tile);
            const int row0 = fwd_block_rows<kBlockM>(tiles, c.block, seqlen_q).row0;
            const int n_block_max = key_blocks(row0), head_k = tiles.q_per_kv_head.div(c.head);
            load_k(kv, 0, head_k, c.batch);
            if (tile_iter > 0) mbarrier_wait(empty_q, (tile_iter - 1) & 1);
            tma_load_rows<kBlockM, kHeadDim, kSpan>(sQ, &maps.q, &maps.q_tail, row0, c.head, c.batch, full_q);
            for (int j = 0; j < n_block_max; ++j) {
                if (j > 0) load_k(kv + j, j, head_k, c.batch);
                load_v(kv + j, j, head_k, c.batch);
            }
            kv += n_block_max;
            tile = fwd_next_tile<kIsCausal>(params, tile);
        }
    }
    setmaxnreg_inc<Traits::kConsumerRegs>();

    // A consumer reads the tile_iter-th tile's index (kVarlenOrLocal: its LocalTile) from the producer and frees its
    // slot.
    auto read_tile = [&](int tile_iter) {
        const int slot = tile_iter % kNTileSlots;
        mbarrier_wait(full_tile(slot), (tile_iter / kNTileSlots) & 1);
        LocalTile lt;
        lt.tile = tile_slots[slot * kSlotInts];
        if constexpr (kVarlenOrLocal) {
            volatile int* f = tile_slots + slot * kSlotInts;
            lt = {f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9]};
        }
        mbarrier_arrive(empty_tile(slot));
        return lt;
    };

    // Warpgroup wg owns block rows [64 wg, 64 wg + 64); inside it warp w owns 16 rows, and this
    // thread rows `my_row` and `my_row + 8` (g = lane / 4; columns 8j + 2t + {0, 1} of every n8 tile j).
    // Read through a shuffle so the compiler knows it is warp-uniform: the wgmma descriptors built from it then
    // live in uniform registers instead of being moved there (R2UR) before every wgmma of a turn.
    const int wg = __shfl_sync(0xffffffffu, tid / kWarpgroupThreads, 0);
    const int lane = tid % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    const int my_row = wg * kWarpgroupRows + ((tid % kWarpgroupThreads) / kWarpSize) * kMmaM + g;

    float acc_o[kVDim / 2];
    float m_i[2];  // row max of the raw scores
    float l_i[2];  // this thread's partial sums, quad-reduced at the end
    const float scale_log2 = params.scale_softmax_log2;
    float s[kBlockN / 2];           // S_j accumulators, then P_j = exp(S_j - m) in place
    constexpr bool kPSmem = Traits::kPSmem;
    uint32_t p[kPSmem ? 1 : kKStepsN][4];  // P_{j-1} as the register A operand of O += P V (not kPSmem)
    // kPSmem: this warpgroup's P tile, 64-key column blocks of 64 rows x 128 bytes.
    const uint32_t sP_wg = sP + wg * Traits::kSmemPTileBytes;
    constexpr uint32_t kPColBlockBytes = kWarpgroupRows * kSwizzleRowBytes;

    // K-major descriptors of this warpgroup's 64 Q rows; K and V descriptors are per stage.
    // k-step kk of Q K^T starts in column block kk / kSteps, 32 bytes per k-step into its rows; past the whole
    // blocks, in the narrower last one (its own descriptors: another swizzle).
    constexpr int kSteps = Span::kKStepsPerBlock;
    const uint64_t desc_q = make_smem_desc<kSpan>(sQ + wg * kWarpgroupRows * Span::kBytes, 16, Span::kAtomBytes);
    const uint64_t desc_q_tail =
        make_smem_desc<kTailSpan>(sQ + QLayout::kTailOffset + wg * kWarpgroupRows * kTailSpan, 16, TailSpan::kAtomBytes);
    // S = Q K_stage^T into acc (N: its keys), kKStepsD wgmmas, K-major A and B.
    auto issue_s = [&](int stage, auto& acc) {
        constexpr int kN = 2 * static_cast<int>(std::extent_v<std::remove_reference_t<decltype(acc)>>);
        const uint32_t sK_st = sK + stage * Traits::kSmemKTileBytes;
        const uint64_t desc_k = make_smem_desc<kSpan>(sK_st, 16, Span::kAtomBytes);
        const uint64_t desc_k_tail = make_smem_desc<kTailSpan>(sK_st + KLayout::kTailOffset, 16, TailSpan::kAtomBytes);
#pragma unroll
        for (int kk = 0; kk < kKStepsD; ++kk) {
            if (kk < kFullKSteps) {
                Wgmma<Element, kN>::template ss<0>(
                    acc, desc_advance(desc_q, (kk / kSteps) * kQColBlockBytes + (kk % kSteps) * 32),
                    desc_advance(desc_k, (kk / kSteps) * kKColBlockBytes + (kk % kSteps) * 32), kk > 0);
            } else {
                Wgmma<Element, kN>::template ss<0>(acc, desc_advance(desc_q_tail, (kk - kFullKSteps) * 32),
                                                   desc_advance(desc_k_tail, (kk - kFullKSteps) * 32), kk > 0);
            }
        }
    };
    // O += P V_stage over ntiles' keys, a wgmma per k16 step: P from registers (or sP_wg), V N-major.
    auto issue_pv = [&](int stage, auto ntiles) {
        const uint32_t sV_st = sV + stage * Traits::kSmemVTileBytes;
        const uint64_t desc_v = make_smem_desc<kVSpan>(sV_st, kVColBlockBytes, VSpan::kAtomBytes);
        const uint64_t desc_v_tail = make_smem_desc<kVTailSpan>(sV_st + VLayout::kTailOffset, kBlockN * kVTailSpan,
                                                                VTailSpan::kAtomBytes);
        const uint64_t desc_p = make_smem_desc_sw128(sP_wg, 16, kSwizzleAtomBytes);
        // k-step kk into the accumulators of O's columns that `acc` holds (N = its width), V's from desc_b.
        auto pv_step = [&](auto& acc, int kk, uint64_t desc_b) {
            constexpr int kN = 2 * static_cast<int>(std::extent_v<std::remove_reference_t<decltype(acc)>>);
            if constexpr (kPSmem) {
                const uint64_t desc_p_kk = desc_advance(desc_p, (kk / 4) * kPColBlockBytes + (kk % 4) * 32);
                Wgmma<Element, kN>::template ss<1>(acc, desc_p_kk, desc_b, 1);
            } else {
                Wgmma<Element, kN>::template rs<1>(acc, p[kk], desc_b, 1);
            }
        };
#pragma unroll
        for (int kk = 0; kk < decltype(ntiles)::value / 2; ++kk) {
            if constexpr (kVDim > kVFullCols) {
                // O's columns in V's whole column blocks, then those in its narrower last block: two wgmmas.
                pv_step(*reinterpret_cast<float(*)[kVFullCols / 2]>(acc_o), kk,
                        desc_advance(desc_v, kk * kKStepBytesN));
                pv_step(*reinterpret_cast<float(*)[(kVDim - kVFullCols) / 2]>(acc_o + kVFullCols / 2), kk,
                        desc_advance(desc_v_tail, kk * kMmaK * kVTailSpan));
            } else {
                pv_step(acc_o, kk, desc_advance(desc_v, kk * kKStepBytesN));
            }
        }
    };
    // A turn's S_j and P_j span its key block's kNTilesN n8 tiles (all_tiles) or, where FLASH_FWD_NARROW_LAST_BLOCK
    // narrows the tile's last block, its first ntiles (std::integral_constant); s's tiles past them are neither written
    // nor read. A narrowed S_j accumulates into an array of its own (s_narrow, 4 ntiles floats), which land_s copies
    // into s once its wgmmas completed: with a narrower wgmma accumulating into part of s, ptxas serializes every wgmma
    // of the kernel (C7511, "insufficient register resources for the wgmma pipeline").
    constexpr std::integral_constant<int, kNTilesN> all_tiles{};
    auto issue_s_into = [&](int stage, auto ntiles, auto& s_narrow) {
        if constexpr (decltype(ntiles)() < kNTilesN) {
            issue_s(stage, s_narrow);
        } else {
            issue_s(stage, s);
        }
    };
    auto land_s = [&](auto ntiles, const auto& s_narrow) {
        if constexpr (decltype(ntiles)() < kNTilesN) {
#pragma unroll
            for (int i = 0; i < 4 * decltype(ntiles)(); ++i) s[i] = s_narrow[i];
        }
    };
    // Mask S_j, online softmax (flash_fwd_kernel.cuh: base 2, rows without a visible key keep m = -inf), and
    // P_j into the A-operand registers. acc_o already holds every P V up to j - 1, so it is rescaled here.
    // defer_o = std::true_type (kIntraWgOverlap, while this warpgroup's P_{j-1} V_{j-1} is in flight): acc_o and p,
    // which that wgmma reads, are left alone; P_j stays in s and O's factors in `correction` until rescale_o_pack_p
    // after the wait, which also exponentiates S_j's tiles from fwd_exp_tiles_before_wait on (kRescaleBeforePv: the
    // factors wait for the next turn, which applies them before it issues its P V).
    // kVarlenOrLocal: the current tile's sequence, whose bounds and window the mask applies.
    int local_len_k = 0, local_co = 0;
    // One past the last key that query `row` of the current tile's sequence sees: the dense mask's bound and the
    // narrowed last block's (the varlen mask takes key_hi beside key_lo).
    auto key_end = [&](int row) {
        if constexpr (kVarlenOrLocal) return key_hi(tiles.window, local_co, local_len_k, row);
        return kIsCausal ? min(seqlen_k, row + causal_offset + 1) : seqlen_k;
    };
    float correction[2] = {1.f, 1.f};
    float row_max_scaled[2];  // defer_o: each row's m_i * scale_log2, for the exponentials after the wait
    // kRescaleThreshold > 0 (hopper_kernel_traits.h, FLASH_FWD_RESCALE_THRESHOLD): whether the warp's last softmax
    // moved some row's m_i, so that O needs its rescale.
    constexpr int kRescaleThreshold = fwd_rescale_threshold(Traits::kHeadDim, kIsCausal || kVarlenOrLocal);
    constexpr bool kLazyRescale = kRescaleThreshold > 0;
    bool rescale_o = true;
    // defer_o: S_j's first fwd_exp_tiles_before_wait n8 tiles are exponentiated before the wait for P_{j-1} V_{j-1},
    // the rest by rescale_o_pack_p after it (hopper_kernel_traits.h, FLASH_FWD_EXP_SPLIT).
    // The accumulators of S columns 16kk..16kk+15 are the register A operand of k-step kk: four 8x8 matrices (rows
    // 0-7 and 8-15 of the warp's 16, keys 0-7, then the same rows, keys 8-15). kPSmem: one stmatrix per k-step writes
    // them to the warp's rows of sP_wg instead (stmatrix_k_step). Each warp's part of the P V wgmma reads only its
    // own 16 rows of P, so the warp's own sync publishes them, after the fence that shows the async proxy its writes
    // (FA3's order).
    auto pack_p = [&](auto ntiles) {
        constexpr int kKSteps = decltype(ntiles)::value / 2;
        if constexpr (kPSmem) {
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                uint32_t frag[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) frag[r] = pack2<Element>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
                stmatrix_k_step<kWarpgroupRows>(sP_wg, (my_row - g) % kWarpgroupRows, kk, lane, frag);
            }
            fence_view_async_shared();
            __syncwarp();
        } else {
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
                for (int r = 0; r < 4; ++r) p[kk][r] = pack2<Element>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
            }
        }
    };
    // P = exp2(S scale_log2 - max_scaled) for row r (r = 0: my_row, 1: my_row + 8) over S's n8 tiles [begin, end),
    // summed into l_i.
    auto exponentiate = [&](int r, float max_scaled, int begin, int end) {
#pragma unroll
        for (int i = begin; i < end; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[4 * i + 2 * r + e] = fast_exp2(fmaf(s[4 * i + 2 * r + e], scale_log2, -max_scaled));
            }
            l_i[r] += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
        }
    };
    // O's rows times their correction factors (row r = 0: my_row, 1: my_row + 8).
    auto scale_o = [&](int r, float factor) {
#pragma unroll
        for (int i = 0; i < kNTilesD; ++i) {
            acc_o[4 * i + 2 * r] *= factor;
            acc_o[4 * i + 2 * r + 1] *= factor;
        }
    };
    // Both rows of O times the factors kept in `correction`.
    auto scale_o_by_correction = [&] {
        scale_o(0, correction[0]);
        scale_o(1, correction[1]);
    };
    // kRescaleBeforePv (FLASH_FWD_RESCALE_BEFORE_PV): `correction` carries a turn's factors to the next turn, which
    // rescales O with them before it issues the P V that adds P_{j-1} V_{j-1}.
    constexpr bool kRescaleBeforePv = Traits::kIntraWgOverlap && !kLazyRescale &&
                                      fwd_rescale_before_pv(kVDim, kBlockN, kIsCausal || kVarlenOrLocal);
    auto softmax = [&](int n_block, int row0, auto defer_o, auto ntiles) {
        constexpr bool kDeferO = decltype(defer_o)::value;
        constexpr int kTiles = decltype(ntiles)::value;
        bool moved[2] = {true, true};  // kLazyRescale: whether row r's m_i moved
        const int key0 = n_block * kBlockN;
        if constexpr (kVarlenOrLocal) {
            // Row r sees keys [key_lo, key_hi) (hopper_seqlen.h); a block wholly inside every row's range is not masked.
            const KeyWindow w = tiles.window;
            if (key0 + kBlockN > local_len_k || key0 + kBlockN - 1 > row0 + local_co + w.right ||
                key0 < row0 + kBlockM - 1 + local_co - w.left) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = row0 + my_row + 8 * r;
                    const int hi = key_hi(w, local_co, local_len_k, row) - key0 - 2 * t;
                    const int lo = key_lo(w, local_co, row) - key0 - 2 * t;
#pragma unroll
                    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            if (i * kMmaN + e >= hi || i * kMmaN + e < lo) s[4 * i + 2 * r + e] = -INFINITY;
                        }
                    }
                }
            }
        } else if (key0 + kBlockN > seqlen_k || (kIsCausal && key0 + kBlockN - 1 > row0 + causal_offset)) {
            // Row r sees keys below min(seqlen_k, row + causal_offset + 1). As an offset from this thread's first column
            // of the block, that is one limit per row, and each element's column offset 8i + e is a constant: one
            // compare and one select per element.
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + my_row + 8 * r;
                const int limit = key_end(row) - key0 - 2 * t;
#pragma unroll
                for (int i = 0; i < kTiles; ++i) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (i * kMmaN + e >= limit) s[4 * i + 2 * r + e] = -INFINITY;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // r = 0: row my_row, r = 1: row my_row + 8
            constexpr int kChains = Traits::kRowMaxChains < kTiles ? Traits::kRowMaxChains : kTiles;
            float mx = m_i[r];
            if constexpr (kChains == 1) {
#pragma unroll
                for (int i = 0; i < kTiles; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
            } else {
                // kChains independent chains, each through every kChains-th n8 tile, then a tree: the longest fmaxf
                // dependency is about kTiles / kChains deep instead of kTiles.
                float part[kChains];
#pragma unroll
                for (int c = 0; c < kChains; ++c) part[c] = fmaxf(s[4 * c + 2 * r], s[4 * c + 2 * r + 1]);
#pragma unroll
                for (int i = kChains; i < kTiles; ++i) {
                    part[i % kChains] = fmaxf(part[i % kChains], fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
                }
#pragma unroll
                for (int width = kChains / 2; width > 0; width /= 2) {
#pragma unroll
                    for (int c = 0; c < width; ++c) part[c] = fmaxf(part[c], part[c + width]);
                }
                mx = fmaxf(mx, part[0]);
            }
            mx = quad_max(mx);
            if constexpr (kLazyRescale) {
                // m_i moves only when the row max passes it by more than kRescaleThreshold powers of two (from -inf:
                // +inf, it moves; -inf to -inf: NaN, it stays), so the stale max keeps P below 2^kRescaleThreshold.
                moved[r] = mx * scale_log2 - m_i[r] * scale_log2 > static_cast<float>(kRescaleThreshold);
                if (!moved[r]) mx = m_i[r];
            }
            const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
            const float row_correction = moved[r] ? fast_exp2(m_i[r] * scale_log2 - max_scaled) : 1.f;
            row_max_scaled[r] = max_scaled;
            m_i[r] = mx;
            l_i[r] *= row_correction;
            if constexpr (kDeferO || kLazyRescale) {
                correction[r] = row_correction;
            } else {
                scale_o(r, row_correction);
            }
            exponentiate(r, max_scaled, 0, kDeferO ? fwd_exp_tiles_before_wait(kHeadDim, kTiles) : kTiles);
        }
        if constexpr (kLazyRescale) rescale_o = __any_sync(0xffffffffu, moved[0] || moved[1]);
        if constexpr (kLazyRescale && !kDeferO) {
            if (rescale_o) scale_o_by_correction();
        }
        if constexpr (!kDeferO) pack_p(ntiles);
    };
    // The rest of a deferred softmax, once this warpgroup's P_{j-1} V_{j-1} completed: the exponentials of S_j's last
    // tiles and their l_i, O's rescale, P_j's packing (one basic block, which ptxas interleaves). kLazyRescale: two
    // such blocks, with and without the rescale, chosen by the warp's vote.
    auto finish_softmax = [&](auto with_rescale, auto ntiles) {
        constexpr int kTiles = decltype(ntiles)::value;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            exponentiate(r, row_max_scaled[r], fwd_exp_tiles_before_wait(kHeadDim, kTiles), kTiles);
            if constexpr (decltype(with_rescale)::value) scale_o(r, correction[r]);
        }
        pack_p(ntiles);
    };
    auto rescale_o_pack_p = [&](auto ntiles) {
        if (!kRescaleBeforePv && rescale_o) {  // rescale_o: always, without kLazyRescale
            finish_softmax(std::true_type{}, ntiles);
        } else {
            finish_softmax(std::false_type{}, ntiles);
        }
    };
    // FLASH_FWD_NARROW_LAST_BLOCK: the n8 tiles of S in key block n_last (the tile's last) up to the last key that
    // some row of the tile (first row row0) sees, in whole 64-key steps; kNTilesN where that is all of them, or off.
    constexpr bool kNarrowLastBlock = fwd_narrow_last_block(kBlockN, kIsCausal || kVarlenOrLocal);
    auto last_block_tiles = [&](int row0, int n_last) {
        if constexpr (!kNarrowLastBlock) return kNTilesN;
        // The tile's last row sees the furthest key (the rows' bounds do not fall with the row).
        constexpr int kStepKeys = kFwdNarrowStepTiles * kMmaN;
        const int keys = key_end(row0 + kBlockM - 1) - n_last * kBlockN;
        return min(kNTilesN, ceil_div(keys, kStepKeys) * kFwdNarrowStepTiles);
    };
    // A K, V or Q stage is free for the producer once this thread's (warp's) wgmmas that read it completed.
    auto release = [&](uint32_t empty) {
        if constexpr (Traits::kArrivePerWarp) {
            __syncwarp();  // every lane of the warp passed its wgmma wait
            if (lane == 0) mbarrier_arrive(empty);
        } else {
            mbarrier_arrive(empty);
        }
    };

    // Ping-pong turns: warpgroup 0 goes first; every turn ends by handing the tensor cores to the next one in the
    // ring, across tiles too (warpgroup 0 starts tile i + 1 while the last one finishes tile i). Each makes
    // n_block_max + 1 turns per tile; the last warpgroup skips its very last hand-over (nobody would take it).
    constexpr int kNWarpgroups = Traits::kNWarpgroups;
    const int my_turn = kBarTurnWg0 + wg;
    const int next_turn = kBarTurnWg0 + (wg == kNWarpgroups - 1 ? 0 : wg + 1);
    LocalTile cur = read_tile(0);  // dense: blockIdx.x < num_tiles (the launch runs min(SMs, num_tiles) blocks)
    int tile = cur.tile;
    int kv_base = 0;          // K/V tiles this block consumed before the current tile
    int tile_iter = 0;        // tiles this block finished before the current one
    // kVarlenOrLocal: the producer may have skipped every tile of this block.
    const bool any_tile = !kVarlenOrLocal || tile < tiles.num_tiles;
    if (any_tile && wg == kNWarpgroups - 1) named_barrier_arrive(kBarTurnWg0, kTurnBarThreads);

    while (any_tile) {
        // This tile's head, batch, rows and key blocks [n_min, n_min + n_block_max); n_block below counts from n_min.
        int bidh, bidb, n_min = 0, n_block_max, q0 = 0;
        BlockRows rows;
        if constexpr (kVarlenOrLocal) {
            bidh = cur.head;
            bidb = cur.batch;
            rows = {cur.row0, cur.row0 < 0 ? -cur.row0 : 0, kBlockM};
            n_min = cur.n_min;
            n_block_max = cur.n_max - cur.n_min;
            q0 = cur.q0;
            local_len_k = cur.len_k;
            local_co = cur.len_k - cur.len_q;
        } else {
            const BlockCoord coord = fwd_tile_coord<kIsCausal>(tiles, tile);
            bidh = coord.head;
            bidb = coord.batch;
            rows = fwd_block_rows<kBlockM>(tiles, coord.block, seqlen_q);
            n_block_max = key_blocks(rows.row0);
        }
        const int row0 = rows.row0;
        auto stage_of = [&](int n_block) { return (kv_base + n_block) % kNStages; };
        auto phase_of = [&](int n_block) { return ((kv_base + n_block) / kNStages) & 1; };
#pragma unroll
        for (int i = 0; i < kVDim / 2; ++i) acc_o[i] = 0.f;
        m_i[0] = m_i[1] = -INFINITY;
        l_i[0] = l_i[1] = 0.f;
        correction[0] = correction[1] = 1.f;  // turn 0's softmax scales O itself

        // FLASH_FWD_NARROW_LAST_BLOCK: the n8 tiles of S that the last key block's turns compute (kNTilesN: all).
        const int last_tiles = last_block_tiles(row0, n_min + n_block_max - 1);

        // Turn 0: S_0, over the whole block also where it is the last one: with a narrowed copy of this turn, ptxas
        // schedules the main loop with 19 more instructions (uniform moves for its wgmma descriptors). P_0 is zero
        // past the keys a narrowed last P V reads. (TMA writes and wgmma reads are both async-proxy accesses: no
        // proxy fence.)
        mbarrier_wait(full_q, tile_iter & 1);
        mbarrier_wait(full_k(stage_of(0)), phase_of(0));
        named_barrier_sync(my_turn, kTurnBarThreads);
        wgmma_fence();
        issue_s(stage_of(0), s);
        wgmma_commit();
        named_barrier_arrive(next_turn, kTurnBarThreads);
        wgmma_wait<0>();
        pin_registers(s);
        release(empty_k(stage_of(0)));
        if (n_block_max == 1) release(empty_q);
        softmax(n_min, row0, std::false_type{}, all_tiles);
        // kIntraWgOverlap: the turn that computes S_j waits, at its end, for the V_j that the next turn's P V reads.
        if constexpr (Traits::kIntraWgOverlap) mbarrier_wait(full_v(stage_of(0)), phase_of(0));

        // Turn j: O += P_{j-1} V_{j-1} and S_j, then the softmax of S_j while the other warpgroup's turn runs.
        auto turn = [&](int n_block, auto ntiles) {
            float s_narrow[decltype(ntiles)() < kNTilesN ? 4 * decltype(ntiles)() : 1];
            const int stage = stage_of(n_block), prev = stage_of(n_block - 1);
            if constexpr (!Traits::kIntraWgOverlap) mbarrier_wait(full_v(prev), phase_of(n_block - 1));
            mbarrier_wait(full_k(stage), phase_of(n_block));
            named_barrier_sync(my_turn, kTurnBarThreads);
            wgmma_fence();
            if constexpr (Traits::kIntraWgOverlap) {
                // S_j first, as its own group, so that wait<1> returns with the P V still in flight.
                issue_s_into(stage, ntiles, s_narrow);
                wgmma_commit();
                if constexpr (kRescaleBeforePv) {
                    scale_o_by_correction();
                    wgmma_fence();  // acc_o's writes before the P V that accumulates into it
                }
                issue_pv(prev, all_tiles);
                wgmma_commit();
                named_barrier_arrive(next_turn, kTurnBarThreads);
                wgmma_wait<1>();
                land_s(ntiles, s_narrow);
                pin_registers(s);
                release(empty_k(stage));
                if (n_block == n_block_max - 1) release(empty_q);
                softmax(n_min + n_block, row0, std::true_type{}, ntiles);
                // The exponentials of S_j's first tiles and their l_i (fwd_exp_tiles_before_wait) stay before the wait
                // for the P V (they are the overlap), O's rescale and the writes of p after it (that wgmma reads acc_o
                // and p until it completes). The pins order them for nvcc's optimizer; for ptxas, the wait for V_j
                // between them (a loop) ends a basic block: its scheduler hoists a wgmma wait (WARPGROUP.DEPBAR) to
                // the top of its block, above the exponentials there.
                pin_registers(s);
                pin_registers(l_i);
                pin_registers(correction);
                mbarrier_wait(full_v(stage), phase_of(n_block));
                wgmma_wait<0>();
                pin_registers(acc_o);
                if constexpr (!kPSmem) pin_registers(p);
                pin_registers(s);
                release(empty_v(prev));
                rescale_o_pack_p(ntiles);
            } else {
                issue_pv(prev, all_tiles);
                issue_s_into(stage, ntiles, s_narrow);
                wgmma_commit();
                named_barrier_arrive(next_turn, kTurnBarThreads);
                wgmma_wait<0>();
                land_s(ntiles, s_narrow);
                pin_registers(acc_o);
                pin_registers(s);
                release(empty_v(prev));
                release(empty_k(stage));
                if (n_block == n_block_max - 1) release(empty_q);
                softmax(n_min + n_block, row0, std::false_type{}, ntiles);
            }
        };
        // A narrowed last block takes its own copy of the turn, after the loop.
        const bool narrow_last = n_block_max > 1 && last_tiles < kNTilesN;
        for (int n_block = 1; n_block < n_block_max - narrow_last; ++n_block) turn(n_block, all_tiles);
        if (narrow_last) {
            with_s_tiles<kNTilesN, false>(last_tiles, [&](auto ntiles) { turn(n_block_max - 1, ntiles); });
        }

        // Last turn: O += P_last V_last. The producer has published the next tile a turn or more ago and is loading
        // it while the warpgroups finish this one.
        const int last = stage_of(n_block_max - 1);
        // kIntraWgOverlap: the turn of S_last waited for V_last.
        if constexpr (!Traits::kIntraWgOverlap) mbarrier_wait(full_v(last), phase_of(n_block_max - 1));
        named_barrier_sync(my_turn, kTurnBarThreads);
        if constexpr (kRescaleBeforePv) scale_o_by_correction();
        // Each width's copy runs from the issue to the wait: ptxas serializes wgmmas whose paths merge in flight.
        LocalTile next;
        bool more;
        with_s_tiles<kNTilesN>(last_tiles, [&](auto ntiles) {
            wgmma_fence();
            issue_pv(last, ntiles);
            wgmma_commit();
            next = read_tile(tile_iter + 1);
            more = next.tile < tiles.num_tiles;
            if (wg < kNWarpgroups - 1 || more) named_barrier_arrive(next_turn, kTurnBarThreads);
            wgmma_wait<0>();
        });
        pin_registers(acc_o);
        release(empty_v(last));

        // O = O / l, LSE = m * scale + log(l), straight from the accumulators: sQ already holds the next tile's Q,
        // and every other byte of shared memory is a K/V stage (or a P tile). Each 4-byte store writes 2 columns; a
        // warp's store covers 16 bytes of 8 rows, which L2 merges with the next column tile's into whole sectors.
        // The tile stores its rows [rows.first, rows.end); out points at the first of them.
        FwdOutRows<Element> out;
        if constexpr (kVarlenOrLocal) {
            SeqBounds seq{};
            seq.q_row0 = q0;  // the one field local_out_rows reads
            out = local_out_rows<Element>(params, seq, bidb, bidh, row0 + rows.first);
        } else {
            out = fwd_out_rows<Element>(params, bidb, bidh, row0 + rows.first);
        }
        Element* o = out.o;
        float* lse = out.lse;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = my_row + 8 * r;
            const float l = quad_sum(l_i[r]);
            const bool empty = l == 0.f || l != l;  // no visible key: O stays 0, LSE = +inf
            const float inv_sum = empty ? 0.f : 1.f / l;
            if (row >= rows.first && row < rows.end) {
                if (t == 0) lse[row - rows.first] = empty ? INFINITY : m_i[r] * params.scale_softmax + logf(l);
                Element* o_row = o + (row - rows.first) * params.o_row_stride + 2 * t;
#pragma unroll
                for (int i = 0; i < kNTilesD; ++i) {
                    if (i * kMmaN < params.d) {  // head dims below the tile width (d is a multiple of 8)
                        *reinterpret_cast<uint32_t*>(o_row + i * kMmaN) =
                            pack2<Element>(acc_o[4 * i + 2 * r] * inv_sum, acc_o[4 * i + 2 * r + 1] * inv_sum);
                    }
                }
            }
        }
        if (!more) break;
        cur = next;
        tile = next.tile;
        kv_base += n_block_max;
        ++tile_iter;
    }

    // kVarlenOrLocal: per sequence, the rows of the tiles the producer skipped (keyless_tile_rows), every head. A
    // sequence per block: one look at cu_seqlens per block at most, usually no rows.
    if constexpr (kVarlenOrLocal) {
        for (int batch = static_cast<int>(blockIdx.x); batch < params.b; batch += static_cast<int>(gridDim.x)) {
            const SeqBounds sq = seq_bounds(params, batch);
            const int skipped = keyless_tile_rows<kBlockM>(tiles.window, sq.seqlen_q, sq.seqlen_k);  // rows [0, skipped)
            for (int head = 0; head < params.h; ++head) {
                for (int r0 = 0; r0 < skipped; r0 += kBlockM) {
                    const FwdOutRows<Element> out = local_out_rows<Element>(params, sq, batch, head, r0);
                    write_rows_without_keys<kBlockM, kHeadDim, kNConsumerThreads>(out.o, params.o_row_stride, out.lse,
                                                                                 imin(kBlockM, skipped - r0), params.d);
                }
            }
        }
    }

    // Causal with Tq > Tk: the query blocks that see no key, after the main tiles.
    for (int e = static_cast<int>(blockIdx.x); e < tiles.num_empty; e += static_cast<int>(gridDim.x)) {
        const BlockCoord c = fwd_empty_tile_coord(tiles, params, e);
        const BlockRows rows = fwd_block_rows<kBlockM>(tiles, c.block, seqlen_q);
        const FwdOutRows<Element> out = fwd_out_rows<Element>(params, c.batch, c.head, rows.row0 + rows.first);
        write_rows_without_keys<kBlockM, kHeadDim, kNConsumerThreads>(out.o, params.o_row_stride, out.lse,
                                                                     rows.end - rows.first, params.d);
    }
#else
    __trap();  // built without sm_90a: the launcher never picks this kernel (hopper_kernel_traits.h)
#endif
}

}  // namespace flash
