"""Training FLOPs and model FLOPs utilisation (MFU), by the FlashAttention-2 paper's convention.

FA2 paper section 4.3 (following PaLM, appendix B): one training token costs

    6·N + 12·L·d·T  FLOPs

with N the parameters that take part in matmuls, L layers, d = d_model and T the sequence length. N counts
what the model's matmuls really hold, for every option of model/gpt.py: per block the qkv projection
d·(H + 2·Hkv)·D (grouped-query attention shrinks its k and v parts), the output projection d², the MLP's
2·d·d_ff (GELU: fc, proj) or 3·d·d_ff (SwiGLU: gate, up, down); plus the output head V·d, counted once since it
is tied to the token embedding. Position embeddings, norms, biases, RoPE and the activations are excluded.
12·L·d·T is the attention core's QKᵀ and PV, forward (4·T·d) and backward (8·T·d) per token: every query
head attends, so GQA leaves it unchanged, and it is NOT halved for causal masking: MFU compares against the
dense work, as the paper's tables do. torch.utils.flop_counter counts the same on a model whose attention is
explicit matmuls (attention=naive; tests/test_flops.py); fused attention's backward also counts its recompute
of QKᵀ (flash_kernel/flop_count.py).

MFU = achieved FLOP/s per GPU / the GPU's peak dense FLOP/s at the compute dtype. Lightning's own peak
table returns None for 'NVIDIA H200', so the recipe keeps its own, matched on the device name, and the
config can override it (perf.peak_tflops).
"""

from __future__ import annotations

import torch

from model.gpt import GPTConfig


def block_matmul_params(cfg: GPTConfig) -> int:
    """The transformer blocks' share of N, all layers: qkv, proj and the MLP's matrices."""
    d, D = cfg.d_model, cfg.head_dim
    attention = d * (cfg.n_head + 2 * cfg.kv_heads) * D + cfg.n_head * D * d  # qkv, proj
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.ffn_dim  # [gate,] up, down
    return cfg.n_layer * (attention + mlp)


def matmul_params(cfg: GPTConfig) -> int:
    """N: weights that enter a matmul. Biases, norms and position embeddings do not."""
    return block_matmul_params(cfg) + cfg.padded_vocab_size * cfg.d_model  # + tied head, once


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token: 6·N + 12·L·d·T, d = H·D the query heads' width."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


# Dense (no sparsity) tensor-core peaks in TFLOP/s, from the vendors' datasheets, for 16-bit inputs with
# fp32 accumulation. Matched in order on the lower-cased device name, most specific first.
_PEAK_TFLOPS_16BIT: list[tuple[tuple[str, ...], float]] = [
    (("h100", "pcie"), 756.0),
    (("h100", "nvl"), 835.0),
    (("h100",), 989.4),  # SXM; torch names it 'NVIDIA H100 80GB HBM3'
    (("h200",), 989.4),
    (("gh200",), 989.4),
    (("h800",), 989.4),
    (("b200",), 2250.0),
    (("a100",), 312.0),
    (("a800",), 312.0),
    (("l40s",), 362.05),
    (("l4",), 121.0),
    (("a10g",), 70.0),
    (("a10",), 125.0),
    (("rtx 4090",), 165.2),
    (("rtx 3090",), 71.0),
]
_PEAK_TFLOPS_FP32: list[tuple[tuple[str, ...], float]] = [
    (("h100", "pcie"), 51.0),
    (("h100",), 67.0),
    (("h200",), 67.0),
    (("a100",), 19.5),
]


def peak_flops(device_name: str, dtype: torch.dtype, override_tflops: float | None = None) -> float | None:
    """Peak dense FLOP/s of one device at `dtype`, or None when unknown (then MFU is not logged)."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    name = device_name.lower()
    table = _PEAK_TFLOPS_16BIT if dtype in (torch.bfloat16, torch.float16) else _PEAK_TFLOPS_FP32
    for keys, tflops in table:
        if all(k in name for k in keys):
            return tflops * 1e12
    return None
