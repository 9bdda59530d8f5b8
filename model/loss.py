"""The training objective, shared by the LightningModule and the benchmarks' bare loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.cross_entropy import cross_entropy

LOSSES = ("torch", "fused")  # the `loss` key: F.cross_entropy on float32 logits, or model/cross_entropy.py


def check_loss(name: str) -> None:
    if name not in LOSSES:
        raise ValueError(f"loss={name!r} is not one of {', '.join(LOSSES)}")


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """Mean cross-entropy over every position: logits (B, T, V) in any dtype, targets (B, T) token ids.

    Computed in fp32 (the bf16 logits of a 50k vocabulary would round the log-probabilities). impl="torch":
    F.cross_entropy on an fp32 copy; eager, this materializes the fp32 logits and their gradient; under
    torch.compile (compile=true) the cast, the log-softmax and its backward fuse into kernels that read the bf16
    logits. impl="fused": model/cross_entropy.py, the same numbers without the fp32 copy, compiled or not; the
    logits are the model's output, read by this loss alone, so the backward writes their gradient over them
    (not when they are a leaf tensor: a caller's own data stays untouched).
    """
    if impl == "torch":
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    check_loss(impl)
    return cross_entropy(logits.flatten(0, 1), targets.flatten(), inplace_backward=not logits.is_leaf)
