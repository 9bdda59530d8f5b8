"""A decoder-only transformer: GPT-2/GPT-3 (Radford et al. 2019; Brown et al. 2020, Table 2.1 shapes) by
default, and the pieces of current open models (Llama, Touvron et al. 2023) as config options.

Token embeddings, pre-norm blocks with a fused qkv projection, a final norm, and an output head tied to the
token embedding. Each option's default is GPT-3's:

- n_kv_head: key/value heads; fewer than n_head is grouped-query attention (GQA, Ainslie et al. 2023), one is
  multi-query attention (Shazeer 2019). The fused projection produces H query heads then Hkv key and Hkv value
  heads, and the attention receives them unrepeated.
- pos_emb: learned position embeddings, or rotary embeddings on q and k (RoPE, Su et al. 2021; the
  rotate-half form of GPT-NeoX) with base rope_base, their cos and sin made once for the whole context
  (GPT.rope_rotation reads them).
- norm: LayerNorm, or RMSNorm (Zhang & Sennrich 2019). mlp: GELU, or SwiGLU (Shazeer 2020), whose gate and
  up projections are one matmul. bias: biases in every Linear and LayerNorm.

RoPE and SwiGLU come from model/fusion.py: RoPE as a compiled kernel when the model runs eagerly on a GPU, SwiGLU by
Triton kernels of its own on a GPU in every mode (model/swiglu_kernel.py); fused_add_norm and fused_bias_gelu take two
more of its kernels: each residual add with the norm that reads the sum (ln_1 of the next block, ln_2, ln_f), and the
GELU MLP's bias with its GELU. fp32_weight_grad has every Linear's weight gradient written in fp32 by its matmul
(model/linear.py). gelu_epilogue, on a GPU, puts the GELU MLP's fc bias and GELU in fc's matmul and GELU's gradient
in proj's input-gradient matmul (model/gelu_mlp.py), ahead of fused_bias_gelu where both are set.

The attention core is pluggable (model/attention.py) and receives q, k, v as (B, T, H, D) views of the fused
projection, in the layout model/attention.py defines. A KVCache makes the forward incremental for generation.

Attention is causal; `window` narrows it to a sliding window (Mistral-style local attention), and a forward
given cu_seqlens (the batch's documents, data/windows.py) keeps each token's attention inside its document,
its position counting from the document's start when reset_position_ids (README, "Document masking").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.attention import (AttentionMask, attention_mask, check_attention_supported, check_window,
                             document_positions, get_attention, get_qkvpacked_attention)
from model.fusion import apply_add_layer_norm, apply_add_rms_norm, apply_bias_gelu, apply_rope, apply_swiglu
from model import gelu_mlp
from model.linear import Linear, linear

# Embedding and logits matmuls run faster when the vocabulary is a multiple of 64 (nanoGPT: 50257 -> 50304).
VOCAB_MULTIPLE = 64
INIT_STD = 0.02  # GPT-2 initialisation
POS_EMBS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")


class ModelConfigError(ValueError):
    """A model config that cannot be built; the message names the model.* key to change."""


class ContextLengthError(ValueError):
    """More tokens than the model's context (seq_len) holds."""


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # the tokenizer's; the model pads it up to VOCAB_MULTIPLE
    seq_len: int = 1024  # context length (the position embedding's size when pos_emb is learned)
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"
    activation_checkpointing: bool = False
    # Under autocast the residual stream runs in the autocast dtype (bf16), as Megatron-LM's default
    # (fp32_residual_connection=False); true keeps it in fp32, as autocast alone would (fp32 embeddings).
    fp32_residual: bool = False
    n_kv_head: int | None = None  # key/value heads; None: n_head (multi-head attention)
    pos_emb: str = "learned"  # learned | rope
    rope_base: float = 10000.0  # RoPE's θ: channel pair i turns by position · θ^(-2i/D)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # gelu | swiglu
    d_ff: int | None = None  # MLP hidden width; None: mlp_ratio · d_model
    window: int | None = None  # sliding-window attention: keys left of each query it sees; None: all (attention.window)
    reset_position_ids: bool = True  # with documents, positions restart at each document's start
    fused_add_norm: bool = False  # each residual add with the norm after it in one kernel (model/fusion.py)
    fused_bias_gelu: bool = False  # the MLP's fc bias and GELU in one kernel (model/fusion.py); GELU MLPs with biases
    fp32_weight_grad: bool = False  # weight gradients written in fp32 by the matmul, no cast kernel (model/linear.py)
    gelu_epilogue: bool = False  # on a GPU the GELU MLP's fc bias + GELU and GELU's gradient in the matmuls (model/gelu_mlp.py)

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ModelConfigError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ModelConfigError(
                f"model.n_head={self.n_head} is not a multiple of model.n_kv_head={self.n_kv_head}: each key/value "
                f"head serves a whole group of query heads; pick n_kv_head among the divisors of {self.n_head}"
            )
        for key, value, valid in (("pos_emb", self.pos_emb, POS_EMBS), ("norm", self.norm, NORMS), ("mlp", self.mlp, MLPS)):
            if value not in valid:
                raise ModelConfigError(f"model.{key}={value!r} is not one of {', '.join(valid)}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ModelConfigError(
                f"model.pos_emb=rope rotates pairs of channels, so the head dim must be even, but "
                f"d_model/n_head = {self.d_model}/{self.n_head} = {self.head_dim}; change model.n_head or model.d_model"
            )
        gelu_fusions = [name for name in ("fused_bias_gelu", "gelu_epilogue") if getattr(self, name)]
        if gelu_fusions and (self.mlp != "gelu" or not self.bias):
            one = len(gelu_fusions) == 1
            raise ModelConfigError(
                f"{' and '.join(f'model.{name}=true' for name in gelu_fusions)} fuse{'s' if one else ''} the fc bias "
                f"and GELU of a GELU MLP, but model.mlp={self.mlp} and model.bias={str(self.bias).lower()}; "
                f"{'it' if one else 'each'} needs mlp=gelu and bias=true (or add "
                f"{' '.join(f'model.{name}=false' for name in gelu_fusions)}: the gpt3-1.3b and gpt3-2.7b presets "
                f"turn {'it' if one else 'them'} on)"
            )
        try:
            check_window(self.window)
        except ValueError as err:
            raise ModelConfigError(str(err)) from None
        check_attention_supported(self.attention, self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or self.mlp_ratio * self.d_model

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def packs_qkv(cfg: GPTConfig) -> bool:
    """Whether the blocks hand the fused projection whole, (B, T, 3, H, D), to the attention's qkv-packed form
    (model/attention.py): where it has one, for H key/value heads that RoPE does not rotate, without a window.
    (A forward with documents passes q, k, v views too.)"""
    return (get_qkvpacked_attention(cfg.attention) is not None and cfg.kv_heads == cfg.n_head
            and cfg.pos_emb == "learned" and cfg.window is None)


def _norm_in_input_dtype(norm, x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
    """norm(x, *params) outside autocast, with the params cast to x's dtype (see LayerNorm)."""
    with torch.autocast(x.device.type, enabled=False):
        return norm(x, *(p.to(x.dtype) if p is not None else None for p in params))


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that returns its input's dtype under autocast.

    Autocast runs layer_norm in fp32 whatever its input, and the matmul after it casts the fp32 output
    back to bf16: two more passes over every normalized activation, forward and backward. PyTorch's kernel
    accumulates mean and variance in fp32 for a bf16 input anyway, so on the bf16 residual stream this runs
    it outside autocast with weight and bias cast to bf16 (as autocast casts every matmul weight) and
    writes bf16 directly; an fp32 input (fp32_residual=true) stays fp32. Under autocast this path is taken
    whatever the weights' dtype: with the bf16 weights FSDP gathers, autocast would still write fp32.
    Outside autocast it is nn.LayerNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        return _norm_in_input_dtype(
            lambda x, w, b: F.layer_norm(x, self.normalized_shape, w, b, self.eps), x, self.weight, self.bias
        )

    def add_and_norm(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + branch, self(x + branch)) in one compiled kernel where model/fusion.py compiles."""
        return apply_add_layer_norm(x, branch, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that returns its input's dtype, as LayerNorm above: a bf16 input with an fp32 weight would
    miss PyTorch's fused kernel (which accumulates in fp32 for a bf16 input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        return _norm_in_input_dtype(lambda x, w: F.rms_norm(x, self.normalized_shape, w, self.eps), x, self.weight)

    def add_and_norm(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + branch, self(x + branch)) in one compiled kernel where model/fusion.py compiles."""
        return apply_add_rms_norm(x, branch, self.weight, self.eps)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's rotation for each position (T,) or (B, T): cos and sin, each (..., T, D/2), computed in fp32 and
    returned in `dtype`."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (T, D/2) or (B, T, D/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding: each forward appends
    its T tokens' k and v and attends its queries to everything cached (causal, aligned bottom-right)."""

    def __init__(self, cfg: GPTConfig, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (cfg.n_layer, batch_size, max_len, cfg.kv_heads, cfg.head_dim)  # (L, B, T, Hkv, D) each
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # tokens cached; the next token's position

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, T, Hkv, D) after the cached tokens; return every cached key and value (B, length + T, Hkv, D)."""
        end = self.length + k.shape[1]
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.layer = layer  # its slot in a KVCache
        # q: H heads, k and v: Hkv heads each, in one matmul; with Hkv = H the layout is (3, H, D) as before GQA
        self.qkv = Linear(cfg.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=cfg.bias,
                          fp32_weight_grad=cfg.fp32_weight_grad)
        self.proj = Linear(cfg.d_model, cfg.d_model, bias=cfg.bias, fp32_weight_grad=cfg.fp32_weight_grad)
        self.proj.is_residual_out = True
        self.dropout = nn.Dropout(cfg.dropout)
        self.attn_fn = get_attention(cfg.attention)
        # None: attn_fn gets q, k, v views
        self.attn_qkvpacked = get_qkvpacked_attention(cfg.attention) if packs_qkv(cfg) else None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, cache: KVCache | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x)  # (B, T, (H + 2·Hkv)·D)
        if self.attn_qkvpacked is not None and cache is None and mask is None:
            # One input, so autograd gets one (B, T, 3, H, D) gradient, not three views' to concatenate.
            o = self.attn_qkvpacked(qkv.view(B, T, 3, H, D), causal=True)  # (B, T, H, D)
        else:
            q, k, v = qkv.view(B, T, H + 2 * Hkv, D).split((H, Hkv, Hkv), dim=2)  # strided views, (B, T, H|Hkv, D)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if cache is not None:
                k, v = cache.update(self.layer, k, v)  # (B, Tc + T, Hkv, D)
            o = self.attn_fn(q, k, v, causal=True, mask=mask)  # (B, T, H, D)
        return self.dropout(self.proj(o.reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.fused_bias_gelu = cfg.fused_bias_gelu
        self.gelu_epilogue = cfg.gelu_epilogue and gelu_mlp.available()  # else the options below, on any device
        # SwiGLU's gate and up projections are one matmul: fc's output is [gate | up]
        self.fc = Linear(cfg.d_model, (2 if self.swiglu else 1) * cfg.ffn_dim, bias=cfg.bias,
                         fp32_weight_grad=cfg.fp32_weight_grad)
        self.proj = Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias, fp32_weight_grad=cfg.fp32_weight_grad)
        self.proj.is_residual_out = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_epilogue and gelu_mlp.runs_here(x, self.fc.weight):  # (B, T, C) -> (B, T, C), one function
            fc, proj = self.fc, self.proj
            return self.dropout(gelu_mlp.gelu_mlp(x, fc.weight, fc.bias, proj.weight, proj.bias, fc.fp32_weight_grad))
        if self.fused_bias_gelu:  # the bias added in the GELU's kernel, not the matmul's epilogue
            h = apply_bias_gelu(linear(x, self.fc.weight, None, self.fc.fp32_weight_grad), self.fc.bias)  # (B, T, d_ff)
        else:
            h = self.fc(x)  # (B, T, d_ff) or (B, T, 2·d_ff)
            h = apply_swiglu(h) if self.swiglu else F.gelu(h, approximate="tanh")  # (B, T, d_ff)
        return self.dropout(self.proj(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.fused_add_norm = cfg.fused_add_norm

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, cache: KVCache | None = None,
        mask: AttentionMask | None = None, pending: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C), the residual stream -> the stream after this block.

        With fused_add_norm the stream travels as two tensors, x + pending, and each sum is formed in the kernel of
        the norm that reads it (model/fusion.py): the block takes `pending`, the previous block's MLP output (None
        before the first block), and returns (x, its own MLP output) for the next block, or ln_f, to add."""
        if not self.fused_add_norm:
            x = x + self.attn(self.ln_1(x), rope, cache, mask)
            return x + self.mlp(self.ln_2(x))
        x, h = self.ln_1.add_and_norm(x, pending) if pending is not None else (x, self.ln_1(x))
        x, h = self.ln_2.add_and_norm(x, self.attn(h, rope, cache, mask))
        return x, self.mlp(h)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos_emb == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = Linear(cfg.d_model, cfg.padded_vocab_size, bias=False, fp32_weight_grad=cfg.fp32_weight_grad)
        self.lm_head.weight = self.wte.weight  # tied: counted once in the FLOP formula too
        if cfg.pos_emb == "rope":
            # RoPE's cos and sin for every position of the context (seq_len, D/2) each, fp32, computed once where
            # the model is made. Under torch.compile a rotation computed in forward is fused into every block's
            # RoPE kernel and recomputed there, forward and backward (Llama-1B at 8k on an H200: two such kernels,
            # 16 ms of a 263 ms step; bench/profile_step.py --pipeline --compile); tables are read instead.
            # Not persistent: no checkpoint holds them, and every checkpoint loads.
            cos, sin = rope_cos_sin(torch.arange(cfg.seq_len), cfg.head_dim, cfg.rope_base, torch.float32)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            # GPT-2: residual output projections scaled by 1/sqrt(2·L) so the residual stream's
            # variance does not grow with depth
            std = INIT_STD / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "is_residual_out", False) else INIT_STD
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def forward(
        self, idx: torch.Tensor, cache: KVCache | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, padded_vocab_size). With a cache, idx continues the cached
        tokens: its positions start at cache.length, and its keys and values are appended to the cache.
        With cu_seqlens ((n + 1,) int32 on idx's device: the documents of the B windows packed back to back,
        every window starting one; data/windows.py), attention stays inside each document."""
        B, T = idx.shape
        if cu_seqlens is not None and cache is not None:
            raise ValueError("documents (cu_seqlens) apply to a training forward, not to decoding with a KV cache")
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ContextLengthError(f"{start} cached + {T} new tokens exceed the KV cache's {cache.max_len}")
        if start + T > self.cfg.seq_len:
            advice = ("generate fewer tokens" if cache is not None else
                      f"set seq_len={start + T} (it sets both the model context and the data windows)")
            raise ContextLengthError(
                f"input has {start + T} tokens but the model's context holds seq_len={self.cfg.seq_len}; {advice}"
            )
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        if cu_seqlens is not None and self.cfg.reset_position_ids:
            pos = document_positions(cu_seqlens, B, T)  # (B, T): 0 at each document's first token
        mask = attention_mask(self.cfg.attention, B, T, start + T, idx.device, self.cfg.window, cu_seqlens)
        x = self.wte(idx)  # (B, T, C), fp32
        if self.wpe is not None:
            x = x + self.wpe(pos)
        x = self.drop(x)
        device = idx.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype  # the matmuls'
        if not self.cfg.fp32_residual and dtype != x.dtype:
            # Every branch output is bf16 under autocast; an fp32 stream makes each residual add, LayerNorm
            # and their gradients read and write fp32, and casts in between. GPT3-1.3B on an H100, 16k tokens:
            # 314.7 -> 289.1 ms per step at 2k, 382.1 -> 356.1 at 8k (bench/profile_step.py).
            x = x.to(dtype)
        rope = self.rope_rotation(pos, start, dtype) if self.cfg.pos_emb == "rope" else None
        pending = None  # with fused_add_norm: the last block's MLP output, not yet added to x (Block.forward)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training:
                # recompute each block in backward: trades ~1/3 more compute for O(L) fewer activations
                out = checkpoint(block, x, rope, None, mask, pending, use_reentrant=False)
            else:
                out = block(x, rope, cache, mask, pending)
            x, pending = out if self.cfg.fused_add_norm else (out, None)
        if cache is not None:
            cache.length += T
        h = self.ln_f(x) if pending is None else self.ln_f.add_and_norm(x, pending)[1]
        return self.lm_head(h)  # (B, T, V)

    def rope_rotation(self, pos: torch.Tensor, start: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin in `dtype` for positions start.. ((T,): rows of the tables) or for document positions
        ((B, T): gathered), each (T, D/2) or (B, T, D/2); cast once here for every block."""
        rows = pos if pos.dim() == 2 else slice(start, start + pos.shape[0])
        return self.rope_cos[rows].to(dtype), self.rope_sin[rows].to(dtype)

    def num_params(self, exclude_position_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weight counted once by parameters()
        return n - self.wpe.weight.numel() if exclude_position_embedding and self.wpe is not None else n
