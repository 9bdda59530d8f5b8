// Torch-free parameters of the FlashAttention-2 kernels (forward and backward).
//
// Everything a kernel needs is plain data: device pointers, strides in ELEMENTS (not bytes), sizes,
// the softmax scale and flags. flash_api.cpp fills these from at::Tensor; nothing below includes torch,
// so the kernels compile (and can be inspected with `nvcc -Xptxas -v`) on a machine without torch's
// CUDA headers. Strides are int64 because B*T*H*D overflows int32 for long sequences.
#pragma once

#include <cstdint>

namespace flash {

// log2(e): the kernels' softmax runs on exp2, exp(x) = exp2(x * log2(e)). In double for the host, which folds it into
// scale_softmax_log2 (flash_api.cpp); kLog2e, its float, for the kernels.
constexpr double kLog2eDouble = 1.4426950408889634;
constexpr float kLog2e = static_cast<float>(kLog2eDouble);

struct FwdParams {
    // Layout of every tensor: (B, T, H, D) with stride(D) == 1; batch/row/head strides arbitrary.
    const void* q_ptr;
    const void* k_ptr;
    const void* v_ptr;
    void* o_ptr;
    float* lse_ptr;  // (B, Hq, Tq) contiguous, natural-log log-sum-exp per query row

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;

    int b;               // batch
    int h;               // query heads (Hq)
    int h_k;             // key/value heads (Hkv), divides h
    int h_h_k_ratio;     // h / h_k: query head i reads kv head i / h_h_k_ratio
    int seqlen_q;        // Tq >= 1
    int seqlen_k;        // Tk >= 1
    int d;               // the caller's head dim (multiple of 8, <= the instantiated kHeadDim)
    int d_rounded;       // the instantiated kHeadDim that runs it

    float scale_softmax;       // usually 1/sqrt(d)
    float scale_softmax_log2;  // scale_softmax * kLog2eDouble: softmax runs on exp2

    bool is_causal;  // bottom-right aligned: query i sees keys j <= i + (seqlen_k - seqlen_q)
    // Sliding (local) window, FlashAttention's semantics: after the bottom-right alignment above, query i sees key
    // j iff i + (seqlen_k - seqlen_q) - window_left <= j <= i + (seqlen_k - seqlen_q) + window_right, where -1
    // is unbounded; is_causal is window_right = 0. Key blocks wholly outside the window are never visited.
    int window_left;
    int window_right;

    // Variable-length (packed) sequences, FlashAttention's varlen layout; nullptr is the dense layout. Otherwise
    // q and o are (total_q, Hq, D), k and v (total_k, Hk, D) (batch strides 0, unused); sequence s of b holds
    // rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of q and [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of k and v,
    // and every bound above (causal alignment, window, masking) applies per sequence with its own lengths;
    // seqlen_q and seqlen_k hold max_seqlen_q and max_seqlen_k (they size the grids); lse is (Hq, total_q).
    const int* cu_seqlens_q;  // (b + 1,) int32, non-decreasing, cu_seqlens_q[0] = 0, cu_seqlens_q[b] = total_q
    const int* cu_seqlens_k;  // (b + 1,) int32, likewise
    int total_q;
    int total_k;
    int causal_group_heads;  // causal, varlen and windowed forward: (batch, head) pairs per group of the tile
                             // order (causal_order.h)
    // The device's limits, from its cached properties (flash_api.cpp): the Hopper forward's persistent grid
    // (fwd_tile_scheduler.h) and the sm80 configs' fallbacks where a GPU's shared memory is smaller (the launches).
    int num_sms;
    int smem_per_sm;          // shared memory per SM, bytes
    int smem_per_block_optin;  // dynamic shared memory a block may opt in to, bytes (flash_api.cpp, set_smem_limits)
    int* tile_counter;  // Hopper causal forward and backward: a zeroed int their blocks take their next tile from
                        // (the backward's preprocess kernel zeroes it); else unused
    bool is_bf16;    // else fp16
    bool use_sm90;   // the device is sm_90 and the caller allows the Hopper kernel of this pass (flash_api.cpp,
                     // Overrides); head dims without one (hopper_kernel_traits.h, hopper_bwd_traits.h) and the
                     // deterministic backward run the sm80 kernel regardless
};

struct BwdParams : public FwdParams {
    const void* do_ptr;
    void* dq_ptr;
    void* dk_ptr;  // (B, Tk, Hq, D) expanded buffer when h != h_k (summed over groups by the caller)
    void* dv_ptr;

    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

    // Workspaces allocated by the caller.
    float* delta_ptr;     // (B, Hq, Tq): rowsum(dO * O), Alg. 2 line 4; varlen: (Hq, total_q)
    float* dq_accum_ptr;  // (num_splits, B, Hq, Tq, dq_accum_cols) fp32, zeroed by the preprocess kernel; the Hopper
                          // kernel's rows hold their 16-byte chunks swizzled (dq_accum_layout.h, dq_accum_chunk_in)
    int64_t dq_accum_split_stride;  // elements between splits = B * Hq * Tq * dq_accum_cols
    // varlen: dq_accum is (num_splits, Hq, dq_accum_rows(total_q, b), dq_accum_cols) and sequence s's rows begin at
    // dq_accum_row0(cu_seqlens_q[s], s), so whole kBlockM-row tiles of one sequence never touch another's rows.

    // Non-deterministic: one thread block per K/V block, dQ accumulated with fp32 atomics (sm80 kernel) or the
    // TMA unit's bulk reduce-adds (Hopper kernel) (num_splits=1).
    // Deterministic: num_splits thread blocks per (head, batch), block s handles K/V blocks s, s+S, ...
    // in order and owns split s of dq_accum exclusively, so every element is summed in a fixed order;
    // the convert kernel then sums the splits in index order.
    int num_splits;
    bool deterministic;

    // Hopper causal kernel (flash_bwd_hopper_kernel.cuh): (batch, head) pairs per group of its block order
    // (causal_order.h, bwd_tile_scheduler.h), or 0 for the grid's own order.
    int bwd_causal_group;
    // Floats per dq_accum row: d_rounded, or the Hopper kernel's kQKDim (hopper_bwd_dq_accum_cols). It fills the
    // padding before block_trace: no other field moves, and the kernels that do not read it keep their code.
    int dq_accum_cols;

    // FLASH_BWD_TRACE builds of the Hopper kernel (block_trace.h): kBlockTraceCols values per thread block, at the
    // row of its index in the grid where that is below block_trace_rows; nullptr (the default) writes none.
    long long* block_trace;
    int64_t block_trace_rows;

    // The dense Hopper backward's L_i and D_i as operands of its S^T and dP^T products (FLASH_BWD_LD_IN_MMA,
    // hopper_bwd_traits.h): (B, Hq, 2, ld_mma_rows, 8) in the input dtype, row q of slice 0 holding -L_q / softmax
    // scale and of slice 1 -D_q, each as the sum of its first three elements (the rest zeros); rows from Tq to
    // ld_mma_rows (Tq rounded up to kLdMmaRowPad) zeros. Written by the preprocess kernel; nullptr where unused.
    void* ld_mma_ptr;
    int64_t ld_mma_rows;
};

constexpr int kLdMmaRowPad = 128;  // a multiple of every Hopper backward's kBlockM
// The element offset in ld_mma of (batch, head)'s query row q of slice 0 (L); slice 1's (D) is ld_mma_rows * 8 on.
#ifdef __CUDACC__
__host__ __device__
#endif
inline int64_t ld_mma_row(const BwdParams& p, int batch, int head, int q) {
    return ((static_cast<int64_t>(batch) * p.h + head) * 2 * p.ld_mma_rows + q) * 8;
}

// varlen dq_accum rows: each sequence starts on a multiple of kDqAccumRowPad (a multiple of every kernel's kBlockM)
// and owns at least ceil(len / kBlockM) * kBlockM rows (FlashAttention-3's padded offsets).
constexpr int kDqAccumRowPad = 128;
#ifdef __CUDACC__
__host__ __device__
#endif
constexpr inline int64_t dq_accum_row0(int cu_seqlen, int seq) {
    return (static_cast<int64_t>(cu_seqlen) + static_cast<int64_t>(seq) * kDqAccumRowPad) / kDqAccumRowPad * kDqAccumRowPad;
}
#ifdef __CUDACC__
__host__ __device__
#endif
constexpr inline int64_t dq_accum_rows(int total_q, int b) {
    return dq_accum_row0(total_q, b);  // sequence b - 1's last tile ends at or before it
}

// Whether a call needs the kernels' per-sequence bounds (cu_seqlens) or the window: the binding sets window_left =
// window_right = -1 for every other call, causal or not, so those keep the dense kernels.
#ifdef __CUDACC__
__host__ __device__
#endif
inline bool is_varlen_or_local(const FwdParams& p) {
    return p.cu_seqlens_q != nullptr || p.window_left >= 0 || p.window_right >= 0;
}

#ifdef __CUDACC__
// One sequence of a call: its lengths, its first row in q/o and in k/v ((B, T, H, D) tensors: 0, the batch stride
// places it; varlen: cu_seqlens), and the window that applies to it, causal folded in as right = 0 (-1: unbounded).
struct SeqBounds {
    int seqlen_q, seqlen_k;
    int q_row0, k_row0;
    int window_left, window_right;
    __device__ __forceinline__ int causal_offset() const { return seqlen_k - seqlen_q; }  // bottom-right alignment
};
__device__ __forceinline__ SeqBounds seq_bounds(const FwdParams& p, int batch) {
    SeqBounds s{p.seqlen_q, p.seqlen_k, 0, 0, p.window_left, p.is_causal ? 0 : p.window_right};
    if (p.cu_seqlens_q != nullptr) {
        s.q_row0 = p.cu_seqlens_q[batch];
        s.k_row0 = p.cu_seqlens_k[batch];
        s.seqlen_q = p.cu_seqlens_q[batch + 1] - s.q_row0;
        s.seqlen_k = p.cu_seqlens_k[batch + 1] - s.k_row0;
    }
    return s;
}
// Index of (batch, head, row 0 of the sequence) in lse / delta: (B, Hq, Tq), or (Hq, total_q) in varlen.
__device__ __forceinline__ int64_t lse_row0(const FwdParams& p, const SeqBounds& s, int batch, int head) {
    if (p.cu_seqlens_q != nullptr) return static_cast<int64_t>(head) * p.total_q + s.q_row0;
    return (static_cast<int64_t>(batch) * p.h + head) * p.seqlen_q;
}
// floor(a / b) for b > 0 and any a (C++ division truncates toward zero).
__host__ __device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }

// Where a forward tile writes: O from row row0 of (batch, head), and those rows' LSE ((B, Hq, Tq), fp32). The
// Hopper forward's tiles and empty tiles use it; the sm80 forward keeps its own lines, since with this helper its
// hd64 kernel re-reads seqlen_q from the params (another register at 255) and is slower.
template <typename Element>
struct FwdOutRows {
    Element* o;
    float* lse;
};
template <typename Element>
__device__ __forceinline__ FwdOutRows<Element> fwd_out_rows(const FwdParams& p, int batch, int head, int row0) {
    return {static_cast<Element*>(p.o_ptr) + batch * p.o_batch_stride + head * p.o_head_stride + row0 * p.o_row_stride,
            p.lse_ptr + (static_cast<int64_t>(batch) * p.h + head) * p.seqlen_q + row0};
}
#endif

}  // namespace flash
