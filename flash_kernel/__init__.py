"""flash_kernel: a from-scratch FlashAttention-2 (Dao, 2023) CUDA extension and its PyTorch face.

- `flash_attn_func(q, k, v, causal=True, softmax_scale=None, deterministic=False, window_size=(-1, -1))`: (B, T, H, D) attention
  on CUDA via the custom ops `flash_kernel::fwd` / `flash_kernel::bwd` (interface.py);
- `flash_attn_qkvpacked_func(qkv, ...)`: the same on a fused projection's qkv (B, T, 3, H, D), whose gradient
  the backward writes as one tensor;
- `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`: packed
  variable-length sequences, each attending only within itself (FlashAttention's varlen layout); every entry takes
  `window_size=(left, right)`, sliding-window attention; `cu_seqlens_to(cu_seqlens, device, total, max_seqlen)`
  moves a host-built cu_seqlens to the GPU with its values checked on the host, so the ops do not wait to check them;
- `is_available()` / `unavailable_reason()`: whether the compiled `flash_kernel._C` can run here;
- `flash_kernel.reference`: the same tiled algorithm in PyTorch, CPU-runnable (reference_fwd/bwd/attn_func),
  and `naive_attention`, the materialised-softmax oracle the tests compare against.

Importing this package never needs CUDA or the built extension; `_C` is loaded on first use.
`KERNEL_VERSION` names the kernels' version in docs/CHANGELOG.md; benchmark rows record it.
"""

KERNEL_VERSION = "v59"  # docs/CHANGELOG.md: bump with every change that moves the kernels' numbers

from flash_kernel.interface import (
    check_bwd_inputs,
    check_inputs,
    check_values_of_cu_seqlens,
    check_varlen_inputs,
    cu_seqlens_to,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    is_available,
    unavailable_reason,
)
from flash_kernel import flop_count  # noqa: F401  (registers the ops' FLOP formulas with torch.utils.flop_counter)
from flash_kernel.reference import naive_attention, reference_attn_func, reference_bwd, reference_fwd

__all__ = [
    "KERNEL_VERSION",
    "check_bwd_inputs",
    "check_inputs",
    "check_values_of_cu_seqlens",
    "check_varlen_inputs",
    "cu_seqlens_to",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "is_available",
    "naive_attention",
    "reference_attn_func",
    "reference_bwd",
    "reference_fwd",
    "unavailable_reason",
]
