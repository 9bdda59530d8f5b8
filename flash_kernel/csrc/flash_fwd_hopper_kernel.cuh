// FlashAttention-2 forward (Algorithm 1) on Hopper: wgmma (sm_90a) instead of mma.sync, ping-pong warpgroups.
//
// Same algorithm, masking and outputs as flash_fwd_kernel.cuh (which has the line-by-line Algorithm 1 text);
// what changes is who does the matmuls, where their operands live, and who loads them:
//   - S = Q K^T: one warpgroup-wide wgmma per 16 columns of the head dim, both operands read by the tensor
//     cores straight from the swizzled shared-memory tiles through descriptors (no ldmatrix, no fragment
//     registers for Q or K), fp32 accumulators in registers: 64 query rows x kBlockN keys per warpgroup.
//   - O += P V: P stays in registers (the accumulator layout of S is wgmma's register A layout, as with
//     mma.sync), V is read from shared memory as an N-major B operand (the transpose is the descriptor's).
//   - Q_i, K_j and V_j arrive by TMA (hopper_tma.h: one instruction per 64-column block, issued by one thread)
//     into kNStages stages each for K and V; each stage has a "full" mbarrier (its bytes landed) and an
//     "empty" one (every warpgroup is done reading it), so no block-wide barrier couples the warpgroups.
//     Once a warpgroup has issued its turn j, one of its threads loads K_{j+kNStages-1} into the stage K_{j-1}
//     freed and V_{j+kNStages-2} into the one V_{j-2} freed, while its warp waits for the tensor cores anyway.
//     With three stages or more that is the last warpgroup (v29): every warpgroup released both stages in its turn
//     j - 1, which comes before the last one's turn j in the ring, so its empty waits return at once. From
//     warpgroup 0, thread 0 waited there for the others' turn j - 1 to finish, and its warp's softmax started that
//     much later: +1 to +4% on 128-key blocks. With two stages (hd128 from 2048 keys) V_j is loaded in turn j for
//     turn j + 1, and the last warpgroup's turn came too late for it (-10 to -13%), so thread 0 loads them there.
//     (Loading after the wait put the loader's waits and copies on its warp's path to the softmax: -8 to -12% at
//     head dim 64, where the softmax is the longer half of a turn.)
//   - Ping-pong (FA3 paper, section 3.1): the warpgroups (two, or three at hd64) take turns in a
//     ring to issue their matmuls (named barriers), so the tensor cores run one warpgroup's GEMMs while the
//     others do their softmax. Each turn issues O += P_{j-1} V_{j-1} and S_j = Q K_j^T together, so one wait
//     covers both and the softmax of S_j runs while the other warpgroups' pairs are on the tensor cores.
//   - Persistent (v16, fwd_tile_scheduler.h): one block per SM runs query-block tiles one after another. The K/V
//     stages and their barrier phases run on across tiles; in a tile's last turn thread 0 loads the next tile's
//     Q (once the tile's last S released it) and first K/V, and warpgroup 0 starts the next tile while the
//     others finish this one. O is stored straight from the accumulators (sQ holds the next Q by then).
#pragma once

#include <cmath>

#include "flash_params.h"
#include "fwd_tile_scheduler.h"
#include "hopper_kernel_traits.h"
#include "hopper_tma.h"
#include "utils.cuh"
#include "wgmma.cuh"

namespace flash {

// Named barriers of the kernel (0 is __syncthreads, used once, after the mbarriers are initialised).
constexpr int kBarTurnWg0 = 1;     // + wg: "warpgroup wg may issue its matmuls"
constexpr int kBarNextTile = kBarTurnWg0 + kMaxFwdWarpgroups;  // warpgroup 0: the loader has shared the next tile
// A turn barrier: the warpgroup whose turn it is syncs, the one before it arrives.
constexpr int kTurnBarThreads = 2 * kWarpgroupThreads;

template <typename Traits, bool kIsCausal>
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
    constexpr int kNTilesD = kHeadDim / kMmaN;   // n8 column tiles of O per warp
    constexpr int kKStepsD = Traits::kQKDim / kMmaK;  // k16 steps of Q K^T (to d_rounded, not the tile width)
    constexpr int kKStepsN = kBlockN / kMmaK;    // k16 steps of P V
    constexpr uint32_t kQColBlockBytes = kBlockM * kSwizzleRowBytes;   // one 64-column block of Q
    constexpr uint32_t kKVColBlockBytes = kBlockN * kSwizzleRowBytes;  // one 64-column block of K or V
    constexpr uint32_t kKStepBytesN = kMmaK * kSwizzleRowBytes;        // 16 keys of V
    constexpr int kPolyExpEvery = Traits::kPolyExpEvery;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    // The tiles' swizzle is relative to 1024-aligned addresses; the launch allocates kSwizzleAtomBytes of slack.
    unsigned char* smem = align_smem<kSwizzleAtomBytes>(smem_raw);
    const uint32_t sQ = smem_addr(smem);                              // swizzled kBlockM x kHeadDim
    const uint32_t sK = sQ + Traits::kSmemQBytes;                     // [kNStages][swizzled kBlockN x kHeadDim]
    const uint32_t sV = sK + kNStages * Traits::kSmemKVTileBytes;     // [kNStages][swizzled kBlockN x kHeadDim]
    constexpr int kNThreads = Traits::kNThreads;
    const uint32_t bars = sQ + Traits::kSmemTileBytes;                // [4][kNStages] + 2 mbarriers of 8 bytes
    const uint32_t full_q = bars + 8 * 4 * kNStages;
    const uint32_t empty_q = full_q + 8;
    auto full_k = [&](int stage) { return bars + 8 * stage; };
    auto full_v = [&](int stage) { return bars + 8 * (kNStages + stage); };
    auto empty_k = [&](int stage) { return bars + 8 * (2 * kNStages + stage); };
    auto empty_v = [&](int stage) { return bars + 8 * (3 * kNStages + stage); };
    // Causal: the next tile, from the loader (fwd_tile_scheduler.h) to the other threads.
    volatile int* next_tile_slot = reinterpret_cast<volatile int*>(smem + Traits::kSmemTileBytes + 8 * Traits::kNMbarriers);

    const int tid = threadIdx.x;
    const int seqlen_q = params.seqlen_q;
    const int seqlen_k = params.seqlen_k;
    const int causal_offset = seqlen_k - seqlen_q;  // query i sees keys j <= i + causal_offset

    // Thread 0 initialises the barriers, claims tiles and loads each tile's head (Q and its first K/V tiles); the
    // rest of the K/V tiles (load_ahead) come from stream_loader (the header says which). Each load is one TMA per
    // 64-column block and arms its "full" barrier with its bytes.
    const bool loader = tid == 0;
    const bool stream_loader = tid == (kNStages >= 3 ? (Traits::kNWarpgroups - 1) * kWarpgroupThreads : 0);
    if (loader) {
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        mbarrier_init(full_q, 1);
        mbarrier_init(empty_q, kNThreads);  // one arrival per thread: its tile's last S read Q
        for (int stage = 0; stage < kNStages; ++stage) {
            mbarrier_init(full_k(stage), 1);  // the loader's arrival, plus the tile's bytes
            mbarrier_init(full_v(stage), 1);
            mbarrier_init(empty_k(stage), kNThreads);  // one arrival per thread: its wgmmas read the stage
            mbarrier_init(empty_v(stage), kNThreads);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the only block-wide barrier

    // The stages run on across tiles: K/V tile n_block of a tile whose first K/V tile is this block's kv_base-th
    // has running index kv = kv_base + n_block, lives in stage kv % kNStages and completes its barriers' phase
    // kv / kNStages.
    // (Loader only.) K or V tile n_block of (head_k, batch), running index kv, once every warpgroup released the
    // tile its stage held kNStages tiles earlier; `full` and `empty` are the operand's stage-0 mbarriers.
    auto load = [&](const CUtensorMap* map, uint32_t stage_tiles, uint32_t full, uint32_t empty, int kv, int n_block,
                    int head_k, int batch) {
        const int stage = kv % kNStages;
        if (kv >= kNStages) mbarrier_wait(empty + 8 * stage, (kv / kNStages - 1) & 1);
        tma_load_rows<kBlockN, kHeadDim>(stage_tiles + stage * Traits::kSmemKVTileBytes, map, n_block * kBlockN, head_k,
                                         batch, full + 8 * stage);
    };
    auto load_k = [&](int kv, int n_block, int head_k, int batch) {
        load(&maps.k, sK, full_k(0), empty_k(0), kv, n_block, head_k, batch);
    };
    auto load_v = [&](int kv, int n_block, int head_k, int batch) {
        load(&maps.v, sV, full_v(0), empty_v(0), kv, n_block, head_k, batch);
    };
    // The key blocks of the tile whose first row is row0: all of them, or causal up to the diagonal of its last row
    // (>= 1: fwd_tiles).
    auto key_blocks = [&](int row0) {
        const int n = ceil_div(seqlen_k, kBlockN);
        return kIsCausal ? min(n, ceil_div(row0 + kBlockM + causal_offset, kBlockN)) : n;
    };
    // (Loader only.) The block's tile_iter-th tile's Q, K_0 .. K_{kNStages-2} and V_0 .. V_{kNStages-3}; Q once
    // every thread's last S of the tile before is done reading it (full_q and empty_q complete phase tile_iter
    // for the tile_iter-th tile).
    auto load_tile_head = [&](int tile, int tile_iter, int kv_base) {
        const BlockCoord c = fwd_tile_coord<kIsCausal>(tiles, tile);
        const int row0 = fwd_block_rows<kBlockM>(tiles, c.block, seqlen_q).row0;
        const int n_block_max = key_blocks(row0), head_k = tiles.q_per_kv_head.div(c.head);
        if (tile_iter > 0) mbarrier_wait(empty_q, (tile_iter - 1) & 1);
        tma_load_rows<kBlockM, kHeadDim>(sQ, &maps.q, row0, c.head, c.batch, full_q);
        for (int j = 0; j < kNStages - 1 && j < n_block_max; ++j) load_k(kv_base + j, j, head_k, c.batch);
        for (int j = 0; j < kNStages - 2 && j < n_block_max; ++j) load_v(kv_base + j, j, head_k, c.batch);
    };

    // Warpgroup wg owns block rows [64 wg, 64 wg + 64); inside it warp w owns 16 rows, and this
    // thread rows `my_row` and `my_row + 8` (g = lane / 4; columns 8j + 2t + {0, 1} of every n8 tile j).
    // Read through a shuffle so the compiler knows it is warp-uniform: the wgmma descriptors built from it then
    // live in uniform registers instead of being moved there (R2UR) before every wgmma of a turn.
    const int wg = __shfl_sync(0xffffffffu, tid / kWarpgroupThreads, 0);
    const int lane = tid % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    const int my_row = wg * kWarpgroupRows + ((tid % kWarpgroupThreads) / kWarpSize) * kMmaM + g;

    float acc_o[kHeadDim / 2];
    float row_max[2];
    float row_sum[2];  // this thread's partial sums, quad-reduced at the end
    const float scale_log2 = params.scale_softmax_log2;
    float s[kBlockN / 2];           // S_j accumulators, then P_j = exp(S_j - m) in place
    uint32_t p[kKStepsN][4];        // P_{j-1} as the register A operand of O += P V

    // K-major descriptors of this warpgroup's 64 Q rows; K and V descriptors are per stage.
    const uint64_t desc_q = make_smem_desc_sw128(sQ + wg * kWarpgroupRows * kSwizzleRowBytes, 16, kSwizzleAtomBytes);
    auto issue_s = [&](int stage) {  // S = Q K_stage^T, kKStepsD wgmmas, K-major A and B
        const uint64_t desc_k = make_smem_desc_sw128(sK + stage * Traits::kSmemKVTileBytes, 16, kSwizzleAtomBytes);
#pragma unroll
        for (int kk = 0; kk < kKStepsD; ++kk) {
            Wgmma<Element, kBlockN>::template ss<0>(s, desc_advance(desc_q, (kk / 4) * kQColBlockBytes + (kk % 4) * 32),
                                                    desc_advance(desc_k, (kk / 4) * kKVColBlockBytes + (kk % 4) * 32), kk > 0);
        }
    };
    auto issue_pv = [&](int stage) {  // O += P V_stage, kKStepsN wgmmas, P from registers, V N-major
        const uint64_t desc_v = make_smem_desc_sw128(sV + stage * Traits::kSmemKVTileBytes, kKVColBlockBytes, kSwizzleAtomBytes);
#pragma unroll
        for (int kk = 0; kk < kKStepsN; ++kk) {
            Wgmma<Element, kHeadDim>::template rs<1>(acc_o, p[kk], desc_advance(desc_v, kk * kKStepBytesN), 1);
        }
    };
    // Mask S_j, online softmax (flash_fwd_kernel.cuh: base 2, rows without a visible key keep m = -inf), and
    // P_j into the A-operand registers. acc_o already holds every P V up to j - 1, so it is rescaled here.
    auto softmax = [&](int n_block, int row0) {
        const int key0 = n_block * kBlockN;
        if (key0 + kBlockN > seqlen_k || (kIsCausal && key0 + kBlockN - 1 > row0 + causal_offset)) {
            // Row r sees keys below min(seqlen_k, row + causal_offset + 1). As an offset from this thread's first column
            // of the block, that is one limit per row, and each element's column offset 8i + e is a constant: one
            // compare and one select per element.
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + my_row + 8 * r;
                const int end = kIsCausal ? min(seqlen_k, row + causal_offset + 1) : seqlen_k;
                const int limit = end - key0 - 2 * t;
#pragma unroll
                for (int i = 0; i < kNTilesN; ++i) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (i * kMmaN + e >= limit) s[4 * i + 2 * r + e] = -INFINITY;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // r = 0: row my_row, r = 1: row my_row + 8
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
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    // Every kPolyExpEvery-th n8 tile off the SFU (hopper_kernel_traits.h).
                    s[4 * i + 2 * r + e] = softmax_exp2<kPolyExpEvery>(fmaf(s[4 * i + 2 * r + e], scale_log2, -max_scaled), i);
                }
                row_sum[r] += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
            }
        }
        // The accumulators of S columns 16kk..16kk+15 are the register A operand of k-step kk.
#pragma unroll
        for (int kk = 0; kk < kKStepsN; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) p[kk][r] = pack2<Element>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        }
    };

    // Ping-pong turns: warpgroup 0 goes first; every turn ends by handing the tensor cores to the next one in the
    // ring, across tiles too (warpgroup 0 starts tile i + 1 while the last one finishes tile i). Each makes
    // n_block_max + 1 turns per tile; the last warpgroup skips its very last hand-over (nobody would take it).
    constexpr int kNWarpgroups = Traits::kNWarpgroups;
    const int my_turn = kBarTurnWg0 + wg;
    const int next_turn = kBarTurnWg0 + (wg == kNWarpgroups - 1 ? 0 : wg + 1);
    int tile = blockIdx.x;  // < num_tiles: the launch runs min(SMs, num_tiles) blocks
    int next = 0;           // the tile after this one (causal: the loader's until it shares it in the last turn)
    int kv_base = 0;        // K/V tiles this block consumed before the current tile
    int tile_iter = 0;      // tiles this block finished before the current one
    if (loader) load_tile_head(tile, tile_iter, kv_base);
    if (wg == kNWarpgroups - 1) named_barrier_arrive(kBarTurnWg0, kTurnBarThreads);

    while (true) {
        const BlockCoord coord = fwd_tile_coord<kIsCausal>(tiles, tile);
        const int bidh = coord.head, bidb = coord.batch;
        const BlockRows rows = fwd_block_rows<kBlockM>(tiles, coord.block, seqlen_q);
        const int row0 = rows.row0;
        const int n_block_max = key_blocks(row0);
        const int bidh_k = tiles.q_per_kv_head.div(bidh);  // GQA/MQA: the kv head of this query head
        auto stage_of = [&](int n_block) { return (kv_base + n_block) % kNStages; };
        auto phase_of = [&](int n_block) { return ((kv_base + n_block) / kNStages) & 1; };
        // Issued with stream_loader's turn j: K_{j+kNStages-1} and V_{j+kNStages-2}, into the stages of K_{j-1} and
        // V_{j-2}.
        auto load_ahead = [&](int n_block) {
            if (!stream_loader) return;
            if (n_block + kNStages - 1 < n_block_max) load_k(kv_base + n_block + kNStages - 1, n_block + kNStages - 1, bidh_k, bidb);
            if (n_block + kNStages - 2 < n_block_max) load_v(kv_base + n_block + kNStages - 2, n_block + kNStages - 2, bidh_k, bidb);
        };
        // Causal: the loader claims the next tile in turn n_block_max - 2 (turn 0 of a 1-block tile), after its
        // hand-over, and loads its head in the last turn. Claims then come in about the order the blocks finish, as
        // the hardware would hand out whole blocks; claiming at a tile's start instead (a tile ahead) left blocks 4%
        // apart at hd128 in the greedy-schedule model and measured 4-7% slower. Two turns (one at least) hide the
        // atomic's latency.
        auto claim_next = [&](int n_block) {
            if (n_block != max(0, n_block_max - 2)) return;
            if (!kIsCausal || loader) next = fwd_next_tile<kIsCausal>(params, tile);
        };
#pragma unroll
        for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.f;
        row_max[0] = row_max[1] = -INFINITY;
        row_sum[0] = row_sum[1] = 0.f;

        // Turn 0: S_0. (TMA writes and wgmma reads are both async-proxy accesses: no proxy fence.)
        mbarrier_wait(full_q, tile_iter & 1);
        mbarrier_wait(full_k(stage_of(0)), phase_of(0));
        named_barrier_sync(my_turn, kTurnBarThreads);
        wgmma_fence();
        issue_s(stage_of(0));
        wgmma_commit();
        named_barrier_arrive(next_turn, kTurnBarThreads);
        claim_next(0);
        load_ahead(0);
        wgmma_wait<0>();
        pin_registers(s);
        mbarrier_arrive(empty_k(stage_of(0)));
        if (n_block_max == 1) mbarrier_arrive(empty_q);
        softmax(0, row0);

        // Turn j: O += P_{j-1} V_{j-1} and S_j, then the softmax of S_j while the other warpgroup's turn runs.
        for (int n_block = 1; n_block < n_block_max; ++n_block) {
            const int stage = stage_of(n_block), prev = stage_of(n_block - 1);
            mbarrier_wait(full_v(prev), phase_of(n_block - 1));
            mbarrier_wait(full_k(stage), phase_of(n_block));
            named_barrier_sync(my_turn, kTurnBarThreads);
            wgmma_fence();
            issue_pv(prev);
            issue_s(stage);
            wgmma_commit();
            named_barrier_arrive(next_turn, kTurnBarThreads);
            claim_next(n_block);
            load_ahead(n_block);
            wgmma_wait<0>();
            pin_registers(acc_o);
            pin_registers(s);
            mbarrier_arrive(empty_v(prev));
            mbarrier_arrive(empty_k(stage));
            if (n_block == n_block_max - 1) mbarrier_arrive(empty_q);
            softmax(n_block, row0);
        }

        // Last turn: O += P_last V_last. Then the loader starts the next tile's loads, which land while the
        // warpgroups finish this one.
        const int last = stage_of(n_block_max - 1);
        mbarrier_wait(full_v(last), phase_of(n_block_max - 1));
        named_barrier_sync(my_turn, kTurnBarThreads);
        wgmma_fence();
        issue_pv(last);
        wgmma_commit();
        if constexpr (kIsCausal) {  // the loader shares the next tile: warpgroup 0 reads it after their barrier, the
            if (loader) *next_tile_slot = next;  // others after their last turn's (which follow our hand-over)
            if (wg == 0) named_barrier_sync(kBarNextTile, kWarpgroupThreads);
            next = *next_tile_slot;
        }
        const bool more = next < tiles.num_tiles;
        if (wg < kNWarpgroups - 1 || more) named_barrier_arrive(next_turn, kTurnBarThreads);
        // The next tile's Q, first K and V: they land while the warpgroups finish this tile. (A second Q stage,
        // loaded a turn earlier, measured 1-4% slower at hd64: the loader's waits then sat before warpgroup 0's
        // softmax.)
        if (loader && more) load_tile_head(next, tile_iter + 1, kv_base + n_block_max);
        wgmma_wait<0>();
        pin_registers(acc_o);
        mbarrier_arrive(empty_v(last));

        // O = O / l, LSE = m * scale + log(l), straight from the accumulators: sQ already holds the next tile's Q,
        // and every other byte of shared memory is a K/V stage. Each 4-byte store writes 2 columns; a warp's
        // store covers 16 bytes of 8 rows, which L2 merges with the next column tile's into whole sectors.
        // The tile stores its rows [rows.first, rows.end); out points at the first of them.
        const FwdOutRows<Element> out = fwd_out_rows<Element>(params, bidb, bidh, row0 + rows.first);
        Element* o = out.o;
        float* lse = out.lse;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = my_row + 8 * r;
            const float l = quad_sum(row_sum[r]);
            const bool empty = l == 0.f || l != l;  // no visible key: O stays 0, LSE = +inf
            const float inv_sum = empty ? 0.f : 1.f / l;
            if (row >= rows.first && row < rows.end) {
                if (t == 0) lse[row - rows.first] = empty ? INFINITY : row_max[r] * params.scale_softmax + logf(l);
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
        tile = next;
        kv_base += n_block_max;
        ++tile_iter;
    }

    // Causal with Tq > Tk: the query blocks that see no key, after the main tiles.
    for (int e = static_cast<int>(blockIdx.x); e < tiles.num_empty; e += static_cast<int>(gridDim.x)) {
        const BlockCoord c = fwd_empty_tile_coord(tiles, params, e);
        const BlockRows rows = fwd_block_rows<kBlockM>(tiles, c.block, seqlen_q);
        const FwdOutRows<Element> out = fwd_out_rows<Element>(params, c.batch, c.head, rows.row0 + rows.first);
        write_rows_without_keys<kBlockM, kHeadDim, kNThreads>(out.o, params.o_row_stride, out.lse, rows.end - rows.first,
                                                             params.d);
    }
#else
    __trap();  // built without sm_90a: the launcher never picks this kernel (hopper_kernel_traits.h)
#endif
}

}  // namespace flash
