"""The FLOP convention (FA2 paper 4.3: 6·N + 12·L·d·T, causal not halved) against hand-computed values."""

import pytest
import torch

from model.flops import flops_per_token, matmul_params, peak_flops
from model.gpt import GPT, GPTConfig

# GPT3-1.3B as the FA2 paper runs it: 24 layers, d 2048, 16 heads of 128, GPT-2 vocab padded to 50304.
GPT3_13B = GPTConfig(vocab_size=50257, seq_len=8192, n_layer=24, n_head=16, d_model=2048)


def test_gpt3_13b_matmul_params_by_hand():
    # per block 12·d² = 12·2048² = 50,331,648; ×24 = 1,207,959,552; tied head 50304·2048 = 103,022,592
    assert matmul_params(GPT3_13B) == 1_207_959_552 + 103_022_592


@pytest.mark.parametrize(
    "seq_len, expected",
    [
        # 6·1,310,982,144 = 7,865,892,864; 12·24·2048·2048 = 1,207,959,552
        (2048, 7_865_892_864 + 1_207_959_552),
        # 12·24·2048·8192 = 4,831,838,208
        (8192, 7_865_892_864 + 4_831_838_208),
    ],
)
def test_gpt3_13b_flops_per_token_by_hand(seq_len, expected):
    assert flops_per_token(GPT3_13B, seq_len) == expected


def test_matmul_params_match_the_real_module():
    """N must equal the module's weights that enter matmuls: all params minus biases, LayerNorms, wpe."""
    cfg = GPTConfig(vocab_size=300, seq_len=32, n_layer=2, n_head=2, d_model=64)
    model = GPT(cfg)
    matmul_weights = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and not name.startswith("wpe")
    )
    assert matmul_params(cfg) == matmul_weights


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.float16, 312.0),
        ("NVIDIA H100 80GB HBM3", torch.float32, 67.0),
    ],
)
def test_peak_table(name, dtype, tflops):
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_peak_unknown_device_and_override():
    assert peak_flops("cpu", torch.float32) is None
    assert peak_flops("cpu", torch.float32, override_tflops=2.5) == pytest.approx(2.5e12)
