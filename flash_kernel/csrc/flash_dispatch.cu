// Runtime dtype / head-dim dispatch onto the explicit instantiations (flash_{fwd,bwd}_hdim*.cu).
#include "flash_launch.h"
#include "hopper_bwd_traits.h"
#include "hopper_kernel_traits.h"
#include "kernel_traits.h"
#include "static_switch.h"

namespace flash {

cudaError_t run_mha_fwd(const FwdParams& params, cudaStream_t stream) {
    return FLASH_DTYPE_SWITCH(params.is_bf16, Element, [&] {
        return FLASH_HEADDIM_SWITCH(params.d_rounded, kHeadDim, [&] { return run_mha_fwd_<Element, kHeadDim>(params, stream); });
    });
}

bool hopper_fwd_built(int head_dim_rounded) {
    return FLASH_HEADDIM_SWITCH(head_dim_rounded, kHeadDim, [&] { return HopperFwdConfig<kHeadDim, __nv_bfloat16>::kAvailable; });
}

bool hopper_bwd_built(int head_dim_rounded) {
    return FLASH_HEADDIM_SWITCH(head_dim_rounded, kHeadDim, [&] { return HopperBwdConfig<kHeadDim, __nv_bfloat16>::kAvailable; });
}

bool bwd_head_dim_supported(int head_dim_rounded) { return head_dim_rounded <= kMaxHeadDim; }

bool hopper_bwd_ld_in_mma(bool is_bf16) { return is_bf16 ? kBwdLdInMma<__nv_bfloat16> : kBwdLdInMma<__half>; }

int hopper_bwd_dq_accum_cols(int head_dim, int head_dim_rounded) {
    return FLASH_HEADDIM_SWITCH(head_dim_rounded, kHeadDim, [&] {
        using Config = HopperBwdConfig<kHeadDim, __nv_bfloat16>;
        if constexpr (Config::kAvailable) return hopper_dq_accum_cols<Config>(head_dim);
        else return kHeadDim;
    });
}

// fp16 and bf16 configs have the same tiles, so the bf16 ones answer for both.
int sm80_fwd_smem_bytes(const FwdParams& params) {
    return FLASH_HEADDIM_SWITCH(params.d_rounded, kHeadDim, [&] {
        return fwd_smem_bytes<FwdConfig<kHeadDim, __nv_bfloat16>>(params.smem_per_block_optin, params.smem_per_sm);
    });
}

int sm80_bwd_smem_bytes(const FwdParams& params) {
    return FLASH_HEADDIM_SWITCH(params.d_rounded, kHeadDim, [&] {
        return bwd_smem_bytes<BwdConfig<kHeadDim, __nv_bfloat16>>(params.smem_per_block_optin);
    });
}

int bwd_block_n(int head_dim_rounded) {
    return FLASH_HEADDIM_SWITCH(head_dim_rounded, kHeadDim, [&] { return BwdConfig<kHeadDim, __nv_bfloat16>::Traits::kBlockN; });
}

cudaError_t run_mha_bwd(const BwdParams& params, cudaStream_t stream) {
    if (!bwd_head_dim_supported(params.d_rounded)) return cudaErrorNotSupported;
    return FLASH_DTYPE_SWITCH(params.is_bf16, Element, [&] {
        return FLASH_HEADDIM_SWITCH(params.d_rounded, kHeadDim, [&] { return run_mha_bwd_<Element, kHeadDim>(params, stream); });
    });
}

}  // namespace flash
