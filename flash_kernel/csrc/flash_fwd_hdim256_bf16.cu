// Explicit instantiation: forward, head dim 256, bf16 (one file per instantiation: parallel ninja build).
#include "flash_fwd_launch_template.cuh"

namespace flash {
template cudaError_t run_mha_fwd_<__nv_bfloat16, 256>(const FwdParams& params, cudaStream_t stream);
}  // namespace flash
