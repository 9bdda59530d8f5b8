"""model/fusion.py: RoPE, SwiGLU, the residual add with its norm and bias-GELU trace whole into one graph each with
their gradients, run as they are off the GPU and where no gradient follows, give up compiling at dynamo's recompile
limit with a warning, and on a GPU run compiled, within the error rule of the plain bf16 functions (and the
Llama-style and GPT-3-style GPTs with them)."""

import functools
import warnings

import pytest
import torch

import model.fusion as fusion
import model.gpt as gpt_mod
from model.gpt import GPT, GPTConfig, ModelConfigError, rope_cos_sin
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


def _residual_inputs(B=2, T=37, C=48, device="cpu", dtype=torch.float32, seed=0, bias=True):
    """(x, branch, weight[, bias]): the residual stream and a branch output (B, T, C), a norm's parameters (C,) in
    fp32, as the model keeps them."""
    g = torch.Generator().manual_seed(seed)
    x, branch = (torch.randn(B, T, C, generator=g).to(device, dtype) for _ in range(2))
    params = [1 + 0.1 * torch.randn(C, generator=g), 0.1 * torch.randn(C, generator=g)][:2 if bias else 1]
    return x, branch, *(q.to(device) for q in params)


def _bias_gelu_inputs(B=2, T=37, F=48, device="cpu", dtype=torch.float32, seed=0):
    """(h, bias): the fc matmul's output (B, T, F) and its fp32 bias (F,)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, F, generator=g).to(device, dtype), (0.5 * torch.randn(F, generator=g)).to(device)


def add_layer_norm(x, branch, weight, bias):
    return fusion.add_layer_norm(x, branch, weight, bias, 1e-5)


def add_layer_norm_no_bias(x, branch, weight):
    return fusion.add_layer_norm(x, branch, weight, None, 1e-5)


def add_rms_norm(x, branch, weight):
    return fusion.add_rms_norm(x, branch, weight, 1e-5)


def _value_and_grads(fn, *inputs):
    """fn's outputs (one tensor or a tuple) and its inputs' gradients, fp32, for a fixed upstream gradient of each
    output. Each leaf keeps its input's strides (k stays a strided (B, T, Hkv, D) layout, as a view of the fused
    projection is)."""
    leaves = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x).requires_grad_()
              for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.linspace(-1, 1 - i, o.numel(), dtype=o.dtype, device=o.device).view_as(o) for i, o in enumerate(outs)]
    torch.autograd.backward(outs, grads)
    return [*(o.detach().float() for o in outs), *(x.grad.float() for x in leaves)]


CASES = {
    "rope": (fusion.rope, _rope_inputs),
    "rope_per_batch": (fusion.rope, lambda **kw: _rope_inputs(per_batch=True, **kw)),
    "swiglu": (fusion.swiglu, _swiglu_input),
    "add_layer_norm": (add_layer_norm, _residual_inputs),
    "add_layer_norm_no_bias": (add_layer_norm_no_bias, lambda **kw: _residual_inputs(bias=False, **kw)),
    "add_rms_norm": (add_rms_norm, lambda **kw: _residual_inputs(bias=False, **kw)),
    "bias_gelu": (fusion.bias_gelu, _bias_gelu_inputs),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_function_traces_into_one_graph_with_the_same_values_and_gradients(case):
    """fullgraph: one graph with no break, so the GPU's compile makes one kernel of the chain (aot_eager here runs
    the traced forward and backward graphs as they are)."""
    fn, make = CASES[case]
    inputs = make()
    assert not case.startswith("rope") or not inputs[0].is_contiguous()  # RoPE reads k where the projection wrote it
    traced = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for want, got in zip(_value_and_grads(fn, *inputs), _value_and_grads(traced, *inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_off_the_gpu_the_plain_functions_run(monkeypatch):
    monkeypatch.setattr(fusion, "compiled", lambda fn: pytest.fail("compiled on a CPU tensor"))
    k, cos, sin = _rope_inputs()
    torch.testing.assert_close(fusion.apply_rope(k, cos, sin), fusion.rope(k, cos, sin), rtol=0, atol=0)
    (h,) = _swiglu_input()
    torch.testing.assert_close(fusion.apply_swiglu(h), fusion.swiglu(h), rtol=0, atol=0)
    x, branch, w, b = _residual_inputs()
    for got, want in ((fusion.apply_add_layer_norm(x, branch, w, b, 1e-5), fusion.add_layer_norm(x, branch, w, b, 1e-5)),
                      (fusion.apply_add_rms_norm(x, branch, w, 1e-5), fusion.add_rms_norm(x, branch, w, 1e-5))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(fusion.apply_bias_gelu(*_bias_gelu_inputs()), fusion.bias_gelu(*_bias_gelu_inputs()),
                               rtol=0, atol=0)


LLAMA = dict(n_kv_head=2, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)  # the Llama-style options
FUSED_OPTIONS = {"gpt3": dict(fused_add_norm=True, fused_bias_gelu=True), "llama": dict(fused_add_norm=True, **LLAMA)}


def _off_init(model: GPT) -> GPT:
    """The model with its biases and norm weights moved off their initial zeros and ones, so that a bias or a norm
    weight left out of a fused path changes the loss."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g).to(p.device))
    return model


def _small_gpt(**options) -> GPT:
    torch.manual_seed(0)
    return _off_init(GPT(GPTConfig(vocab_size=300, seq_len=64, n_layer=2, n_head=4, d_model=64, attention="naive",
                                   **options)))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation_checkpointing"])
@pytest.mark.parametrize("name", list(FUSED_OPTIONS))
def test_fused_options_keep_the_parameters_and_the_values(name, checkpointing):
    """model.fused_add_norm and model.fused_bias_gelu change how a block computes, not what: the same parameters
    under the same names (a checkpoint loads either way), and in fp32 the same loss and gradients as without them,
    also with each block recomputed in the backward (the stream passes between blocks as two tensors)."""
    options = {**FUSED_OPTIONS[name], "activation_checkpointing": checkpointing}
    plain_options = {k: v for k, v in options.items() if not k.startswith("fused_")}
    fused, plain = _small_gpt(**options), _small_gpt(**plain_options)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(fused.state_dict())
    x, y = (torch.randint(0, 300, (2, 63), generator=torch.Generator().manual_seed(i)) for i in range(2))
    losses = [next_token_loss(model(x), y) for model in (fused, plain)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")


def test_a_training_step_with_the_fused_options_takes_their_compiled_path(compiles_on_cpu):
    """Where fusion.py compiles (here CPU tensors through dynamo's eager backend), a GPT-3-style block calls the add +
    LayerNorm and bias-GELU graphs, under autocast as training runs it, and its loss is the plain model's."""
    model = _small_gpt(**FUSED_OPTIONS["gpt3"])
    plain = _small_gpt()
    x, y = (torch.randint(0, 300, (2, 63), generator=torch.Generator().manual_seed(i)) for i in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, loss_plain = next_token_loss(model(x), y), next_token_loss(plain(x), y)
    loss.backward()
    assert set(compiles_on_cpu) == {fusion.add_layer_norm, fusion.bias_gelu}
    torch.testing.assert_close(loss, loss_plain, rtol=2e-3, atol=2e-3)  # the bias added after the bf16 matmul


@pytest.mark.parametrize("options", [dict(mlp="swiglu"), dict(bias=False)], ids=["swiglu", "no_bias"])
def test_fused_bias_gelu_needs_a_gelu_mlp_with_biases(options):
    with pytest.raises(ModelConfigError, match="model.fused_bias_gelu=true .* needs mlp=gelu and bias=true"):
        GPTConfig(fused_bias_gelu=True, **options)


def test_a_preset_that_turns_the_gelu_fusions_on_names_the_way_out_with_a_swiglu_mlp():
    """The GPT3 presets turn on fused_bias_gelu and gelu_epilogue: one error names both and the overrides that
    switch them off."""
    from run_overrides import compose_train

    cfg = compose_train("model=gpt3-1.3b", "model.mlp=swiglu").model
    with pytest.raises(ModelConfigError, match="model.fused_bias_gelu=true and model.gelu_epilogue=true fuse .* each "
                       "needs mlp=gelu and bias=true .*add model.fused_bias_gelu=false model.gelu_epilogue=false: "
                       "the gpt3-1.3b and gpt3-2.7b presets turn them on"):
        GPTConfig(**cfg, vocab_size=50257)
    off = GPTConfig(**{**cfg, "fused_bias_gelu": False, "gelu_epilogue": False}, vocab_size=50257)
    assert not off.fused_bias_gelu and not off.gelu_epilogue


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
    for i, (r, p, o) in enumerate(zip(ref, plain, ours)):  # the outputs, then the inputs' gradients
        err, err_plain = (o - r).abs().max().item(), (p - r).abs().max().item()
        assert err <= 2 * err_plain + 1e-6, f"{case} value {i}: max error {err:.2e}, plain {dtype}'s {err_plain:.2e}"


GPU_MODELS = {"llama": LLAMA, "llama_fused_add_norm": FUSED_OPTIONS["llama"], "gpt3_fused": FUSED_OPTIONS["gpt3"]}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_gpt_trains_the_same_with_the_compiled_kernels(monkeypatch, name):
    """One eager bf16 step of a Llama-style GPT (RoPE, SwiGLU, and the add + RMSNorm) and of a GPT-3-style one (add +
    LayerNorm, bias-GELU): loss and gradients with the compiled kernels match the plain functions' to bf16's
    rounding."""
    cfg = GPTConfig(vocab_size=500, seq_len=256, n_layer=2, n_head=4, d_model=256, attention="sdpa", **GPU_MODELS[name])
    torch.manual_seed(0)
    model = _off_init(GPT(cfg)).cuda()
    x, y = (torch.randint(0, 500, (2, 255), device="cuda") for _ in range(2))

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = next_token_loss(model(x), y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = step()
    monkeypatch.setattr(fusion, "compiled", lambda fn: fn)  # the plain functions, eager
    monkeypatch.setattr(gpt_mod, "apply_swiglu", fusion.swiglu)  # and SwiGLU's, not its Triton kernels
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


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, T, F", [(2, 1023, 48), (1, 37, 1100), (2, 513, 2048), (1, 1, 1), (3, 17, 8192)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_swiglu_kernels_within_twice_the_plain_functions_error(B, T, F, dtype, layout):
    """model/swiglu_kernel.py against the plain function in fp64: output and dh each within twice the plain function's
    error in `dtype` (the FA2 paper's rule), over widths that are and are not multiples of its column block, and
    on an h whose rows are strided (a slice of a wider buffer, as a view of a fused projection would be)."""
    g = torch.Generator().manual_seed(B * T + F)
    wide = torch.randn(B, T, 2 * F + (16 if layout == "strided" else 0), generator=g).to("cuda", dtype)
    h = wide[..., :2 * F]  # (B, T, 2F)
    assert h.stride(-2) == wide.shape[-1]  # rows as far apart as the wider buffer's
    dout = torch.randn(B, T, F, generator=g).to("cuda", dtype)

    def value_and_grad(fn, x, d):
        x = x.detach().requires_grad_()
        out = fn(x)
        return out, torch.autograd.grad(out, x, d)[0]

    out, dh = value_and_grad(fusion.apply_swiglu, h, dout)
    ref_out, ref_dh = value_and_grad(fusion.swiglu, h.double(), dout.double())
    plain_out, plain_dh = value_and_grad(fusion.swiglu, h, dout)
    assert out.dtype == dtype and dh.dtype == dtype and dh.shape == h.shape
    for name, got, want, plain in (("out", out, ref_out, plain_out), ("dh", dh, ref_dh, plain_dh)):
        err = (got.double() - want).abs().max().item()
        err_plain = (plain.double() - want).abs().max().item()
        one_rounding = torch.finfo(dtype).eps * want.abs().max().item()  # the floor where plain is exact by chance
        assert err <= 2 * err_plain + one_rounding, f"{name}: max error {err:.2e}, plain {dtype}'s {err_plain:.2e}"


@needs_cuda
@pytest.mark.gpu
def test_the_swiglu_kernels_run_inside_a_compiled_model():
    """Under a whole-model torch.compile the op is traced as itself (torch.library.triton_op): the compiled code
    launches the same Triton kernels, and the values and gradients are eager's."""
    from torch._inductor.utils import run_and_get_code

    h = torch.randn(4, 129, 2 * 320, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(4, 129, 320, device="cuda", dtype=torch.bfloat16)

    def step(fn):
        leaf = h.detach().requires_grad_()
        out = fn(leaf)
        out.backward(dout)
        return out.detach(), leaf.grad

    eager = step(lambda x: fusion.apply_swiglu(x) * 2)
    compiled_fn = torch.compile(lambda x: fusion.apply_swiglu(x) * 2, fullgraph=True)
    compiled, codes = run_and_get_code(step, compiled_fn)
    assert any("swiglu_fwd_kernel" in c for c in codes) and any("swiglu_bwd_kernel" in c for c in codes)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    # the ops' registration: fake tensors (what compile traces with), autograd, and the schema
    torch.library.opcheck(torch.ops.fa2_gpt.swiglu.default, (h.detach().requires_grad_(),))
    torch.library.opcheck(torch.ops.fa2_gpt.swiglu_backward.default, (dout, h))
