// The Hopper backward's persistent schedule (dense inputs): one thread block per SM, each looping over key-block
// tiles (flash_bwd_hopper_kernel.cuh).
//
// Why: a backward block holds nearly all of an SM's shared memory, so with one block per tile the SM's next block
// starts only once the last one has exited, and each tile pays its loads (K_j, V_j and the first Q_i / dO_i landing)
// and its epilogue (the last dQ_i reduce, the dK_j / dV_j stores) back to back: 2.1-2.7 loop trips per tile at head
// dims 80-128 (bench/block_trace.py), a fifth of the blocks' cycles at 1k keys. A persistent block issues its next
// tile's loads as soon as its main loop ends, so they land while it stores the current tile's dK_j and dV_j.
// It runs where those fit the sdQ stage that the next tile's first dQ_i takes (hd64) or a buffer of their own
// (hd81-96, non-causal only; Traits::persistent), so that they leave by TMA stores that no thread waits for; the K
// and V tiles hold the next tile's loads by then.
//
// Which tile next, as the forward's schedule (fwd_tile_scheduler.h) takes them:
//   - non-causal: every tile visits the same query blocks, so block b takes tiles b, b + grid, b + 2 grid, ... in
//     the grid's order (key block fastest, then head, then batch);
//   - causal: key block j is visited by the query blocks from the first that sees it, so the tiles differ in length;
//     a block takes its next tile from a zeroed counter in global memory (atomicAdd), greedily, in the order of
//     causal_order.h (each head's key block 0, its longest, first; heads in L2-sized groups from
//     kBwdCausalOrderMinKeys keys, else the grid's order), as the hardware starts the blocks of a grid.
#pragma once

#include "causal_order.h"
#include "fast_div.h"
#include "flash_params.h"
#include "utils.cuh"

namespace flash {

struct BwdTiles {
    int num_tiles;               // key blocks x h x b
    CausalOrder<FastDiv> order;  // the tiles' order (non-causal, and causal without groups: one pair per group)
};

// Host: the persistent kernel's tiles of kBlockN keys.
template <int kBlockN>
inline BwdTiles bwd_tiles(const BwdParams& p) {
    const int n_blocks = ceil_div(p.seqlen_k, kBlockN);
    const int pairs = p.h * p.b;
    const bool grouped = p.is_causal && p.bwd_causal_group > 0;
    return {n_blocks * pairs, causal_order<FastDiv>(n_blocks, p.h, pairs, grouped ? p.bwd_causal_group : 1,
                                                    grouped ? p.num_sms : 0)};
}

#ifdef __CUDACC__
// The (key block, head, batch) of tile `tile`.
__device__ __forceinline__ BlockCoord bwd_tile_coord(const BwdTiles& t, int tile) {
    return causal_bwd_tile_coord(static_cast<uint32_t>(tile), t.order);
}

// The tile this block runs after `tile`; >= num_tiles when it has none left. Thread 0 calls it (causal: an atomic per
// tile) and publishes the answer to the other threads through shared memory.
template <bool kIsCausal>
__device__ __forceinline__ int bwd_next_tile(const BwdParams& p, int tile) {
    if constexpr (kIsCausal) return static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1);
    return tile + static_cast<int>(gridDim.x);
}
#endif

}  // namespace flash
