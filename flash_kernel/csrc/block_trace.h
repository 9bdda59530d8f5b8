// Phase stamps of one thread block, written by thread 0 as the block exits: where a block's life goes outside its
// main loop (the loads before the first matmul, the epilogue's stores), and the gaps between blocks on an SM. Built
// only with a trace switch (FLASH_BWD_TRACE, hopper_bwd_traits.h); bench/block_trace.py gives the kernel a buffer
// (BwdParams::block_trace) and reads it. Plain stores: a printf's function call would serialize every wgmma.
#pragma once

#include <cstdint>

namespace flash {

// A block's row: SM, batch, head, block, loop trips, start and exit by the global timer (ns), then kBlockTracePhases
// stamps by the SM's cycle counter, counted from the start.
constexpr int kBlockTracePhases = 5;
constexpr int kBlockTraceCols = 7 + kBlockTracePhases;

template <bool kOn>
struct BlockTrace {
    __device__ __forceinline__ void start() {}
    __device__ __forceinline__ void stamp(int) {}
    __device__ __forceinline__ void write(long long*, int64_t, int, int, int, int, int) {}
};

template <>
struct BlockTrace<true> {
    long long start_ns = 0;
    long long start_clock = 0;
    long long clocks[kBlockTracePhases] = {};

    __device__ __forceinline__ static long long global_ns() {
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return static_cast<long long>(t);
    }
    __device__ __forceinline__ void start() {
        start_ns = global_ns();
        start_clock = clock64();
    }
    __device__ __forceinline__ void stamp(int phase) { clocks[phase] = clock64() - start_clock; }
    // At row `tile`, or (tile < 0) at the block's index in the grid.
    __device__ __forceinline__ void write(long long* buffer, int64_t rows, int tile, int batch, int head, int block,
                                          int trips) {
        const int64_t row = tile >= 0 ? tile
                                      : blockIdx.x + static_cast<int64_t>(gridDim.x) *
                                                         (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
        if (buffer == nullptr || row >= rows) return;
        uint32_t sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        long long* out = buffer + row * kBlockTraceCols;
        const long long head_values[7] = {sm, batch, head, block, trips, start_ns, global_ns()};
#pragma unroll
        for (int i = 0; i < 7; ++i) out[i] = head_values[i];
#pragma unroll
        for (int i = 0; i < kBlockTracePhases; ++i) out[7 + i] = clocks[i];
    }
};

}  // namespace flash
