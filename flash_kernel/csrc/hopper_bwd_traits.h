// Tile shapes of the Hopper (sm_90a, wgmma) backward, per head dim (issue 5, stage 2; the kernel is
// flash_bwd_hopper_kernel.cuh).
//
// A thread block owns kBlockN = 128 keys (K_j, V_j, dK_j, dV_j) and walks the query blocks of kBlockM = 64
// rows. Two warpgroups each own 64 of the keys: their S^T, dP^T (64 keys x 64 queries) and dK, dV (64 keys x
// head dim) are wgmma accumulators in registers. dQ_i = dS_i K_j needs every key of the block, so dS^T goes
// through shared memory, and the two warpgroups split dQ's work either by columns (each the full 128 keys,
// half of the head dim: hd128) or by keys (each its own 64 keys, all columns, both adding into dq_accum: hd64,
// whose 32-column halves would cut the 128-byte swizzle atom).
#pragma once

#include "hopper_kernel_traits.h"  // kWarpgroupThreads, kWarpgroupRows, kMaxSmemBytesSm90

namespace flash {

// kHeadDim is the tile width; kQKDim <= kHeadDim the instantiated head dim (d_rounded) that S^T = K Q_i^T and
// dP^T = V dO_i^T sum over (HopperFwdTraits: head dims 65-96 run the 128-wide tiles with zero columns).
template <int kHeadDim_, typename Element_, int kQKDim_ = kHeadDim_>
struct HopperBwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kQKDim = kQKDim_;
    static constexpr int kNWarpgroups = 2;
    static constexpr int kNThreads = kNWarpgroups * kWarpgroupThreads;
    static constexpr int kBlockN = kNWarpgroups * kWarpgroupRows;  // keys per thread block, 64 per warpgroup
    static constexpr int kBlockM = 64;                             // queries per iteration: N of S^T and dP^T
    static constexpr int kNStages = 2;                             // Q_i / dO_i / L_i / D_i double-buffered
    // dQ: each warpgroup a (64 queries x kDqCols) tile over kDqKeys keys.
    static constexpr bool kDqSplitKeys = kHeadDim < 2 * kSwizzleBlockElems;
    static constexpr int kDqCols = kDqSplitKeys ? kHeadDim : kHeadDim / kNWarpgroups;
    static constexpr int kDqKeys = kDqSplitKeys ? kWarpgroupRows : kBlockN;
    static constexpr int kDqParts = kDqSplitKeys ? kNWarpgroups : 1;  // partial dQ tiles in sdQ
    static constexpr int kSdqStride = kHeadDim + 8;  // floats per sdQ row: + 8 keeps each half-warp's float2 stores
                                                     // (rows g, columns 2t) on distinct banks

    static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
    static constexpr int kSmemKVBytes = kBlockN * kHeadDim * kElemBytes;     // K or V, swizzled
    static constexpr int kSmemQBytes = kBlockM * kHeadDim * kElemBytes;      // one stage of Q or dO, swizzled
    static constexpr int kSmemDsBytes = kBlockN * kBlockM * kElemBytes;      // dS^T: keys x queries, swizzled
    static constexpr int kSmemTileBytes = 2 * kSmemKVBytes + 2 * kNStages * kSmemQBytes + kSmemDsBytes;
    static constexpr int kSmemRowStatBytes = 2 * kNStages * kBlockM * 4;     // L_i and D_i per stage
    static constexpr int kSmemDqBytes = kDqParts * kBlockM * kSdqStride * 4;  // dQ_i, flushed by iteration i+1
    static constexpr int kSmemBarBytes = 8 * (1 + kNStages);                 // mbarriers: K/V, Q_i/dO_i per stage
    // + one swizzle atom of slack: the kernel rounds the dynamic shared-memory base up to 1024 bytes.
    static constexpr int kSmemBytes = kSmemTileBytes + kSmemRowStatBytes + kSmemDqBytes + kSmemBarBytes + kSwizzleAtomBytes;

    static_assert(sizeof(Element) == 2, "16-bit inputs: the swizzled layout has 64 elements per 128-byte row");
    static_assert(kHeadDim % kSwizzleBlockElems == 0, "head dim must be whole 64-column blocks (64 or 128)");
    static_assert(kQKDim % 16 == 0 && kQKDim <= kHeadDim && kQKDim > kHeadDim - kSwizzleBlockElems,
                  "S^T's and dP^T's head dim: whole k16 steps in the tile's last 64-column block");
    static_assert(kBlockM == kSwizzleBlockElems, "dS^T's queries are one 64-column block (dQ's M-major A)");
    static_assert(kDqCols % kSwizzleBlockElems == 0, "a warpgroup's dQ columns are whole 64-column blocks of K");
    static_assert(kBlockM * kHeadDim / 4 % kNThreads == 0, "the dQ flush: whole float4 steps per thread");
    static_assert(kSmemBytes <= kMaxSmemBytesSm90, "backward tiles must fit Hopper shared memory");
};

// Which head dims have a Hopper backward (only when the build includes sm_90a; see HopperFwdConfig).
template <int kHeadDim, typename Element> struct HopperBwdConfig { static constexpr bool kAvailable = false; };
#ifdef FLASH_KERNEL_SM90A
template <typename E> struct HopperBwdConfig<64, E> {
    static constexpr bool kAvailable = true;
    using Traits = HopperBwdTraits<64, E>;    // 118 KB of shared memory
};
template <typename E> struct HopperBwdConfig<96, E> {
    static constexpr bool kAvailable = true;
    using Traits = HopperBwdTraits<128, E, 96>;  // hd128's tiles, 6 of 8 k16 steps in S^T and dP^T
};
template <typename E> struct HopperBwdConfig<128, E> {
    static constexpr bool kAvailable = true;
    using Traits = HopperBwdTraits<128, E>;   // 180 KB
};
#endif

}  // namespace flash
