"""The fused cross-entropy's two passes in PyTorch, a chunk of rows at a time: what runs off CUDA, and the
algorithm of the Triton kernels (model/cross_entropy_kernel.py) with the same arguments and outputs.

forward_rows:  lse_i = log Σ_j exp(x_ij) in float32; loss_i = lse_i - x_i,t_i (0 where t_i = ignore_index).
backward_rows: dx_ij = (exp(x_ij - lse_i) - [j = t_i]) · dloss_i (0 where t_i = ignore_index), in x's dtype.
Each chunk upcasts at most CHUNK_ELEMENTS logits to float32, so memory beyond the logits stays bounded.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 22  # float32 logits per chunk: 16 MiB of temporaries, whatever N and V


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def check_target_range(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ValueError naming the first target outside [0, V) that is not ignore_index (a host sync: the
    Triton kernels skip it and give such rows a NaN loss instead)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"targets[{row}] = {int(targets[row])} is outside the vocabulary [0, {vocab}) of the logits (N, V) and "
            f"is not ignore_index={ignore_index}; the targets must be token ids of the model's vocabulary"
        )


@torch.no_grad()
def forward_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                 losses: torch.Tensor, lse: torch.Tensor) -> None:
    """logits (N, V) any float dtype, targets (N,) -> losses (N,) and lse (N,), float32, written in place."""
    n_rows, vocab = logits.shape
    check_target_range(targets, vocab, ignore_index)
    valid = targets != ignore_index  # (N,)
    safe = torch.where(valid, targets, 0)  # (N,) a gatherable column on ignored rows
    step = _rows_per_chunk(vocab)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        x = logits[rows].float()  # (n, V)
        lse_c = torch.logsumexp(x, dim=-1)  # (n,)
        x_t = x.gather(1, safe[rows, None]).squeeze(1)  # (n,)
        losses[rows] = torch.where(valid[rows], lse_c - x_t, 0.0)
        lse[rows] = lse_c


@torch.no_grad()
def backward_rows(dlosses: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                  ignore_index: int, dlogits: torch.Tensor) -> None:
    """dlosses (N,) float32, logits (N, V), targets (N,), lse (N,) -> dlogits (N, V) in logits' dtype, written in
    place; dlogits may be logits itself (each chunk is read before it is overwritten)."""
    n_rows, vocab = logits.shape
    valid = targets != ignore_index  # (N,)
    safe = torch.where(valid, targets, 0)  # (N,)
    step = _rows_per_chunk(vocab)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        p = torch.exp(logits[rows].float() - lse[rows, None])  # (n, V) softmax
        p.scatter_add_(1, safe[rows, None], -valid[rows, None].float())  # - onehot(t) on valid rows
        dloss = torch.where(valid[rows], dlosses[rows].float(), 0.0)  # (n,)
        dlogits[rows] = (p * dloss[:, None]).to(dlogits.dtype)
