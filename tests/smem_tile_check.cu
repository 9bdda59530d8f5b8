// Host-side check of flash_kernel/csrc/smem_tile.h, compiled and run by tests/test_smem_tile.py: for each layout,
// every element has its own slot inside its row; ldmatrix's 8 rows are free of bank conflicts; a warp's 512-byte
// cp.async request fills whole 128-byte lines (swizzled); SmemTile::step lands where index() says, over the walks
// the kernels make.
#include <cstdio>
#include <set>

#include "host_check.h"
#include "smem_tile.h"

using flash::SmemTile;

#define CHECK(cond, ...) HOST_CHECK(name, cond, __VA_ARGS__)

template <typename Tile>
void check(const char* name) {
    constexpr int kRows = 64;
    constexpr int kChunks = Tile::kCols / 8;
    const int before = g_failures;
    auto byte = [](int row, int col) { return Tile::index(row, col) * 2; };
    auto bank_group = [&](int row, int col) { return (byte(row, col) / 16) % 8; };

    std::set<int> seen;
    for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < Tile::kCols; ++c) {
            const int i = Tile::index(r, c);
            CHECK(i / Tile::kStride == r && i % Tile::kStride < Tile::kCols, "(%d, %d) -> %d leaves its row", r, c, i);
            CHECK(seen.insert(i).second, "(%d, %d) -> %d is taken", r, c, i);
            CHECK(i % 8 == c % 8, "(%d, %d) -> %d splits a 16-byte chunk", r, c, i);
        }
    }
    // ldmatrix: 8 consecutive rows (from a multiple of 8, as the kernels' lanes address them) at one chunk.
    for (int r0 = 0; r0 < kRows; r0 += 8) {
        for (int c = 0; c < Tile::kCols; c += 8) {
            std::set<int> groups;
            for (int i = 0; i < 8; ++i) groups.insert(bank_group(r0 + i, c));
            CHECK(groups.size() == 8, "ldmatrix rows %d.. at column %d: %zu bank groups", r0, c, groups.size());
        }
    }
    // A warp's cp.async request, 32 consecutive 16-byte chunks of whole rows: in the swizzled layout exactly 4 whole
    // 128-byte lines (the padded layout's rows straddle lines, which cost its copies 2.6 x the wavefronts).
    if (Tile::kSwizzled) {
        for (int first = 0; first + 32 <= kRows * kChunks; first += 32) {
            std::set<int> lines, chunks;
            for (int k = first; k < first + 32; ++k) {
                const int b = byte(k / kChunks, (k % kChunks) * 8);
                lines.insert(b / 128);
                chunks.insert(b / 16);
            }
            CHECK(lines.size() == 4 && chunks.size() == 32, "copy chunks %d..: %zu lines", first, lines.size());
        }
    }
    // step(): lane column 0 or 8 plus a warp offset w (a multiple of a power of two W), dc a k16 step below W.
    const uint32_t base = 4 * 1024;  // a tile start, kAlign-aligned
    for (int W = 16; W <= Tile::kCols; W *= 2) {
        if (Tile::kCols % W != 0) continue;
        for (int w = 0; w < Tile::kCols; w += W) {
            for (int lane_col = 0; lane_col <= 8; lane_col += 8) {
                for (int dc = 0; dc < W; dc += 16) {
                    for (int r = 0; r < 16; ++r) {
                        for (int dr = 0; r + dr < kRows; dr += 8) {
                            const int col = w + lane_col;
                            const uint32_t at = base + byte(r, col);
                            const uint32_t want = base + byte(r + dr, col + dc);
                            CHECK(Tile::step(at, dr, dc) == want, "step from (%d, %d) by (%d, %d): %u, not %u", r, col, dr,
                                  dc, Tile::step(at, dr, dc), want);
                        }
                    }
                }
            }
        }
    }
    CHECK(!Tile::kSwizzled || Tile::kAlign % 128 == 0, "kAlign %d", Tile::kAlign);
    if (g_failures == before) std::printf("ok %s\n", name);
}

int main() {
    check<SmemTile<32>>("padded 32");
    check<SmemTile<96>>("padded 96");
    check<SmemTile<64, false>>("padded 64");
    check<SmemTile<128, false>>("padded 128");
    check<SmemTile<64>>("swizzled 64");
    check<SmemTile<128>>("swizzled 128");
    check<SmemTile<256>>("swizzled 256");
    return g_failures == 0 ? 0 : 1;
}
