// Host-side check of the Hopper tiles' shared-memory layout (TileLayout and swizzled_chunk_offset, hopper_utils.cuh),
// compiled and run by tests/test_tile_layout.py: every 16-byte chunk of a tile has its own place inside the tile,
// in its column block's region, where the hardware's swizzle puts it. TMA writes and wgmma reads a block of span S
// bytes (128, 64, 32) through the same address rule: the 16-byte chunk index, address bits [4, 4 + log2(S / 16)),
// XORed with bits [7, 7 + log2(S / 16)) of the unswizzled address (CUTLASS's Swizzle<log2(S / 16), 4, 3>). And a
// tile of whole column blocks maps as swizzled_chunk_offset did before it took a width.
#include <cstdio>
#include <set>

#include "host_check.h"
#include "hopper_utils.cuh"

// The hardware's place of chunk c of row `row` in one column block of span kSpan bytes.
template <int kSpan>
unsigned swizzled(int row, int c) {
    const unsigned plain = static_cast<unsigned>(row * kSpan + c * 16);
    const unsigned mask = kSpan / 16 - 1;  // the chunk index's bits, shifted down by 4
    return plain ^ (((plain >> 7) & mask) << 4);
}

template <int kRows, int kCols, int kSpan>
void check(const char* name) {
    using Layout = flash::TileLayout<kRows, kCols, kSpan>;
    using Tail = typename Layout::TailSpan;
    const int before = g_failures;
    HOST_CHECK(name, Layout::kBytes == kRows * kCols * 2, "%u bytes for %d x %d", Layout::kBytes, kRows, kCols);
    std::set<unsigned> seen;
    for (int row = 0; row < kRows; ++row) {
        for (int c = 0; c < kCols / 8; ++c) {
            const unsigned at = Layout::chunk_offset(row, c);
            HOST_CHECK(name, at % 16 == 0 && at < Layout::kBytes, "(%d, %d) -> %u outside the tile", row, c, at);
            HOST_CHECK(name, seen.insert(at).second, "(%d, %d) -> %u is taken", row, c, at);
            const int block = c / (kSpan / 16);
            const unsigned want = c < Layout::kFullCols / 8
                                      ? block * Layout::kBlockBytes + swizzled<kSpan>(row, c % (kSpan / 16))
                                      : Layout::kTailOffset + swizzled<Tail::kBytes>(row, c - Layout::kFullCols / 8);
            HOST_CHECK(name, at == want, "(%d, %d) -> %u, the swizzle puts it at %u", row, c, at, want);
            if (Layout::kTailCols == 0) {
                const unsigned before_width = flash::swizzled_chunk_offset<kRows, kSpan>(row, c);
                HOST_CHECK(name, at == before_width, "(%d, %d) -> %u, without the width %u", row, c, at, before_width);
            }
        }
    }
    // Every block starts where its swizzle atoms line up (TMA's and wgmma's alignment, relative to the tile's start).
    HOST_CHECK(name, Layout::kTailOffset % Tail::kAtomBytes == 0, "the last block at %u", Layout::kTailOffset);
    if (g_failures == before) std::printf("ok %s\n", name);
}

int main() {
    check<64, 80, 128>("64 x 80 sw128 + sw32");
    check<128, 80, 128>("128 x 80 sw128 + sw32");
    check<144, 80, 128>("144 x 80 sw128 + sw32");
    check<192, 80, 128>("192 x 80 sw128 + sw32");
    check<64, 96, 128>("64 x 96 sw128 + sw64");
    check<128, 128, 128>("128 x 128 sw128");
    check<128, 96, 64>("128 x 96 sw64");
    check<64, 64, 128>("64 x 64 sw128");
    return g_failures == 0 ? 0 : 1;
}
