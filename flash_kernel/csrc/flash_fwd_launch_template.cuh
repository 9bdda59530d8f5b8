// Launch of the forward kernel for one (dtype, head dim); included by the flash_fwd_hdim*.cu files.
#pragma once

#include "flash_fwd_kernel.cuh"
#include "flash_launch.h"
#include "static_switch.h"

namespace flash {

constexpr int kDefaultSmemBytes = 48 * 1024;  // dynamic shared memory above this needs an opt-in

template <typename Element, int kHeadDim>
cudaError_t run_mha_fwd_(const FwdParams& params, cudaStream_t stream) {
    using Traits = typename FwdConfig<kHeadDim, Element>::Traits;
    return FLASH_BOOL_SWITCH(params.is_causal, kIsCausal, [&]() -> cudaError_t {
        auto kernel = &flash_fwd_kernel<Traits, kIsCausal>;
        constexpr int kSmem = Traits::kSmemBytes;
        if (kSmem > kDefaultSmemBytes) {
            FLASH_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
        }
        // Alg. 1 line 3: one thread block per (query block, head, batch).
        const dim3 grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.h, params.b);
        kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
        FLASH_LAUNCH_CHECK();
        return cudaSuccess;
    });
}

}  // namespace flash
