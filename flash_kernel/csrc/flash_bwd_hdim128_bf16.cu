// Explicit instantiation: backward, head dim 128, bf16 (one file per instantiation: parallel ninja build).
#include "flash_bwd_launch_template.cuh"

namespace flash {
template cudaError_t run_mha_bwd_<__nv_bfloat16, 128>(const BwdParams& params, cudaStream_t stream);
}  // namespace flash
