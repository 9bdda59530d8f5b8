"""A GPT-2/GPT-3 style decoder (Radford et al. 2019; Brown et al. 2020, Table 2.1 shapes).

Token + learned position embeddings, pre-LayerNorm blocks with a fused qkv projection and a GELU MLP,
a final LayerNorm, and an output head tied to the token embedding. The attention core is pluggable
(model/attention.py) and receives q, k, v as (B, T, H, D) views of the fused projection: no transpose,
no copy (DESIGN.md, "Interfaces").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.attention import check_attention_supported, get_attention, get_qkvpacked_attention

# Embedding and logits matmuls run faster when the vocabulary is a multiple of 64 (nanoGPT: 50257 -> 50304).
VOCAB_MULTIPLE = 64
INIT_STD = 0.02  # GPT-2 initialisation


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # the tokenizer's; the model pads it up to VOCAB_MULTIPLE
    seq_len: int = 1024  # context length the position embedding can hold
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

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        check_attention_supported(self.attention, self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that returns its input's dtype under autocast.

    Autocast runs layer_norm in fp32 whatever its input, and the matmul after it casts the fp32 output
    back to bf16: two more passes over every normalized activation, forward and backward. PyTorch's kernel
    accumulates mean and variance in fp32 for a bf16 input anyway, so on the bf16 residual stream this runs
    it outside autocast with weight and bias cast to bf16 (as autocast casts every matmul weight) and
    writes bf16 directly. An fp32 input (fp32_residual=true, or no autocast) takes nn.LayerNorm's path.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), bias, self.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_out = True
        self.dropout = nn.Dropout(cfg.dropout)
        self.attn_fn = get_attention(cfg.attention)
        self.attn_qkvpacked = get_qkvpacked_attention(cfg.attention)  # None: attn_fn on q, k, v views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim)  # (B, T, 3, H, D)
        if self.attn_qkvpacked is not None:
            # One input, so autograd gets one (B, T, 3, H, D) gradient, not three views' to stack.
            o = self.attn_qkvpacked(qkv, causal=True)  # (B, T, H, D)
        else:
            q, k, v = qkv.unbind(dim=2)  # each (B, T, H, D), strided views
            o = self.attn_fn(q, k, v, causal=True)  # (B, T, H, D)
        return self.dropout(self.proj(o.reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_out = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: counted once in the FLOP formula too
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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, padded_vocab_size)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(
                f"input has {T} tokens but the model's position embedding holds seq_len={self.cfg.seq_len}; "
                f"set seq_len={T} (it sets both the model context and the data windows)"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C), fp32
        device = idx.device.type
        if not self.cfg.fp32_residual and torch.is_autocast_enabled(device):
            # Every branch output is bf16 under autocast; an fp32 stream makes each residual add, LayerNorm
            # and their gradients read and write fp32, and casts in between. GPT3-1.3B on an H100, 16k tokens:
            # 314.7 -> 289.1 ms per step at 2k, 382.1 -> 356.1 at 8k (bench/profile_step.py).
            x = x.to(torch.get_autocast_dtype(device))
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training:
                # recompute each block in backward: trades ~1/3 more compute for O(L) fewer activations
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def num_params(self, exclude_position_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weight counted once by parameters()
        return n - self.wpe.weight.numel() if exclude_position_embedding else n
