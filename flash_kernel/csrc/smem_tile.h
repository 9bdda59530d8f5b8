// Where element (row, col) of a row-major (rows x kCols) tile of 16-bit elements lives in shared memory: the
// layout of the mma.sync (sm80) kernels' Q, K, V and dO tiles and of their output staging.
//
// ldmatrix, whose 8 lanes per 8x8 matrix read 16 bytes from each of 8 consecutive rows at one column, is free of
// bank conflicts when those 8 chunks fall in 8 different 16-byte bank groups; the 16-byte cp.async tile copies,
// whose warp writes 512 bytes of whole rows, cost the fewest shared-memory wavefronts and L2 sectors when the
// request fills whole 128-byte lines. Two layouts:
//   swizzled (kCols = 64, 128, 256: rows of 128, 256, 512 bytes): rows unpadded, the 16-byte chunk c of row r
//     stored at chunk c ^ (r % 8). Both accesses are ideal (Nsight Compute counts exactly the ideal L2 sectors and
//     shared-memory wavefronts on the backward's copies; the padded layout would cost 1.5 x and 2.6 x).
//   padded (kCols = 32, 96): rows padded by 16 bytes, a pitch of 80 or 208 bytes (an odd multiple of 16 mod 128,
//     so ldmatrix is conflict free); the copies' rows straddle 128-byte lines.
// tests/test_smem_tile.py checks these properties, and step() below, on the host.
#pragma once

#include <cstdint>

namespace flash {

constexpr int kSmemPadElems = 8;  // 16 bytes of padding per row of the padded layout

// kSwizzle_ forces a layout (the backward's dS^T and P^T tiles, written by 4-byte stores, stay padded).
template <int kCols_, bool kSwizzle_ = kCols_ == 64 || kCols_ == 128 || kCols_ == 256>
struct SmemTile {
    static constexpr int kCols = kCols_;
    static constexpr bool kSwizzled = kSwizzle_;
    static_assert(!kSwizzled || kCols == 64 || kCols == 128 || kCols == 256,
                  "the swizzle assumes rows of a power-of-two number of 16-byte chunks, at least 8");
    static constexpr int kStride = kSwizzled ? kCols : kCols + kSmemPadElems;  // elements per row
    static constexpr int kRowBytes = kStride * 2;
    // step() XORs absolute shared-memory addresses, so every swizzled tile must start kRowBytes-aligned: the
    // kernels round their dynamic shared-memory base up to kAlign (align_smem, utils.cuh), for which the launch
    // reserves kAlignSlack bytes, and their tiles hold multiples of 8 rows.
    static constexpr int kAlign = kSwizzled ? kRowBytes : 16;
    static constexpr int kAlignSlack = kAlign - 16;  // the base is at least 16-byte aligned

    // Element index of (row, col), col anywhere inside its 16-byte chunk.
    __host__ __device__ static constexpr int index(int row, int col) {
        if constexpr (kSwizzled) {
            return row * kStride + ((((col / 8) ^ (row % 8)) * 8) | (col % 8));
        } else {
            return row * kStride + col;
        }
    }

    // The address of (row + dr, col + dc) is step(at, dr, dc) = (at ^ step_xor(dc)) + step_add(dr, dc), `at` the
    // address of (row, col), for the kernels' ldmatrix walks: dr a multiple of 8 (the row's swizzle stays) and dc
    // a multiple of 8 whose chunk bits (dc / 8) are disjoint from col / 8's, i.e. col / 8 + dc / 8 ==
    // col / 8 ^ dc / 8 (col a lane's 0 or 8 plus a warp's power-of-two offset, dc a k16 step below that offset).
    // Then the chunk of col + dc is the one of col XOR dc / 8: in its low 3 bits an XOR (0, 32, 64 or 96 bytes
    // for k16 steps), above them an addition, which with dr's is a multiple of 128 and leaves those bits alone,
    // so the XOR may come first: one XOR per k-step serves every row offset of a walk, which the compiler then
    // folds into the ldmatrix's immediate. The padded layout adds both. ldmatrix_tile (utils.cuh) computes step()
    // as plain code or, for some backward configs, inside its asm.
    __host__ __device__ static constexpr uint32_t step_add(int dr, int dc) {
        return kSwizzled ? static_cast<uint32_t>(dr * kRowBytes) + (static_cast<uint32_t>(dc * 2) & ~127u)
                         : static_cast<uint32_t>((dr * kStride + dc) * 2);
    }
    __host__ __device__ static constexpr uint32_t step_xor(int dc) {
        return kSwizzled ? static_cast<uint32_t>(dc * 2) & 127u : 0u;
    }
    __host__ __device__ static constexpr uint32_t step(uint32_t at, int dr, int dc) {
        return (at ^ step_xor(dc)) + step_add(dr, dc);
    }
};

// Where element (row, col) of a warp's (16 x kCols) fp32 dQ staging tile lives (the sm80 backward's staged dQ adds,
// BwdDqStagedTraits in kernel_traits.h): rows unpadded, the 16-byte chunk c of row r stored at chunk c ^ 2 (r % 4).
// The warp writes its C fragments there, 8 bytes per lane: a half-warp writes 32 bytes at one chunk pair of each of 4
// rows (r % 4 = 0..3), which the XOR moves to 4 different pairs of one 128-byte bank span. It reads back whole
// 16-byte chunks: a quarter-warp reads 8 chunks of one 128-byte row span, which the XOR only permutes. Both are
// free of bank conflicts (tests/smem_tile_check.cu).
template <int kCols_>
struct DqStageTile {
    static constexpr int kCols = kCols_;  // a multiple of 32 for the claims above (BwdDqStagedTraits asserts 32)
    __host__ __device__ static constexpr int index(int row, int col) {
        return row * kCols + ((((col / 4) ^ ((row % 4) * 2)) * 4) | (col % 4));
    }
    // The byte address of (row + dr, col + 8 i) is step(at, dr, i), `at` the address of (row, col) with col < 8 (a
    // lane's C fragment column 2t) in a tile starting 128-byte aligned, dr a multiple of 4 (the row's swizzle stays):
    // n8 tile i's chunk pair is the lane's XOR i, so the fragments' stores take one XOR per tile and immediates.
    __host__ __device__ static constexpr uint32_t step(uint32_t at, int dr, int i) {
        return (at ^ static_cast<uint32_t>(i * 32)) + static_cast<uint32_t>(dr * kCols * 4);
    }
};

}  // namespace flash
