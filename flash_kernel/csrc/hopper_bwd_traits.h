// Tile shapes of the Hopper (sm_90a, wgmma) backward, per head dim (the kernel is flash_bwd_hopper_kernel.cuh).
//
// A thread block owns kBlockN = 128 keys (K_j, V_j, dK_j, dV_j) and walks the query blocks of kBlockM rows
// (64 at hd128, 128 at hd64). Two warpgroups each own 64 of the keys: their S^T, dP^T (64 keys x kBlockM
// queries) and dK, dV (64 keys x head dim) are wgmma accumulators in registers. dQ_i = dS_i K_j needs every key
// of the block, so dS^T goes through shared memory, and the two warpgroups split dQ's work by queries (kBlockM
// = 128: each 64 queries x the head dim) or by columns (kBlockM = 64: 64 queries x 64 columns each at hd128; at
// hd65-96 the second warpgroup's columns stop at 96 with FLASH_BWD_NARROW_DQ).
#pragma once

#include "hopper_kernel_traits.h"  // kWarpgroupThreads, kWarpgroupRows, kMaxSmemBytesSm90

// FLASH_BWD_LD_IN_MMA (on): the dense Hopper backward in bf16 (kBwdLdInMma) adds -L_i / scale to S^T and -D_i to dP^T
// by one more k16 step of each product, A a fragment of ones and B the query block's rows of BwdParams::ld_mma,
// instead of every thread loading L_i and D_i for its 16 query columns from shared memory.
#ifndef FLASH_BWD_LD_IN_MMA
#define FLASH_BWD_LD_IN_MMA 1
#endif
// Build switch for HopperBwdTraits::kDqBeforeDk (on by default; -DFLASH_BWD_DQ_BEFORE_DK=0 builds without it).
#ifndef FLASH_BWD_DQ_BEFORE_DK
#define FLASH_BWD_DQ_BEFORE_DK 1
#endif
// FLASH_BWD_NARROW_DKV (on): the hd96 config's 128-wide tiles (kQKDim = 96; with FLASH_BWD_HD96_SW64 off, whose
// 96-wide tiles give dK and dV 96 columns either way) accumulate dK and dV over 96 columns (kDkvDim, n96 wgmmas
// reading 1.5 of Q's and dO's 64-column blocks) instead of 128: a quarter less work in those two products, and 32
// fewer accumulator registers per thread.
#ifndef FLASH_BWD_NARROW_DKV
#define FLASH_BWD_NARROW_DKV 1
#endif
// FLASH_BWD_NARROW_DQ (on): where the warpgroups split dQ_i by columns and the head dim is not two whole 64-column
// blocks (hd65-96: dQ rows of 96 floats), the last warpgroup computes only the columns up to kQKDim (n32 instead of
// n64; the other keeps its 64): dQ's tensor work per iteration 128 -> 96 columns, a quarter less, 6-7% of the
// iteration's (FA4's sm90 backward at these head dims computes dQ as one n96 on one warpgroup instead). The 96-wide
// SW64 tiles (FLASH_BWD_HD96_SW64) end at 96 columns, so there the last warpgroup's n32 needs no switch.
#ifndef FLASH_BWD_NARROW_DQ
#define FLASH_BWD_NARROW_DQ 1
#endif
// FLASH_BWD_HD96_SW64 (on): head dims 81-96 (the hd96 config's Traits) store Q, dO, K and V 96 columns wide in the
// SW64 layout (as the forward's FLASH_FWD_HD96_SW64) instead of 128 in SW128, whose last 32 columns TMA fills with
// zeros: a quarter fewer bytes per Q_i / dO_i stage and per K_j / V_j, 162 KiB of shared memory instead of 194, and
// with every SM loading, TMA lands a 64-row tile of d = 96 as three SW64 boxes in 379 cycles against 435 for two SW128
// boxes (bench/layout_rates.cu). dS^T and sdQ keep their layouts; the hd80 twins keep SW128 (HopperBwdConfig<96>).
#ifndef FLASH_BWD_HD96_SW64
#define FLASH_BWD_HD96_SW64 1
#endif
// FLASH_BWD_PERSISTENT (on): where dK_j and dV_j fit one sdQ stage (hd64) or a buffer of their own (hd81-96 on SW64
// tiles, non-causal), the dense kernel is persistent, one thread block per SM looping over tiles, each loading its
// next tile's K_j, V_j and first Q_i / dO_i while it stores the current one's dK_j and dV_j (bwd_tile_scheduler.h);
// off, and at the other head dims, one thread block per tile.
#ifndef FLASH_BWD_PERSISTENT
#define FLASH_BWD_PERSISTENT 1
#endif
// FLASH_BWD_TRACE (off): thread 0 of every thread block writes the SM clock at the phases of its life into
// BwdParams::block_trace (block_trace.h; bench/block_trace.py gives the buffer and reads it). For measurement only.
#ifndef FLASH_BWD_TRACE
#define FLASH_BWD_TRACE 0
#endif

namespace flash {

// Whether the dense Hopper backward of this dtype takes L_i and D_i through its matmuls (FLASH_BWD_LD_IN_MMA), and so
// whether the binding makes ld_mma (hopper_bwd_ld_in_mma, flash_launch.h).
template <typename Element>
constexpr bool kBwdLdInMma = FLASH_BWD_LD_IN_MMA != 0 && std::is_same_v<Element, __nv_bfloat16>;

// kHeadDim is the tile width; kQKDim the floats of a dQ row in sdQ and dq_accum (BwdParams::dq_accum_cols): the
// instantiated head dim (d_rounded), or 80 for the hd65-80 twins (NarrowTraits); kSumDim <= kQKDim the columns that
// S^T = K Q_i^T and dP^T = V dO_i^T sum over (HopperFwdTraits: head dims 65-96 run the 128-wide tiles with zero
// columns; FLASH_NARROW_HD80's twins skip 16 more of them). kSpanBytes: Q, dO, K and V in SW128 (128, column blocks
// of 64) or SW64 (64, column blocks of 32; hopper_utils.cuh); SW128 tiles may end in a narrower block (TileLayout).
template <int kHeadDim_, typename Element_, int kQKDim_ = kHeadDim_, int kBlockM_ = 64, int kDkvDim_ = kHeadDim_,
          int kSumDim_ = kQKDim_, int kSpanBytes_ = kSwizzleRowBytes>
struct HopperBwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kSpanBytes = kSpanBytes_;  // the Q, dO, K and V tiles' SwizzleSpan
    static constexpr int kBlockElems = SwizzleSpan<kSpanBytes>::kBlockElems;
    static constexpr int kQKDim = kQKDim_;
    static constexpr int kSumDim = kSumDim_;
    // dK's and dV's columns, the N of dV += P^T dO_i and dK += dS^T Q_i (<= kHeadDim: the tile's columns past it,
    // zeros from TMA, are not read); dQ keeps whole 64-column blocks per warpgroup.
    static constexpr int kDkvDim = kDkvDim_;
    static constexpr int kNWarpgroups = 2;
    static constexpr int kNThreads = kNWarpgroups * kWarpgroupThreads;
    static constexpr int kBlockN = kNWarpgroups * kWarpgroupRows;  // keys per thread block, 64 per warpgroup
    static constexpr int kBlockM = kBlockM_;                       // queries per iteration: N of S^T and dP^T
    static constexpr int kNStages = 2;                             // Q_i / dO_i / L_i / D_i double-buffered
    // dQ: each warpgroup a (64 queries x kDqCols) tile over all kBlockN keys.
    static constexpr bool kDqSplitQueries = kBlockM == kNWarpgroups * kWarpgroupRows;
    // S^T_{i+1} issued at the end of iteration i, so that it runs under the dQ_i stores and the closing barrier
    // (flash_bwd_hopper_kernel.cuh). At kBlockM = 128 its 64 accumulators beside dK and dV spilled.
    static constexpr bool kIssueNextSEarly = kBlockM == kWarpgroupRows;
    // FA3's matmul order after dS^T: dV += P^T dO_i before the barrier that publishes dS^T, then dQ_i and
    // dK += dS^T Q_i, so that the dQ_i stores into sdQ run while dK is on the tensor cores. Otherwise dV and dK
    // both go before the barrier and dQ_i is stored once every matmul of the iteration is done.
    static constexpr bool kDqBeforeDk = FLASH_BWD_DQ_BEFORE_DK != 0;
    // Split by columns: whole 64-column blocks per warpgroup (the 96-wide SW64 tiles: 64, then 32).
    static constexpr int kDqCols =
        kDqSplitQueries ? kHeadDim : ceil_div(kHeadDim / kNWarpgroups, kSwizzleBlockElems) * kSwizzleBlockElems;
    // The last warpgroup's dQ columns, its wgmma's N: up to kQKDim (FLASH_BWD_NARROW_DQ) where the tile is wider,
    // else up to the tile's width (where the 96-wide SW64 tiles and the 80-wide ones end).
    static constexpr int kDqColsLast =
        kDqSplitQueries ? kDqCols
                        : (FLASH_BWD_NARROW_DQ != 0 && kQKDim < kHeadDim ? kQKDim : kHeadDim) -
                              (kNWarpgroups - 1) * kDqCols;

    static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
    static constexpr int kSmemKVBytes = kBlockN * kHeadDim * kElemBytes;     // K or V, swizzled
    static constexpr int kSmemQBytes = kBlockM * kHeadDim * kElemBytes;      // one stage of Q or dO, swizzled
    static constexpr int kSmemDsBytes = kBlockN * kBlockM * kElemBytes;      // dS^T: keys x queries, swizzled
    static constexpr int kSmemTileBytes = 2 * kSmemKVBytes + 2 * kNStages * kSmemQBytes + kSmemDsBytes;
    // kBwdLdInMma: per stage the query block's rows of ld_mma's two slices (16 bytes
    // each: L_i's, then D_i's), then kBlockM rows of zeros, the other 8 columns of their k16 step; else L_i and D_i
    // per stage as floats (the varlen kernel's, at the same place).
    static constexpr bool kLdInMma = kBwdLdInMma<Element>;
    static constexpr int kSmemRowStatBytes = kLdInMma ? (2 * kNStages + 1) * kBlockM * 16 : 2 * kNStages * kBlockM * 4;
    static constexpr int kSmemDqBytes = kBlockM * kQKDim * 4;  // dQ_i (fp32, rows of kQKDim), reduced by iteration i+1
    // sdQ by iteration parity: before the barrier that publishes dS^T_i, the thread issuing the reduces waits for the
    // TMA unit's reads of dQ_{i-2} (one iteration old), not of dQ_{i-1} (issued in this iteration), so that the other
    // warps do not wait at that barrier for the reduce.
    static constexpr int kDqStages = 2;
    static constexpr int kSmemBarBytes = 8 * (1 + kNStages);                 // mbarriers: K/V, Q_i/dO_i per stage
    // The dense kernel's schedule (bwd_tile_scheduler.h): persistent where dK_j and dV_j, in K's layout, leave by TMA
    // stores that no thread waits for: from the sdQ stage that the next tile's first dQ_i takes, where they fit it
    // (kBlockM = 128: hd64; kDkvInSdq), or from a buffer of their own where shared memory has room for one (the
    // 96-wide SW64 tiles; kSmemDkvBytes). Staged elsewhere (in sdQ once the last dQ_i reduce has read it, or stored
    // from registers), they cost what the persistence saves (docs/results.md, 42-43).
    static constexpr bool kDkvInSdq = 2 * kSmemKVBytes <= kSmemDqBytes;
    static constexpr int kSmemOneBlockBytes =
        kSmemTileBytes + kSmemRowStatBytes + kDqStages * kSmemDqBytes + kSmemBarBytes + kSwizzleAtomBytes;
    static constexpr bool kDkvOwnBuffer = !kDkvInSdq && kSmemOneBlockBytes + 2 * kSmemKVBytes <= kMaxSmemBytesSm90;
    // Not on tiles with a narrower last column block (TileLayout): tma_store_rows stores whole blocks.
    static constexpr bool kPersistent = FLASH_BWD_PERSISTENT != 0 && (kDkvInSdq || kDkvOwnBuffer) &&
                                        TileLayout<kBlockN, kHeadDim, kSpanBytes>::kTailCols == 0;
    static constexpr int kSmemDkvBytes = kPersistent && kDkvOwnBuffer ? 2 * kSmemKVBytes : 0;  // after the tiles
    // + one swizzle atom of slack: the kernel rounds the dynamic shared-memory base up to 1024 bytes.
    static constexpr int kSmemBytes = kSmemOneBlockBytes + kSmemDkvBytes;
    // Whether the dense kernel of this causality is the persistent one. With a buffer of its own the persistent
    // kernel runs non-causal only: there it is 1.01-1.02 x the one-block kernel's speed, causal 0.93-1.04 x, and
    // 0.99-1.00 x with its main loop at each of seven offsets within a 128-byte line (docs/results.md, 45-46).
    __host__ __device__ static constexpr bool persistent(bool causal) { return kPersistent && (kDkvInSdq || !causal); }
    __host__ __device__ static constexpr int smem_bytes(bool causal) {
        return persistent(causal) ? kSmemBytes : kSmemOneBlockBytes;
    }

    static_assert(sizeof(Element) == 2, "16-bit inputs: the swizzled layout has 64 elements per 128-byte row");
    static_assert(TileLayout<kBlockN, kHeadDim, kSpanBytes>::kTailCols == 0 || kSpanBytes == kSwizzleRowBytes,
                  "the tile width: whole column blocks (of 64, or 32 for SW64), or SW128 blocks and a last one "
                  "of 16 or 32 columns (TileLayout)");
    static_assert(kSumDim % 16 == 0 && kSumDim <= kQKDim && kSumDim <= kHeadDim && kSumDim > kHeadDim - kBlockElems,
                  "S^T's and dP^T's head dim: whole k16 steps in the tile's last column block");
    static_assert(kBlockM == kWarpgroupRows || kDqSplitQueries, "64 queries per iteration, or 64 per warpgroup");
    static_assert(kDqCols % kSwizzleBlockElems == 0, "a warpgroup's dQ columns are whole 64-column blocks of K");
    static_assert(kDqColsLast % 16 == 0 && kDqColsLast > 0 && kDqColsLast <= kDqCols,
                  "the last warpgroup's dQ columns: whole n16 tiles of its 64-column block");
    static_assert(kDqSplitQueries || (kNWarpgroups - 1) * kDqCols + kDqColsLast <= kHeadDim,
                  "dQ's columns inside K's tile");
    static_assert(kQKDim % 32 == 0 || kQKDim == 80, "sdQ rows in one of dq_accum_chunk_in's layouts");
    static_assert(kQKDim <= kHeadDim, "every column of a dQ row inside the tile, written by a warpgroup");
    static_assert(kDkvDim % 16 == 0 && kDkvDim <= kHeadDim && kDkvDim > kHeadDim - kBlockElems,
                  "dK's and dV's N: whole n16 tiles that reach into the tile's last column block");
    static_assert(kSmemBytes <= kMaxSmemBytesSm90, "backward tiles must fit Hopper shared memory");
};

// Which head dims have a Hopper backward (only when the build includes sm_90a; see HopperFwdConfig).
template <int kHeadDim, typename Element> struct HopperBwdConfig { static constexpr bool kAvailable = false; };
#ifdef FLASH_KERNEL_SM90A
template <typename E> struct HopperBwdConfig<64, E> {
    static constexpr bool kAvailable = true;
    // 128 queries per iteration: S^T and dP^T as n128 wgmmas, dQ split by queries (faster than 64 queries, whose dQ
    // would be split by keys into two partial tiles); 195 KiB of shared memory.
    using Traits = HopperBwdTraits<64, E, 64, 128>;
};
template <typename E> struct HopperBwdConfig<96, E> {
    static constexpr bool kAvailable = true;
    // FLASH_BWD_HD96_SW64: tiles 96 columns wide in SW64, else hd128's tiles, 6 of 8 k16 steps in S^T and dP^T (and,
    // under FLASH_BWD_NARROW_DKV, 96 columns of dK and dV)
    static constexpr int kWidth = FLASH_BWD_HD96_SW64 != 0 ? 96 : 128;
    using Traits = HopperBwdTraits<kWidth, E, 96, 64, FLASH_BWD_NARROW_DKV ? 96 : kWidth, 96,
                                   FLASH_BWD_HD96_SW64 != 0 ? 64 : kSwizzleRowBytes>;
    // FLASH_NARROW_HD80 (hopper_kernel_traits.h): head dims up to 80 on 5 k16 steps and 80 columns of dK and dV, on
    // 80-wide tiles (FLASH_HD80_TAIL: 64 columns in SW128, 16 in SW32), else the 128-wide ones; dQ's rows of 80
    // floats (dq_accum_chunk_80), a sixth fewer bytes to zero, reduce and read than d_rounded's 96. At d = 80 the
    // third SW64 box is half past d and costs TMA a whole box: a 64-row tile lands in 509 cycles against 443 in two
    // SW128 boxes (bench/layout_rates.cu, every SM loading), and in SW64 the non-causal backward ran 0.93-0.97 x
    // (docs/results.md, sections 40 and 47).
    static constexpr int kNarrowDim = kNarrowHd80Dim;
    using NarrowTraits = HopperBwdTraits<kHd80Tail ? 80 : 128, E, 80, 64, 80, 80>;
};
template <typename E> struct HopperBwdConfig<128, E> {
    static constexpr bool kAvailable = true;
    // 64-row query blocks, 210 KiB of shared memory. FA3's 80 (dQ_i^T = K^T dS_i^T) leave room for one sdQ stage
    // only: non-causal, they ran 0.93 x these, 0.96-0.98 x with conflict-free dQ^T stores (docs/results.md, section 52).
    using Traits = HopperBwdTraits<128, E>;
};
#endif

// Whether HopperBwdConfig runs head dim d on its NarrowTraits (head dims up to its kNarrowDim), else on its Traits.
template <typename Config>
constexpr bool hopper_bwd_runs_narrow(int d) {
    return NarrowDimOf<Config>::value > 0 && d <= NarrowDimOf<Config>::value;
}
// The floats of a dq_accum row (BwdParams::dq_accum_cols) where that kernel runs head dim d: its Traits' kQKDim.
template <typename Config>
constexpr int hopper_dq_accum_cols(int d) {
    if constexpr (NarrowDimOf<Config>::value > 0) {
        if (hopper_bwd_runs_narrow<Config>(d)) return Config::NarrowTraits::kQKDim;
    }
    return Config::Traits::kQKDim;
}

}  // namespace flash
