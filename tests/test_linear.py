"""model/linear.py: weight gradients in fp32 out of the matmul. On the CPU the autograd function itself (its
fallback product is the GPU's fp32 output by definition) and where the option applies; on a GPU against autocast's
nn.Linear."""

import pytest
import torch
import torch.nn.functional as F

from model.gpt import GPT, GPTConfig
from model.linear import Linear, LinearFp32WeightGrad, linear, mm_fp32, takes_fp32_weight_grad


def _operands(shape=(2, 5, 8), out=6, bias=True, x_dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=device).to(x_dtype).requires_grad_()
    w = torch.randn(out, shape[-1], generator=g, device=device).requires_grad_()
    b = torch.randn(out, generator=g, device=device).requires_grad_() if bias else None
    dy = torch.randn(*shape[:-1], out, generator=g, device=device)
    return x, w, b, dy


def _grads(fn, x, w, b, dy):
    out = fn(x, w, b)
    out.backward(dy.to(out.dtype))
    return out.detach(), x.grad, w.grad, None if b is None else b.grad


def test_in_fp32_the_function_is_f_linear():
    ours = _grads(lambda x, w, b: LinearFp32WeightGrad.apply(x, w, b, torch.float32), *_operands())
    plain = _grads(F.linear, *_operands())
    for a, p in zip(ours, plain):
        torch.testing.assert_close(a, p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_in_bf16_the_weight_gradient_is_the_unrounded_product(bias, x_dtype):
    x, w, b, dy = _operands(bias=bias, x_dtype=x_dtype)
    out, dx, dw, db = _grads(lambda x, w, b: LinearFp32WeightGrad.apply(x, w, b, torch.bfloat16), x, w, b, dy)
    x16, w16, dy16 = x.detach().bfloat16(), w.detach().bfloat16(), dy.bfloat16()
    assert torch.equal(out, F.linear(x16, w16, None if b is None else b.detach().bfloat16()))  # autocast's forward
    assert dx.dtype == x_dtype and torch.equal(dx, (dy16 @ w16).to(x_dtype))
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw, dy16.reshape(-1, 6).float().t() @ x16.reshape(-1, 8).float(), rtol=1e-6, atol=1e-6)
    if bias:
        assert db.dtype == torch.float32 and torch.equal(db, dy16.reshape(-1, 6).sum(0, dtype=torch.float32))


def test_mm_fp32_off_the_gpu_multiplies_the_upcast_operands():
    a, b = torch.randn(3, 4).bfloat16(), torch.randn(4, 5).bfloat16()
    assert torch.equal(mm_fp32(a, b), a.float() @ b.float())


def test_the_option_runs_only_eager_on_a_gpu_under_low_precision_autocast():
    x, w, _, _ = _operands()
    assert not takes_fp32_weight_grad(x, w)  # CPU tensors
    layer = Linear(8, 6, fp32_weight_grad=True)
    plain = torch.nn.Linear(8, 6)
    plain.load_state_dict(layer.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), plain(x))  # off the GPU: F.linear as it is


def test_the_option_keeps_the_models_parameters_and_names():
    cfg = dict(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64)
    plain, ours = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, fp32_weight_grad=True))
    assert list(plain.state_dict()) == list(ours.state_dict())
    assert all(m.fp32_weight_grad for m in ours.modules() if isinstance(m, Linear))
    assert ours.lm_head.weight is ours.wte.weight  # still tied


# --- GPU: against autocast's nn.Linear ---------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's fp32-output matmul: needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape, out", [((2, 7, 64), 96), ((1, 333, 128), 384), ((4, 64, 200), 1000)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_forward_is_autocasts_and_the_weight_gradient_is_closer(shape, out, bias, x_dtype):
    ops = _operands(shape, out, bias, x_dtype, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert takes_fp32_weight_grad(ops[0], ops[1])
        ours = _grads(lambda x, w, b: linear(x, w, b, fp32_weight_grad=True), *ops)
    plain_ops = _operands(shape, out, bias, x_dtype, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = _grads(F.linear, *plain_ops)
    assert torch.equal(ours[0], plain[0])  # the forward: the same bf16 matmul on the same operands
    torch.testing.assert_close(ours[1], plain[1], rtol=2**-7, atol=1e-5)  # the input's: a bf16 matmul either way
    x, w, b, dy = ops
    exact = dy.bfloat16().reshape(-1, out).double().t() @ x.detach().bfloat16().reshape(-1, shape[-1]).double()
    err_ours, err_plain = (ours[2].double() - exact).norm(), (plain[2].double() - exact).norm()
    assert err_ours <= err_plain and err_ours <= 1e-5 * exact.norm()
    assert (ours[2] - plain[2]).norm() <= 2**-8 * exact.norm()  # apart by bf16's rounding of the plain one
    if bias:
        torch.testing.assert_close(ours[3], plain[3], rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@gpu
def test_on_a_gpu_a_training_step_with_the_option_has_the_same_loss():
    cfg = dict(n_layer=2, n_head=4, d_model=128, seq_len=64, vocab_size=512, attention="sdpa")
    idx = torch.randint(0, 512, (4, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for option in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg, fp32_weight_grad=option)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(idx[:, :-1]).float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_plain, g_plain), (loss_ours, g_ours) = results
    assert torch.equal(loss_plain, loss_ours)  # the forward's bits are autocast's
    for name, grad in g_plain.items():
        assert g_ours[name].dtype == torch.float32
        assert (g_ours[name] - grad).norm() <= 2**-7 * grad.norm() + 1e-6, name


@pytest.mark.gpu
@gpu
def test_on_a_gpu_the_option_stays_out_of_fp32_no_grad_and_flop_counting():
    from torch.utils.flop_counter import FlopCounterMode

    x, w, _, _ = _operands(device="cuda")
    assert not takes_fp32_weight_grad(x, w)  # no autocast: the matmul is fp32 already
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert takes_fp32_weight_grad(x, w)
        assert not takes_fp32_weight_grad(x, w.detach().bfloat16())  # FSDP's gathered bf16 weight
        with torch.no_grad():
            assert not takes_fp32_weight_grad(x, w)
        with FlopCounterMode(display=False) as counter:
            assert not takes_fp32_weight_grad(x, w)
            linear(x, w, None, fp32_weight_grad=True).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 10 * 8 * 6  # forward and both gradients, as for F.linear
