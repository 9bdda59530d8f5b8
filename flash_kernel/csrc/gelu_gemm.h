// The GELU MLP's matmuls with the GELU in cuBLASLt's epilogues (gelu_gemm.cu; model/gelu_mlp.py calls them).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

// x (M, K), weight (N, K), bias (N,) -> (gelu(x weight^T + bias), x weight^T + bias), each (M, N).
std::tuple<at::Tensor, at::Tensor> linear_gelu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// dy (M, C), weight (C, N), pre (M, N) -> ((dy weight) * gelu'(pre) (M, N), its sum over the M rows (N,)).
std::tuple<at::Tensor, at::Tensor> linear_dgelu(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& pre);
