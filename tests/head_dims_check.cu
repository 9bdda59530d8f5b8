// Host-side check of the head-dim dispatch, compiled and run by tests/test_head_dims.py: for every head dim the
// binding accepts (multiples of 8 up to kMaxHeadDim), FLASH_HEADDIM_SWITCH (static_switch.h) picks
// round_head_dim(d) (kernel_traits.h), the smallest of kHeadDims at least d. Prints the instantiated head dims and
// kMaxHeadDim for the Python side to compare with its own constants and with the flash_*_hdim*.cu files.
#include <cstdio>

#include "host_check.h"
#include "kernel_traits.h"
#include "static_switch.h"

#define CHECK(cond, ...) HOST_CHECK("head_dims", cond, __VA_ARGS__)

int main() {
    for (int i = 1; i < flash::kNumHeadDims; ++i) {
        CHECK(flash::kHeadDims[i - 1] < flash::kHeadDims[i], "kHeadDims not increasing at %d", i);
    }
    for (int d = 8; d <= flash::kMaxHeadDim; d += 8) {
        int smallest = 0;
        for (const int head_dim : flash::kHeadDims) {
            if (smallest == 0 && head_dim >= d) smallest = head_dim;
        }
        const int switched = FLASH_HEADDIM_SWITCH(d, kHeadDim, [&] { return kHeadDim; });
        CHECK(flash::round_head_dim(d) == smallest, "round_head_dim(%d) = %d, not %d", d, flash::round_head_dim(d),
              smallest);
        CHECK(switched == smallest, "FLASH_HEADDIM_SWITCH(%d) runs %d, not %d", d, switched, smallest);
    }
    if (g_failures > 0) return 1;
    std::printf("head dims");
    for (const int head_dim : flash::kHeadDims) std::printf(" %d", head_dim);
    std::printf("\nmax %d\n", flash::kMaxHeadDim);
    return 0;
}
