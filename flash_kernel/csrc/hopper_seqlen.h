// The keys each query sees on the Hopper kernels' varlen / sliding-window path (kVarlenOrLocal), and what the kernels
// derive from it; a sequence's lengths and rows come from seq_bounds (flash_params.h).
//
// Varlen tensors are read through tensor maps over the whole packed (total, H, D) tensor with row coordinates
// offset by cu_seqlens (hopper_tma.h), so a tile's rows past its sequence's end hold the NEXT sequence's rows, not
// zeros: every bound below is applied as a mask, never left to TMA's zero fill. The dense layout is the one
// sequence per batch entry, at offset 0.
//
// Query i of a sequence (lengths len_q, len_k) sees key j iff 0 <= j < len_k and
//     i + co - left <= j <= i + co + right,   co = len_k - len_q (bottom-right alignment),
// with left, right the window (FwdParams::window_left / window_right), causal being right = 0, and an unbounded
// side (-1) replaced by max_seqlen_q + max_seqlen_k, which no offset reaches: one formula, no branches per element.
#pragma once

#include <cuda_runtime.h>  // __host__ / __device__

#include "flash_params.h"

namespace flash {

__host__ __device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

struct KeyWindow {
    int left, right;  // both >= 0 (unbounded: seqlen_q + seqlen_k)
};

__host__ __device__ __forceinline__ KeyWindow key_window(const FwdParams& p) {
    const int unbounded = p.seqlen_q + p.seqlen_k;
    const int right = p.is_causal ? 0 : p.window_right;  // causal: window_right 0 intersected with the window
    return {p.window_left < 0 ? unbounded : p.window_left, right < 0 ? unbounded : right};
}

#ifdef __CUDACC__
// The tensor maps' batch coordinate of sequence `batch` (hopper_tma.h: the packed tensors are one batch entry).
__device__ __forceinline__ int tma_batch(const FwdParams& p, int batch) { return p.cu_seqlens_q != nullptr ? 0 : batch; }

// Where a varlen / local forward tile writes: O and LSE from row `row` of sequence s, (batch, head) (fwd_out_rows'
// form for any layout).
template <typename Element>
__device__ __forceinline__ FwdOutRows<Element> local_out_rows(const FwdParams& p, const SeqBounds& s, int batch, int head,
                                                              int row) {
    return {static_cast<Element*>(p.o_ptr) + batch * p.o_batch_stride + head * p.o_head_stride +
                (static_cast<int64_t>(s.q_row0) + row) * p.o_row_stride,
            p.lse_ptr + lse_row0(p, s, batch, head) + row};
}
#endif

// The keys query i sees: [key_lo(i), key_hi(i)) (empty where lo >= hi).
__host__ __device__ __forceinline__ int key_lo(const KeyWindow& w, int co, int i) { return i + co - w.left; }
__host__ __device__ __forceinline__ int key_hi(const KeyWindow& w, int co, int len_k, int i) {
    return imin(len_k, i + co + w.right + 1);
}

// Key blocks [n_min, n_max) that queries [first, last] touch (n_min >= n_max: none).
template <int kBlockN>
__host__ __device__ __forceinline__ void key_block_range(const KeyWindow& w, int co, int len_k, int first, int last,
                                                         int& n_min, int& n_max) {
    n_min = imax(0, key_lo(w, co, first)) / kBlockN;
    n_max = (imax(0, key_hi(w, co, len_k, last)) + kBlockN - 1) / kBlockN;
}

// Queries [0, rows_without_keys) see no key (len_k == 0, or causal / right-bounded with len_q > len_k + right);
// every later query sees at least one (i + co - left <= len_k - 1 - left for i < len_q). O = 0, LSE = +inf there.
__host__ __device__ __forceinline__ int rows_without_keys(const KeyWindow& w, int len_q, int len_k) {
    if (len_k == 0) return len_q;
    return imax(0, imin(len_q, len_q - len_k - w.right));
}

// The rows the forward writes after its main tiles, [0, keyless_tile_rows) (none if <= 0): those of the tiles whose
// every row sees no key, which the producer skips. Tiles end at len_q - r kBlockM (fwd_tile_scheduler.h), and a tile
// is skipped iff its last row is one of the rows_without_keys.
template <int kBlockM>
__host__ __device__ __forceinline__ int keyless_tile_rows(const KeyWindow& w, int len_q, int len_k) {
    return len_q - (len_q - rows_without_keys(w, len_q, len_k) + kBlockM - 1) / kBlockM * kBlockM;
}

// Query blocks [m_min, m_max) of kBlockM rows from the sequence's first query that see a key of [first, last]
// (the backward's loop over query blocks of one key block).
template <int kBlockM>
__host__ __device__ __forceinline__ void query_block_range(const KeyWindow& w, int co, int len_q, int first, int last,
                                                           int& m_min, int& m_max) {
    // i sees j iff j - co - right <= i <= j - co + left
    m_min = imax(0, first - co - w.right) / kBlockM;
    m_max = (imax(0, imin(len_q, last - co + w.left + 1)) + kBlockM - 1) / kBlockM;
}

}  // namespace flash
