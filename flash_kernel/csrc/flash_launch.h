// Torch-free launch entry points. flash_api.cpp (the only file that sees torch) fills the params and
// passes the current stream; every function returns the first CUDA error (launch or attribute) so the
// binding can raise it with context, and never synchronizes.
#pragma once

#include <cuda_runtime.h>

#include "flash_params.h"

// Every launch is followed by this: report a bad configuration / launch failure to the caller.
#define FLASH_LAUNCH_CHECK()                              \
    do {                                                  \
        const cudaError_t flash_err_ = cudaGetLastError(); \
        if (flash_err_ != cudaSuccess) return flash_err_;  \
    } while (0)

#define FLASH_RETURN_IF_ERROR(expr)                       \
    do {                                                  \
        const cudaError_t flash_err_ = (expr);            \
        if (flash_err_ != cudaSuccess) return flash_err_;  \
    } while (0)

namespace flash {

#ifdef __CUDACC__
constexpr int kDefaultSmemBytes = 48 * 1024;  // dynamic shared memory above this needs an opt-in

// kernel<<<grid, threads, smem, stream>>>(args...), opting the kernel in to `smem` bytes of dynamic shared memory
// where that is above the default, and checked.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, int threads, int smem, cudaStream_t stream,
                          const Args&... args) {
    if (smem > kDefaultSmemBytes) {
        FLASH_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    kernel<<<grid, threads, smem, stream>>>(args...);
    FLASH_LAUNCH_CHECK();
    return cudaSuccess;
}
#endif

// One explicit instantiation per (dtype, head dim), each in its own .cu file so ninja builds them in
// parallel; the causal flag is switched inside (two kernels per file).
template <typename Element, int kHeadDim> cudaError_t run_mha_fwd_(const FwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim> cudaError_t run_mha_bwd_(const BwdParams& params, cudaStream_t stream);

// Dispatch on params.is_bf16 / params.d_rounded (flash_dispatch.cu).
cudaError_t run_mha_fwd(const FwdParams& params, cudaStream_t stream);
// Preprocess (delta; zeroes dq_accum), main backward, dQ convert. Caller provides dq_accum and delta.
cudaError_t run_mha_bwd(const BwdParams& params, cudaStream_t stream);

bool hopper_fwd_built(int head_dim_rounded);      // an sm_90a forward is compiled in for this head dim
bool hopper_bwd_built(int head_dim_rounded);      // an sm_90a backward is compiled in for this head dim
bool bwd_head_dim_supported(int head_dim_rounded);  // head dims with a backward instantiation
// Floats per dq_accum row where the Hopper backward runs head dim head_dim (BwdParams::dq_accum_cols; the sm80
// kernel's rows are head_dim_rounded floats).
int hopper_bwd_dq_accum_cols(int head_dim, int head_dim_rounded);
int bwd_block_n(int head_dim_rounded);              // keys per backward thread block (sizes num_splits)
// Whether the dense Hopper backward of this dtype reads BwdParams::ld_mma (FLASH_BWD_LD_IN_MMA, as the kernels were
// built), which the binding then makes.
bool hopper_bwd_ld_in_mma(bool is_bf16);
// Dynamic shared memory per thread block of the sm80 forward / main backward kernel that runs for params.d_rounded
// on a GPU with params' limits (a config's smaller variant where its Traits do not fit).
int sm80_fwd_smem_bytes(const FwdParams& params);
int sm80_bwd_smem_bytes(const FwdParams& params);

}  // namespace flash
