"""RoPE, the residual add with the norm after it, and bias-GELU, compiled into fused kernels when the model runs
eagerly on a GPU; SwiGLU by Triton kernels of its own (model/swiglu_kernel.py) on a GPU.

Eager PyTorch runs each as a chain of kernels over strided views of a fused projection's output. RoPE on q and k,
views of the qkv matmul's output, takes the two halves of the head dim, four products, a difference, a sum and a
concatenation; SwiGLU multiplies SiLU of one half of the fc matmul's output by the other half, and its backward
concatenates the two halves' gradients. PyTorch's elementwise kernels vectorize only contiguous operands, so on the
views they take their strided path. On Llama-1B at 2 × 8k, eager, these casts, copies and strided kernels take 53 ms
of a 294 ms step (one H200, docs/results.md section 7), for flash and sdpa alike.

SwiGLU takes Triton kernels of its own on a GPU (model/swiglu_kernel.py), in every mode: eager, and under a
whole-model compile, which calls them as they are (a torch.library op), with or without a gradient to follow.
torch.compile (2.11) lowers SwiGLU's backward, the concatenation of the two halves' gradients, as a pointwise cat,
each half from its own expression; the kernel computes both halves from one read of its inputs, in half the time
(docs/results.md section 26).

A residual add and the norm that reads its sum (model.fused_add_norm: the next block's ln_1, ln_2, ln_f), and the
MLP's bias with the GELU after it (model.fused_bias_gelu), are separate passes in eager PyTorch: the add writes the
stream that the norm reads back, and the bias rides in the fc matmul's epilogue but its gradient is a reduction of
its own that reads the GELU's gradient back. Compiled, the sum and its norm come out of one kernel, and the bias's
gradient can be reduced in the pass that computes the GELU's. Both options are off in GPTConfig and
conf/model/_base.yaml, and on in the GPT3-1.3B and 2.7B presets (conf/model/); the Llama preset turns on the first.

torch.compile turns each chain into one kernel that reads the views where they lie and writes its output once (and
one for the backward). The functions here are compiled on their own, as model/attention.py compiles flex_attention,
so an eager run gets those kernels without compiling the model. Under a whole-model torch.compile (compile=true) the
plain functions are traced into the model's graph instead, and tensors off the GPU run them as they are.
The compiled kernels compute in fp32 and round once, where eager bf16 rounds after each op.

They run only where a gradient follows (training steps); validation and sampling run the plain functions. Dynamo
compiles a function anew for each grad mode, dtype and shape it has not seen (a no-grad call is a graph of its own;
sampling's shapes change with every token against a growing cache), and at its recompile limit (8 per function) a
fullgraph compile raises. A process that still reaches the limit (many models in one process, as the test suite
makes) gets a warning, and the function runs plain from then on.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

COMPILED_DEVICES = ("cuda",)  # the device types whose tensors take the compiled kernels
TRITON_DEVICES = ("cuda",)  # the device types whose tensors take model/swiglu_kernel.py's kernels


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by position: channel i pairs with i + D/2 (GPT-NeoX's rotate-half layout); cos and sin
    (T, D/2) or (B, T, D/2) -> (B, T, H, D)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, D/2) each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, D/2) or (B, T, 1, D/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h (..., 2·F) = [gate | up] -> SiLU(gate) · up (..., F) (Shazeer 2020)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn compiled on its own (fullgraph: one graph, no fallback to eager inside it)."""
    return torch.compile(fn, fullgraph=True)


def runs_compiled(x: torch.Tensor) -> bool:
    """Whether fn(x, ...) takes the compiled kernel: x on a GPU with a gradient to follow, outside a compiled region
    (whose graph traces the plain function) and outside dispatch modes (FlopCounterMode, which sees the plain ops)."""
    return (x.device.type in COMPILED_DEVICES and torch.is_grad_enabled() and x.requires_grad
            and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode())


_past_recompile_limit: set[Callable[..., torch.Tensor]] = set()  # functions that run plain from now on


def fused(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn, run compiled where runs_compiled says so and plain everywhere else."""

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        if runs_compiled(x) and fn not in _past_recompile_limit:
            try:
                return compiled(fn)(x, *args)
            except FailOnRecompileLimitHit:  # raised before the compiled code runs: nothing to undo
                _past_recompile_limit.add(fn)
                warnings.warn(f"model/fusion.py: {fn.__name__} reached torch._dynamo's recompile limit "
                              f"(torch._dynamo.config.recompile_limit = {torch._dynamo.config.recompile_limit}) "
                              "and runs as plain PyTorch from now on in this process", stacklevel=2)
        return fn(x, *args)

    return run


def add_layer_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x (B, T, C) plus a block's branch output, and LayerNorm of that sum: (x + branch,
    layer_norm(x + branch)), both in x's dtype. As model/gpt.py's LayerNorm, the norm runs outside autocast with its
    parameters cast to the stream's dtype (on a bf16 stream it writes bf16, not autocast's fp32)."""
    x = x + branch
    with torch.autocast(x.device.type, enabled=False):
        return x, F.layer_norm(x, x.shape[-1:], weight.to(x.dtype), None if bias is None else bias.to(x.dtype), eps)


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_layer_norm with RMSNorm: (x + branch, rms_norm(x + branch))."""
    x = x + branch
    with torch.autocast(x.device.type, enabled=False):
        return x, F.rms_norm(x, x.shape[-1:], weight.to(x.dtype), eps)


def bias_gelu(h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation, GPT-2's) of the fc matmul's output h (..., F) plus its bias (F,), cast to h's dtype
    as autocast casts a Linear's bias; the bias's gradient is the sum of the GELU's over every token."""
    return F.gelu(h + bias.to(h.dtype), approximate="tanh")


def apply_swiglu(h: torch.Tensor) -> torch.Tensor:
    """swiglu(h) by model/swiglu_kernel.py's Triton kernels for a tensor on a GPU (eager or inside a whole-model
    compile, with or without a gradient to follow), by the plain function elsewhere."""
    if h.device.type in TRITON_DEVICES:
        from model import swiglu_kernel  # Triton: imported only where it runs

        return swiglu_kernel.swiglu(h)
    return swiglu(h)


apply_rope = fused(rope)
apply_add_layer_norm = fused(add_layer_norm)
apply_add_rms_norm = fused(add_rms_norm)
apply_bias_gelu = fused(bias_gelu)
