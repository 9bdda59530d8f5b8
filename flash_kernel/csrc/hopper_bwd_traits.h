// Tile shapes of the Hopper (sm_90a, wgmma) backward, per head dim (the kernel is flash_bwd_hopper_kernel.cuh).
//
// A thread block owns kBlockN = 128 keys (K_j, V_j, dK_j, dV_j) and walks the query blocks of kBlockM rows
// (64 at hd128, 128 at hd64). Two warpgroups each own 64 of the keys: their S^T, dP^T (64 keys x kBlockM
// queries) and dK, dV (64 keys x head dim) are wgmma accumulators in registers. dQ_i = dS_i K_j needs every key
// of the block, so dS^T goes through shared memory, and the two warpgroups split dQ's work by queries (kBlockM
// = 128: each 64 queries x the head dim) or by columns (kBlockM = 64: 64 queries x 64 columns each at hd128; at
// hd65-96, on the 128-wide tiles, the second warpgroup's columns stop at 96 with FLASH_BWD_NARROW_DQ).
#pragma once

#include "hopper_kernel_traits.h"  // kWarpgroupThreads, kWarpgroupRows, kMaxSmemBytesSm90

// Build switch for HopperBwdTraits::kDqBeforeDk (on by default; -DFLASH_BWD_DQ_BEFORE_DK=0 builds without it).
#ifndef FLASH_BWD_DQ_BEFORE_DK
#define FLASH_BWD_DQ_BEFORE_DK 1
#endif
// FLASH_BWD_NARROW_DKV (on): head dims 65-96 (the 128-wide tiles with kQKDim = 96) accumulate dK and dV over 96
// columns (kDkvDim, n96 wgmmas reading 1.5 of Q's and dO's 64-column blocks) instead of 128: a quarter less work
// in those two products, and 32 fewer accumulator registers per thread.
#ifndef FLASH_BWD_NARROW_DKV
#define FLASH_BWD_NARROW_DKV 1
#endif
// FLASH_BWD_NARROW_DQ (on): where the warpgroups split dQ_i by columns and the head dim is not two whole 64-column
// blocks (hd65-96: dQ rows of 96 floats), the last warpgroup computes only the columns up to kQKDim (n32 instead of
// n64; the other keeps its 64): dQ's tensor work per iteration 128 -> 96 columns, a quarter less, 6-7% of the
// iteration's (FA4's sm90 backward at these head dims computes dQ as one n96 on one warpgroup instead).
#ifndef FLASH_BWD_NARROW_DQ
#define FLASH_BWD_NARROW_DQ 1
#endif

namespace flash {

// kHeadDim is the tile width; kQKDim <= kHeadDim the instantiated head dim (d_rounded), the floats of a dQ row;
// kSumDim <= kQKDim the columns that S^T = K Q_i^T and dP^T = V dO_i^T sum over (HopperFwdTraits: head dims 65-96
// run the 128-wide tiles with zero columns; FLASH_NARROW_HD80's twins skip 16 more of them).
template <int kHeadDim_, typename Element_, int kQKDim_ = kHeadDim_, int kBlockM_ = 64, int kDkvDim_ = kHeadDim_,
          int kSumDim_ = kQKDim_>
struct HopperBwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
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
    static constexpr int kDqCols = kDqSplitQueries ? kHeadDim : kHeadDim / kNWarpgroups;
    // The last warpgroup's dQ columns (FLASH_BWD_NARROW_DQ: up to kQKDim; its wgmma's N).
    static constexpr int kDqColsLast =
        FLASH_BWD_NARROW_DQ != 0 && !kDqSplitQueries ? kQKDim - (kNWarpgroups - 1) * kDqCols : kDqCols;

    static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
    static constexpr int kSmemKVBytes = kBlockN * kHeadDim * kElemBytes;     // K or V, swizzled
    static constexpr int kSmemQBytes = kBlockM * kHeadDim * kElemBytes;      // one stage of Q or dO, swizzled
    static constexpr int kSmemDsBytes = kBlockN * kBlockM * kElemBytes;      // dS^T: keys x queries, swizzled
    static constexpr int kSmemTileBytes = 2 * kSmemKVBytes + 2 * kNStages * kSmemQBytes + kSmemDsBytes;
    static constexpr int kSmemRowStatBytes = 2 * kNStages * kBlockM * 4;     // L_i and D_i per stage
    static constexpr int kSmemDqBytes = kBlockM * kQKDim * 4;  // dQ_i (fp32, rows of d_rounded), reduced by iteration i+1
    // sdQ by iteration parity: before the barrier that publishes dS^T_i, the thread issuing the reduces waits for the
    // TMA unit's reads of dQ_{i-2} (one iteration old), not of dQ_{i-1} (issued in this iteration), so that the other
    // warps do not wait at that barrier for the reduce.
    static constexpr int kDqStages = 2;
    static constexpr int kSmemBarBytes = 8 * (1 + kNStages);                 // mbarriers: K/V, Q_i/dO_i per stage
    // + one swizzle atom of slack: the kernel rounds the dynamic shared-memory base up to 1024 bytes.
    static constexpr int kSmemBytes =
        kSmemTileBytes + kSmemRowStatBytes + kDqStages * kSmemDqBytes + kSmemBarBytes + kSwizzleAtomBytes;

    static_assert(sizeof(Element) == 2, "16-bit inputs: the swizzled layout has 64 elements per 128-byte row");
    static_assert(kHeadDim % kSwizzleBlockElems == 0, "head dim must be whole 64-column blocks (64 or 128)");
    static_assert(kQKDim <= kHeadDim && kSumDim % 16 == 0 && kSumDim <= kQKDim &&
                      kSumDim > kHeadDim - kSwizzleBlockElems,
                  "S^T's and dP^T's head dim: whole k16 steps in the tile's last 64-column block");
    static_assert(kBlockM == kWarpgroupRows || kDqSplitQueries, "64 queries per iteration, or 64 per warpgroup");
    static_assert(kDqCols % kSwizzleBlockElems == 0, "a warpgroup's dQ columns are whole 64-column blocks of K");
    static_assert(kDqColsLast % 16 == 0 && kDqColsLast > 0 && kDqColsLast <= kDqCols,
                  "the last warpgroup's dQ columns: whole n16 tiles of its 64-column block");
    static_assert(kQKDim % 32 == 0, "sdQ rows of whole 8-chunk groups (dq_accum_chunk's swizzle)");
    static_assert(kDkvDim % 16 == 0 && kDkvDim <= kHeadDim && kDkvDim > kHeadDim - kSwizzleBlockElems,
                  "dK's and dV's N: whole n16 tiles that reach into the tile's last 64-column block");
    static_assert(kSmemBytes <= kMaxSmemBytesSm90, "backward tiles must fit Hopper shared memory");
};

// Which head dims have a Hopper backward (only when the build includes sm_90a; see HopperFwdConfig).
template <int kHeadDim, typename Element> struct HopperBwdConfig { static constexpr bool kAvailable = false; };
#ifdef FLASH_KERNEL_SM90A
template <typename E> struct HopperBwdConfig<64, E> {
    static constexpr bool kAvailable = true;
    // 128 queries per iteration: S^T and dP^T as n128 wgmmas, dQ split by queries (faster than 64 queries, whose dQ
    // would be split by keys into two partial tiles); 167 KB of shared memory.
    using Traits = HopperBwdTraits<64, E, 64, 128>;
};
template <typename E> struct HopperBwdConfig<96, E> {
    static constexpr bool kAvailable = true;
    // hd128's tiles, 6 of 8 k16 steps in S^T and dP^T (and, under FLASH_BWD_NARROW_DKV, 96 columns of dK and dV)
    using Traits = HopperBwdTraits<128, E, 96, 64, FLASH_BWD_NARROW_DKV ? 96 : 128>;
    // FLASH_NARROW_HD80 (hopper_kernel_traits.h): head dims up to 80 on 5 k16 steps and 80 columns of dK and dV;
    // dQ's rows stay 96 floats, the rows the convert kernel of this head dim reads.
    static constexpr int kNarrowDim = kNarrowHd80Dim;
    using NarrowTraits = HopperBwdTraits<128, E, 96, 64, 80, 80>;
};
template <typename E> struct HopperBwdConfig<128, E> {
    static constexpr bool kAvailable = true;
    using Traits = HopperBwdTraits<128, E>;   // 180 KB
};
#endif

}  // namespace flash
