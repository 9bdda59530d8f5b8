"""The GELU MLP, proj(gelu(fc(x))), with fc's bias and GELU in fc's matmul and GELU's gradient in proj's
input-gradient matmul: cuBLASLt's epilogues (model.gelu_epilogue; flash_kernel/csrc/gelu_gemm.cu), as NVIDIA's
Transformer Engine runs its LayerNormMLP.

    forward:   G, H = linear_gelu(X, W1, b1)       G = gelu(X W1^T + b1), H = X W1^T + b1    (M, d_ff) each
               Y = G W2^T + b2                                                               (M, C)
    backward:  dH, db1 = linear_dgelu(dY, W2, H)   dH = (dY W2) · gelu'(H), db1 = Σ_rows dH
               dX = dH W1,  dW1 = dH^T X,  dW2 = dY^T G,  db2 = Σ_rows dY

Elsewhere the MLP's GELU is a pass of its own over the (tokens, d_ff) activations each way: the forward reads
fc's output and writes G, and the backward reads H and dG and writes dH. Here the epilogues apply GELU to the fp32
accumulator and write G and H (the backward's input) as the matmul's outputs, and multiply proj's fp32 dG by
gelu'(H) before dH is written, so dG is never written at all. db1 stays a sum over dH, as in the unfused backward
(flash_kernel/csrc/gelu_gemm.cu says why not cuBLASLt's bias-gradient epilogue). GELU is the tanh approximation
throughout (F.gelu(approximate="tanh"), GPT-2's and GPT-3's).

The product, the GELU and its gradient come out rounded once from fp32, where the unfused MLP rounds fc's output
(and dG) to bf16 before the GELU (its gradient) reads it; the weight gradients and db2 round as autocast's do (or
stay fp32 with model.fp32_weight_grad).

It runs on a GPU under bf16/fp16 autocast (or on bf16/fp16 weights), with the extension built and widths that are
multiples of 8; elsewhere, and under dispatch modes (FlopCounterMode counts the unfused matmuls), the MLP runs
unfused. The ops also run on the CPU, in plain PyTorch with the same roundings, for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from flash_kernel import interface
from model.linear import LOW_PRECISION, mm_fp32

ALIGN = 8  # cuBLASLt's epilogues: leading dimensions of the 16-bit matrices in multiples of 8 elements (16 bytes)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("fa2_gpt::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), weight (N, K), bias (N,) -> (gelu(x weight^T + bias), x weight^T + bias), each (M, N)."""
    if x.is_cuda:
        g, h = interface._load_C().linear_gelu(x, weight, bias)
        return g, h
    acc = _accumulator(x.dtype)
    h = torch.addmm(bias.to(acc), x.to(acc), weight.to(acc).t())  # (M, N)
    return F.gelu(h, approximate="tanh").to(x.dtype), h.to(x.dtype)


@linear_gelu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("fa2_gpt::linear_dgelu", mutates_args=())
def linear_dgelu(dy: torch.Tensor, weight: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (M, C), weight (C, N), h (M, N) -> (dh = (dy weight) · gelu'(h) (M, N), dh summed over its rows (N,))."""
    if dy.is_cuda:
        dh, db = interface._load_C().linear_dgelu(dy, weight, h)
        return dh, db
    acc = _accumulator(dy.dtype)
    dh = torch.ops.aten.gelu_backward(dy.to(acc) @ weight.to(acc), h.to(acc), approximate="tanh").to(dy.dtype)
    return dh, dh.sum(0)  # (M, N), (N,): the sum of the rounded dh, as on the GPU


@linear_dgelu.register_fake
def _(dy: torch.Tensor, weight: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return dy.new_empty((dy.shape[0], weight.shape[1])), dy.new_empty((weight.shape[1],))


def _weight_grad(dy: torch.Tensor, x: torch.Tensor, fp32: bool) -> torch.Tensor:
    """dy (M, out)^T x (M, in) -> (out, in): in fp32 out of the matmul, or rounded to the operands' dtype."""
    return mm_fp32(dy.t(), x) if fp32 else dy.t() @ x


class GeluMLP(torch.autograd.Function):
    """proj(gelu(fc(x))) in `dtype` with fc's bias and GELU, and GELU's gradient, in the matmuls' epilogues."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None,
                dtype: torch.dtype, fp32_weight_grad: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()  # (M, C)
        w1h, w2h = w1.to(dtype), w2.to(dtype)  # (d_ff, C), (C, d_ff)
        g, h = torch.ops.fa2_gpt.linear_gelu(x2, w1h, b1.to(dtype))  # (M, d_ff) each
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(g, w2h, None if b2 is None else b2.to(dtype))  # (M, C)
        ctx.save_for_backward(x2, w1h, w2h, g, h)
        ctx.x_shape, ctx.x_dtype, ctx.fp32_weight_grad = x.shape, x.dtype, fp32_weight_grad
        ctx.param_dtypes = (w1.dtype, b1.dtype, w2.dtype, None if b2 is None else b2.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w1h, w2h, g, h = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(g.dtype).contiguous()  # (M, C)
        needs = ctx.needs_input_grad
        w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.param_dtypes
        fp32 = ctx.fp32_weight_grad
        dx = dw1 = db1 = dw2 = db2 = None
        if needs[0] or needs[1] or needs[2]:
            dh, db1 = torch.ops.fa2_gpt.linear_dgelu(dy2, w2h, h)  # (M, d_ff), (d_ff,)
            if needs[0]:
                dx = (dh @ w1h).view(ctx.x_shape).to(ctx.x_dtype)  # (..., C)
            if needs[1]:
                dw1 = _weight_grad(dh, x2, fp32).to(w1_dtype)  # (d_ff, C)
            db1 = db1.to(b1_dtype) if needs[2] else None
        if needs[3]:
            dw2 = _weight_grad(dy2, g, fp32).to(w2_dtype)  # (C, d_ff)
        if b2_dtype is not None and needs[4]:
            db2 = (dy2.sum(0, dtype=torch.float32) if fp32 else dy2.sum(0)).to(b2_dtype)  # (C,)
        return dx, dw1, db1, dw2, db2, None, None


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype the MLP's matmuls run in for this input (autocast's, else the weight's), or None."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    else:
        dtype = weight.dtype
    return dtype if dtype in LOW_PRECISION else None


def unavailable_reason() -> str | None:
    """Why this process cannot run the epilogue matmuls (no GPU, no extension build, a build without them), or None."""
    reason = interface.unavailable_reason()
    if reason is None and not hasattr(interface._load_C(), "linear_gelu"):
        reason = ("the flash_kernel extension was built without flash_kernel/csrc/gelu_gemm.cu "
                  "(`make build` rebuilds it)")
    return reason


def available() -> bool:
    """Whether this process can run the epilogue matmuls: a GPU, and an extension build that has them."""
    return unavailable_reason() is None


def runs_here(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether gelu_mlp() fuses for this input (where available() holds): on a GPU in 16-bit, widths in multiples
    of ALIGN, outside dispatch modes."""
    return (x.is_cuda and compute_dtype(x, w1) is not None and not w1.shape[0] % ALIGN and not w1.shape[1] % ALIGN
            and (torch.compiler.is_compiling() or not is_in_torch_dispatch_mode()))


def gelu_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None,
             fp32_weight_grad: bool = False) -> torch.Tensor:
    """x (..., C) -> proj(gelu(fc(x))) (..., C) by GeluMLP: fc's weight w1 (d_ff, C) and bias b1 (d_ff,), proj's
    weight w2 (C, d_ff) and bias b2 (C,) or None. Call it where available() and runs_here() say so."""
    return GeluMLP.apply(x, w1, b1, w2, b2, compute_dtype(x, w1), fp32_weight_grad)
