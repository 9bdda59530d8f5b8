"""CPU tests of flash_kernel/reference.py: the tiled FA2 algorithm (Alg. 1 fwd, Alg. 2 bwd) against the
materialised-softmax oracle in float64, over causal/non-causal, odd lengths, Tq != Tk (bottom-right
causal), GQA/MQA, head dims 32/80, several tile shapes, and rows that see no key at all."""

import math

import pytest
import torch

from flash_kernel.reference import naive_attention, reference_attn_func, reference_bwd, reference_fwd

F64_TOL = 1e-10  # float64 tiling vs float64 oracle: only summation order differs

SEQLENS = [(1, 1), (17, 17), (113, 113), (17, 113), (113, 17), (1, 113), (113, 1)]
HEADS = [(2, 2), (4, 1), (6, 2)]  # (Hq, Hkv): MHA, MQA, GQA with 3 query heads per kv head


def _inputs(B, seqlen_q, seqlen_k, Hq, Hkv, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seqlen_q, Hq, D, generator=g, dtype=dtype)  # (B, Tq, Hq, D)
    k = torch.randn(B, seqlen_k, Hkv, D, generator=g, dtype=dtype)  # (B, Tk, Hkv, D)
    v = torch.randn(B, seqlen_k, Hkv, D, generator=g, dtype=dtype)
    do = torch.randn(B, seqlen_q, Hq, D, generator=g, dtype=dtype)
    return q, k, v, do


def _naive_grads(q, k, v, do, causal, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = naive_attention(q, k, v, causal, scale)
    o.backward(do)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def _max_err(a, b):
    # Equal infinities (lse of rows that see no key) count as exact; NaN makes the max NaN and fails `<`.
    return torch.where(a == b, 0.0, (a.double() - b.double()).abs()).max().item()


@pytest.mark.parametrize("D", [32, 80])
@pytest.mark.parametrize("Hq,Hkv", HEADS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_bwd_match_naive_float64(causal, seqlen_q, seqlen_k, Hq, Hkv, D):
    q, k, v, do = _inputs(2, seqlen_q, seqlen_k, Hq, Hkv, D, seed=seqlen_q * 1000 + seqlen_k + D)
    scale = None
    # 16 x 32 tiles so that even 17-long sequences cross tile edges in both directions.
    o, lse = reference_fwd(q, k, v, causal, scale, block_m=16, block_n=32)
    dq, dk, dv = reference_bwd(do, q, k, v, o, lse, causal, scale, block_m=16, block_n=32)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = _naive_grads(q, k, v, do, causal, scale)

    assert o.shape == q.shape and lse.shape == (2, Hq, seqlen_q) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert _max_err(o, o_ref) < F64_TOL
    assert _max_err(lse, lse_ref.float()) < 1e-5  # lse is returned in float32 by contract
    for name, ours, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        # lse was rounded to float32, so P recomputed from it carries ~1e-7 relative error.
        assert _max_err(ours, ref) < 1e-5 * max(1.0, ref.abs().max().item()), name


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (16, 16), (32, 128), (128, 16), (7, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_shape_does_not_change_result(causal, block_m, block_n):
    q, k, v, do = _inputs(1, 150, 130, 4, 2, 32, seed=7)
    o, lse = reference_fwd(q, k, v, causal, 0.3, block_m, block_n)
    dq, dk, dv = reference_bwd(do, q, k, v, o, lse, causal, 0.3, block_m, block_n)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = _naive_grads(q, k, v, do, causal, 0.3)
    assert _max_err(o, o_ref) < F64_TOL
    assert _max_err(lse, lse_ref.float()) < 1e-5
    for ours, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert _max_err(ours, ref) < 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("scale", [0.05, 1.0, 2.5])
def test_softmax_scale(scale):
    q, k, v, _ = _inputs(1, 33, 45, 2, 1, 32, seed=3)
    o, lse = reference_fwd(q, k, v, True, scale, 16, 16)
    o_ref, lse_ref = naive_attention(q, k, v, True, scale)
    assert _max_err(o, o_ref) < F64_TOL
    assert _max_err(lse, lse_ref.float()) < 1e-5 * max(1.0, lse_ref.abs().max().item())


def test_causal_is_bottom_right_aligned():
    # With Tq < Tk the last query sees every key; query i sees keys j <= i + Tk - Tq (flash-attn convention).
    seqlen_q, seqlen_k = 3, 8
    q, k, v, _ = _inputs(1, seqlen_q, seqlen_k, 1, 1, 8, seed=1)
    o, _ = reference_fwd(q, k, v, True, None, 2, 2)
    for i in range(seqlen_q):
        n_visible = i + seqlen_k - seqlen_q + 1
        o_i, _ = naive_attention(q[:, i : i + 1], k[:, :n_visible], v[:, :n_visible], causal=False)
        assert _max_err(o[:, i : i + 1], o_i) < F64_TOL


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (4, 4), (8, 3)])
def test_rows_that_see_no_key_are_zero_not_nan(block_m, block_n):
    # Causal with Tq > Tk: the first Tq - Tk queries see no key. The kernel contract: o = 0, lse = +inf,
    # zero dq there, and no NaN anywhere (including dk/dv, which only the visible rows feed).
    seqlen_q, seqlen_k = 20, 5
    empty_rows = seqlen_q - seqlen_k
    q, k, v, do = _inputs(2, seqlen_q, seqlen_k, 4, 2, 16, seed=11)
    o, lse = reference_fwd(q, k, v, True, None, block_m, block_n)
    dq, dk, dv = reference_bwd(do, q, k, v, o, lse, True, None, block_m, block_n)
    for t in (o, lse, dq, dk, dv):
        assert not t.isnan().any()
    assert (o[:, :empty_rows] == 0).all()
    assert torch.isposinf(lse[:, :, :empty_rows]).all()
    assert torch.isfinite(lse[:, :, empty_rows:]).all()
    assert (dq[:, :empty_rows] == 0).all()
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = _naive_grads(q, k, v, do, True, None)
    assert _max_err(o, o_ref) < F64_TOL and _max_err(lse, lse_ref.float()) < 1e-5
    for ours, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert not ref.isnan().any()  # the oracle itself must not be the thing that NaNs
        assert _max_err(ours, ref) < 1e-5 * max(1.0, ref.abs().max().item())


def test_empty_rows_through_autograd_function():
    q, k, v, do = _inputs(1, 9, 4, 2, 1, 8, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = reference_attn_func(q, k, v, causal=True)
    o.backward(do)
    assert (o[:, :5] == 0).all()
    for g in (q.grad, k.grad, v.grad):
        assert g is not None and torch.isfinite(g).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_return_input_dtype(dtype):
    q, k, v, do = (t.to(dtype) for t in _inputs(2, 40, 40, 4, 2, 32, seed=2))
    o, lse = reference_fwd(q, k, v, True, None)
    dq, dk, dv = reference_bwd(do, q, k, v, o, lse, True, None)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    # Computed in float32 internally: as close to the float64 oracle as the output rounding allows.
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = _naive_grads(q.double(), k.double(), v.double(), do.double(), True, None)
    # Output rounding (eps of the dtype) plus float32 accumulation (~1e-6 relative).
    tol = torch.finfo(dtype).eps + 1e-5
    assert _max_err(o, o_ref) <= tol * o_ref.abs().max().item()
    assert _max_err(lse, lse_ref) < 1e-4
    for ours, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert _max_err(ours, ref) <= 2 * tol * ref.abs().max().item()


def test_strided_views_of_fused_qkv():
    B, T, H, D = 2, 37, 3, 16
    qkv = torch.randn(B, T, 3, H, D, dtype=torch.float64)  # the model's fused projection, (B, T, 3, H, D)
    q, k, v = qkv.unbind(dim=2)  # (B, T, H, D) each, non-contiguous views
    o, lse = reference_fwd(q, k, v, True, None, 16, 16)
    o_ref, lse_ref = naive_attention(q.contiguous(), k.contiguous(), v.contiguous(), True)
    assert _max_err(o, o_ref) < F64_TOL


def test_reference_attn_func_gradcheck():
    q, k, v, _ = _inputs(1, 6, 9, 4, 2, 8, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda q, k, v: reference_attn_func(q, k, v, causal, None, 4, 4), (q, k, v))


def test_reference_attn_func_matches_naive_autograd():
    q, k, v, do = _inputs(2, 50, 70, 6, 3, 32, seed=9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference_attn_func(*leaves, causal=True, softmax_scale=0.2).backward(do)
    o_ref, _, dq_ref, dk_ref, dv_ref = _naive_grads(q, k, v, do, True, 0.2)
    for leaf, ref in zip(leaves, (dq_ref, dk_ref, dv_ref)):
        assert _max_err(leaf.grad, ref) < 1e-5 * max(1.0, ref.abs().max().item())


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, _ = _inputs(1, 10, 10, 1, 1, 64, seed=6)
    o_default, _ = reference_fwd(q, k, v, False, None)
    o_explicit, _ = reference_fwd(q, k, v, False, 1 / math.sqrt(64))
    assert torch.equal(o_default, o_explicit)


def test_shape_errors():
    q, k, v, _ = _inputs(1, 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        reference_fwd(q, k, v, True, None)
