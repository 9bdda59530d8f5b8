// The Hopper forward's persistent schedule: one thread block per SM, each looping over query-block tiles.
//
// Why: a Hopper forward block holds nearly all of an SM's shared memory, so the hardware starts the SM's next
// block only once the last one has exited, and the tail of one tile (its last P V, O's stores) and the head of
// the next (barrier set-up, Q and the first K landing, the first S) run back to back. A persistent block loads its
// next tile's Q and first K/V while it finishes the current one, and one warpgroup starts the next tile while the
// other finishes. Against a grid of one block per tile this speeds up the hd64 forward and leaves hd128's as it is.
//
// Which tile next:
//   - non-causal: every tile visits the same key blocks, so block b takes tiles b, b + grid, b + 2 grid, ...
//     in the grid's order (query block fastest, so the blocks running together share a few heads' K and V in L2);
//   - causal: query block i visits i + 1 key blocks, and no static assignment of causal_order.h's longest-first
//     order comes close to the hardware's greedy one (a greedy-schedule model of 132 SMs: a round robin leaves
//     the longest block 27-30% above the mean at hd128, 3% at hd64); so a causal block takes its next tile from
//     a zeroed counter in global memory (atomicAdd), greedily, in that same order.
// Causal query blocks end at the last query row: where kBlockM does not divide Tq, the block short of kBlockM
// rows is block 0, the one with the fewest keys, instead of the last one, which has the most. (With 192-row tiles
// at T = 2k that is 96 key blocks of work per head instead of 101, where the last block's idle warpgroup would
// compute its 16 key blocks.) Block 0 then starts at a negative row. Its rows before 0 are outside the tensor, so TMA
// fills them with zeros as it does rows past Tq, and they are never stored.
// Tiles are numbered over the query blocks that see a key. In a causal grid with Tq > Tk the first m_first blocks
// of every head see none (O = 0, LSE = +inf); the blocks write those after their main tiles.
//
// Varlen / sliding window (kVarlenOrLocal, hopper_seqlen.h): tiles are (query block, head, sequence) over
// ceil(max_seqlen_q / kBlockM) blocks per (sequence, head), in the causal order above (longest first, heads in
// groups), from a counter when the launch passes one, else round robin. Every sequence's blocks end at its last
// query, so rank r (0: the last block) covers rows len_q - (r + 1) kBlockM .. len_q - r kBlockM - 1; ranks past a
// sequence's blocks, and blocks whose rows see no key, are skipped by the producer (fwd_local_tile), and the rows
// without keys are written after the main tiles.
#pragma once

#include <algorithm>

#include "causal_order.h"
#include "flash_params.h"
#include "hopper_seqlen.h"
#include "utils.cuh"

namespace flash {

// The launch computes these once (fast_div.h: so that finding a tile's coordinates costs a few multiplies on the
// path between two tiles) and passes them to every block.
struct FwdTiles {
    int n_blocks;   // query blocks per (batch, head)
    int row_shift;  // causal: n_blocks kBlockM - Tq, block 0's rows before row 0 (fwd_block_rows); else 0
    int m_first;    // blocks [0, m_first) of every head see no key (causal, Tq > Tk), else 0
    int num_tiles;  // (n_blocks - m_first) * h * b: the tiles with at least one key
    int num_empty;  // m_first * h * b
    CausalOrder<FastDiv> causal;  // causal: the order of the n_blocks - m_first blocks that see a key
    FastDiv blocks;               // non-causal: n_blocks
    FastDiv heads;                // non-causal: h
    FastDiv q_per_kv_head;        // h / h_k (GQA / MQA): query head i reads kv head i / h_h_k_ratio
    KeyWindow window;             // kVarlenOrLocal: the keys each query sees (hopper_seqlen.h)
};

// Host: the launch's grid and the kernel's argument.
template <int kBlockM>
inline FwdTiles fwd_tiles(const FwdParams& p) {
    FwdTiles t;
    t.n_blocks = ceil_div(p.seqlen_q, kBlockM);
    t.row_shift = p.is_causal ? t.n_blocks * kBlockM - p.seqlen_q : 0;
    // Causal query block m's last row is Tq - 1 - (n_blocks - 1 - m) kBlockM, which sees a key iff
    // (n_blocks - 1 - m) kBlockM < Tk (query i sees keys j <= i + Tk - Tq); Tk >= 1 makes m_first < n_blocks.
    t.m_first = p.is_causal ? std::max(0, t.n_blocks - ceil_div(p.seqlen_k, kBlockM)) : 0;
    t.num_tiles = (t.n_blocks - t.m_first) * p.h * p.b;
    t.num_empty = t.m_first * p.h * p.b;
    t.causal = p.is_causal ? causal_order<FastDiv>(t.n_blocks - t.m_first, p.h, p.h * p.b, p.causal_group_heads, p.num_sms)
                           : causal_order<FastDiv>(t.n_blocks, p.h, p.h * p.b, 1);
    t.blocks = FastDiv(t.n_blocks);
    t.heads = FastDiv(p.h);
    t.q_per_kv_head = FastDiv(p.h_h_k_ratio);
    t.window = key_window(p);
    return t;
}

// Host: the tiles of the varlen / sliding-window kernel (seqlen_q >= 1: max_seqlen_q, or Tq).
template <int kBlockM>
inline FwdTiles fwd_local_tiles(const FwdParams& p) {
    FwdTiles t{};
    t.n_blocks = ceil_div(p.seqlen_q, kBlockM);
    t.num_tiles = t.n_blocks * p.h * p.b;
    // Heads in L2-sized groups as in the causal order (causal_order.h), sized by max_seqlen_k's K and V (run_fwd
    // sets p.causal_group_heads): without them, the tiles running together would read as many sequences' K and V as
    // there are SMs (on an H200, 0.87x the dense kernel's speed at hd128, 8 x 2k documents, non-causal; 0.98x with
    // them).
    const int pairs = p.h * p.b;
    t.causal = causal_order<FastDiv>(t.n_blocks, p.h, pairs, std::clamp(p.causal_group_heads, 1, pairs));
    t.blocks = FastDiv(t.n_blocks);
    t.heads = FastDiv(p.h);
    t.q_per_kv_head = FastDiv(p.h_h_k_ratio);
    t.window = key_window(p);
    return t;
}

// Query block `block` computes rows [row0, row0 + kBlockM) and stores the ones inside the tensor, row0 + [first,
// end): row0 < 0 (first > 0) only for a causal grid's block 0 where kBlockM does not divide Tq, end < kBlockM only
// for a non-causal grid's last block.
struct BlockRows {
    int row0, first, end;
};
template <int kBlockM>
__host__ __device__ __forceinline__ BlockRows fwd_block_rows(const FwdTiles& t, int block, int seqlen_q) {
    const int row0 = block * kBlockM - t.row_shift;
    return {row0, row0 < 0 ? -row0 : 0, seqlen_q - row0 < kBlockM ? seqlen_q - row0 : kBlockM};
}

// The (query block, head, batch) of main tile `tile`.
template <bool kIsCausal>
__host__ __device__ __forceinline__ BlockCoord fwd_tile_coord(const FwdTiles& t, int tile) {
    if constexpr (kIsCausal) {
        BlockCoord c = causal_tile_coord(tile, t.causal);
        c.block += t.m_first;
        return c;
    }
    const uint32_t pair = t.blocks.div(tile), batch = t.heads.div(pair);  // pair: (batch, head), batch-major
    return {static_cast<int>(tile - pair * t.blocks.d), static_cast<int>(pair - batch * t.heads.d), static_cast<int>(batch)};
}

#ifdef __CUDACC__
// A varlen / sliding-window tile: its query rows [row0, row0 + kBlockM) of sequence `batch` (row0 < 0: the rows before
// 0 belong to the sequence before, and are computed but not stored) and key blocks [n_min, n_max) (empty: none of
// its rows sees a key; the producer skips it). The producer hands these to the consumers in the tile slot.
struct LocalTile {
    int tile, head, batch, row0, n_min, n_max, q0, k0, len_q, len_k;
};
constexpr int kLocalTileInts = 10;

template <int kBlockM, int kBlockN>
__device__ __forceinline__ LocalTile fwd_local_tile(const FwdTiles& t, const FwdParams& p, int tile) {
    const BlockCoord c = causal_tile_coord(tile, t.causal);
    const SeqBounds s = seq_bounds(p, c.batch);
    const int rank = t.n_blocks - 1 - c.block;  // 0: the sequence's last block
    LocalTile lt{tile, c.head, c.batch, s.seqlen_q - (rank + 1) * kBlockM, 0, 0, s.q_row0, s.k_row0, s.seqlen_q, s.seqlen_k};
    if (lt.row0 + kBlockM > 0) {  // else past the sequence's blocks: no rows
        key_block_range<kBlockN>(t.window, s.causal_offset(), s.seqlen_k, imax(lt.row0, 0), lt.row0 + kBlockM - 1,
                                 lt.n_min, lt.n_max);
    }
    return lt;
}

// The (query block, head, batch) of empty tile `e` (blocks [0, m_first) of each head).
__device__ __forceinline__ BlockCoord fwd_empty_tile_coord(const FwdTiles& t, const FwdParams& p, int e) {
    return {e % t.m_first, e / t.m_first % p.h, e / (t.m_first * p.h)};
}

// The tile this block runs after `tile`; >= num_tiles when it has none left. The producer warpgroup's thread calls
// it (causal: an atomic per tile) and publishes the answer to the consumers in a tile slot.
// kVarlenOrLocal: from the counter where the launch passes one.
template <bool kIsCausal, bool kVarlenOrLocal = false>
__device__ __forceinline__ int fwd_next_tile(const FwdParams& p, int tile) {
    if constexpr (kIsCausal) return static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1);
    if constexpr (kVarlenOrLocal) {
        if (p.tile_counter != nullptr) return static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1);
    }
    return tile + static_cast<int>(gridDim.x);
}
#endif

}  // namespace flash
