"""The attention implementations a GPT block can run, one function each, picked by config name.

Every function has the same signature and layout:

    fn(q, k, v, causal=True, softmax_scale=None) -> o
    q: (B, Tq, Hq, D)   k, v: (B, Tk, Hkv, D) with Hq % Hkv == 0   o: (B, Tq, Hq, D)

(B, T, H, D) is flash-attn's layout: the model hands over strided views of its fused qkv projection
with no transpose or copy. When Tq != Tk, causal masking is aligned bottom-right, as in flash-attn:
query i sees keys j <= i + Tk - Tq.

- naive: the textbook QKᵀ -> mask -> softmax -> PV. It really materializes the (B, H, Tq, Tk) score
  matrix; it is the baseline that runs out of memory at long context (FA2 paper, Figure 5).
- sdpa:  torch.nn.functional.scaled_dot_product_attention with PyTorch's own backend choice
  (cuDNN or FA2 on Hopper, the C++ math kernel on CPU).
- flash: this repository's compiled FlashAttention-2 kernel (flash_kernel/).
- flash_reference: the same tiled FA2 algorithm in PyTorch (flash_kernel/reference.py); slow, CPU-
  runnable, used to test the model wiring where no GPU is present.

An implementation may also have a qkv-packed form, fn(qkv, causal=True, softmax_scale=None) -> o with
qkv (B, T, 3, H, D) the fused projection itself; the model calls it when it exists
(get_qkvpacked_attention). flash has one: its backward writes dq, dk and dv into one gradient tensor,
where the three views' gradients would be stacked by autograd (a copy per layer).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F


class AttentionFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = True,
        softmax_scale: float | None = None,
    ) -> torch.Tensor: ...


def _causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """True where query i may attend key j (bottom-right aligned): j <= i + (Tk - Tq). Shape (Tq, Tk)."""
    i = torch.arange(t_q, device=device).unsqueeze(1)
    j = torch.arange(t_k, device=device).unsqueeze(0)
    return j <= i + (t_k - t_q)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention for the implementations that lack it: (B, T, Hkv, D) -> (B, T, Hkv*n_rep, D)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


def naive_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    n_rep = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    scores = (q_ @ k_.transpose(-2, -1)) * scale  # (B, H, Tq, Tk): the T×T matrix, on purpose
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    # softmax in at least fp32 like every serious baseline; a row with no visible key gives 0/0, zeroed
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    probs = probs.nan_to_num(0.0).to(q.dtype)
    return (probs @ v_).transpose(1, 2)  # (B, Tq, H, D)


def sdpa_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D) views, no copy
    t_q, t_k = q.shape[1], k.shape[1]
    gqa = q.shape[2] != k.shape[2]
    if causal and t_q != t_k:
        # is_causal in SDPA is top-left aligned; pass the bottom-right mask explicitly
        mask = _causal_mask(t_q, t_k, q.device)
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, scale=softmax_scale, enable_gqa=gqa)
    return o.transpose(1, 2)  # (B, Tq, H, D)


def _flash_kernel():
    """The flash_kernel package, or a RuntimeError that says how to get it built."""
    import flash_kernel

    if not flash_kernel.is_available():
        raise RuntimeError(
            f"attention=flash needs the compiled flash_kernel extension on a CUDA GPU, but: "
            f"{flash_kernel.unavailable_reason()}. Build it with `make build`, or pick attention=sdpa."
        )
    return flash_kernel


def flash_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    return _flash_kernel().flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale)


def flash_attention_qkvpacked(qkv, causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    """flash on qkv (B, T, 3, H, D) -> o (B, T, H, D); the gradient comes back as one (B, T, 3, H, D) tensor."""
    return _flash_kernel().flash_attn_qkvpacked_func(qkv, causal=causal, softmax_scale=softmax_scale)


def flash_reference_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    from flash_kernel.reference import reference_attn_func

    return reference_attn_func(q, k, v, causal, softmax_scale)


ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "flash_reference": flash_reference_attention,
}


def get_attention(name: str) -> Callable[..., torch.Tensor]:
    try:
        return ATTENTION[name]
    except KeyError:
        raise ValueError(f"unknown attention {name!r}; valid names: {', '.join(ATTENTION)}") from None


# The implementations with a qkv-packed form (see the module docstring).
QKVPACKED_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {"flash": flash_attention_qkvpacked}


def get_qkvpacked_attention(name: str) -> Callable[..., torch.Tensor] | None:
    """name's qkv-packed form, or None where the model should pass q, k, v views instead."""
    get_attention(name)
    return QKVPACKED_ATTENTION.get(name)


def check_attention_runs_on(name: str, head_dim: int, device: torch.device) -> None:
    """Fail before the first step where `name` cannot run at head_dim on this device: flash needs its built
    extension, and a GPU whose thread blocks get the shared memory of its smallest kernel configs (99 KiB or less,
    which every sm_80+ GPU gives; flash_kernel.interface.set_kernel_overrides can ask for less)."""
    if name != "flash" or device.type != "cuda":
        return
    import flash_kernel

    reason = flash_kernel.unavailable_reason(head_dim, device)
    if reason is not None:
        raise RuntimeError(f"attention=flash cannot run at head dim {head_dim} on {device}: {reason}")


def check_attention_supported(name: str, head_dim: int) -> None:
    """Fail at model construction, not at the first step, for a head dim an implementation lacks."""
    get_attention(name)
    # The flash kernel's head-dim contract, which flash_kernel/interface.py checks again at call time.
    from flash_kernel.interface import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM

    if name in ("flash", "flash_reference") and (head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE):
        raise ValueError(
            f"attention={name} supports head dims that are multiples of {HEAD_DIM_MULTIPLE} up to "
            f"{MAX_HEAD_DIM}, but this model has d_model/n_head = {head_dim}. Change model.n_head "
            f"or model.d_model, or use attention=sdpa."
        )


def check_attention(name: str, accelerator: str, precision: str) -> None:
    """Fail before any work where the config cannot run `name`: an unknown name, flash off a CUDA GPU or
    without its built extension, flash outside bf16/fp16. accelerator: "gpu" or "cpu"; precision: Lightning's."""
    get_attention(name)
    if name != "flash":
        return
    import flash_kernel

    if accelerator != "gpu" or not flash_kernel.is_available():
        why = f"trainer.accelerator={accelerator}" if accelerator != "gpu" else flash_kernel.unavailable_reason()
        raise ValueError(
            f"attention=flash needs the compiled kernel on a CUDA GPU, but: {why}. "
            "Build it with `make build` on a GPU machine, or use attention=sdpa."
        )
    if not str(precision).startswith(("bf16", "16")):
        raise ValueError(
            f"attention=flash runs in bf16/fp16, but trainer.precision={precision}; use trainer.precision=bf16-mixed"
        )
