// Division by a divisor the host knows before the launch: a multiply-high and a shift on the device.
//
// Why: for `n / d` with a runtime d nvcc emits ~16 instructions around a MUFU.RCP and two conversions, about 100
// cycles from n to the quotient. The Hopper forward finds each tile's (query block, head, batch) with three such
// divisions in a row, twice per tile (the loader in the tile's last turn, every thread at the next one's start), on
// the path from one tile's last matmul to the next one's first.
//
// The method is Granlund and Montgomery's ("Division by invariant integers using multiplication", PLDI 1994)
// round-up multiplier. For 1 <= d < 2^31 let l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, which is below
// 2^32 because 2^l < 2d. Then n / d = (umulhi(n, m) + n) >> l for every 0 <= n < 2^31; the sum stays below 2^32.
// tests/tile_coord_check.cu checks it against `/` over divisors 1 .. 4096 and the powers of two and their
// neighbours up to 2^31 - 1.
#pragma once

#include <cuda_runtime.h>  // __host__ / __device__ for a host compiler too (flash_api.cpp)

#include <cstdint>

namespace flash {

struct FastDiv {
    uint32_t d = 1;      // the divisor
    uint32_t mul = 1;    // m above
    uint32_t shift = 0;  // l above

    FastDiv() = default;
    // d must be in [1, 2^31). A 64-bit division and a loop: the Hopper forward's launch builds its FastDivs on the host
    // once (fwd_tiles); __device__ too only so that causal_order<Div> compiles for both dividers.
    __host__ __device__ explicit FastDiv(uint32_t divisor) : d(divisor) {
        while ((uint64_t{1} << shift) < d) ++shift;
        mul = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d) / d + 1);
    }

    // n / d for 0 <= n < 2^31.
    __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
        const uint32_t hi = __umulhi(n, mul);
#else
        const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> 32);
#endif
        return (hi + n) >> shift;
    }
};

// The same interface over `/`, for the callers that divide once per thread block.
struct PlainDiv {
    uint32_t d = 1;
    __host__ __device__ explicit PlainDiv(uint32_t divisor) : d(divisor) {}
    __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const { return n / d; }
};

}  // namespace flash
