"""The fused cross-entropy's two passes as Triton kernels, for CUDA tensors; the same arguments, outputs and
algorithm as model/cross_entropy_reference.py.

Forward, one program per row: the online softmax (Milakov & Gimelshein 2018, as FlashAttention's m_i, l_i)
walks the row in FWD_BLOCK_V blocks, reading each logit once in its own dtype and accumulating in float32:
    m_new = max(m_i, max_j x_j);  l_i = l_i · exp(m_i - m_new) + Σ_j exp(x_j - m_new);  lse = m_i + log l_i,
then loss = lse - x_t. Backward, one program per (row, BWD_BLOCK_V block): dx = (exp(x - lse) - [j = t]) · dloss,
stored in the logits' dtype, possibly over the logits themselves (each program reads its block before writing it).
No N × V float32 buffer exists at any point.

A valid target outside [0, V) is not checked (that would be a host sync): its row's loss is NaN, which the
training loop's NaN guard reports.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Logits per loop step of the forward: 16k walks a 50k vocabulary in 4 steps. The backward's 4k blocks give
# N · 13 programs at V = 50304, enough to fill every SM. Warps: one per LOGITS_PER_WARP logits of a block (32
# float32 registers a thread), so 16 for the forward, 4 for the backward, fewer for a small vocabulary.
FWD_BLOCK_V = 16384
BWD_BLOCK_V = 4096
LOGITS_PER_WARP = 1024


@triton.jit
def cross_entropy_fwd_kernel(
    loss_ptr, lse_ptr, logits_ptr, targets_ptr,
    stride_logits_row, V, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride_logits_row
    m_i = -float("inf")
    l_i = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)  # (BLOCK_V,)
        m_new = tl.maximum(m_i, tl.max(x, axis=0))
        # While every logit so far is -inf, shift by 0 instead: exp(-inf - -inf) would be NaN.
        m_shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_shift) + tl.sum(tl.exp(x - m_shift), axis=0)
        m_i = m_new
    lse = m_i + tl.log(l_i)
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    x_t = tl.load(logits_ptr + target, mask=valid & (target >= 0) & (target < V), other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def cross_entropy_bwd_kernel(
    dlogits_ptr, dloss_ptr, logits_ptr, lse_ptr, targets_ptr,
    stride_logits_row, stride_dlogits_row, stride_dloss, V, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    mask = cols < V
    target = tl.load(targets_ptr + row).to(tl.int64)
    dloss = tl.where(target != ignore_index, tl.load(dloss_ptr + row * stride_dloss), 0.0)
    lse = tl.load(lse_ptr + row)
    x = tl.load(logits_ptr + row * stride_logits_row + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x - lse)  # softmax
    dx = tl.where(cols == target, p - 1.0, p) * dloss
    tl.store(dlogits_ptr + row * stride_dlogits_row + cols, dx.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return max(1, block // LOGITS_PER_WARP)


def forward_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                 losses: torch.Tensor, lse: torch.Tensor) -> None:
    """logits (N, V) with unit column stride, targets (N,) contiguous -> losses (N,), lse (N,) float32."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return
    block = min(FWD_BLOCK_V, triton.next_power_of_2(vocab))
    with torch.cuda.device(logits.device):
        cross_entropy_fwd_kernel[(n_rows,)](
            losses, lse, logits, targets, logits.stride(0), vocab, ignore_index,
            BLOCK_V=block, num_warps=_num_warps(block),
        )


def backward_rows(dlosses: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                  ignore_index: int, dlogits: torch.Tensor) -> None:
    """dlosses (N,) float32 (any stride, 0 included), logits (N, V), targets (N,), lse (N,) -> dlogits (N, V) in
    logits' dtype; dlogits may be logits itself."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return
    block = min(BWD_BLOCK_V, triton.next_power_of_2(vocab))
    with torch.cuda.device(logits.device):
        cross_entropy_bwd_kernel[(n_rows, triton.cdiv(vocab, block))](
            dlogits, dlosses, logits, lse, targets,
            logits.stride(0), dlogits.stride(0), dlosses.stride(0), vocab, ignore_index,
            BLOCK_V=block, num_warps=_num_warps(block),
        )
