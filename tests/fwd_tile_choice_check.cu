// Host-side check of the Hopper forward's tile choice in dense non-causal calls, compiled and run by
// tests/test_fwd_tile_choice.py: wider_blocks_pay (hopper_kernel_traits.h) for the two tiles of hd128's config and of
// the hd96 config's head dims up to its kNarrowDim (80). Prints each pair's key blocks, then one line per pair with
// the lengths from 1 to 16384 keys at which the wider blocks run, as ranges "first-last".
#define FLASH_KERNEL_SM90A
#include <cstdio>

#include "hopper_kernel_traits.h"

template <typename Long, typename Short>
void print_pair(const char* name) {
    constexpr int kMaxKeys = 16384;
    std::printf("%s %d %d", name, Long::kBlockN, Short::kBlockN);
    int first = 0;  // the first length of the open range, 0 while none is open
    for (int seqlen_k = 1; seqlen_k <= kMaxKeys; ++seqlen_k) {
        const bool wider = flash::wider_blocks_pay<Long, Short>(seqlen_k);
        if (wider && first == 0) first = seqlen_k;
        if (!wider && first != 0) {
            std::printf(" %d-%d", first, seqlen_k - 1);
            first = 0;
        }
    }
    if (first != 0) std::printf(" %d-%d", first, kMaxKeys);
    std::printf("\n");
}

int main() {
    using Hd128 = flash::HopperFwdConfig<128, __nv_bfloat16>;
    using Hd96 = flash::HopperFwdConfig<96, __nv_bfloat16>;
    print_pair<Hd128::Traits, Hd128::ShortTraits>("hd128");
    print_pair<Hd96::NarrowTraits, Hd96::NarrowShortTraits>("hd80");
    return 0;
}
