"""Linear layers whose weight gradient the matmul writes in fp32 (model.fp32_weight_grad).

Under bf16 autocast a Linear with fp32 weights casts the weight to bf16 for the matmul, so the backward's weight
gradient comes out of the matmul in bf16 and the cast's backward converts it to fp32 in a kernel of its own: one
more read of every weight's gradient in bf16 and a write in fp32 per step (2 + 4 bytes a parameter, 7.8 GB for
GPT3-1.3B; by its bytes, the 7.6 ms copy kernel of its 325 ms step at 2 × 8k in bench/profile_step.py's table on
an H200, docs/results.md section 12). Here the weight-gradient matmul writes fp32 itself (cuBLAS accumulates in
fp32 either way; torch.mm's out_dtype keeps the result unrounded), so the conversion kernel goes, and each
gradient loses its rounding to bf16. The forward is autocast's, the same bf16 matmul on the same operands, and the
input's gradient is a bf16 matmul as under autocast.

It runs where autocast's conversion kernel runs, and nothing else changes: eager, on a GPU, under fp16/bf16
autocast, with fp32 weights that take a gradient. Compiled regions trace the plain F.linear (whether the function
pays under Inductor, which places the cast itself, is not measured), and so do dispatch modes (FlopCounterMode
counts the plain matmuls); FSDP's gathered bf16 weights take the plain path.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

LOW_PRECISION = (torch.bfloat16, torch.float16)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32 for bf16/fp16 a and b: cuBLAS's fp32 output on a GPU; elsewhere
    the same product of the upcast operands."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class LinearFp32WeightGrad(torch.autograd.Function):
    """F.linear(x, weight, bias) in `dtype` (as autocast runs it) whose gradients for the fp32 weight and bias
    are fp32 out of the matmul and the sum, not bf16 converted afterwards."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
        x16, w16 = x.to(dtype), weight.to(dtype)  # (..., in), (out, in)
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x16, w16, None if bias is None else bias.to(dtype))  # (..., out)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x16, w16 = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(w16.dtype)  # (N, out)
        x2 = x16.reshape(-1, x16.shape[-1])  # (N, in)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ w16).view(x16.shape).to(ctx.x_dtype)  # (..., in)
        if ctx.needs_input_grad[1]:
            dw = mm_fp32(dy2.t(), x2)  # (out, in) fp32
        if ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32)  # (out,)
        return dx, dw, db, None


def takes_fp32_weight_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear() runs LinearFp32WeightGrad: eager, on a GPU, under low-precision autocast, for an fp32
    weight that takes a gradient (see the module's docstring)."""
    return (x.device.type == "cuda" and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") in LOW_PRECISION and weight.dtype == torch.float32
            and weight.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not is_in_torch_dispatch_mode())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp32_weight_grad: bool = False) -> torch.Tensor:
    """F.linear, with fp32_weight_grad through LinearFp32WeightGrad where takes_fp32_weight_grad says so."""
    if fp32_weight_grad and takes_fp32_weight_grad(x, weight):
        return LinearFp32WeightGrad.apply(x, weight, bias, torch.get_autocast_dtype("cuda"))
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (the same parameters and names) whose forward is linear() with its fp32_weight_grad."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 fp32_weight_grad: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fp32_weight_grad = fp32_weight_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp32_weight_grad)
