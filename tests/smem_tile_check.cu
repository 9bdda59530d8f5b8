// Host-side check of flash_kernel/csrc/smem_tile.h, compiled and run by tests/test_smem_tile.py: for each layout,
// every element has its own slot inside its row; ldmatrix's 8 rows are free of bank conflicts; a warp's 512-byte
// cp.async request fills whole 128-byte lines (swizzled); SmemTile::step lands where index() says, over the walks
// the kernels make. And the same for the backward's dQ staging tile (DqStageTile) and its accesses, and for the
// Hopper backward's dQ tile rows (dq_accum_layout.h).
#include <cstdio>
#include <set>

#include "dq_accum_layout.h"
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

// The backward's dQ staging tile (16 x kCols fp32 per warp): every element its own slot in its row; the C fragments'
// 8-byte stores (lane g * 4 + t writes row g + 8 r, column 8 i + 2 t) free of bank conflicts per half-warp, the
// 16-byte row reads (lane l reads row l / 8, chunk l % 8, 4 rows per read) per quarter-warp; step() equal to index().
template <int kCols>
void check_dq_stage(const char* name) {
    using Stage = flash::DqStageTile<kCols>;
    constexpr int kRows = 16;
    const int before = g_failures;
    auto byte = [](int row, int col) { return Stage::index(row, col) * 4; };
    auto bank = [&](int row, int col) { return (byte(row, col) / 4) % 32; };
    std::set<int> seen;
    for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < kCols; ++c) {
            const int i = Stage::index(r, c);
            CHECK(i / kCols == r, "(%d, %d) -> %d leaves its row", r, c, i);
            CHECK(seen.insert(i).second, "(%d, %d) -> %d is taken", r, c, i);
            CHECK(i % 4 == c % 4, "(%d, %d) -> %d splits a 16-byte chunk", r, c, i);
        }
    }
    for (int i = 0; i < kCols / 8; ++i) {
        for (int r = 0; r < 2; ++r) {
            for (int half = 0; half < 2; ++half) {
                std::set<int> banks;
                for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
                    const int row = lane / 4 + 8 * r, col = 8 * i + 2 * (lane % 4);
                    banks.insert(bank(row, col));
                    banks.insert(bank(row, col + 1));
                }
                CHECK(banks.size() == 32, "fragment store n8 tile %d, rows +%d, half-warp %d: %zu banks", i, 8 * r, half,
                      banks.size());
            }
        }
    }
    constexpr int kLanesPerRow = kCols / 4;
    for (int row0 = 0; row0 < kRows; row0 += 32 / kLanesPerRow) {
        for (int quarter = 0; quarter < 4; ++quarter) {
            std::set<int> banks;
            for (int lane = 8 * quarter; lane < 8 * quarter + 8; ++lane) {
                for (int e = 0; e < 4; ++e) banks.insert(bank(row0 + lane / kLanesPerRow, lane % kLanesPerRow * 4 + e));
            }
            CHECK(banks.size() == 32, "row read from row %d, quarter-warp %d: %zu banks", row0, quarter, banks.size());
        }
    }
    const uint32_t base = 2 * 1024;  // a warp's tile start, 128-byte aligned
    for (int row = 0; row < 8; ++row) {
        for (int col = 0; col < 8; col += 2) {
            for (int dr = 0; row + dr < kRows; dr += 4) {
                for (int i = 0; i < kCols / 8; ++i) {
                    const uint32_t want = base + byte(row + dr, col + 8 * i);
                    const uint32_t got = Stage::step(base + byte(row, col), dr, i);
                    CHECK(got == want, "step from (%d, %d) by (%d, tile %d): %u, not %u", row, col, dr, i, got, want);
                }
            }
        }
    }
    if (g_failures == before) std::printf("ok %s\n", name);
}

// The Hopper backward's sdQ, whose rows dq_accum shares (rows of kRowFloats: d_rounded, or 80 at hd65-80; chunk c of
// query q at dq_accum_chunk_in<kRowFloats>(c, q)): every column its own slot inside its row, 16-byte chunks kept whole, the
// chunk pairs that the convert kernel reads as columns 8i .. 8i + 7 adjacent; a warpgroup's float2
// stores (lane 4g + t of warp w: row 16w + g + 8r, columns col0 + 8i + 2t, col0 = 0 or 64) free of bank conflicts
// per half-warp, the unit in which the SM serves 8-byte stores.
template <int kRowFloats>
void check_hopper_dq(const char* name) {
    const int before = g_failures;
    constexpr int kRows = 64, d_rounded = kRowFloats;
    auto at = [&](int row, int col) {
        return row * d_rounded + 4 * flash::dq_accum_chunk_in<kRowFloats>(col / 4, row) + col % 4;
    };
    for (int row = 0; row < kRows; ++row) {
        std::set<int> seen;
        for (int col = 0; col < d_rounded; ++col) {
            const int i = at(row, col);
            CHECK(i / d_rounded == row, "(%d, %d) -> %d leaves its row", row, col, i);
            CHECK(seen.insert(i).second, "(%d, %d) -> %d is taken", row, col, i);
            CHECK(i % 4 == col % 4, "(%d, %d) -> %d splits a 16-byte chunk", row, col, i);
            if (col % 8 == 4) CHECK(i == at(row, col - 4) + 4, "(%d, %d): the chunk pair of columns %d.. split", row, col, col - 4);
        }
    }
    for (int col0 = 0; col0 < d_rounded; col0 += 64) {
        for (int warp = 0; warp < 4; ++warp) {
            for (int r = 0; r < 2; ++r) {
                for (int i = 0; i < 8; ++i) {
                    for (int half = 0; half < 2; ++half) {
                        std::set<int> banks;
                        int words = 0;
                        for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
                            const int row = 16 * warp + lane / 4 + 8 * r, col = col0 + 8 * i + 2 * (lane % 4);
                            if (col >= d_rounded) continue;  // hd96's second warpgroup: columns past d_rounded stay out
                            banks.insert(at(row, col) % 32);
                            banks.insert(at(row, col + 1) % 32);
                            words += 2;
                        }
                        CHECK(static_cast<int>(banks.size()) == words,
                              "store of n8 tile %d from column %d, warp %d, rows +%d, half-warp %d: %zu banks for %d words",
                              i, col0, warp, 8 * r, half, banks.size(), words);
                    }
                }
            }
        }
    }
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
    check_dq_stage<32>("dq stage 32");
    check_hopper_dq<64>("hopper dq 64");
    check_hopper_dq<80>("hopper dq 80");
    check_hopper_dq<96>("hopper dq 96");
    check_hopper_dq<128>("hopper dq 128");
    return g_failures == 0 ? 0 : 1;
}
