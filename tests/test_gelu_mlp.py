"""model/gelu_mlp.py: the GELU MLP with its GELU in the matmuls' epilogues. On the CPU its function passes gradcheck
in fp64 and equals the unfused MLP, and the option is refused where there is no GELU or no fc bias and falls back
where it cannot run; on a GPU the cuBLASLt epilogues are within twice the unfused bf16/fp16 MLP's error against fp64,
trace into a whole-model compile, and train a GPT as the unfused MLP does."""

import pytest
import torch
import torch.nn.functional as F

from model import gelu_mlp
from model.gpt import GPT, GPTConfig, ModelConfigError
from model.loss import next_token_loss

needs_epilogues = pytest.mark.skipif(not gelu_mlp.available(),
                                     reason=f"the cuBLASLt epilogues cannot run here: {gelu_mlp.unavailable_reason()}")


def _mlp_inputs(B=2, T=5, C=8, N=32, bias2=True, device="cpu", dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)  # (B, T, C)
    w1 = torch.randn(N, C, generator=g, dtype=torch.float64) / C ** 0.5  # (N, C)
    b1 = torch.randn(N, generator=g, dtype=torch.float64)
    w2 = torch.randn(C, N, generator=g, dtype=torch.float64) / N ** 0.5  # (C, N)
    b2 = torch.randn(C, generator=g, dtype=torch.float64) if bias2 else None
    return [t if t is None else t.to(device, dtype).requires_grad_() for t in (x, w1, b1, w2, b2)]


def unfused_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


@pytest.mark.parametrize("bias2", [True, False])
def test_the_function_passes_gradcheck_and_equals_the_unfused_mlp_in_fp64(bias2):
    inputs = _mlp_inputs(bias2=bias2)
    fused = lambda *a: gelu_mlp.GeluMLP.apply(*a, torch.float64, False)  # noqa: E731
    assert torch.autograd.gradcheck(fused, tuple(inputs))
    torch.testing.assert_close(fused(*inputs), unfused_mlp(*inputs), rtol=1e-12, atol=1e-12)


def test_the_ops_register_their_fake_and_schema_on_the_cpu():
    x, w1, b1, w2, _ = (t.detach() for t in _mlp_inputs(dtype=torch.float32))
    x2 = x.reshape(-1, x.shape[-1])
    torch.library.opcheck(torch.ops.fa2_gpt.linear_gelu.default, (x2, w1, b1))
    g, h = torch.ops.fa2_gpt.linear_gelu(x2, w1, b1)
    torch.library.opcheck(torch.ops.fa2_gpt.linear_dgelu.default, (torch.randn_like(x2), w2, h))


def test_bf16_weight_gradients_round_as_autocasts_or_stay_fp32():
    """In bf16 the weight gradients come out of bf16 matmuls (rounded, then fp32 as the parameters are), or in fp32
    with fp32_weight_grad; both near the fp64 gradient."""
    ref = _mlp_inputs()
    unfused_mlp(*ref).sum().backward()
    for fp32 in (False, True):
        x, w1, b1, w2, b2 = _mlp_inputs(dtype=torch.float32)
        gelu_mlp.GeluMLP.apply(x, w1, b1, w2, b2, torch.bfloat16, fp32).sum().backward()
        for got, want in zip((w1.grad, b1.grad, w2.grad, b2.grad), (t.grad for t in ref[1:])):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)
        rounded = torch.equal(w2.grad, w2.grad.bfloat16().float())
        assert rounded != fp32  # bf16-exact values unless written in fp32


@pytest.mark.parametrize("options", [{"mlp": "swiglu"}, {"bias": False}])
def test_gelu_epilogue_needs_a_gelu_mlp_with_biases(options):
    with pytest.raises(ModelConfigError, match="gelu_epilogue=true .* needs mlp=gelu and bias=true"):
        GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=64, seq_len=8, gelu_epilogue=True, **options)


def test_where_the_epilogues_cannot_run_the_model_is_the_unfused_one(monkeypatch):
    """On the CPU (or a GPU without the extension) the option changes nothing: the same values and gradients."""
    cfg = dict(n_layer=2, n_head=2, d_model=16, vocab_size=64, seq_len=8)
    x = torch.randint(0, 64, (2, 8))

    def step(**options):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg, **options))
        loss = next_token_loss(model(x), x)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    monkeypatch.setattr(gelu_mlp, "GeluMLP", None)  # any use of the fused function fails
    loss, grads = step(gelu_epilogue=True)
    loss_plain, grads_plain = step()
    assert torch.equal(loss, loss_plain) and all(torch.equal(a, b) for a, b in zip(grads, grads_plain))


def test_unavailable_names_why_a_build_without_the_epilogues_cannot_run_them(monkeypatch):
    """A GPU and an extension built before gelu_gemm.cu: the reason points at the rebuild; else the extension's own."""
    from flash_kernel import interface

    monkeypatch.setattr(interface, "unavailable_reason", lambda: None)
    monkeypatch.setattr(interface, "_load_C", lambda: object())  # an extension without linear_gelu
    assert "gelu_gemm.cu" in gelu_mlp.unavailable_reason() and not gelu_mlp.available()
    monkeypatch.setattr(interface, "unavailable_reason", lambda: "no CUDA device")
    assert gelu_mlp.unavailable_reason() == "no CUDA device" and not gelu_mlp.available()


def test_runs_here_only_for_16_bit_gpu_inputs_with_aligned_widths():
    w = torch.zeros(32, 8)
    assert not gelu_mlp.runs_here(torch.zeros(2, 8), w)  # a CPU tensor
    assert gelu_mlp.compute_dtype(torch.zeros(2, 8), w) is None  # fp32 weights, no autocast
    assert gelu_mlp.compute_dtype(torch.zeros(2, 8), w.bfloat16()) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gelu_mlp.compute_dtype(torch.zeros(2, 8), w) == torch.bfloat16


def _errors_within_twice_the_unfused(got, ref, plain, dtype, what):
    for name, g, r, p in zip(what, got, ref, plain):
        err = (g.double() - r).abs().max().item()
        err_plain = (p.double() - r).abs().max().item()
        one_rounding = torch.finfo(dtype).eps * r.abs().max().item()
        assert err <= 2 * err_plain + one_rounding, f"{name}: max error {err:.2e}, the unfused {dtype}'s {err_plain:.2e}"


SHAPES = [(1, 1, 8, 8), (2, 37, 64, 256), (3, 333, 128, 512), (2, 1024, 2048, 8192)]  # B, T, C, d_ff


@needs_epilogues
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, C, N", SHAPES)
def test_the_epilogue_ops_within_twice_the_unfused_error(B, T, C, N, dtype):
    """linear_gelu's G and H and linear_dgelu's dH and db against fp64, each within twice the error of the same
    quantities computed unfused in `dtype` (matmul, then GELU or its gradient) plus one rounding."""
    x, w1, b1, w2, _ = (t.detach() for t in _mlp_inputs(B, T, C, N, device="cuda", dtype=dtype, seed=T))
    x2 = x.reshape(-1, C)
    dy = torch.randn(B * T, C, device="cuda", dtype=dtype)
    g, h = torch.ops.fa2_gpt.linear_gelu(x2, w1, b1)
    dh, db = torch.ops.fa2_gpt.linear_dgelu(dy, w2, h)

    h_ref = F.linear(x2.double(), w1.double(), b1.double())
    dh_ref = torch.ops.aten.gelu_backward(dy.double() @ w2.double(), h.double(), approximate="tanh")
    h_plain = F.linear(x2, w1, b1)
    dh_plain = torch.ops.aten.gelu_backward(dy @ w2, h, approximate="tanh")
    _errors_within_twice_the_unfused(
        (g, h, dh, db),
        (F.gelu(h_ref, approximate="tanh"), h_ref, dh_ref, dh_ref.sum(0)),
        (F.gelu(h_plain, approximate="tanh"), h_plain, dh_plain, dh_plain.sum(0)),
        dtype, ("G", "H", "dH", "db"))


@needs_epilogues
@pytest.mark.gpu
@pytest.mark.parametrize("fp32_weight_grad", [False, True])
@pytest.mark.parametrize("B, T, C, N", SHAPES[1:])
def test_the_mlp_under_autocast_within_twice_the_unfused_error(B, T, C, N, fp32_weight_grad):
    """gelu_mlp() on fp32 parameters under bf16 autocast, as the model runs it: the output and the gradients of x
    and of every parameter within twice the unfused autocast MLP's error against fp64."""
    inputs = _mlp_inputs(B, T, C, N, device="cuda", dtype=torch.float32, seed=C)
    dy = torch.randn(B, T, C, device="cuda")

    def run(fn, tensors, autocast=True):
        tensors = [t.detach().requires_grad_() for t in tensors]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*tensors)
        return [out, *torch.autograd.grad(out, tensors, dy.to(out.dtype))]

    assert gelu_mlp.runs_here(inputs[0], inputs[1]) is False  # fp32 weights without autocast
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert gelu_mlp.runs_here(inputs[0], inputs[1])
    got = run(lambda *a: gelu_mlp.gelu_mlp(*a, fp32_weight_grad=fp32_weight_grad), inputs)
    ref = run(unfused_mlp, [t.double() for t in inputs], autocast=False)
    plain = run(unfused_mlp, inputs)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[1:])
    _errors_within_twice_the_unfused(got, ref, plain, torch.bfloat16, ("out", "dx", "dw1", "db1", "dw2", "db2"))


@needs_epilogues
@pytest.mark.gpu
def test_the_epilogues_run_inside_a_compiled_model():
    """Under torch.compile(fullgraph=True) the two ops are traced as themselves: the values and gradients are
    eager's, and opcheck passes on GPU tensors."""
    inputs = _mlp_inputs(2, 129, 64, 256, device="cuda", dtype=torch.float32)
    dy = torch.randn(2, 129, 64, device="cuda", dtype=torch.bfloat16)

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in inputs]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(*leaves)
        out.backward(dy)
        return [out.detach()] + [t.grad for t in leaves]

    fn = lambda *a: gelu_mlp.gelu_mlp(*a) * 2  # noqa: E731
    for e, c in zip(step(fn), step(torch.compile(fn, fullgraph=True))):
        torch.testing.assert_close(c, e, rtol=1e-2, atol=1e-2)
    x, w1, b1, w2, _ = (t.detach().bfloat16() for t in inputs)
    x2 = x.reshape(-1, x.shape[-1])
    torch.library.opcheck(torch.ops.fa2_gpt.linear_gelu.default, (x2, w1, b1))
    torch.library.opcheck(torch.ops.fa2_gpt.linear_dgelu.default, (dy.reshape(-1, 64), w2, x2 @ w1.t()))


@needs_epilogues
@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_a_gpt_trains_with_the_epilogues_as_without(compile):
    """GPT3-style (LayerNorm, GELU, biases) training steps with gelu_epilogue: the MLPs take the fused function, and
    the loss of each of five AdamW steps is the unfused model's within bf16's spread."""
    cfg = dict(n_layer=2, n_head=4, d_model=128, vocab_size=256, seq_len=64, attention="sdpa")
    x = torch.randint(0, 256, (4, 64), device="cuda")

    def losses(**options):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg, **options)).cuda()
        assert all(b.mlp.gelu_epilogue == bool(options) for b in model.blocks)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fwd = torch.compile(model) if compile else model
        out = []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = next_token_loss(fwd(x), x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    fused, plain = losses(gelu_epilogue=True), losses()
    assert fused[-1] < fused[0]
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=1e-2, atol=1e-2)
