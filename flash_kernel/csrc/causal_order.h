// The order in which the thread blocks of a causal forward grid run: longest first, heads in L2-sized groups.
//
// The hardware starts thread blocks in linear blockIdx order as SMs free up. In a causal forward, query block i
// visits i + 1 key blocks, so however each head's blocks are ordered, the last wave holds one head's blocks of every
// length, and the SMs that finish their short ones idle while the long ones run: 3-8% of the makespan at the FA2
// grid's B*H = 16-512 in a greedy-schedule model of 132 SMs with one block each (bench/block_order_model.py prints
// it). Ordering every block of the grid longest-first removes that tail, but spreads the blocks running together
// over all heads, whose K and V would then no longer be shared in L2; so the heads go in groups whose K and V fit
// kCausalGroupBytes (a third of H100's L2), longest-first within each group (the model: within 2% of the ideal
// makespan). Both forwards use it.
// The Hopper causal backward too, reversed: key block j is visited by the query blocks from the first that sees it,
// so block 0 is the longest. In the grid's own order each head's longest block already starts first, but the last
// wave still holds one head's blocks of every length (in the same model 5.8-7.1% above the ideal makespan at hd128
// and 2.8-3.5% at hd64, T = 1k-8k). Its groups are sized by the bytes of Q, dO and dq_accum that a (batch, head)
// pair's blocks read, and it applies from kBwdCausalOrderMinKeys keys (flash_api.cpp's bwd_causal_order_group_heads
// says why).
// The last group holds the pairs left over (all_heads mod group, or a whole group). Where its blocks are fewer than
// the SMs, its longest blocks start late and run on while the other SMs idle (the backward at hd80, 4k keys: 100
// pairs in groups of 11, the last of one pair, 5.6% of the SMs' time after their last block; bench/block_trace.py);
// such a last group takes in the group before it (the model: 1.059 -> 1.010 of the ideal makespan there). The dense
// causal orders pass the SM count for that; 0 keeps the last group as it is.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fast_div.h"

namespace flash {

constexpr int64_t kCausalGroupBytes = 16 << 20;
constexpr int64_t kBwdCausalGroupBytes = 32 << 20;  // two thirds of H100's L2 (FA3's backward: 40 MB)
constexpr int kBwdCausalOrderMinKeys = 2048;

// Host: how many (batch, head) pairs form a group, given the bytes a pair's blocks read (the forward: K and V) and
// the bytes a group's may.
inline int causal_group_heads(int64_t bytes_per_head, int64_t all_heads, int64_t group_bytes = kCausalGroupBytes) {
    const int64_t heads = group_bytes / std::max<int64_t>(1, bytes_per_head);
    return static_cast<int>(std::clamp<int64_t>(heads, 1, std::max<int64_t>(1, all_heads)));
}

struct BlockCoord {
    int block, head, batch;
};

// The order of a causal grid of n_blocks query blocks per (batch, head) pair, `heads` heads per batch and
// all_heads = heads * batches pairs (batch-major), in groups of `group` pairs, with the divisors causal_tile_coord
// needs. Div is FastDiv (fast_div.h) where the host builds them once for a launch's many tiles (the Hopper forward's
// scheduler), PlainDiv where a thread block finds its one tile.
template <typename Div>
struct CausalOrder {
    uint32_t n_blocks, all_heads, group;
    uint32_t last_first;   // the last group's first pair
    Div group_tiles;       // group * n_blocks: the tiles of a group
    Div group_pairs;       // group
    Div last_group_pairs;  // the last group's pairs (all_heads - last_first: below, at or above group)
    Div heads;
};

// sms > 0: a last group of fewer than `sms` blocks takes in the group before it.
template <typename Div>
__host__ __device__ inline CausalOrder<Div> causal_order(uint32_t n_blocks, uint32_t heads, uint32_t all_heads,
                                                         uint32_t group, uint32_t sms = 0) {
    uint32_t last_first = (all_heads - 1) / group * group;
    if (last_first > 0 && (all_heads - last_first) * n_blocks < sms) last_first -= group;
    return {n_blocks, all_heads, group, last_first, Div(group * n_blocks), Div(group), Div(all_heads - last_first),
            Div(heads)};
}

// The (query block, head, batch) of tile `linear`. 32-bit arithmetic: a grid of 2^31 tiles would need ~4 TB of q
// alone (each tile owns >= 64 rows of >= 8 columns per head).
template <typename Div>
__host__ __device__ __forceinline__ BlockCoord causal_tile_coord(uint32_t linear, const CausalOrder<Div>& o) {
    const uint32_t whole = o.group_tiles.div(linear) * o.group;  // the first pair, were every group `group` pairs
    const uint32_t first = whole < o.last_first ? whole : o.last_first;  // the group's first (batch, head) pair
    const uint32_t in_group = linear - first * o.n_blocks;
    const Div pairs_here = first == o.last_first ? o.last_group_pairs : o.group_pairs;
    const uint32_t rank = pairs_here.div(in_group);  // 0: each head's last (longest) block
    const uint32_t pair = first + (in_group - rank * pairs_here.d);
    const uint32_t batch = o.heads.div(pair);
    return {static_cast<int>(o.n_blocks - 1 - rank), static_cast<int>(pair - batch * o.heads.d), static_cast<int>(batch)};
}

// The (key block, head, batch) of backward tile `linear`: the same order with key block 0, each head's longest, first.
// With groups of one pair it is the grid's own order (key block fastest, then head, then batch).
template <typename Div>
__host__ __device__ __forceinline__ BlockCoord causal_bwd_tile_coord(uint32_t linear, const CausalOrder<Div>& o) {
    BlockCoord c = causal_tile_coord(linear, o);
    c.block = static_cast<int>(o.n_blocks) - 1 - c.block;
    return c;
}

#ifdef __CUDACC__
__device__ __forceinline__ CausalOrder<PlainDiv> grid_causal_order(int group_heads, int sms) {
    return causal_order<PlainDiv>(gridDim.x, gridDim.y, gridDim.y * gridDim.z, group_heads, sms);
}
__device__ __forceinline__ uint32_t linear_block_index() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

// This thread block's tile of a (n_blocks, h, b) grid, in the order above on `sms` SMs.
__device__ __forceinline__ BlockCoord causal_block_order(int group_heads, int sms) {
    return causal_tile_coord(linear_block_index(), grid_causal_order(group_heads, sms));
}

// A forward thread block's (query block, head, batch): the order above when causal, else the grid's own.
template <bool kIsCausal>
__device__ __forceinline__ BlockCoord fwd_block_coord(int group_heads, int sms) {
    if constexpr (kIsCausal) return causal_block_order(group_heads, sms);
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}

// A backward thread block's (key block, head, batch) of a (n_blocks, heads, b) grid: causal with group_heads > 0,
// the order above with key block 0 as each head's longest; else (and for group_heads = 0) the grid's own.
template <bool kIsCausal>
__device__ __forceinline__ BlockCoord bwd_block_coord(int group_heads, int sms) {
    if constexpr (kIsCausal) {
        if (group_heads > 0) return causal_bwd_tile_coord(linear_block_index(), grid_causal_order(group_heads, sms));
    }
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}
#endif

}  // namespace flash
