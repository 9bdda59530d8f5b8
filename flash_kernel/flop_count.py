"""FLOP formulas for flash_kernel's custom ops, registered with torch.utils.flop_counter, so that
FlopCounterMode (and Lightning's measure_flops, built on it) count our kernel as it counts PyTorch's own fused
attention: the forward's QKᵀ and PV, 4·B·Hq·Tq·Tk·D, and the backward's recompute of QKᵀ plus its four
gradient matmuls, 10·B·Hq·Tq·Tk·D (FA2 paper section 4.1: backward = 2.5 × forward). Every query head counts
(GQA shares k and v, not the work) and causal masking is not halved, as torch's sdpa formulas do.

torch's formulas take (B, H, T, D) shapes; the ops take (B, T, H, D), and (B, T, 3, H, D) for the packed pair.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count


def _bhtd(shape) -> tuple[int, int, int, int]:
    B, T, H, D = shape
    return B, H, T, D


def _unpack(qkv_shape) -> tuple[tuple, tuple, tuple]:
    B, T, _, H, D = qkv_shape  # (B, T, 3, H, D)
    return ((B, T, H, D),) * 3


def _fwd_count(q_shape, k_shape, v_shape) -> int:
    return sdpa_flop_count(_bhtd(q_shape), _bhtd(k_shape), _bhtd(v_shape))


def _bwd_count(do_shape, q_shape, k_shape, v_shape) -> int:
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
