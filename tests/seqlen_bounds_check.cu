// Host-side check of the Hopper varlen / sliding-window bounds (flash_kernel/csrc/hopper_seqlen.h), compiled and run
// by tests/test_tile_coord.py, against the visibility rule written out per (query, key) pair (query i sees key j iff
// 0 <= j < len_k and i + co - left <= j <= i + co + right, co = len_k - len_q; -1 unbounded; causal: right 0):
//   - rows_without_keys: exactly the leading queries that see no key;
//   - the forward's tiles (rank r: rows len_q - (r + 1) kBlockM .. len_q - r kBlockM - 1, the rows before 0 not
//     stored): key_block_range holds every key block a stored row sees, its first and last blocks hold a visible
//     key, and it is empty exactly for the tiles the kernel's post-pass writes instead (their rows: a prefix);
//   - the backward's query_block_range: every query block with a query that sees one of the key block's keys, its
//     first and last blocks holding one.
#include <cstdio>
#include <random>
#include <vector>

#include "host_check.h"
#include "hopper_seqlen.h"

#define CHECK(cond, ...) HOST_CHECK("seqlen_bounds", cond, __VA_ARGS__)

struct Case {
    int len_q, len_k, left, right;
    bool causal;
};

static bool sees(const Case& c, int i, int j) {
    const int co = c.len_k - c.len_q, right = c.causal ? 0 : c.right;
    return j >= 0 && j < c.len_k && (c.left < 0 || j >= i + co - c.left) && (right < 0 || j <= i + co + right);
}

template <int kBlockM, int kBlockN>
static void check_case(const Case& c, int max_q, int max_k) {
    flash::FwdParams p{};
    p.seqlen_q = max_q;
    p.seqlen_k = max_k;
    p.is_causal = c.causal;
    p.window_left = c.left;
    p.window_right = c.right;
    const flash::KeyWindow w = flash::key_window(p);
    const int co = c.len_k - c.len_q;
    std::vector<int> first_key(c.len_q, -1), last_key(c.len_q, -1);
    for (int i = 0; i < c.len_q; ++i) {
        for (int j = 0; j < c.len_k; ++j) {
            if (sees(c, i, j)) {
                if (first_key[i] < 0) first_key[i] = j;
                last_key[i] = j;
            }
        }
    }
    // rows_without_keys: a prefix
    const int without = flash::rows_without_keys(w, c.len_q, c.len_k);
    for (int i = 0; i < c.len_q; ++i) {
        CHECK((first_key[i] < 0) == (i < without), "q %d k %d (%d, %d) causal %d: row %d sees %s key, without = %d",
              c.len_q, c.len_k, c.left, c.right, c.causal, i, first_key[i] < 0 ? "no" : "a", without);
    }
    // forward tiles, and the post-pass's rows [0, skipped)
    const int skipped = flash::keyless_tile_rows<kBlockM>(w, c.len_q, c.len_k);
    std::vector<int> written(c.len_q, 0);
    for (int rank = 0; c.len_q - rank * kBlockM > 0; ++rank) {
        const int row0 = c.len_q - (rank + 1) * kBlockM;
        const int first = row0 < 0 ? 0 : row0, last = row0 + kBlockM - 1;
        int n_min, n_max;
        flash::key_block_range<kBlockN>(w, co, c.len_k, first, last, n_min, n_max);
        int lo = -1, hi = -1;
        for (int i = first; i <= last; ++i) {
            if (first_key[i] >= 0) {
                if (lo < 0 || first_key[i] < lo) lo = first_key[i];
                if (last_key[i] > hi) hi = last_key[i];
            }
        }
        if (lo < 0) {
            CHECK(n_min >= n_max, "q %d k %d (%d, %d): tile %d sees no key but has blocks [%d, %d)", c.len_q, c.len_k, c.left,
                  c.right, rank, n_min, n_max);
        } else {
            CHECK(n_min == lo / kBlockN && n_max == hi / kBlockN + 1, "q %d k %d (%d, %d) causal %d: tile %d blocks [%d, %d), "
                  "keys %d .. %d", c.len_q, c.len_k, c.left, c.right, c.causal, rank, n_min, n_max, lo, hi);
        }
        if (n_min < n_max) {
            for (int i = first; i <= last; ++i) ++written[i];
        }
    }
    for (int i = 0; i < skipped; ++i) ++written[i];
    for (int i = 0; i < c.len_q; ++i) CHECK(written[i] == 1, "q %d k %d: row %d written %d times", c.len_q, c.len_k, i, written[i]);
    // backward: query blocks from row 0 per key block
    for (int key0 = 0; key0 < c.len_k; key0 += kBlockN) {
        const int key_last = key0 + kBlockN - 1 < c.len_k ? key0 + kBlockN - 1 : c.len_k - 1;
        int m_min, m_max;
        flash::query_block_range<kBlockM>(w, co, c.len_q, key0, key_last, m_min, m_max);
        int lo = -1, hi = -1;
        for (int i = 0; i < c.len_q; ++i) {
            for (int j = key0; j <= key_last; ++j) {
                if (sees(c, i, j)) {
                    if (lo < 0) lo = i;
                    hi = i;
                }
            }
        }
        if (lo >= 0) {  // (a key block no query sees may visit query blocks whose P is all masked)
            CHECK(m_min <= lo / kBlockM && m_max >= hi / kBlockM + 1, "q %d k %d (%d, %d) causal %d: keys %d..: blocks [%d, %d), "
                  "queries %d .. %d", c.len_q, c.len_k, c.left, c.right, c.causal, key0, m_min, m_max, lo, hi);
            CHECK(m_min == lo / kBlockM && m_max == hi / kBlockM + 1, "q %d k %d (%d, %d) causal %d: keys %d..: blocks [%d, %d) "
                  "not tight, queries %d .. %d", c.len_q, c.len_k, c.left, c.right, c.causal, key0, m_min, m_max, lo, hi);
        }
    }
}

int main() {
    std::mt19937 rng(0);
    const int lens[] = {0, 1, 7, 63, 64, 65, 128, 129, 200, 383, 700};
    const int windows[] = {-1, 0, 1, 5, 64, 100, 300};
    int cases = 0;
    for (int lq : lens) {
        for (int lk : lens) {
            for (int left : windows) {
                for (int right : windows) {
                    for (int causal = 0; causal < 2; ++causal) {
                        if (rng() % 4 != 0) continue;  // a quarter of the grid: about 2.5k cases
                        const Case c{lq, lk, left, right, causal != 0};
                        check_case<192, 128>(c, 700, 700);
                        check_case<64, 128>(c, 700, 700);
                        ++cases;
                    }
                }
            }
        }
    }
    if (g_failures == 0 && cases > 2000) std::printf("ok seqlen bounds\n");
    return g_failures == 0 ? 0 : 1;
}
