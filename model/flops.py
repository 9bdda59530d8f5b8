"""Training FLOPs and model FLOPs utilisation (MFU), by the FlashAttention-2 paper's convention.

FA2 paper section 4.3 (following PaLM, appendix B): one training token costs

    6·N + 12·L·d·T  FLOPs

with N the parameters that take part in matmuls (per block 12·d² for qkv, proj and the 4d MLP; the
output head V·d, counted once since it is tied to the token embedding; position embeddings, LayerNorms
and biases excluded), L layers, d = d_model and T the sequence length. The attention term is NOT halved
for causal masking: MFU compares against the dense work, as the paper's tables do.

MFU = achieved FLOP/s per GPU / the GPU's peak dense FLOP/s at the compute dtype. Lightning's own peak
table returns None for 'NVIDIA H200', so the recipe keeps its own, matched on the device name, and the
config can override it (perf.peak_tflops).
"""

from __future__ import annotations

import torch

from model.gpt import GPTConfig


def matmul_params(cfg: GPTConfig) -> int:
    """N: weights that enter a matmul. Biases, LayerNorms and position embeddings do not."""
    d = cfg.d_model
    per_block = 3 * d * d + d * d + 2 * cfg.mlp_ratio * d * d  # qkv, proj, fc, mlp proj = 12·d² at ratio 4
    return cfg.n_layer * per_block + cfg.padded_vocab_size * d  # + tied head, once


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token: 6·N + 12·L·d·T."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * cfg.d_model * seq_len


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
