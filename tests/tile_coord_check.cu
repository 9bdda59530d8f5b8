// Host-side check of the Hopper forward's tile arithmetic, compiled and run by tests/test_tile_coord.py:
//   - FastDiv (flash_kernel/csrc/fast_div.h) against `/`: every divisor 1 .. 4096, and the powers of two and
//     their neighbours up to 2^31 - 1, at dividends around multiples of the divisor up to 2^31 - 1;
//   - fwd_tile_coord (fwd_tile_scheduler.h, on FastDiv) against the orders written out as loops: causal tiles go
//     group by group, longest block first, the group's pairs in turn, a last group of fewer blocks than SMs merged
//     into the one before; non-causal tiles query block fastest. Every tile is checked, so the map is also a
//     bijection onto the blocks that see a key;
//   - the blocks' rows (fwd_block_rows): each query row stored by one block, causal blocks ending at Tq, and m_first
//     the blocks whose rows see no key, at 128 and 192 rows per block.
//   - causal_bwd_tile_coord (causal_order.h, the Hopper causal backward) against its order as loops: group by
//     group, key block 0 first, the group's pairs in turn, the last group merged as above; groups of one pair with
//     no SM count are the grid's own order.
#include <cstdio>
#include <vector>

#include "fwd_tile_scheduler.h"
#include "host_check.h"

using flash::BlockCoord;
using flash::FastDiv;

#define CHECK(cond, ...) HOST_CHECK("tile_coord", cond, __VA_ARGS__)

// The first pair of the causal orders' last group, as causal_order.h states the rule: the pairs left over after whole
// groups (a whole group if none are), and the group before them too where they hold fewer than `sms` blocks.
static int last_group_first(int pairs, int group, int n_blocks, int sms) {
    int first = (pairs - 1) / group * group;
    if (first > 0 && (pairs - first) * n_blocks < sms) first -= group;
    return first;
}

static void check_div(uint32_t d, uint32_t n) {
    const FastDiv f(d);
    CHECK(f.div(n) == n / d, "%u / %u: %u, not %u", n, d, f.div(n), n / d);
}

static void check_fast_div() {
    const int before = g_failures;
    constexpr uint32_t kMaxN = 0x7fffffffu;
    std::vector<uint32_t> divisors;
    for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
    for (int k = 12; k <= 31; ++k) {
        const uint32_t p = uint32_t{1} << k;
        for (uint32_t d : {p - 1, p, p + 1}) {
            if (d <= kMaxN) divisors.push_back(d);
        }
    }
    for (uint32_t d : divisors) {
        for (uint32_t n = 0; n < 2048; ++n) check_div(d, n);
        // Around multiples of d, where a quotient off by one would show; spread up to 2^31 - 1.
        for (uint64_t q = 1; q * d <= kMaxN; q = q < 64 ? q + 1 : q * 2 + 1) {
            for (int64_t e = -1; e <= 1; ++e) {
                const int64_t n = static_cast<int64_t>(q * d) + e;
                if (n >= 0 && n <= kMaxN) check_div(d, static_cast<uint32_t>(n));
            }
        }
        check_div(d, kMaxN);
        check_div(d, kMaxN - kMaxN % d);
        if (kMaxN % d != 0) check_div(d, kMaxN - kMaxN % d - 1);
    }
    if (g_failures == before) std::printf("ok fast_div\n");
}

static flash::FwdParams params(int b, int h, int h_k, int tq, int tk, bool causal, int group, int sms) {
    flash::FwdParams p{};
    p.num_sms = sms;
    p.b = b;
    p.h = h;
    p.h_k = h_k;
    p.h_h_k_ratio = h / h_k;
    p.seqlen_q = tq;
    p.seqlen_k = tk;
    p.is_causal = causal;
    p.causal_group_heads = group;
    return p;
}

// The query blocks' rows: every row of [0, Tq) in exactly one block, each block at most kBlockM rows past row 0;
// causal blocks end at Tq (the short block, if any, is block 0), non-causal ones start at row 0. Returns how many
// leading blocks see no key (causal: query i sees keys j <= i + Tk - Tq).
template <int kBlockM, bool kIsCausal>
static int check_rows(const flash::FwdParams& p, const flash::FwdTiles& t, int n_blocks) {
    std::vector<int> owner(p.seqlen_q, 0);
    int without_keys = 0;
    for (int block = 0; block < n_blocks; ++block) {
        const flash::BlockRows rows = flash::fwd_block_rows<kBlockM>(t, block, p.seqlen_q);
        const int row0 = rows.row0;
        CHECK(row0 > -kBlockM && row0 < p.seqlen_q, "tq %d: block %d starts at row %d", p.seqlen_q, block, row0);
        if (kIsCausal && block == n_blocks - 1) CHECK(row0 + kBlockM == p.seqlen_q, "the last causal block ends at %d", row0 + kBlockM);
        if (!kIsCausal) CHECK(row0 == block * kBlockM, "non-causal block %d starts at %d", block, row0);
        // The rows it stores: inside the tensor and inside the block.
        CHECK(0 <= rows.first && rows.first < rows.end && rows.end <= kBlockM && row0 + rows.first >= 0 &&
                  row0 + rows.end <= p.seqlen_q,
              "tq %d: block %d at %d stores [%d, %d)", p.seqlen_q, block, row0, rows.first, rows.end);
        for (int row = row0 + rows.first; row < row0 + rows.end && row >= 0 && row < p.seqlen_q; ++row) ++owner[row];
        const int last_row = row0 + rows.end - 1;
        const bool sees_key = !kIsCausal || last_row + p.seqlen_k - p.seqlen_q >= 0;
        if (!sees_key) CHECK(without_keys++ == block, "block %d sees no key after one that does", block);
    }
    for (int row = 0; row < p.seqlen_q; ++row) CHECK(owner[row] == 1, "tq %d: row %d in %d blocks", p.seqlen_q, row, owner[row]);
    return without_keys;
}

template <int kBlockM, bool kIsCausal>
static void check_order(const flash::FwdParams& p) {
    const flash::FwdTiles t = flash::fwd_tiles<kBlockM>(p);
    const int n_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
    CHECK(t.n_blocks == n_blocks, "n_blocks %d", t.n_blocks);
    const int m_first = check_rows<kBlockM, kIsCausal>(p, t, n_blocks);
    CHECK(t.m_first == m_first, "tq %d tk %d: m_first %d, not %d", p.seqlen_q, p.seqlen_k, t.m_first, m_first);
    CHECK(t.num_tiles == (n_blocks - m_first) * p.h * p.b, "num_tiles %d", t.num_tiles);

    std::vector<BlockCoord> want;  // tile i's coordinates, in launch order
    const int pairs = p.h * p.b;
    if (kIsCausal) {
        const int last_first = last_group_first(pairs, p.causal_group_heads, n_blocks - m_first, p.num_sms);
        for (int first = 0; first < pairs; first += p.causal_group_heads) {
            const int last = first == last_first ? pairs : first + p.causal_group_heads;
            for (int block = n_blocks - 1; block >= m_first; --block) {
                for (int pair = first; pair < last; ++pair) want.push_back({block, pair % p.h, pair / p.h});
            }
            if (last == pairs) break;
        }
    } else {
        for (int pair = 0; pair < pairs; ++pair) {
            for (int block = 0; block < n_blocks; ++block) want.push_back({block, pair % p.h, pair / p.h});
        }
    }
    CHECK(static_cast<int>(want.size()) == t.num_tiles, "%zu tiles written out, num_tiles %d", want.size(), t.num_tiles);
    for (int tile = 0; tile < t.num_tiles && tile < static_cast<int>(want.size()); ++tile) {
        const BlockCoord c = flash::fwd_tile_coord<kIsCausal>(t, tile);
        const BlockCoord w = want[tile];
        CHECK(c.block == w.block && c.head == w.head && c.batch == w.batch,
              "causal %d, b %d h %d tq %d tk %d group %d: tile %d -> (%d, %d, %d), not (%d, %d, %d)", kIsCausal, p.b,
              p.h, p.seqlen_q, p.seqlen_k, p.causal_group_heads, tile, c.block, c.head, c.batch, w.block, w.head,
              w.batch);
    }
    for (int head = 0; head < p.h; ++head) {
        const int head_k = static_cast<int>(t.q_per_kv_head.div(head));
        CHECK(head_k == head / p.h_h_k_ratio, "kv head of %d: %d", head, head_k);
    }
}

// The causal backward's order over n_blocks key blocks per pair of a (n_blocks, h, b) grid, in groups of `group`.
static void check_bwd_order(int b, int h, int n_blocks, int group, int sms) {
    const int pairs = b * h;
    const int last_first = last_group_first(pairs, group, n_blocks, sms);
    std::vector<BlockCoord> want;
    for (int first = 0; first < pairs; first += group) {
        const int last = first == last_first ? pairs : first + group;
        for (int block = 0; block < n_blocks; ++block) {
            for (int pair = first; pair < last; ++pair) want.push_back({block, pair % h, pair / h});
        }
        if (last == pairs) break;
    }
    CHECK(static_cast<int>(want.size()) == n_blocks * pairs, "%zu tiles written out", want.size());
    const auto order = flash::causal_order<flash::PlainDiv>(n_blocks, h, pairs, group, sms);
    for (int tile = 0; tile < n_blocks * pairs; ++tile) {
        const BlockCoord c = flash::causal_bwd_tile_coord(tile, order);
        const BlockCoord w = want[tile];
        // Groups of one pair: the grid's own order, blockIdx.x fastest.
        const BlockCoord grid{tile % n_blocks, (tile / n_blocks) % h, tile / (n_blocks * h)};
        CHECK(c.block == w.block && c.head == w.head && c.batch == w.batch,
              "backward b %d h %d n_blocks %d group %d: tile %d -> (%d, %d, %d), not (%d, %d, %d)", b, h, n_blocks,
              group, tile, c.block, c.head, c.batch, w.block, w.head, w.batch);
        if (group == 1 && sms == 0) {
            CHECK(c.block == grid.block && c.head == grid.head && c.batch == grid.batch, "group 1, tile %d", tile);
        }
    }
}

int main() {
    check_fast_div();
    int before = g_failures;
    for (int b : {1, 2, 5}) {
        for (int h : {1, 3, 16}) {
            for (int h_k : {1, h}) {
                for (int tq : {1, 128, 129, 1000, 2048}) {
                    for (int tk : {1, 300, 2048}) {
                        for (int group : {1, 2, 3, 7, 16, b * h}) {
                            if (group > b * h) continue;
                            for (int sms : {0, 1, 4, 132}) {
                                check_order<128, true>(params(b, h, h_k, tq, tk, true, group, sms));
                                check_order<192, true>(params(b, h, h_k, tq, tk, true, group, sms));  // 3 warpgroups
                            }
                        }
                        check_order<128, false>(params(b, h, h_k, tq, tk, false, 0, 132));
                        check_order<192, false>(params(b, h, h_k, tq, tk, false, 0, 132));
                    }
                }
            }
        }
    }
    for (int b : {1, 2, 5}) {
        for (int h : {1, 3, 16}) {
            for (int n_blocks : {1, 2, 17, 64}) {
                for (int group : {1, 2, 3, 7, 16, b * h}) {
                    for (int sms : {0, 1, 4, 132}) {
                        if (group <= b * h) check_bwd_order(b, h, n_blocks, group, sms);
                    }
                }
            }
        }
    }
    if (g_failures == before) std::printf("ok tile order\n");
    return g_failures == 0 ? 0 : 1;
}
