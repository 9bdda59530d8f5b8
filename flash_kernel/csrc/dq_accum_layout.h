// Where the Hopper backward's dq_accum (and its shared-memory dQ tile, sdQ) keeps each 16-byte chunk of a row.
// Its own header so that tests/smem_tile_check.cu can check the layout on the host.
#pragma once

namespace flash {

// Chunk c (columns 4c .. 4c + 3) of query q lives at chunk c ^ 2 (q % 4). The dQ tiles reach dq_accum by the TMA
// unit's bulk reduce, which adds a tile's bytes as they lie in shared memory, so dq_accum shares sdQ's layout.
// In sdQ, lane 4g + t of a warp stores the float2 of row g (+ 8 r) at columns 8i + 2t: chunk 2i + t / 2. A
// 64-bit store is served per half-warp (rows g = 0-3, then 4-7), and XOR-ing chunk bits 1-2 with the row (q % 4)
// puts a half-warp's 8 chunks in 8 distinct bank groups. (An XOR with q % 8 would put a half-warp's 4 rows in only 4
// bank groups, two 8-byte stores per bank: twice the ideal wavefronts on every sdQ store.)
// A row of d_rounded floats (64, 96 or 128) is whole 8-chunk groups, which the XOR stays inside. The sm80
// kernels' dq_accum is plain row-major.
__host__ __device__ __forceinline__ int dq_accum_chunk(int c, int q) { return c ^ (2 * (q % 4)); }

}  // namespace flash
