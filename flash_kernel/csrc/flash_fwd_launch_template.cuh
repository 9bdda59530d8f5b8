// Launch of the forward kernel for one (dtype, head dim); included by the flash_fwd_hdim*.cu files.
#pragma once

#include <algorithm>
#include <type_traits>

#include "flash_fwd_hopper_kernel.cuh"
#include "flash_fwd_kernel.cuh"
#include "flash_launch.h"
#include "static_switch.h"

namespace flash {

// One sm80 forward kernel of the given Traits.
template <typename Traits>
cudaError_t launch_fwd(void (*kernel)(FwdParams), const FwdParams& params, cudaStream_t stream) {
    // Alg. 1 line 3: one thread block per (query block, head, batch).
    const dim3 grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.h, params.b);
    return launch_kernel(kernel, grid, Traits::kNThreads, Traits::kSmemBytes, stream, params);
}

// The sm80 forward of the given Traits for this call: the dense non-causal or causal kernel, or, for varlen or
// windowed calls (is_varlen_or_local), the kernel that reads per-sequence bounds and the window at run time.
template <typename Traits>
cudaError_t launch_fwd_sm80(const FwdParams& params, cudaStream_t stream) {
    if (is_varlen_or_local(params)) return launch_fwd<Traits>(&flash_fwd_kernel<Traits, false, true>, params, stream);
    return FLASH_BOOL_SWITCH(params.is_causal, kIsCausal, [&] {
        return launch_fwd<Traits>(&flash_fwd_kernel<Traits, kIsCausal>, params, stream);
    });
}

// The Hopper kernel reads Q, K and V through tensor maps: Q in boxes of kBlockM rows, K and V of kBlockN. It is
// persistent (fwd_tile_scheduler.h): one block per SM, at most one per tile. kVarlenOrLocal: the varlen /
// sliding-window kernel, whose tile slots hold each tile's bounds (LocalTile), and which takes its tiles from
// p.tile_counter where the caller passes one.
template <typename Traits, bool kIsCausal, bool kVarlenOrLocal = false>
cudaError_t launch_fwd_hopper(const FwdParams& p, cudaStream_t stream) {
    if (kIsCausal && p.tile_counter == nullptr) return cudaErrorInvalidValue;  // the caller owns the zeroed counter
    if constexpr (kVarlenOrLocal) {
        if (p.seqlen_q == 0) return cudaSuccess;  // every sequence is empty: no rows to write
        QkvTensorMaps maps;
        FLASH_RETURN_IF_ERROR((make_qkv_tile_maps<typename Traits::Element, Traits::kBlockM, Traits::kBlockN,
                                                  Traits::kSpanBytes, Traits::kHeadDim, Traits::kVSpanBytes,
                                                  Traits::kVWidth>(&maps, p)));
        const FwdTiles tiles = fwd_local_tiles<Traits::kBlockM>(p);
        constexpr int kSmemBytes = Traits::kSmemBytes + 4 * Traits::kNTileSlots * (kLocalTileInts - 1);
        static_assert(kSmemBytes <= kMaxSmemBytesSm90, "the varlen / local tile slots must fit beside the tiles");
        return launch_kernel(&flash_fwd_hopper_kernel<Traits, false, true>, dim3(std::min(p.num_sms, tiles.num_tiles)),
                             Traits::kNThreads, kSmemBytes, stream, p, maps, tiles);
    } else {
        QkvTensorMaps maps;
        FLASH_RETURN_IF_ERROR((make_qkv_tile_maps<typename Traits::Element, Traits::kBlockM, Traits::kBlockN,
                                                  Traits::kSpanBytes, Traits::kHeadDim, Traits::kVSpanBytes,
                                                  Traits::kVWidth>(&maps, p)));
        const FwdTiles tiles = fwd_tiles<Traits::kBlockM>(p);
        return launch_kernel(&flash_fwd_hopper_kernel<Traits, kIsCausal>, dim3(std::min(p.num_sms, tiles.num_tiles)),
                             Traits::kNThreads, Traits::kSmemBytes, stream, p, maps, tiles);
    }
}

// Traits from kLongKeys keys up and ShortTraits below; in dense non-causal calls the one whose turns cost less
// (wider_blocks_pay, hopper_kernel_traits.h).
template <typename Traits, typename ShortTraits, int kLongKeys, bool kIsCausal, bool kVarlenOrLocal>
cudaError_t launch_fwd_hopper_tiles(const FwdParams& params, cudaStream_t stream) {
    if constexpr (!std::is_same_v<Traits, ShortTraits>) {
        const bool long_tiles = kIsCausal || kVarlenOrLocal ? params.seqlen_k >= kLongKeys
                                                            : wider_blocks_pay<Traits, ShortTraits>(params.seqlen_k);
        if (!long_tiles) return launch_fwd_hopper<ShortTraits, kIsCausal, kVarlenOrLocal>(params, stream);
    }
    return launch_fwd_hopper<Traits, kIsCausal, kVarlenOrLocal>(params, stream);
}

// The Hopper kernel of HopperFwdConfig for this input: for head dims up to its kNarrowDim its NarrowTraits (dense
// causal calls: CausalNarrowOf) and NarrowShortTraits, else its Traits (dense non-causal calls: DenseLongOf) and
// ShortTraits (hopper_kernel_traits.h).
template <typename Config, bool kIsCausal, bool kVarlenOrLocal = false>
cudaError_t launch_fwd_hopper_config(const FwdParams& params, cudaStream_t stream) {
    if constexpr (NarrowDimOf<Config>::value > 0) {
        if (params.d <= NarrowDimOf<Config>::value) {
            using Narrow = std::conditional_t<kIsCausal && !kVarlenOrLocal, typename CausalNarrowOf<Config>::type,
                                              typename Config::NarrowTraits>;
            return launch_fwd_hopper_tiles<Narrow, typename Config::NarrowShortTraits, Config::kLongKeys, kIsCausal,
                                           kVarlenOrLocal>(params, stream);
        }
    }
    using Long = std::conditional_t<kIsCausal || kVarlenOrLocal, typename Config::Traits,
                                    typename DenseLongOf<Config>::type>;
    return launch_fwd_hopper_tiles<Long, typename Config::ShortTraits, Config::kLongKeys, kIsCausal, kVarlenOrLocal>(
        params, stream);
}

template <typename Element, int kHeadDim>
cudaError_t run_mha_fwd_(const FwdParams& params, cudaStream_t stream) {
    if constexpr (HopperFwdConfig<kHeadDim, Element>::kAvailable) {
        if (params.use_sm90) {
            using HopperConfig = HopperFwdConfig<kHeadDim, Element>;
            if (is_varlen_or_local(params)) return launch_fwd_hopper_config<HopperConfig, false, true>(params, stream);
            return FLASH_BOOL_SWITCH(params.is_causal, kIsCausal, [&] {
                return launch_fwd_hopper_config<HopperConfig, kIsCausal>(params, stream);
            });
        }
    }
    using Config = FwdConfig<kHeadDim, Element>;
    using Traits = typename Config::Traits;
    using OneBlock = typename OneBlockTraitsOf<Config>::type;
    using Smem99KiB = typename Smem99KiBTraitsOf<Config, OneBlock>::type;
    const FwdVariant variant = fwd_variant<Config>(params.smem_per_block_optin, params.smem_per_sm);
    if constexpr (!std::is_same_v<Smem99KiB, OneBlock>) {
        if (variant == kFwdSmem99KiB) return launch_fwd_sm80<Smem99KiB>(params, stream);
    }
    if constexpr (!std::is_same_v<OneBlock, Traits>) {
        if (variant != kFwdTraits) return launch_fwd_sm80<OneBlock>(params, stream);
    }
    return launch_fwd_sm80<Traits>(params, stream);
}

}  // namespace flash
