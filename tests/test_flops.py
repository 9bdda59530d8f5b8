"""The FLOP convention (FA2 paper 4.3: 6·N + 12·L·d·T, causal not halved) against hand-computed values and
torch.utils.flop_counter, for every model option; flash_kernel's ops' FLOP formulas on CPU (FakeTensorMode)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import flash_kernel
from model.flops import flops_per_token, matmul_params, peak_flops
from model.gpt import GPT, GPTConfig
from model.loss import next_token_loss

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


# The Llama-style preset (conf/model/llama-1b.yaml) at the GPT-2 vocabulary.
LLAMA_1B = GPTConfig(vocab_size=50257, seq_len=8192, n_layer=16, n_head=16, n_kv_head=4, d_model=2048, d_ff=8192,
                     pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)


def test_llama_1b_matmul_params_by_hand():
    # per block: qkv 2048·(16 + 2·4)·128 = 6,291,456 (GQA: k and v 512 wide each); proj 2048² = 4,194,304;
    # SwiGLU 3·2048·8192 = 50,331,648; sum 60,817,408, ×16 = 973,078,528; tied head 50304·2048 = 103,022,592
    assert matmul_params(LLAMA_1B) == 973_078_528 + 103_022_592


def test_llama_1b_flops_per_token_by_hand():
    # 6·1,076,101,120 = 6,456,606,720; attention 12·16·2048·8192 = 3,221,225,472 (every query head attends)
    assert flops_per_token(LLAMA_1B, 8192) == 6_456_606_720 + 3_221_225_472


# Each option alone and together (n_head 4 over d_model 64: head dim 16)
OPTIONS = {
    "gpt3": {},
    "gqa": {"n_kv_head": 2},
    "mqa": {"n_kv_head": 1},
    "rope_rmsnorm": {"pos_emb": "rope", "norm": "rmsnorm"},
    "swiglu": {"mlp": "swiglu"},
    "swiglu_d_ff": {"mlp": "swiglu", "d_ff": 80},
    "gelu_d_ff_no_bias": {"d_ff": 96, "bias": False},
    "llama": {"n_kv_head": 2, "pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "d_ff": 160, "bias": False},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_flops_per_token_is_what_torch_counts_on_the_model(options):
    """torch.utils.flop_counter counts every matmul of a training step (forward and backward) on a model whose
    attention is explicit matmuls (naive): that count equals flops_per_token · tokens, for every option."""
    B, T = 2, 24
    cfg = GPTConfig(vocab_size=300, seq_len=T, n_layer=2, n_head=4, d_model=64, attention="naive", **options)
    model = GPT(cfg)
    idx = torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        next_token_loss(model(idx), idx).backward()
    assert counter.get_total_flops() == flops_per_token(cfg, T) * B * T


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_matmul_params_match_the_real_module(options):
    """N must equal the module's weights that enter matmuls: all params minus biases, norms, wpe."""
    cfg = GPTConfig(vocab_size=300, seq_len=32, n_layer=2, n_head=4, d_model=64, **options)
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


def _fake(*shape):
    return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("Tq, Tk, Hkv", [(64, 64, 8), (64, 64, 2), (1, 40, 1), (24, 56, 4)])
def test_flash_op_flop_formulas(Tq, Tk, Hkv):
    """flash_kernel's ops count as PyTorch's fused attention does (torch.utils.flop_counter's sdpa formulas): the
    forward 4·B·Hq·Tq·Tk·D (QKᵀ and PV), the backward 10·B·Hq·Tq·Tk·D (QKᵀ recomputed, then dV, dP, dQ, dK),
    every query head counted (GQA shares k and v, not the work). CPU: the ops' fake impls on fake CUDA tensors;
    autograd cannot run there, so the backward op is called directly."""
    B, Hq, D = 2, 8, 32
    fwd, bwd = 4 * B * Hq * Tq * Tk * D, 10 * B * Hq * Tq * Tk * D
    ops = torch.ops.flash_kernel
    with FakeTensorMode():
        q, k, v = _fake(B, Tq, Hq, D), _fake(B, Tk, Hkv, D), _fake(B, Tk, Hkv, D)
        with FlopCounterMode(display=False) as counter:
            o = flash_kernel.flash_attn_func(q, k, v, causal=True)  # the user entry reaches the op under a mode
            _, lse = ops.fwd(q, k, v, 0.125, True, False)
            ops.bwd(o, q, k, v, o, lse, 0.125, True, False)
    assert counter.get_flop_counts()["Global"] == {ops.fwd: 2 * fwd, ops.bwd: bwd}


def test_flash_qkvpacked_op_flop_formulas():
    B, T, H, D = 2, 48, 4, 64
    ops = torch.ops.flash_kernel
    with FakeTensorMode():
        qkv = _fake(B, T, 3, H, D)
        with FlopCounterMode(display=False) as counter:
            o = flash_kernel.flash_attn_qkvpacked_func(qkv)
            _, lse = ops.fwd_qkvpacked(qkv, 0.125, True, False)
            ops.bwd_qkvpacked(o, qkv, o, lse, 0.125, True, False)
    fwd = 4 * B * H * T * T * D
    assert counter.get_flop_counts()["Global"] == {ops.fwd_qkvpacked: 2 * fwd, ops.bwd_qkvpacked: 10 * B * H * T * T * D}


def test_kernel_flop_formulas_count_every_query_head_under_gqa():
    """flash_kernel's registered formulas take K/V with fewer heads than Q (GQA/MQA), which torch's own sdpa
    formulas refuse, and count 4·B·Hq·T²·D forward and 10·B·Hq·T²·D backward, as with as many K/V heads as Q."""
    from flash_kernel.flop_count import _bwd_count, _fwd_count

    B, T, Hq, D = 2, 256, 4, 128
    q = (B, T, Hq, D)
    for n_kv in (4, 2, 1):
        kv = (B, T, n_kv, D)
        assert _fwd_count(q, kv, kv) == 4 * B * Hq * T * T * D
        assert _bwd_count(q, q, kv, kv) == 10 * B * Hq * T * T * D
