"""The training objective, shared by the LightningModule and the benchmarks' bare loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (B, T, V) in any dtype, targets (B, T) token ids.

    Computed in fp32 (the bf16 logits of a 50k vocabulary would round the log-probabilities). Eager, this
    materializes the fp32 logits and their gradient; under torch.compile (compile=true) the cast, the
    log-softmax and its backward fuse into kernels that read the bf16 logits.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
