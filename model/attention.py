"""The attention implementations a GPT block can run, one function each, picked by config name.

Every function has the same signature and layout:

    fn(q, k, v, causal=True, softmax_scale=None, mask=None) -> o
    q: (B, Tq, Hq, D)   k, v: (B, Tk, Hkv, D) with Hq % Hkv == 0   o: (B, Tq, Hq, D)

(B, T, H, D) is flash-attn's layout: the model hands over strided views of its fused qkv projection
with no transpose or copy. When Tq != Tk, causal masking is aligned bottom-right, as in flash-attn:
query i sees keys j <= i + Tk - Tq.

mask, an AttentionMask that attention_mask() prepares once per forward for every layer, narrows causal
attention further, with the same semantics in every implementation:
  - a sliding window (attention.window = w): query i sees keys i - w ... i (FlashAttention's window_size
    (w, 0), after the bottom-right alignment);
  - documents (data.document_mask): the batch's windows hold documents packed back to back, described by
    cu_seqlens (FlashAttention's varlen layout over the B·T tokens, data/windows.py); query i sees key j only
    when both lie in one document.
Each implementation reads the form it runs fastest with: flash the cu_seqlens and the window size, flex a
BlockMask, naive and sdpa a dense (B, 1, Tq, Tk) boolean mask.

- naive: the textbook QKᵀ -> mask -> softmax -> PV. It really materializes the (B, H, Tq, Tk) score
  matrix; it is the baseline that runs out of memory at long context (FA2 paper, Figure 5).
- sdpa:  torch.nn.functional.scaled_dot_product_attention with PyTorch's own backend choice
  (cuDNN or FA2 on Hopper, the C++ math kernel on CPU). With a mask it takes an explicit boolean mask,
  which rules PyTorch's flash backend out and computes every tile before masking it: the slow path.
- flex:  PyTorch's FlexAttention (torch.nn.attention.flex_attention) with a block mask (causal, window,
  documents), compiled on a GPU; eager (a reference computation) on a CPU.
- flash: this repository's compiled FlashAttention-2 kernel (flash_kernel/); with documents, the whole batch
  in one call of its varlen function.
- flash_reference: the same tiled FA2 algorithm in PyTorch (flash_kernel/reference.py); slow, CPU-
  runnable, used to test the model wiring where no GPU is present (causal only: no mask).

An implementation may also have a qkv-packed form, fn(qkv, causal=True, softmax_scale=None) -> o with
qkv (B, T, 3, H, D) the fused projection itself; the model calls it when it exists and no mask applies
(get_qkvpacked_attention). flash has one: its backward writes dq, dk and dv into one gradient tensor,
where the three views' gradients would be stacked by autograd (a copy per layer).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as flex


class AttentionFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = True,
        softmax_scale: float | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor: ...


@dataclass
class AttentionMask:
    """What narrows causal attention besides causality, prepared once per forward and shared by every layer
    (see the module docstring); each implementation reads its own fields. Built by attention_mask()."""

    window: int | None = None  # keys left of each query that it sees, besides itself; None: all of them
    cu_seqlens: torch.Tensor | None = None  # flash: (n + 1,) int32, the documents of the packed B·T tokens
    dense: torch.Tensor | None = None  # naive, sdpa: (B or 1, 1, Tq, Tk) bool, True where query i sees key j
    block_mask: Any = None  # flex: torch.nn.attention.flex_attention.BlockMask of the same rule


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(
            f"attention.window={window!r} must be null (full causal attention) or an integer >= 0 (the keys left of "
            "each query that it sees: query i attends keys i - window ... i)"
        )


def _causal_mask(t_q: int, t_k: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """True where query i may attend key j (bottom-right aligned): j <= i + (Tk - Tq), and with a window
    j >= i + (Tk - Tq) - window. Shape (Tq, Tk). The kernel's own rule (flash_kernel.reference.visible_keys)."""
    from flash_kernel.reference import visible_keys

    return visible_keys(t_q, t_k, True, (-1 if window is None else window, 0), device)


def document_ids(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """cu_seqlens (n + 1,) of B windows of T tokens packed -> (B, T) int64: each token's document index (unique
    over the batch). Empty sequences (the padding data/windows.py adds) own no token."""
    tokens = torch.arange(batch * seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens, tokens, right=True) - 1  # (B·T,): the last boundary at or before it
    return doc.view(batch, seq_len)


def document_positions(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """(B, T) int64: each token's position within its document (0 at every document start)."""
    doc = document_ids(cu_seqlens, batch, seq_len).reshape(-1)  # (B·T,)
    tokens = torch.arange(batch * seq_len, device=cu_seqlens.device)
    return (tokens - cu_seqlens.long()[doc]).view(batch, seq_len)


def _dense_mask(t_q: int, t_k: int, window: int | None, doc: torch.Tensor | None, device) -> torch.Tensor:
    """(B or 1, 1, Tq, Tk) bool: causal, windowed, and within one document (doc: (B, T) document ids)."""
    visible = _causal_mask(t_q, t_k, device, window)[None, None]  # (1, 1, Tq, Tk)
    if doc is not None:
        visible = visible & (doc[:, None, :, None] == doc[:, None, None, :])  # (B, 1, T, T)
    return visible


@functools.cache
def _create_block_mask_compiled() -> Callable[..., Any]:
    # Compiled, create_block_mask evaluates mask_mod block by block instead of materializing (B, Tq, Tk);
    # a new mask_mod closure over new document ids each step does not recompile (torchtitan does the same).
    return torch.compile(flex.create_block_mask)


@torch.compiler.disable  # built once per forward outside the model's graph; flex_attention inside reads it
def _flex_block_mask(batch: int | None, t_q: int, t_k: int, window: int | None, doc: torch.Tensor | None, device):
    offset = t_k - t_q  # bottom-right alignment

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset
        visible = kv_idx <= q_pos
        if window is not None:
            visible = visible & (q_pos - kv_idx <= window)
        if doc is not None:
            visible = visible & (doc[b, q_idx] == doc[b, kv_idx])
        return visible

    create = _create_block_mask_compiled() if torch.device(device).type == "cuda" else flex.create_block_mask
    return create(mask_mod, batch if doc is not None else None, None, t_q, t_k, device=device)


def attention_mask(
    name: str, batch: int, t_q: int, t_k: int, device: torch.device, window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> AttentionMask | None:
    """The mask `name` reads for causal attention of Tq queries over Tk keys with this window and documents
    (cu_seqlens of the B windows packed; documents need Tq == Tk), or None where plain causal attention is
    all there is (flex always gets a block mask)."""
    check_window(window)
    if window is None and cu_seqlens is None and name != "flex":
        return None
    if cu_seqlens is not None and t_q != t_k:
        raise ValueError(f"document masks apply to whole windows (Tq == Tk), not {t_q} queries over {t_k} keys")
    if name == "flash":
        return AttentionMask(window=window, cu_seqlens=cu_seqlens)
    if name == "flash_reference":
        raise ValueError("attention=flash_reference runs plain causal attention only: use naive, sdpa, flex or flash "
                         "for attention.window or data.document_mask")
    doc = document_ids(cu_seqlens, batch, t_q) if cu_seqlens is not None else None
    if name == "flex":
        block_mask = (_flex_block_mask(batch, t_q, t_k, window, doc, device) if doc is not None
                      else _flex_causal_block_mask(t_q, t_k, window, torch.device(device)))
        return AttentionMask(window=window, block_mask=block_mask)
    return AttentionMask(window=window, dense=_dense_mask(t_q, t_k, window, doc, device))


@torch.compiler.disable  # outside the graph, as _flex_block_mask: dynamo would trace past the cache
@functools.lru_cache(maxsize=16)
def _flex_causal_block_mask(t_q: int, t_k: int, window: int | None, device: torch.device):
    """flex's block mask without documents: the same every step for one shape, so built once per shape."""
    return _flex_block_mask(None, t_q, t_k, window, None, device)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention for the implementations that lack it: (B, T, Hkv, D) -> (B, T, Hkv*n_rep, D)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


def naive_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                    mask: AttentionMask | None = None) -> torch.Tensor:
    n_rep = q.shape[2] // k.shape[2]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    scores = (q_ @ k_.transpose(-2, -1)) * scale  # (B, H, Tq, Tk): the T×T matrix, on purpose
    if mask is not None:
        scores = scores.masked_fill(~mask.dense, float("-inf"))  # (B or 1, 1, Tq, Tk) broadcast over heads
    elif causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    # softmax in at least fp32 like every serious baseline; a row with no visible key gives 0/0, zeroed
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    probs = probs.nan_to_num(0.0).to(q.dtype)
    return (probs @ v_).transpose(1, 2)  # (B, Tq, H, D)


def sdpa_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                   mask: AttentionMask | None = None) -> torch.Tensor:
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D) views, no copy
    t_q, t_k = q.shape[1], k.shape[1]
    gqa = q.shape[2] != k.shape[2]
    if mask is not None:
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask.dense, scale=softmax_scale, enable_gqa=gqa)
    elif causal and t_q != t_k:
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


@functools.cache
def _flex_attention_compiled() -> Callable[..., torch.Tensor]:
    # Eager flex_attention computes the whole score matrix (a reference); compiled it is the fused Triton kernel.
    return torch.compile(flex.flex_attention, dynamic=False)


def flex_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                   mask: AttentionMask | None = None) -> torch.Tensor:
    if mask is None and causal:
        mask = attention_mask("flex", q.shape[0], q.shape[1], k.shape[1], q.device)
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D) views, no copy
    block_mask = mask.block_mask if mask is not None else None
    if q.is_cuda:
        # Inside a compiled model, flex_attention compiles with the graph; outside, through its own compile.
        run = flex.flex_attention if torch.compiler.is_compiling() else _flex_attention_compiled()
        o = run(q_, k_, v_, block_mask=block_mask, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    else:
        with warnings.catch_warnings():  # eager is what a CPU runs (tests, sampling): no advice to compile
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o = flex.flex_attention(q_, k_, v_, block_mask=block_mask, scale=softmax_scale,
                                    enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)  # (B, Tq, H, D)


def flash_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                    mask: AttentionMask | None = None) -> torch.Tensor:
    kernel = _flash_kernel()
    if mask is None:
        return kernel.flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale)
    window_size = (-1 if mask.window is None else mask.window, 0 if causal else -1)
    if mask.cu_seqlens is None:
        return kernel.flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    B, T, H, D = q.shape
    # The batch's windows are one packed sequence of documents: (B·T, H, D) views, no copy.
    o = kernel.flash_attn_varlen_func(
        q.reshape(B * T, H, D), k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]),
        mask.cu_seqlens, mask.cu_seqlens, T, T,  # no document is longer than its window
        causal=causal, softmax_scale=softmax_scale, window_size=window_size,
    )  # (B·T, H, D)
    return o.view(B, T, H, D)


def flash_attention_qkvpacked(qkv, causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    """flash on qkv (B, T, 3, H, D) -> o (B, T, H, D); the gradient comes back as one (B, T, 3, H, D) tensor."""
    return _flash_kernel().flash_attn_qkvpacked_func(qkv, causal=causal, softmax_scale=softmax_scale)


def flash_reference_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                              mask: AttentionMask | None = None) -> torch.Tensor:
    from flash_kernel.reference import reference_attn_func

    if mask is not None:
        raise ValueError("attention=flash_reference runs plain causal attention only (no window, no documents)")
    return reference_attn_func(q, k, v, causal, softmax_scale)


ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "flex": flex_attention,
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
    """Fail before any work where the config cannot run `name`: an unknown name, flex or flash off a CUDA GPU,
    flash without its built extension or outside bf16/fp16. accelerator: "gpu" or "cpu"; precision: Lightning's."""
    get_attention(name)
    if name == "flex" and accelerator != "gpu":
        raise ValueError(
            f"attention=flex trains on a CUDA GPU only (PyTorch's FlexAttention has no backward on a CPU), but "
            f"trainer.accelerator={accelerator}; use attention=sdpa or attention=naive here"
        )
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
