"""model/fusion.py: RoPE and SwiGLU trace whole into one graph each with their gradients, run as they are off the GPU
and where no gradient follows, give up compiling at dynamo's recompile limit with a warning, and on a GPU run
compiled, within the error rule of the plain bf16 functions (and the Llama-style GPT with them)."""

import functools
import warnings

import pytest
import torch

import model.fusion as fusion
from model.gpt import GPT, GPTConfig, rope_cos_sin
from model.loss import next_token_loss

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on a CUDA GPU")


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Each test starts with no compiled function and no function past its recompile limit: dynamo's recompile count
    is per function for the whole process."""
    def reset():
        torch._dynamo.reset()
        fusion.compiled.cache_clear()
        fusion._past_recompile_limit.clear()

    reset()
    yield
    reset()


@pytest.fixture
def compiles_on_cpu(monkeypatch):
    """The compiled path for CPU tensors, through dynamo with the eager backend (the graph capture and its guards,
    without Inductor's code generation); returns the list of functions compiled."""
    calls = []
    monkeypatch.setattr(fusion, "COMPILED_DEVICES", ("cpu",))
    monkeypatch.setattr(fusion, "compiled", functools.cache(
        lambda fn: calls.append(fn) or torch.compile(fn, backend="eager", fullgraph=True)))
    return calls


def _rope_inputs(B=2, T=37, H=4, Hkv=2, D=32, per_batch=False, device="cpu", dtype=torch.float32, seed=0):
    """k: a strided (B, T, Hkv, D) view of a fused projection, as the model hands it over; cos and sin (T, D/2), or
    (B, T, D/2) for positions that restart at document starts."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, H + 2 * Hkv, D, generator=g).to(device, dtype)
    k = qkv[:, :, H:H + Hkv]
    pos = torch.randint(0, 4 * T, (B, T) if per_batch else (T,), generator=g).to(device)
    return k, *rope_cos_sin(pos, D, 10000.0, dtype)


def _swiglu_input(B=2, T=37, F=48, device="cpu", dtype=torch.float32, seed=0):
    """(h,): h (B, T, 2·F), the fc matmul's [gate | up]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, 2 * F, generator=g).to(device, dtype),)


def _value_and_grads(fn, *inputs):
    """fn's output and its inputs' gradients, fp32, for a fixed upstream gradient. Each leaf keeps its input's strides
    (k stays a strided (B, T, Hkv, D) layout, as a view of the fused projection is)."""
    leaves = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x).requires_grad_()
              for x in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out))
    return [out.detach().float(), *(x.grad.float() for x in leaves)]


CASES = {
    "rope": (fusion.rope, _rope_inputs),
    "rope_per_batch": (fusion.rope, lambda **kw: _rope_inputs(per_batch=True, **kw)),
    "swiglu": (fusion.swiglu, _swiglu_input),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_function_traces_into_one_graph_with_the_same_values_and_gradients(case):
    """fullgraph: one graph with no break, so the GPU's compile makes one kernel of the chain (aot_eager here runs
    the traced forward and backward graphs as they are)."""
    fn, make = CASES[case]
    inputs = make()
    assert case == "swiglu" or not inputs[0].is_contiguous()  # RoPE reads k where the projection wrote it
    traced = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for want, got in zip(_value_and_grads(fn, *inputs), _value_and_grads(traced, *inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_off_the_gpu_the_plain_functions_run(monkeypatch):
    monkeypatch.setattr(fusion, "compiled", lambda fn: pytest.fail("compiled on a CPU tensor"))
    k, cos, sin = _rope_inputs()
    torch.testing.assert_close(fusion.apply_rope(k, cos, sin), fusion.rope(k, cos, sin), rtol=0, atol=0)
    (h,) = _swiglu_input()
    torch.testing.assert_close(fusion.apply_swiglu(h), fusion.swiglu(h), rtol=0, atol=0)


def test_only_calls_with_a_gradient_to_follow_take_the_compiled_kernels(compiles_on_cpu):
    """Training compiles; no_grad and inference_mode calls (validation, sampling) and inputs that need no gradient run
    the plain functions and compile nothing."""
    k, cos, sin = _rope_inputs()
    with torch.no_grad():
        fusion.apply_rope(k.clone().requires_grad_(), cos, sin)
    with torch.inference_mode():
        fusion.apply_swiglu(*_swiglu_input())
    fusion.apply_rope(k, cos, sin)
    assert compiles_on_cpu == []
    want, got = _value_and_grads(fusion.rope, k, cos, sin), _value_and_grads(fusion.apply_rope, k, cos, sin)
    assert compiles_on_cpu == [fusion.rope]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_at_the_recompile_limit_a_function_warns_once_and_runs_plain(compiles_on_cpu):
    """A new dtype is a recompile; with a limit of 1 the second dtype reaches it. The call that reaches it and every
    call after return the plain function's values, one warning in all, and the other function still compiles."""
    real = fusion.swiglu
    apply = fusion.fused(real)
    (h,) = _swiglu_input()
    apply(h.requires_grad_())
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in (torch.float64, torch.float64, torch.bfloat16):
            x = h.detach().to(dtype).requires_grad_()
            torch.testing.assert_close(apply(x), real(x), rtol=0, atol=0)
    limit = [w for w in caught if "recompile limit" in str(w.message)]
    assert len(limit) == 1 and "swiglu" in str(limit[0].message)
    assert fusion._past_recompile_limit == {real}
    k, cos, sin = _rope_inputs()
    fusion.apply_rope(k.requires_grad_(), cos, sin)
    assert compiles_on_cpu == [real, fusion.rope]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_on_the_gpu_within_twice_the_plain_functions_error(case, dtype, monkeypatch):
    """Against the fp32 plain function: the compiled kernel's error at most twice the plain function's in `dtype`
    (the FA2 paper's rule), forward and every gradient; and the compiled path is the one taken."""
    fn, make = CASES[case]
    inputs = make(device="cuda", dtype=dtype, T=1023)
    calls = []
    real = fusion.compiled
    monkeypatch.setattr(fusion, "compiled", lambda f: calls.append(f) or real(f))
    run = fusion.fused(fn)
    ref = _value_and_grads(fn, *(x.float() for x in inputs))
    plain = _value_and_grads(fn, *inputs)
    ours = _value_and_grads(run, *inputs)
    assert calls == [fn]
    for what, r, p, o in zip(("out", "d0", "d1", "d2"), ref, plain, ours):
        err, err_plain = (o - r).abs().max().item(), (p - r).abs().max().item()
        assert err <= 2 * err_plain + 1e-6, f"{case} {what}: max error {err:.2e}, plain {dtype}'s {err_plain:.2e}"


@needs_cuda
@pytest.mark.gpu
def test_llama_style_gpt_trains_the_same_with_the_compiled_kernels(monkeypatch):
    """One eager bf16 step of a GPT with RoPE and SwiGLU: loss and gradients with the compiled kernels match the
    plain functions' to bf16's rounding."""
    cfg = GPTConfig(vocab_size=500, seq_len=256, n_layer=2, n_head=4, n_kv_head=2, d_model=256, pos_emb="rope",
                    norm="rmsnorm", mlp="swiglu", bias=False, attention="sdpa")
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    x, y = (torch.randint(0, 500, (2, 255), device="cuda") for _ in range(2))

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = next_token_loss(model(x), y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = step()
    monkeypatch.setattr(fusion, "compiled", lambda fn: fn)  # the plain functions, eager
    loss_plain, grads_plain = step()
    torch.testing.assert_close(loss, loss_plain, rtol=2e-3, atol=2e-3)
    for g, g_plain in zip(grads, grads_plain):
        torch.testing.assert_close(g, g_plain, rtol=5e-2, atol=2e-3)


@needs_cuda
@pytest.mark.gpu
def test_sampling_on_the_gpu_compiles_nothing(monkeypatch):
    """Sampling's one-token steps, each at a new position, run the plain functions: twelve shapes under no_grad,
    more than dynamo's recompile limit, compile nothing and raise nothing."""
    monkeypatch.setattr(fusion, "compiled", lambda fn: pytest.fail(f"{fn.__name__} compiled under no_grad"))
    with torch.no_grad():
        for T in range(1, 13):
            k, cos, sin = _rope_inputs(T=T, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(fusion.apply_rope(k, cos, sin), fusion.rope(k, cos, sin), rtol=0, atol=0)
