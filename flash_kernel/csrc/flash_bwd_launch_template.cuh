// Launch of the three backward kernels for one (dtype, head dim); included by flash_bwd_hdim*.cu.
#pragma once

#include <algorithm>
#include <type_traits>

#include "flash_bwd_common.cuh"
#include "flash_bwd_hopper_kernel.cuh"
#include "flash_bwd_tiled_kernel.cuh"
#include "flash_launch.h"
#include "static_switch.h"

namespace flash {

// Alg. 2 lines 6-20 on sm_90a (flash_bwd_hopper_kernel.cuh) over (K/V block, head, batch) tiles: Traits::persistent,
// one thread block per SM looping over them (bwd_tile_scheduler.h; causal: from p.tile_counter), else one per tile.
// Q, dO, K and V are read through tensor maps (TMA). Varlen and windowed calls run the kVarlenOrLocal kernel, one
// thread block per tile of max_seqlen_k's key blocks per sequence.
template <typename Traits>
cudaError_t launch_bwd_hopper(const BwdParams& p, cudaStream_t stream) {
    using Element = typename Traits::Element;
    constexpr int kM = Traits::kBlockM, kN = Traits::kBlockN, kSpan = Traits::kSpanBytes;
    if (p.seqlen_k == 0) return cudaSuccess;  // no keys: dK and dV are empty, dQ stays 0 (zeroed dq_accum)
    BwdTensorMaps maps;
    FLASH_RETURN_IF_ERROR((make_qkv_tile_maps<Element, kM, kN, kSpan, Traits::kHeadDim>(&maps, p)));
    const TileMapRows rows = tile_map_rows(p);
    FLASH_RETURN_IF_ERROR((make_tile_maps<Element, kM, kSpan, Traits::kHeadDim>(
        &maps.dO, &maps.do_tail, p.do_ptr, p.d, rows.q, p.h, rows.batches, p.do_row_stride, p.do_head_stride,
        p.do_batch_stride)));
    if (is_varlen_or_local(p)) {
        return launch_kernel(&flash_bwd_hopper_kernel<Traits, false, true>, dim3(ceil_div(p.seqlen_k, kN), p.h, p.b),
                             Traits::kNThreads, Traits::kSmemOneBlockBytes, stream, p, maps, BwdTiles{});
    }
    if (p.is_causal && p.tile_counter == nullptr) return cudaErrorInvalidValue;  // the caller owns the zeroed counter
    const BwdTiles tiles = bwd_tiles<kN>(p);
    if (Traits::persistent(p.is_causal)) {  // its dK_j and dV_j go out by TMA stores
        FLASH_RETURN_IF_ERROR((make_tile_map<Element, kN, kSpan>(&maps.dk, p.dk_ptr, p.d, rows.k, p.h, rows.batches,
                                                                 p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride)));
        FLASH_RETURN_IF_ERROR((make_tile_map<Element, kN, kSpan>(&maps.dv, p.dv_ptr, p.d, rows.k, p.h, rows.batches,
                                                                 p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride)));
    }
    return FLASH_BOOL_SWITCH(p.is_causal, kIsCausal, [&]() -> cudaError_t {
        const dim3 grid = Traits::persistent(kIsCausal) ? dim3(std::min(p.num_sms, tiles.num_tiles))
                                                        : dim3(ceil_div(p.seqlen_k, kN), p.h, p.b);
        return launch_kernel(&flash_bwd_hopper_kernel<Traits, kIsCausal>, grid, Traits::kNThreads,
                             Traits::smem_bytes(kIsCausal), stream, p, maps, tiles);
    });
}

// Alg. 2 lines 6-20 on sm80+ (flash_bwd_tiled_kernel.cuh): parallel over K/V blocks (or num_splits ordered
// workers), heads (times the column splits), batch (varlen: sequences, the K/V blocks of max_seqlen_k). Varlen and
// windowed calls (is_varlen_or_local) run the kernel that reads their bounds at run time.
template <typename Traits>
cudaError_t launch_bwd_sm80(const BwdParams& params, cudaStream_t stream) {
    const int num_n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
    const int grid_x = params.deterministic ? params.num_splits : num_n_blocks;
    const dim3 grid(grid_x, params.h * Traits::kColSplits, params.b);
    if (is_varlen_or_local(params)) {
        return launch_kernel(&flash_bwd_tiled_kernel<Traits, false, true>, grid, Traits::kNThreads, Traits::kSmemBytes,
                             stream, params);
    }
    return FLASH_BOOL_SWITCH(params.is_causal, kIsCausal, [&]() -> cudaError_t {
        return launch_kernel(&flash_bwd_tiled_kernel<Traits, kIsCausal>, grid, Traits::kNThreads, Traits::kSmemBytes,
                             stream, params);
    });
}

// The sm80 kernel of BwdConfig that this GPU's thread blocks have the shared memory for (bwd_variant: Traits, else
// SmallSmemTraits, else Smem99KiBTraits).
template <typename Config>
cudaError_t launch_bwd_sm80_config(const BwdParams& params, cudaStream_t stream) {
    using Traits = typename Config::Traits;
    using SmallSmem = typename SmallSmemTraitsOf<Config>::type;
    using Smem99KiB = typename Smem99KiBTraitsOf<Config, SmallSmem>::type;
    static_assert(SmallSmem::kSmemBytes <= kMaxSmemBytesSm80, "every backward config must have one that fits A100");
    const BwdVariant variant = bwd_variant<Config>(params.smem_per_block_optin);
    if constexpr (!std::is_same_v<Smem99KiB, SmallSmem>) {
        if (variant == kBwdSmem99KiB) return launch_bwd_sm80<Smem99KiB>(params, stream);
    }
    if constexpr (!std::is_same_v<SmallSmem, Traits>) {
        if (variant != kBwdTraits) return launch_bwd_sm80<SmallSmem>(params, stream);
    }
    return launch_bwd_sm80<Traits>(params, stream);
}

// The row kernels around the main one (flash_bwd_common.cuh) for dense or packed (varlen) rows: grid.x covers
// (max_)seqlen_q's rows, grid.z the batch or the sequences. dq_accum's rows are kAccumCols floats.
template <typename Element, int kHeadDim, int kAccumCols>
cudaError_t launch_bwd_preprocess(const BwdParams& params, cudaStream_t stream) {
    const dim3 row_grid(ceil_div(params.seqlen_q, RowKernelShape<kHeadDim>::kRows), params.h, params.b);
    FLASH_BOOL_SWITCH(params.cu_seqlens_q != nullptr, kVarlen, [&] {
        bwd_preprocess_kernel<Element, kHeadDim, kVarlen, kAccumCols><<<row_grid, kRowKernelThreads, 0, stream>>>(params);
    });
    FLASH_LAUNCH_CHECK();
    return cudaSuccess;
}
template <typename Element, int kHeadDim, bool kSwizzledChunks, int kAccumCols>
cudaError_t launch_bwd_convert_dq(const BwdParams& params, cudaStream_t stream) {
    const dim3 row_grid(ceil_div(params.seqlen_q, RowKernelShape<kHeadDim>::kRows), params.h, params.b);
    FLASH_BOOL_SWITCH(params.cu_seqlens_q != nullptr, kVarlen, [&] {
        bwd_convert_dq_kernel<Element, kHeadDim, kSwizzledChunks, kVarlen, kAccumCols>
            <<<row_grid, kRowKernelThreads, 0, stream>>>(params);
    });
    FLASH_LAUNCH_CHECK();
    return cudaSuccess;
}

// Alg. 2 line 4 with dq_accum zeroed, lines 6-20 by the Hopper kernel of Traits, then dQ = scale * dq_accum -> the
// input dtype: dq_accum in that kernel's layout (dq_accum_layout.h), rows of Traits::kQKDim floats, the width the
// caller allocated it with (BwdParams::dq_accum_cols, hopper_dq_accum_cols).
template <typename Element, int kHeadDim, typename Traits>
cudaError_t run_bwd_hopper(const BwdParams& params, cudaStream_t stream) {
    constexpr int kAccumCols = Traits::kQKDim;
    if (params.dq_accum_cols != kAccumCols) return cudaErrorInvalidValue;
    FLASH_RETURN_IF_ERROR((launch_bwd_preprocess<Element, kHeadDim, kAccumCols>(params, stream)));
    FLASH_RETURN_IF_ERROR((launch_bwd_hopper<Traits>(params, stream)));
    return launch_bwd_convert_dq<Element, kHeadDim, true, kAccumCols>(params, stream);
}

template <typename Element, int kHeadDim>
cudaError_t run_mha_bwd_(const BwdParams& params, cudaStream_t stream) {
    // The Hopper kernel where there is one (not for the ordered deterministic splits): its NarrowTraits for head dims
    // up to its kNarrowDim, else its Traits (hopper_bwd_traits.h).
    if constexpr (HopperBwdConfig<kHeadDim, Element>::kAvailable) {
        using HopperConfig = HopperBwdConfig<kHeadDim, Element>;
        static_assert(HopperConfig::Traits::kQKDim == kHeadDim,
                      "the Hopper kernel's dq_accum rows are d_rounded floats, the head dim instantiated here");
        if (params.use_sm90 && !params.deterministic) {
            if constexpr (NarrowDimOf<HopperConfig>::value > 0) {
                if (hopper_bwd_runs_narrow<HopperConfig>(params.d)) {
                    return run_bwd_hopper<Element, kHeadDim, typename HopperConfig::NarrowTraits>(params, stream);
                }
            }
            return run_bwd_hopper<Element, kHeadDim, typename HopperConfig::Traits>(params, stream);
        }
    }
    // Else the sm80 kernel, on plain rows of d_rounded floats.
    static_assert(BwdConfig<kHeadDim, Element>::Traits::kHeadDim == kHeadDim,
                  "the sm80 kernel's dq_accum rows are d_rounded floats, the head dim instantiated here");
    if (params.dq_accum_cols != kHeadDim) return cudaErrorInvalidValue;
    FLASH_RETURN_IF_ERROR((launch_bwd_preprocess<Element, kHeadDim, kHeadDim>(params, stream)));
    FLASH_RETURN_IF_ERROR((launch_bwd_sm80_config<BwdConfig<kHeadDim, Element>>(params, stream)));
    return launch_bwd_convert_dq<Element, kHeadDim, false, kHeadDim>(params, stream);
}

}  // namespace flash
