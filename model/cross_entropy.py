"""Cross-entropy over (N, V) logits read in their own dtype (bf16, fp16 or fp32), float32 inside: the same
value and gradient as F.cross_entropy on the float32-upcast logits, without the float32 copy of the logits,
their log-softmax and its gradient (three N × V float32 tensors; 3.3 GB each for GPT3-1.3B's 2 × 8k tokens).

The forward keeps 2 float32 numbers a row (loss and log-sum-exp); the backward recomputes the softmax from the
log-sum-exp and writes dlogits = (softmax - onehot(target)) · dloss in the logits' dtype, with
inplace_backward=True into the logits' own buffer (flash-attn's ops/triton/cross_entropy.py does the same).
That is chosen over Liger-Kernel's gradient-in-the-forward: both read the logits twice and write them once, but
Liger's must scale its gradient by the incoming one afterwards (another pass, or a host sync to skip it when it
is 1), while here the backward loads the incoming gradient, a number per row, inside the kernel.

CUDA tensors run the Triton kernels (model/cross_entropy_kernel.py); other devices run the same passes in
PyTorch, a chunk of rows at a time (model/cross_entropy_reference.py), which also checks the target range.
Under torch.compile the function is a graph break (torch.compiler.disable): it runs as its own kernels
between compiled graphs, so nothing traces the in-place backward (functionalizing it would clone the logits).
"""

from __future__ import annotations

import torch

from model import cross_entropy_reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCTIONS = ("mean", "sum", "none")


def _passes(device: torch.device):
    """(forward_rows, backward_rows) for tensors on `device`."""
    if device.type == "cuda":
        from model import cross_entropy_kernel  # Triton: imported only where it runs

        return cross_entropy_kernel.forward_rows, cross_entropy_kernel.backward_rows
    return cross_entropy_reference.forward_rows, cross_entropy_reference.backward_rows


class CrossEntropyRows(torch.autograd.Function):
    """logits (N, V), targets (N,) -> losses (N,) float32, 0 at ignore_index rows."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, inplace_backward: bool):
        forward_rows, _ = _passes(logits.device)
        n_rows = logits.shape[0]
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)  # (N,)
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)  # (N,)
        forward_rows(logits, targets, ignore_index, losses, lse)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index, ctx.inplace_backward, ctx.used = ignore_index, inplace_backward, False
        return losses

    @staticmethod
    def backward(ctx, dlosses: torch.Tensor):
        if ctx.used and ctx.inplace_backward:
            raise RuntimeError(
                "cross_entropy(inplace_backward=True) wrote its gradient over the logits in the first backward, "
                "so it cannot run a second one (retain_graph=True); call it with inplace_backward=False"
            )
        ctx.used = True
        logits, targets, lse = ctx.saved_tensors
        _, backward_rows = _passes(logits.device)
        dlogits = logits if ctx.inplace_backward else torch.empty_like(logits)  # (N, V)
        backward_rows(dlosses.float(), logits, targets, lse, ctx.ignore_index, dlogits)
        return dlogits, None, None, None


def check_inputs(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> None:
    """Raise ValueError naming the tensor and what it must be."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"cross_entropy: logits must be (N, V) with V >= 1, got shape {tuple(logits.shape)}; "
                         "flatten the batch and time dimensions first")
    if logits.dtype not in DTYPES:
        raise ValueError(f"cross_entropy: logits dtype {logits.dtype} is not one of bfloat16, float16, float32")
    if targets.shape != logits.shape[:1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cross_entropy: targets must be ({logits.shape[0]},) int64 or int32 token ids for logits "
                         f"{tuple(logits.shape)}, got {tuple(targets.shape)} {targets.dtype}")
    if targets.device != logits.device:
        raise ValueError(f"cross_entropy: targets are on {targets.device} but logits on {logits.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")


@torch.compiler.disable
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                  inplace_backward: bool = False) -> torch.Tensor:
    """F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction), float32, without
    the float32 copy. logits (N, V) bf16/fp16/fp32, targets (N,) token ids. "mean" divides by the rows whose
    target is not ignore_index (NaN when there are none, as torch). With inplace_backward=True the backward
    writes the gradient over `logits` (so nothing else may read them afterwards) and allocates nothing."""
    check_inputs(logits, targets, reduction)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    if targets.data_ptr() % 16:  # x[:, 1:] with B = 1: flash-attn saw Triton misread int64 at unaligned addresses
        targets = targets.clone()
    with torch.autocast(logits.device.type, enabled=False):
        losses = CrossEntropyRows.apply(logits, targets, ignore_index, inplace_backward)  # (N,) float32
        if reduction == "none":
            return losses
        if reduction == "sum":
            return losses.sum()
        return losses.sum() / (targets != ignore_index).sum()
