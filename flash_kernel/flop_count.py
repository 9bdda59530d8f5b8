"""FLOP formulas for flash_kernel's custom ops, registered with torch.utils.flop_counter, so that
FlopCounterMode (and Lightning's measure_flops, built on it) count our kernel as it counts PyTorch's own fused
attention: the forward's QKᵀ and PV, 4·B·Hq·Tq·Tk·D, and the backward's recompute of QKᵀ plus its four
gradient matmuls, 10·B·Hq·Tq·Tk·D (FA2 paper section 4.1: backward = 2.5 × forward). Every query head counts
(GQA shares k and v, not the work) and causal masking is not halved, as torch's sdpa formulas do.

torch's formulas take (B, H, T, D) shapes; the ops take (B, T, H, D), and (B, T, 3, H, D) for the packed pair.

The varlen ops count only the work that is not masked: per sequence, the (query, key) pairs its causal mask and
window leave visible (varlen_visible_pairs), times 4·Hq·D forward and 10·Hq·D backward. That reads cu_seqlens, so
on tensors without values (meta, fake) it counts the upper bound total_q · max_seqlen_k pairs instead.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

FWD_FLOPS_PER_PAIR = 4  # per (query, key) pair, head and head-dim column: Q Kᵀ and P V, a multiply-add each
BWD_FLOPS_PER_PAIR = 10  # Q Kᵀ recomputed, dV, dP, dQ, dK: 2.5 × the forward (FA2 paper section 4.1)


def _bhtd(shape) -> tuple[int, int, int, int]:
    B, T, H, D = shape
    return B, H, T, D


def _unpack(qkv_shape) -> tuple[tuple, tuple, tuple]:
    B, T, _, H, D = qkv_shape  # (B, T, 3, H, D)
    return ((B, T, H, D),) * 3


def _per_query_head(kv_shape, q_shape) -> tuple[int, int, int, int]:
    """k or v as torch's formulas count it: one head per query head (GQA shares k and v, not the work; torch's
    sdpa formulas refuse fewer K/V heads than Q heads)."""
    B, T, _, D = kv_shape
    return B, T, q_shape[2], D


def _fwd_count(q_shape, k_shape, v_shape) -> int:
    k_shape, v_shape = _per_query_head(k_shape, q_shape), _per_query_head(v_shape, q_shape)
    return sdpa_flop_count(_bhtd(q_shape), _bhtd(k_shape), _bhtd(v_shape))


def _bwd_count(do_shape, q_shape, k_shape, v_shape) -> int:
    k_shape, v_shape = _per_query_head(k_shape, q_shape), _per_query_head(v_shape, q_shape)
    return sdpa_backward_flop_count(_bhtd(do_shape), _bhtd(q_shape), _bhtd(k_shape), _bhtd(v_shape))


@register_flop_formula(torch.ops.flash_kernel.fwd)
def fwd_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _fwd_count(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.flash_kernel.bwd)
def bwd_flop(do_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _bwd_count(do_shape, q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.flash_kernel.fwd_qkvpacked)
def fwd_qkvpacked_flop(qkv_shape, *args, out_shape=None, **kwargs) -> int:
    return _fwd_count(*_unpack(qkv_shape))


@register_flop_formula(torch.ops.flash_kernel.bwd_qkvpacked)
def bwd_qkvpacked_flop(do_shape, qkv_shape, *args, out_shape=None, **kwargs) -> int:
    return _bwd_count(do_shape, *_unpack(qkv_shape))


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window_left: int = -1, window_right: int = -1) -> int:
    """The (query, key) pairs a sequence's mask leaves visible: query i sees keys max(0, i + off - left) ..
    min(Tk - 1, i + off + right), off = Tk - Tq (bottom-right alignment), -1 unbounded, causal making right 0."""
    right = 0 if causal else window_right
    rows = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)  # (Tq,) aligned query positions
    lo = torch.zeros_like(rows) if window_left < 0 else (rows - window_left).clamp_min(0)
    hi = torch.full_like(rows, seqlen_k - 1) if right < 0 else (rows + right).clamp_max(seqlen_k - 1)
    return int((hi - lo + 1).clamp_min(0).sum())


def varlen_visible_pairs(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, max_seqlen_k: int,
                         causal: bool, window_left: int, window_right: int) -> int:
    """Sum over the sequences of visible_pairs; total_q * max_seqlen_k where cu_seqlens hold no values."""
    if cu_seqlens_q.device.type == "meta" or isinstance(cu_seqlens_q, torch._subclasses.FakeTensor):
        return total_q * max_seqlen_k
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return sum(visible_pairs(bounds_q[s + 1] - bounds_q[s], bounds_k[s + 1] - bounds_k[s], causal, window_left,
                             window_right) for s in range(len(bounds_q) - 1))


@register_flop_formula(torch.ops.flash_kernel.varlen_fwd, get_raw=True)
def varlen_fwd_flop(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, *args, out_val=None, **kwargs) -> int:
    total_q, Hq, D = q.shape
    pairs = varlen_visible_pairs(cu_seqlens_q, cu_seqlens_k, total_q, max_seqlen_k, causal, window_left, window_right)
    return FWD_FLOPS_PER_PAIR * Hq * D * pairs


@register_flop_formula(torch.ops.flash_kernel.varlen_bwd, get_raw=True)
def varlen_bwd_flop(do, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, *args, out_val=None, **kwargs) -> int:
    total_q, Hq, D = q.shape
    pairs = varlen_visible_pairs(cu_seqlens_q, cu_seqlens_k, total_q, max_seqlen_k, causal, window_left, window_right)
    return BWD_FLOPS_PER_PAIR * Hq * D * pairs
