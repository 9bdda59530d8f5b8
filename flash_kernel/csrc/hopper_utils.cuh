// Hopper (sm_90a) pieces of the forward and backward kernels: the swizzled shared-memory tile layouts that wgmma
// reads through matrix descriptors (and TMA writes, hopper_tma.h), the descriptors themselves, the wgmma fences,
// mbarriers and named barriers, and the copy of a tile out of that layout.
//
// Swizzled tile layout (the "SW128" layout of the PTX ISA's wgmma shared-memory matrix section): a tile of
// kRows x kHeadDim 16-bit elements is stored as kHeadDim / 64 column blocks of 64 elements (128 bytes per
// row), each block kRows rows of 128 bytes, one after the other:
//     byte(row, col) = (col / 64) * kRows * 128 + row * 128 + (((col % 64) / 8) ^ (row % 8)) * 16 + (col % 8) * 2
// i.e. inside every 8-row x 128-byte atom (1024 bytes, 1024-aligned) the 16-byte chunk index is XORed with
// the row index: the 8 rows of one 16-byte column land in 8 different bank groups, so the epilogues' 4-
// and 16-byte accesses and wgmma's reads are all conflict free, and the hardware undoes the
// same XOR on the address bits [4:6] ^= [7:9] when it reads through a descriptor with the 128B swizzle mode.
// The same layout serves both operand majors:
//   K-major (Q and K in S = Q K^T: rows = M or N, 64-element blocks along K = head dim): 8-row groups are
//     SBO = 1024 bytes apart; LBO is unused; k-step kk (16 elements = 32 bytes) starts at block kk / 4,
//     byte (kk % 4) * 32.
//   N-major (V in O = P V: rows = K = keys, 64-element blocks along N = head dim): 8-key groups are
//     SBO = 1024 bytes apart, the 64-column blocks LBO = kRows * 128 bytes apart; k-step kk (16 keys) starts
//     kk * 16 * 128 bytes in.
// The SW64 layout (SwizzleSpan<64>) is the same with rows of 64 bytes: column blocks of 32 elements, atoms of 8 rows
// x 64 bytes (512 bytes), the chunk index's two bits XORed with (row / 2) % 4 (address bits [4:5] ^= [7:8]), so 8
// rows of one 16-byte column still fill 8 bank groups. It tiles head dims 65-96 at 96 columns, where SW128 needs
// 128 (a quarter of every K/V stage zeros, written by TMA and never read): the forward's Q, K and V there, and the
// backward's Q, dO, K and V at 81-96. The SW32 layout (SwizzleSpan<32>): rows of 32 bytes, column blocks of 16
// elements, atoms of 8 rows x 32 bytes, the chunk index's bit XORed with (row / 4) % 2 (address bit [4] ^= [7]).
// A tile whose width is not whole column blocks ends in a narrower block of its own (TileLayout below): head dims
// 65-80 take one 64-column SW128 block and a 16-column SW32 one.
#pragma once

#include <cstdint>

#include "utils.cuh"

namespace flash {

// A swizzled layout by the bytes of its rows (its swizzle span): 128 (SW128), 64 (SW64) or 32 (SW32).
template <int kBytes_>
struct SwizzleSpan {
    static_assert(kBytes_ == 128 || kBytes_ == 64 || kBytes_ == 32, "the SW128, SW64 and SW32 layouts");
    static constexpr int kBytes = kBytes_;                // one row of one column block
    static constexpr int kBlockElems = kBytes / 2;        // 16-bit elements per row of one column block
    static constexpr int kChunks = kBytes / 16;           // 16-byte chunks per row of one column block
    static constexpr int kAtomBytes = 8 * kBytes;         // 8 rows: SBO of a K-major operand, and of N-major's 8 keys
    static constexpr int kKStepsPerBlock = kBlockElems / 16;  // k16 steps of a K-major operand in one column block
    static constexpr uint64_t kDescLayout = kBytes == 128 ? 1 : kBytes == 64 ? 2 : 3;  // the descriptor's layout type
    // The chunk index XOR of a row: its bits are address bits [7:7+log2(kChunks)) of the row's start.
    __host__ __device__ static constexpr int swizzle(int row) { return (row / (8 / kChunks)) % kChunks; }
};

// A tile of kRows rows and kCols 16-bit columns: kCols / kBlockElems whole column blocks of SwizzleSpan<kSpanBytes>,
// then, where columns are left (kTailCols: 16 or 32), one column block of those in the span of their bytes (SW32 or
// SW64); each block kRows rows, one block after the other. A head dim of 80 so takes 160 bytes per row, where two
// SW128 blocks take 256 and three SW64 ones 192 (the last half zeros past d in both), and with every SM loading, TMA
// lands a 64-row tile in 342 cycles against 443 and 509 (bench/layout_rates.cu: a box costs its whole width, past d
// too).
template <int kRows, int kCols, int kSpanBytes>
struct TileLayout {
    using Span = SwizzleSpan<kSpanBytes>;
    static constexpr int kFullBlocks = kCols / Span::kBlockElems;
    static constexpr int kFullCols = kFullBlocks * Span::kBlockElems;
    static constexpr int kTailCols = kCols - kFullCols;
    static_assert(kTailCols == 0 || kTailCols == 16 || kTailCols == 32, "a last block of 16 (SW32) or 32 (SW64) columns");
    using TailSpan = SwizzleSpan<(kTailCols > 0 ? 2 * kTailCols : kSpanBytes)>;
    static constexpr uint32_t kBlockBytes = kRows * Span::kBytes;          // one whole column block
    static constexpr uint32_t kTailOffset = kFullBlocks * kBlockBytes;     // the last block's start
    static constexpr uint32_t kBytes = kTailOffset + kRows * 2 * kTailCols;
    static constexpr int kFullKSteps = kFullBlocks * Span::kKStepsPerBlock;  // K-major k16 steps in the whole blocks
    // Byte offset of the 16-byte chunk c (columns 8c..8c+7) of row `row`.
    __host__ __device__ static constexpr uint32_t chunk_offset(int row, int c) {
        if (c < kFullCols / 8) {
            return static_cast<uint32_t>((c / Span::kChunks) * kBlockBytes + row * Span::kBytes +
                                         ((c % Span::kChunks) ^ Span::swizzle(row)) * 16);
        }
        return kTailOffset + static_cast<uint32_t>(row * TailSpan::kBytes +
                                                   ((c - kFullCols / 8) ^ TailSpan::swizzle(row)) * 16);
    }
};

// SW128, the layout of every tile but the SW64 ones and the narrower last blocks named above.
constexpr int kSwizzleAtomBytes = SwizzleSpan<128>::kAtomBytes;    // 1024: tiles start at multiples of this
constexpr int kSwizzleRowBytes = SwizzleSpan<128>::kBytes;
constexpr int kSwizzleBlockElems = SwizzleSpan<128>::kBlockElems;  // 64 elements per row of one column block

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride
// byte offsets (all >> 4, 14 bits each), base offset 0 (tiles are 1024-aligned), layout type 1 = 128B swizzle,
// 2 = 64B swizzle, 3 = 32B swizzle.
//
// FLASH_WGMMA_DESC_PAIR (off): the descriptor is built from its two 32-bit words by `mov.b64 {lo, hi}`, which NVVM
// cannot see into, and desc_advance is a 64-bit add. Where NVVM sees the constant high word, it turns every advance
// into a 32-bit add and masks, and ptxas then moves the high word into place beside every wgmma again: 4-5
// uniform-datapath instructions per wgmma. As a pair, ptxas advances each operand's descriptor by one UIADD3.64, the
// form of FA4's code. Counted statically (sm_90a, bench/sass_mix.py), the backward's main loop issues 5-9% fewer
// instructions, the forward's 0.9-2.2% fewer; the same spills. Timed on an H200 it runs as fast as the default
// (forward 1.004 x, backward 0.993 x): these loops are not bound by issue slots.
#ifndef FLASH_WGMMA_DESC_PAIR
#define FLASH_WGMMA_DESC_PAIR 0
#endif
template <int kSpanBytes>
__device__ __forceinline__ uint64_t make_smem_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
#if FLASH_WGMMA_DESC_PAIR
    const uint32_t lo = ((smem_byte_addr & 0x3FFFF) >> 4) | ((lbo_bytes >> 4) << 16);          // bits 0-13, 16-29
    const uint32_t hi = (sbo_bytes >> 4) | static_cast<uint32_t>(SwizzleSpan<kSpanBytes>::kDescLayout << 30);
    uint64_t desc;
    asm("mov.b64 %0, {%1, %2};" : "=l"(desc) : "r"(lo), "r"(hi));
    return desc;
#else
    return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
           (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (SwizzleSpan<kSpanBytes>::kDescLayout << 62);
#endif
}
// The descriptor of an operand without swizzle (layout type 0), K-major: 8-row x 16-byte core matrices of 128
// contiguous bytes, lbo_bytes apart along K and sbo_bytes apart along M or N.
__device__ __forceinline__ uint64_t make_smem_desc_plain(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
           (static_cast<uint64_t>(sbo_bytes >> 4) << 32);
}
__device__ __forceinline__ uint64_t make_smem_desc_sw128(uint32_t smem_byte_addr, uint32_t lbo_bytes,
                                                        uint32_t sbo_bytes) {
    return make_smem_desc<128>(smem_byte_addr, lbo_bytes, sbo_bytes);
}
// A descriptor moved by a byte offset inside the same 256 KB window: only the 14-bit address field changes,
// and it cannot carry (shared memory is < 256 KB). A 32-bit add on the low word, or (FLASH_WGMMA_DESC_PAIR) a 64-bit
// add, the same value: the low word's fields end at bit 29.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
#if FLASH_WGMMA_DESC_PAIR
    return desc + (bytes >> 4);
#else
    const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
    return (desc & 0xFFFFFFFF00000000ull) | lo;
#endif
}

// wgmma.fence: orders this warpgroup's earlier register writes (accumulators rescaled, P packed) before the
// wgmma that reads them. commit/wait: wgmma runs asynchronously until wait_group<N> leaves N groups in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kInFlight>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kInFlight) : "memory");
}
// The compiler must not move accesses of an accumulator across an in-flight wgmma that owns it: an empty asm
// that "reads and writes" every register pins them in program order (as CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The register A operands of an rs wgmma are read asynchronously too: kept live (and unchanged) until the wait.
template <int M, int N>
__device__ __forceinline__ void pin_registers(uint32_t (&r)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
        for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
    }
}
// st.shared (and cp.async) write through the generic proxy; wgmma reads shared memory through the async
// proxy. Each writer fences its own writes before the barrier that publishes them.
__device__ __forceinline__ void fence_view_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarriers (PTX ISA "mbarrier") in shared memory: a stage's "full" barrier completes when its TMA bytes
// landed (hopper_tma.h), its "empty" one when every reader arrived. A waiter names the phase parity it waits
// to see completed.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// Named barriers 1..15 (0 is __syncthreads): sync waits until `count` threads have synced or arrived;
// arrive counts this thread without waiting (a signal from one warpgroup to another).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// setmaxnreg (sm_90a): a warpgroup gives registers back to its block's pool (dec) or waits to take them from it (inc),
// so a producer warpgroup can run on few and the consumers on more than the launch bound's even split. ptxas honours
// it only with a launch bound that fixes the entry count (__launch_bounds__ with a minimum of blocks per SM); every
// warp of the warpgroup must execute it, and the counts must fit what the block was launched with, or inc waits for
// ever.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Byte offset of the 16-byte chunk c (column c * 8) of row `row` in a swizzled tile of kRows rows (SW128: 8 chunks
// per row of a column block, XORed with row % 8; SW64: 4, XORed with (row / 2) % 4), kCols wide (0: whole column
// blocks; else TileLayout's, whose last block may be narrower).
template <int kRows, int kSpanBytes = kSwizzleRowBytes, int kCols = 0>
__host__ __device__ __forceinline__ uint32_t swizzled_chunk_offset(int row, int c) {
    using Span = SwizzleSpan<kSpanBytes>;
    if constexpr (kCols > 0) {
        return TileLayout<kRows, kCols, kSpanBytes>::chunk_offset(row, c);
    } else {
        return static_cast<uint32_t>((c / Span::kChunks) * kRows * kSpanBytes + row * kSpanBytes +
                                     (((c % Span::kChunks) ^ Span::swizzle(row)) * 16));
    }
}

// A warp's 16-bit fragment of k-step kk (the register A operand of an m64nNk16 wgmma, or an m16n8k16 mma: four 8x8
// matrices, its rows 0-7 and 8-15 of columns 16kk..16kk+7, then the same rows of 16kk+8..16kk+15) by one stmatrix
// into its 16 rows from row0 of a swizzled tile of kRows rows at `tile`. Lane l gives the address of row l % 8 of
// matrix l / 8, one 16-byte chunk each: conflict free.
template <int kRows>
__device__ __forceinline__ void stmatrix_k_step(uint32_t tile, int row0, int kk, int lane, const uint32_t (&frag)[4]) {
    stmatrix_x4(tile + swizzled_chunk_offset<kRows>(row0 + lane % 8 + 8 * ((lane / 8) % 2), 2 * kk + lane / 16), frag);
}

// A swizzled tile of kRows rows of 16-bit elements (swizzled_chunk_offset) as a Tile of store_tile (utils.cuh).
template <int kRows, int kSpanBytes = kSwizzleRowBytes, int kCols = 0>
struct SwizzledSpanTile {
    __device__ static int index(int row, int col) {
        return static_cast<int>(swizzled_chunk_offset<kRows, kSpanBytes, kCols>(row, col / 8) / 2) + col % 8;
    }
};

}  // namespace flash
