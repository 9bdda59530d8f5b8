// TMA (the Tensor Memory Accelerator, sm_90): a whole tile of Q, K, V or dO copied global -> shared memory by
// one instruction of one thread, straight into the 128B-swizzled layout of hopper_utils.cuh, completing on an
// mbarrier by byte count. It takes the cp.async address arithmetic (about 190 instructions per warp per K/V turn)
// off the warps that run the softmax.
//
// Host: a tensor map (CUtensorMap, 128 bytes) per operand describes the (B, T, H, D) tensor as 4 dims,
// innermost first: (d, seqlen, heads, batch), strides in bytes; its box is one column block of kRows rows (64
// bf16/fp16 = 128 bytes, the swizzle span; 32 = 64 bytes for the SW64 layout), so a kHeadDim-wide tile is
// kHeadDim / 64 (or / 32) copies, each landing on its own column block of the tile. A tile whose last column block
// is narrower (TileLayout, hopper_utils.cuh: 64 + 16 columns at head dims 65-80) has a second map per operand, of
// that block's width and swizzle (16 columns in SW32), for its last copy. Rows past seqlen and columns
// past d are out of bounds and filled with zeros by the hardware (the masking the cp.async path did with
// predicates). The maps are kernel parameters (__grid_constant__), which is where the TMA unit reads them from.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only; the encoder comes from the runtime, below)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash_launch.h"  // FwdParams, FLASH_RETURN_IF_ERROR
#include "hopper_utils.cuh"

namespace flash {

// ---------------------------------------------------------------------------------------------------- host
using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                          CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point: no link against libcuda.so.
inline TensorMapEncodeTiled tensor_map_encoder() {
    static const TensorMapEncodeTiled encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            return TensorMapEncodeTiled{nullptr};
        }
        return reinterpret_cast<TensorMapEncodeTiled>(fn);
    }();
    return encode;
}

// A (B, T, H, D) operand, strides in elements as in FwdParams (0 for a dimension of size 1), tiled as
// kRows x 64-column boxes (kSpanBytes = 64: 32-column boxes; 32: 16-column ones). The binding already checked what
// TMA needs: a 16-byte-aligned base, strides that are multiples of 8 elements, d a multiple of 8.
template <typename Element, int kRows, int kSpanBytes = kSwizzleRowBytes>
cudaError_t make_tile_map(CUtensorMap* map, const void* ptr, int d, int seqlen, int heads, int batch, int64_t row_stride,
                          int64_t head_stride, int64_t batch_stride) {
    static_assert(sizeof(Element) == 2, "16-bit elements: a box of kBlockElems columns is one swizzle span");
    using Span = SwizzleSpan<kSpanBytes>;
    const TensorMapEncodeTiled encode = tensor_map_encoder();
    if (encode == nullptr) return cudaErrorNotSupported;
    constexpr int64_t kBytes = sizeof(Element);
    // A size-1 dimension's stride is never used to address; TMA still wants a non-zero multiple of 16 bytes.
    auto bytes = [](int64_t stride) { return static_cast<cuuint64_t>(stride > 0 ? stride * kBytes : 16); };
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(seqlen), static_cast<cuuint64_t>(heads),
                                static_cast<cuuint64_t>(batch)};
    const cuuint64_t strides[3] = {bytes(row_stride), bytes(head_stride), bytes(batch_stride)};  // dims 1..3
    const cuuint32_t box[4] = {static_cast<cuuint32_t>(Span::kBlockElems), static_cast<cuuint32_t>(kRows), 1, 1};
    constexpr CUtensorMapSwizzle kSwizzle = kSpanBytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                            : kSpanBytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                               : CU_TENSOR_MAP_SWIZZLE_32B;
    const cuuint32_t element_strides[4] = {1, 1, 1, 1};
    const CUresult r = encode(map, std::is_same_v<Element, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                              4, const_cast<void*>(ptr), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              kSwizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Q, K and V of both passes: Q in boxes of kQRows rows, K and V (h_k heads under GQA) of kKVRows; the tails' maps
// for tiles whose last column block is narrower (else not made).
struct QkvTensorMaps {
    CUtensorMap q, k, v;
    CUtensorMap q_tail, k_tail, v_tail;
};

// Varlen (hopper_seqlen.h): the packed (total, H, D) tensors as one batch entry of total rows, read at row
// coordinates offset by cu_seqlens. A packed tensor of no rows gets a map of one row, which no tile reads.
struct TileMapRows {
    int q, k, batches;
};
inline TileMapRows tile_map_rows(const FwdParams& p) {
    if (p.cu_seqlens_q == nullptr) return {p.seqlen_q, p.seqlen_k, p.b};
    return {p.total_q > 0 ? p.total_q : 1, p.total_k > 0 ? p.total_k : 1, 1};
}

// The maps of a kRows x kCols tile of one operand (TileLayout): `map` in boxes of its whole column blocks, and, where
// its last block is narrower, `tail` in boxes of that block (else not made). Arguments after `tail` as make_tile_map's.
template <typename Element, int kRows, int kSpanBytes, int kCols>
cudaError_t make_tile_maps(CUtensorMap* map, CUtensorMap* tail, const void* ptr, int d, int seqlen, int heads,
                           int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
    using Layout = TileLayout<kRows, kCols, kSpanBytes>;
    if constexpr (Layout::kTailCols > 0) {
        FLASH_RETURN_IF_ERROR((make_tile_map<Element, kRows, Layout::TailSpan::kBytes>(
            tail, ptr, d, seqlen, heads, batch, row_stride, head_stride, batch_stride)));
    }
    return make_tile_map<Element, kRows, kSpanBytes>(map, ptr, d, seqlen, heads, batch, row_stride, head_stride,
                                                     batch_stride);
}

// Q's and K's tiles kCols wide in kSpanBytes (TileLayout), V's kVCols wide in kVSpanBytes (by default the same).
template <typename Element, int kQRows, int kKVRows, int kSpanBytes, int kCols, int kVSpanBytes = kSpanBytes,
          int kVCols = kCols>
cudaError_t make_qkv_tile_maps(QkvTensorMaps* maps, const FwdParams& p) {
    const TileMapRows rows = tile_map_rows(p);
    FLASH_RETURN_IF_ERROR((make_tile_maps<Element, kQRows, kSpanBytes, kCols>(
        &maps->q, &maps->q_tail, p.q_ptr, p.d, rows.q, p.h, rows.batches, p.q_row_stride, p.q_head_stride,
        p.q_batch_stride)));
    FLASH_RETURN_IF_ERROR((make_tile_maps<Element, kKVRows, kSpanBytes, kCols>(
        &maps->k, &maps->k_tail, p.k_ptr, p.d, rows.k, p.h_k, rows.batches, p.k_row_stride, p.k_head_stride,
        p.k_batch_stride)));
    return make_tile_maps<Element, kKVRows, kVSpanBytes, kVCols>(&maps->v, &maps->v_tail, p.v_ptr, p.d, rows.k, p.h_k,
                                                                 rows.batches, p.v_row_stride, p.v_head_stride,
                                                                 p.v_batch_stride);
}

// -------------------------------------------------------------------------------------------------- device
// The phase of `bar` completes once its pending arrivals are done and `bytes` more bytes have landed.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// `bytes` more bytes to land before the phase of `bar` completes, without an arrival.
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) global -> shared memory by the TMA unit,
// counted on `bar`'s transaction bytes.
__device__ __forceinline__ void bulk_load(uint32_t smem, const void* gmem, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem), "l"(reinterpret_cast<uint64_t>(gmem)), "r"(bytes), "r"(bar)
                 : "memory");
}

// mbarrier.init is a generic-proxy write; the TMA unit signals the barriers through the async proxy.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The TMA unit caches tensor maps; fetching one early hides that miss behind the prologue.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Box (col, row, head, batch) of `map` into shared memory at `smem` (aligned to the swizzle's atom: 1024 bytes for
// SW128, 512 for SW64), counted on `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load_tile(uint32_t smem, const CUtensorMap* map, int col, int row, int head, int batch,
                                              uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        ::"r"(smem), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(bar)
        : "memory");
}

// A kRows x kHeadDim tile (all its column blocks, TileLayout) starting at `row` of (head, batch): arms `bar` with the
// tile's bytes, then issues one copy per column block, the last from tail_map where that block is narrower (unread
// otherwise). One thread calls it, with a map of the same kSpanBytes.
template <int kRows, int kHeadDim, int kSpanBytes = kSwizzleRowBytes>
__device__ __forceinline__ void tma_load_rows(uint32_t smem, const CUtensorMap* map, const CUtensorMap* tail_map, int row,
                                              int head, int batch, uint32_t bar) {
    using Layout = TileLayout<kRows, kHeadDim, kSpanBytes>;
    mbarrier_arrive_expect_tx(bar, Layout::kBytes);
#pragma unroll
    for (int c = 0; c < Layout::kFullBlocks; ++c) {
        tma_load_tile(smem + c * Layout::kBlockBytes, map, c * Layout::Span::kBlockElems, row, head, batch, bar);
    }
    if constexpr (Layout::kTailCols > 0) {
        tma_load_tile(smem + Layout::kTailOffset, tail_map, Layout::kFullCols, row, head, batch, bar);
    }
}

// Shared -> global: box (col, row, head, batch) of `map` from the swizzled tile at `smem`, tracked in the calling
// thread's bulk async-group. Rows and columns past the map's bounds are not written. The shared-memory source must
// be made visible to the async proxy first (fence_view_async_shared by its writers).
__device__ __forceinline__ void tma_store_tile(const CUtensorMap* map, uint32_t smem, int col, int row, int head, int batch) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem), "r"(col), "r"(row), "r"(head), "r"(batch)
                 : "memory");
}

// tma_load_rows' inverse: a kRows x kHeadDim tile (all its column blocks, whole ones only) to `row` of (head, batch).
// One thread calls it; it does not commit the group.
template <int kRows, int kHeadDim, int kSpanBytes = kSwizzleRowBytes>
__device__ __forceinline__ void tma_store_rows(const CUtensorMap* map, uint32_t smem, int row, int head, int batch) {
    using Span = SwizzleSpan<kSpanBytes>;
    constexpr uint32_t kColBlockBytes = kRows * Span::kBytes;
#pragma unroll
    for (int c = 0; c < kHeadDim / Span::kBlockElems; ++c) {
        tma_store_tile(map, smem + c * kColBlockBytes, c * Span::kBlockElems, row, head, batch);
    }
}

// Bulk (non-tensor) reduce-add: `bytes` contiguous bytes of fp32 in shared memory added element-wise into global
// memory by the TMA unit, one instruction of one thread; tracked in that thread's bulk async-group. The
// shared-memory source must be made visible to the async proxy first (fence_view_async_shared by its writers).
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, uint32_t smem, int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(reinterpret_cast<uint64_t>(gmem)), "r"(smem), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most kPending of this thread's bulk groups are still reading their shared-memory source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace flash
