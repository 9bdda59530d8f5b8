// The GELU MLP's two matmuls with the GELU in cuBLASLt's epilogues (model/gelu_mlp.py):
//   forward,  fc:              H = X W1^T + b1, G = gelu(H)   (GELU_AUX_BIAS: G is the output, H the auxiliary one)
//   backward, proj's dgrad:    dH = (dY W2) * gelu'(H)        (DGELU, reading H), then db1 = dH summed over rows
// GELU is the tanh approximation in both (GPT-2/3's, and F.gelu(approximate="tanh")). Each matmul accumulates in
// fp32 and applies its epilogue to the fp32 accumulator before rounding to the 16-bit output: the bias and GELU
// of the forward, the product with gelu'(H) of the backward, so the GELU and its gradient take no kernel, and no
// pass over the (tokens, d_ff) activations, of their own.
// db1 is a sum over dH, not DGELU_BGRAD's bias gradient: cuBLASLt runs that epilogue as a kernel of its own after
// the matmul (1.13 ms after a 0.71 ms matmul at GPT3-1.3B's 16k x 2048 x 8192 on an H200), and the MLP's forward and
// backward took 1.09 x the unfused MLP's time with it, 0.95 x with the sum (docs/results.md section 27).
//
// Host code only: no kernel is defined here, so the file builds with the extension's nvcc flags like the others.
// Row-major (M, N) tensors are column-major (N, M) matrices to cuBLASLt, so each product below is written
// transposed: D^T = op(A) op(B) with D^T (N, M).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include "gelu_gemm.h"

#include <tuple>

namespace {

#define FLASH_CUBLASLT_CHECK(expr)                                                                           \
    do {                                                                                                     \
        const cublasStatus_t status_ = (expr);                                                               \
        TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, #expr " failed with cuBLAS status ",                   \
                    static_cast<int>(status_));                                                              \
    } while (0)

// The descriptors of one call, destroyed on every path out.
struct LtDescriptors {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulPreference_t preference = nullptr;
    ~LtDescriptors() {
        if (preference) cublasLtMatmulPreferenceDestroy(preference);
        if (d) cublasLtMatrixLayoutDestroy(d);
        if (b) cublasLtMatrixLayoutDestroy(b);
        if (a) cublasLtMatrixLayoutDestroy(a);
        if (op) cublasLtMatmulDescDestroy(op);
    }
};

template <typename T>
void set_attribute(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attribute, const T& value) {
    FLASH_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(op, attribute, &value, sizeof(value)));
}

// Column-major D (m, n) = op(A) (m, k) op(B) (k, n) with `epilogue`, whose bias (or bias gradient) has m elements
// and whose auxiliary matrix is (m, n) with leading dimension m, like D.
void lt_matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
               const void* b, int64_t ldb, void* d, cudaDataType_t dtype, cublasLtEpilogue_t epilogue, void* bias,
               void* aux) {
    LtDescriptors desc;
    FLASH_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m);
    FLASH_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc.a, dtype, transpose_a ? k : m, transpose_a ? m : k, lda));
    FLASH_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc.b, dtype, transpose_b ? n : k, transpose_b ? k : n, ldb));
    FLASH_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc.d, dtype, m, n, m));

    const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
    void* workspace = at::cuda::getCUDABlasLtWorkspace();
    const uint64_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
    FLASH_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&desc.preference));
    FLASH_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &workspace_bytes, sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t heuristic = {};
    int found = 0;
    FLASH_CUBLASLT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d,
                                                        desc.preference, 1, &heuristic, &found));
    TORCH_CHECK(found > 0, "cuBLASLt has no algorithm for this matmul with epilogue ", static_cast<int>(epilogue),
                " (m ", m, ", n ", n, ", k ", k, ")");
    const float alpha = 1.0f, beta = 0.0f;
    FLASH_CUBLASLT_CHECK(cublasLtMatmul(handle, desc.op, &alpha, a, desc.a, b, desc.b, &beta, d, desc.d, d, desc.d,
                                        &heuristic.algo, workspace, workspace_bytes,
                                        at::cuda::getCurrentCUDAStream()));
}

cudaDataType_t cuda_dtype(const at::Tensor& t) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
                "the GELU epilogues take bf16 or fp16 tensors, got ", t.scalar_type());
    return t.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

void check_matrix(const at::Tensor& t, const char* name, at::ScalarType dtype, c10::Device device) {
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous matrix, got sizes ", t.sizes(),
                " and strides ", t.strides());
    TORCH_CHECK(t.scalar_type() == dtype && t.device() == device, name, " must be ", dtype, " on ", device, ", got ",
                t.scalar_type(), " on ", t.device());
    TORCH_CHECK(t.size(1) % 8 == 0, name, "'s rows must be a multiple of 8 elements (16-byte aligned), got ",
                t.size(1));
}

}  // namespace

// x (M, K), weight (N, K), bias (N,) -> (gelu(x weight^T + bias), x weight^T + bias), each (M, N).
std::tuple<at::Tensor, at::Tensor> linear_gelu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
    TORCH_CHECK(x.is_cuda(), "linear_gelu runs on a CUDA device");
    const cudaDataType_t dtype = cuda_dtype(x);
    check_matrix(x, "x", x.scalar_type(), x.device());
    check_matrix(weight, "weight", x.scalar_type(), x.device());
    TORCH_CHECK(weight.size(1) == x.size(1), "weight (N, K) must match x (M, K): ", weight.sizes(), " vs ", x.sizes());
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0) && bias.is_contiguous() &&
                    bias.scalar_type() == x.scalar_type() && bias.device() == x.device(),
                "bias must be a contiguous (N,) vector of x's dtype on x's device, got ", bias.sizes(), " ",
                bias.scalar_type());
    TORCH_CHECK(weight.size(0) % 8 == 0, "N must be a multiple of 8, got ", weight.size(0));
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    at::Tensor out = at::empty({M, N}, x.options());  // G
    at::Tensor pre = at::empty({M, N}, x.options());  // H
    if (M == 0) return {out, pre};
    // G^T (N, M) = W1 (N, K) . X^T (K, M): W1 is column-major (K, N), transposed; X^T is column-major (K, M).
    lt_matmul(true, false, N, M, K, weight.data_ptr(), K, x.data_ptr(), K, out.data_ptr(), dtype,
              CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias.data_ptr(), pre.data_ptr());
    return {out, pre};
}

// dy (M, C), weight (C, N) (proj's), pre (M, N) (H) -> (dH = (dy weight) * gelu'(pre) (M, N), db = dH summed over
// its M rows (N,)), both in dy's dtype.
std::tuple<at::Tensor, at::Tensor> linear_dgelu(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& pre) {
    TORCH_CHECK(dy.is_cuda(), "linear_dgelu runs on a CUDA device");
    const cudaDataType_t dtype = cuda_dtype(dy);
    check_matrix(dy, "dy", dy.scalar_type(), dy.device());
    check_matrix(weight, "weight", dy.scalar_type(), dy.device());
    check_matrix(pre, "pre", dy.scalar_type(), dy.device());
    TORCH_CHECK(weight.size(0) == dy.size(1) && pre.size(0) == dy.size(0) && pre.size(1) == weight.size(1),
                "dy (M, C), weight (C, N) and pre (M, N) disagree: ", dy.sizes(), ", ", weight.sizes(), ", ",
                pre.sizes());
    const c10::cuda::CUDAGuard guard(dy.device());
    const int64_t M = dy.size(0), C = dy.size(1), N = weight.size(1);
    at::Tensor dh = at::empty({M, N}, dy.options());
    if (M == 0) return {dh, at::zeros({N}, dy.options())};
    // dH^T (N, M) = W2^T (N, C) . dY^T (C, M): W2 is column-major (N, C); dY^T is column-major (C, M).
    lt_matmul(false, false, N, M, C, weight.data_ptr(), N, dy.data_ptr(), C, dh.data_ptr(), dtype,
              CUBLASLT_EPILOGUE_DGELU, nullptr, const_cast<void*>(pre.data_ptr()));
    return {dh, dh.sum(0)};  // fp32 accumulation, rounded to dy's dtype
}
