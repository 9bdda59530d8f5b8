"""The GPT, its options and its attention switch on CPU: the implementations agree, errors are clear."""

import re

import pytest
import torch

from model.attention import ATTENTION, get_attention, naive_attention, sdpa_attention
from model.fusion import apply_rope
from model.gpt import GPT, GPTConfig, KVCache, LayerNorm, ModelConfigError, RMSNorm, rope_cos_sin
from model.loss import next_token_loss


def _qkv(B=2, Tq=37, Tk=37, Hq=4, Hkv=4, D=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Tk, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, Tk, Hkv, D, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Tq, Tk, Hkv", [(37, 37, 4), (17, 53, 4), (37, 37, 1), (1, 9, 2)])
def test_naive_and_sdpa_agree(causal, Tq, Tk, Hkv):
    q, k, v = _qkv(Tq=Tq, Tk=Tk, Hkv=Hkv, dtype=torch.float64)
    torch.testing.assert_close(naive_attention(q, k, v, causal), sdpa_attention(q, k, v, causal))


def test_naive_attention_is_causal_bottom_right():
    """Query i must not see key j > i + Tk - Tq: changing such a key leaves its output unchanged."""
    q, k, v = _qkv(Tq=5, Tk=8)
    o = naive_attention(q, k, v, causal=True)
    v2 = v.clone()
    v2[:, -1] += 10.0  # the last key is visible to the last query only
    o2 = naive_attention(q, k, v2, causal=True)
    torch.testing.assert_close(o[:, :-1], o2[:, :-1])
    assert not torch.allclose(o[:, -1], o2[:, -1])


def test_flash_reference_matches_naive():
    pytest.importorskip("flash_kernel.reference")
    # the reference accumulates in fp32 whatever the input dtype, so compare at fp32 tolerances
    q, k, v = (x.requires_grad_() for x in _qkv(Tq=45, Tk=45, dtype=torch.float64))
    o_ref = get_attention("flash_reference")(q, k, v, causal=True)
    o_naive = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(o_ref, o_naive, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(o_ref)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), g)
    grads_naive = torch.autograd.grad(o_naive, (q, k, v), g)
    for a, b in zip(grads_ref, grads_naive):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_unknown_attention_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: naive, sdpa, flash"):
        get_attention("flashy")


def test_flash_head_dim_checked_at_construction():
    with pytest.raises(ValueError, match="multiples of 8"):
        GPTConfig(n_head=3, d_model=60, attention="flash")  # head dim 20


# Each model option alone, and all together as in conf/model/llama-1b.yaml (n_head 4 over d_model 64: head dim 16).
OPTIONS = {
    "gpt3": {},
    "gqa": {"n_kv_head": 2},
    "mqa": {"n_kv_head": 1},
    "rope": {"pos_emb": "rope", "rope_base": 500.0},
    "rmsnorm": {"norm": "rmsnorm"},
    "swiglu": {"mlp": "swiglu", "d_ff": 96},
    "no_bias": {"bias": False},
    "llama": {"n_kv_head": 2, "pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False},
    "fused": {"fused_add_norm": True, "fused_bias_gelu": True},  # the stream as x + pending between blocks
    "llama_fused": {"n_kv_head": 2, "pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
                    "fused_add_norm": True},
}


def _tiny(attention, seed=0, **options):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=300, seq_len=64, n_layer=2, n_head=4, d_model=64, attention=attention, **options))


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("attention", ["naive", "sdpa", "flash_reference"])
def test_model_forward_backward_agree_across_attentions(attention, options):
    if attention == "flash_reference":
        pytest.importorskip("flash_kernel.reference")
    idx = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    ref = _tiny("sdpa", **options)
    model = _tiny(attention, **options)
    model.load_state_dict(ref.state_dict())
    logits_ref, logits = ref(idx), model(idx)
    assert logits.shape == (2, 48, 320)  # vocab 300 padded to a multiple of 64
    torch.testing.assert_close(logits, logits_ref, atol=2e-5, rtol=1e-4)
    logits.float().logsumexp(-1).mean().backward()
    logits_ref.float().logsumexp(-1).mean().backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-3, msg=name)


def test_tied_head_and_too_long_input():
    model = _tiny("sdpa")
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    with pytest.raises(ValueError, match="set seq_len=65"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_activation_checkpointing_gives_same_grads():
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    plain = _tiny("sdpa")
    ckpt = GPT(GPTConfig(vocab_size=300, seq_len=64, n_layer=2, n_head=4, d_model=64, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    for m in (plain, ckpt):
        m(idx).float().logsumexp(-1).mean().backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_registry_has_the_three_config_words():
    assert {"naive", "sdpa", "flash"} <= set(ATTENTION)


def _ln_input_dtypes(model, idx):
    """The dtype each LayerNorm sees in one autocast (bf16, CPU) forward + backward of `model`."""
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = (args[0].dtype, out.dtype)  # returns None: the output stays as it is
        return hook

    hooks = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = next_token_loss(model(idx), idx)
    loss.backward()
    for h in hooks:
        h.remove()
    return seen, loss


@pytest.mark.parametrize("fp32_residual", [False, True])
def test_residual_stream_dtype_under_autocast(fp32_residual):
    """bf16 by default (every LayerNorm reads and writes bf16), fp32 with fp32_residual=true; the parameters
    and their gradients stay fp32 either way, and the two give nearly the same loss."""
    idx = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(3))
    ref = _tiny("sdpa")
    model = GPT(GPTConfig(vocab_size=300, seq_len=64, n_layer=2, n_head=4, d_model=64, fp32_residual=fp32_residual))
    model.load_state_dict(ref.state_dict())
    seen, loss = _ln_input_dtypes(model, idx)
    want = torch.float32 if fp32_residual else torch.bfloat16
    assert len(seen) == 5 and all(dtypes == (want, want) for dtypes in seen.values()), seen
    assert loss.dtype == torch.float32
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    exact = next_token_loss(ref(idx), idx)  # fp32 throughout, no autocast
    torch.testing.assert_close(loss, exact, atol=0.02, rtol=0)


def test_layernorm_keeps_bf16_and_matches_fp32():
    """On a bf16 input under autocast: a bf16 output within bf16 rounding of the fp32 LayerNorm of the same
    values, and gradients for the fp32 weight and bias."""
    torch.manual_seed(0)
    ln = LayerNorm(64)
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.1)
        ln.bias.normal_(0.0, 0.1)
    x = (torch.randn(8, 64) * 3 + 1).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln(x)
    assert y.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(x.detach().float(), (64,), ln.weight, ln.bias)
    torch.testing.assert_close(y.float(), ref, atol=0.03, rtol=0.02)
    y.float().sum().backward()
    assert ln.weight.grad.dtype == torch.float32 and ln.weight.grad.abs().sum() > 0
    assert x.grad.dtype == torch.bfloat16


def test_without_autocast_fp32_residual_changes_nothing():
    idx = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(4))
    a = _tiny("sdpa")
    b = GPT(GPTConfig(vocab_size=300, seq_len=64, n_layer=2, n_head=4, d_model=64, fp32_residual=True))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(idx), b(idx))


def test_next_token_loss_is_fp32_cross_entropy():
    logits = torch.randn(2, 5, 320, generator=torch.Generator().manual_seed(5)).bfloat16()
    targets = torch.randint(0, 320, (2, 5), generator=torch.Generator().manual_seed(6))
    loss = next_token_loss(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.float().view(10, 320), targets.view(10)))


def test_compile_covers_the_loss_and_keeps_its_value():
    """compile=true with loss=torch compiles the loss with the model (its fp32 cast fuses into the
    cross-entropy), and the compiled step gives the eager step's loss."""
    from model.lit_gpt import LitGPT

    kwargs = dict(vocab_size=300, seq_len=64, n_layer=1, n_head=2, d_model=32, attention="sdpa")
    eager, compiled = LitGPT(model=kwargs, loss="torch"), LitGPT(model=kwargs, compile=True, loss="torch")
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()
    assert eager.loss_fn is next_token_loss and compiled.loss_fn is not next_token_loss
    batch = tuple(torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7)) for _ in range(2))
    torch.testing.assert_close(compiled._loss(batch), eager._loss(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(n_head=4, n_kv_head=3), ModelConfigError, "model.n_head=4 is not a multiple of model.n_kv_head=3"),
        (dict(n_head=4, n_kv_head=0), ModelConfigError, "not a multiple of model.n_kv_head=0"),
        (dict(n_head=4, d_model=36, pos_emb="rope"), ModelConfigError, "head dim must be even.*36/4 = 9"),
        (dict(pos_emb="alibi"), ModelConfigError, "model.pos_emb='alibi' is not one of learned, rope"),
        (dict(norm="batchnorm"), ModelConfigError, "model.norm='batchnorm'"),
        (dict(mlp="relu"), ModelConfigError, "model.mlp='relu' is not one of gelu, swiglu"),
    ],
)
def test_bad_options_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        GPTConfig(**{"n_layer": 1, "n_head": 4, "d_model": 64, **kwargs})


def test_default_options_keep_the_gpt3_weights():
    """The options' defaults build GPT-3 (learned positions, LayerNorms with biases, a 4d GELU MLP, one fused
    (3·d, d) projection): the parameter names and shapes of checkpoints written before the options existed."""
    shapes = {name: tuple(p.shape) for name, p in _tiny("sdpa").state_dict().items()}
    assert shapes["wpe.weight"] == (64, 64) and shapes["blocks.0.attn.qkv.weight"] == (192, 64)
    assert shapes["blocks.0.mlp.fc.weight"] == (256, 64) and shapes["blocks.0.ln_1.bias"] == (64,)
    assert len(shapes) == 5 + 2 * 12  # wte, wpe, ln_f (2), lm_head (tied); 12 per block


def test_llama_options_build_their_modules():
    model = _tiny("sdpa", **OPTIONS["llama"])
    names = dict(model.named_parameters())
    assert model.wpe is None and not any("bias" in n for n in names)
    assert isinstance(model.blocks[0].ln_1, RMSNorm) and isinstance(model.ln_f, RMSNorm)
    assert names["blocks.0.attn.qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)  # 4 q heads, 2 k and 2 v heads of 16
    assert names["blocks.0.mlp.fc.weight"].shape == (2 * 256, 64)  # gate and up in one matmul


def test_gqa_is_multi_head_attention_with_each_kv_head_shared_by_its_group():
    """A GQA model equals a multi-head model whose k and v heads are its own, each repeated for the query heads of
    its group (query head h uses key/value head h // (H / Hkv), as in Llama and flash-attn)."""
    H, Hkv, D = 4, 2, 16
    gqa = _tiny("sdpa", n_kv_head=Hkv)
    mha = _tiny("sdpa")
    state = gqa.state_dict()
    for name in [n for n in state if n.endswith("attn.qkv.weight") or n.endswith("attn.qkv.bias")]:
        w = state[name].unflatten(0, (H + 2 * Hkv, D))  # (H + 2·Hkv, D, ...) heads
        q, k, v = w.split((H, Hkv, Hkv))
        state[name] = torch.cat((q, k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0))).flatten(0, 1)
    mha.load_state_dict(state)
    idx = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(gqa(idx), mha(idx), atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    """RoPE (Su et al. 2021, eq. 16): <R_m q, R_n k> is a function of n - m, and each rotation keeps the norm."""
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 1, 3, 32, generator=g), torch.randn(1, 1, 3, 32, generator=g)

    def rotated(x, pos):
        cos, sin = rope_cos_sin(torch.tensor([pos]), 32, 10000.0, torch.float32)
        return apply_rope(x, cos, sin)

    score = lambda m, n: (rotated(q, m) * rotated(k, n)).sum(-1)  # noqa: E731
    torch.testing.assert_close(score(3, 10), score(103, 110), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(3, 10), score(3, 11), atol=1e-3)
    torch.testing.assert_close(rotated(q, 57).norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rotated(q, 0), q)  # position 0: no rotation


def test_rope_tables_hold_the_rotation_of_every_position():
    """GPT.rope_rotation reads what rope_cos_sin computes: rows start.. of the tables, or document positions
    gathered; the tables stay out of the state dict, so checkpoints carry and expect no such keys."""
    model = _tiny("sdpa", pos_emb="rope", rope_base=500.0)
    T, D = model.cfg.seq_len, model.cfg.head_dim
    assert "rope_cos" not in model.state_dict() and "rope_sin" not in model.state_dict()
    for got, want in zip((model.rope_cos, model.rope_sin), rope_cos_sin(torch.arange(T), D, 500.0, torch.float32)):
        assert got.shape == (T, D // 2)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for start, n in [(0, T), (5, 11), (T - 1, 1)]:
        pos = torch.arange(start, start + n)
        for got, want in zip(model.rope_rotation(pos, start, torch.bfloat16),
                             rope_cos_sin(pos, D, 500.0, torch.bfloat16)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    documents = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])  # (B, T): positions restart at each document
    for got, want in zip(model.rope_rotation(documents, 0, torch.float32),
                         rope_cos_sin(documents, D, 500.0, torch.float32)):
        assert got.shape == (2, 5, D // 2)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    fresh = _tiny("sdpa", pos_emb="rope", rope_base=500.0)
    fresh.load_state_dict(model.state_dict())  # strict: the state dict holds no table, and none is missing


def test_compiled_gpt_computes_no_rotation():
    """Under torch.compile the rotation is a graph input (the tables), not recomputed: no generated kernel of the
    forward or the backward takes a cosine or sine (a rotation computed in forward is fused into every block's
    RoPE kernels, forward and backward; 16 ms of Llama-1B's 263 ms step at 8k on an H200)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = _tiny("sdpa", pos_emb="rope")
    model.compile()
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(11))

    def step():
        model(idx).float().sum().backward()

    _, code = run_and_get_code(step)
    assert len(code) == 2, "one forward and one backward graph"
    kernels = "\n".join(code)
    assert not re.search(r"\b(cos|sin)\b", kernels), "a compiled kernel computes RoPE's rotation"
    torch._dynamo.reset()


def test_swiglu_mlp_by_hand():
    """SwiGLU (Shazeer 2020): down(silu(x W_gate) * (x W_up)), the gate the first half of fc's output."""
    model = _tiny("sdpa", mlp="swiglu", d_ff=96, bias=False)
    mlp = model.blocks[0].mlp
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10))
    w_gate, w_up = mlp.fc.weight.split(96)
    expected = (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ mlp.proj.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_rmsnorm_keeps_bf16_and_matches_fp32():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = (torch.randn(8, 64) * 3 + 1).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    xf = x.detach().float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(y.float(), ref, atol=0.03, rtol=0.02)
    y.float().sum().backward()
    assert norm.weight.grad.dtype == torch.float32 and norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("options", [OPTIONS[k] for k in ("gpt3", "llama", "mqa", "llama_fused")],
                         ids=["gpt3", "llama", "mqa", "llama_fused"])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_kv_cache_decoding_gives_the_full_forward_logits(attention, options):
    """A prompt, then one token at a time through the KV cache: the logits of every position equal those of one
    forward over the whole sequence (positions, RoPE angles and causal masks line up with the cache)."""
    model = _tiny(attention, **options).eval()
    idx = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(model.cfg, 2, 20, idx.device, torch.float32)
        steps = [model(idx[:, :12], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(12, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
