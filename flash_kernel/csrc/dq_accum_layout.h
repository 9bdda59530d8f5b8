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

// Rows of 80 floats (the hd65-80 kernels, hopper_bwd_traits.h's NarrowTraits): 320 bytes, so row q + 1 starts 16
// banks after row q, and a half-warp's rows q and q + 1 already fall on different halves of the banks; chunk c of
// query q at chunk c ^ 2 ((q / 2) % 2) separates rows q and q + 2. The XOR (0 or 2) stays inside each group of 4
// chunks, so the row's last 4 (columns 64-79) stay among themselves.
__host__ __device__ __forceinline__ int dq_accum_chunk_80(int c, int q) { return c ^ (2 * ((q / 2) % 2)); }

// The chunk of a row of kRowFloats floats: whole 8-chunk groups (32 floats) as dq_accum_chunk, else 80 floats.
template <int kRowFloats>
__host__ __device__ __forceinline__ int dq_accum_chunk_in(int c, int q) {
    static_assert(kRowFloats % 32 == 0 || kRowFloats == 80, "dq_accum rows of whole 8-chunk groups, or 80 floats");
    return kRowFloats % 32 == 0 ? dq_accum_chunk(c, q) : dq_accum_chunk_80(c, q);
}

}  // namespace flash
