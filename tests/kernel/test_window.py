"""GPU correctness of sliding-window (local) attention in the dense functions: flash_attn_func and
flash_attn_qkvpacked_func with window_size=(left, right), FlashAttention's semantics (query i sees key j iff
i + Tk - Tq - left <= j <= i + Tk - Tq + right, -1 unbounded, causal making right 0), forward and backward, against
flash_kernel.naive_attention with the same window, with the flash-attn error criterion of test_flash_kernel.py,
under both kernel paths ("default" and kernel_overrides(fwd="sm80", bwd="sm80"))."""

import math

import pytest
import torch

from flash_kernel import flash_attn_func, flash_attn_qkvpacked_func, naive_attention
from flash_kernel.interface import _load_C, kernel_overrides
from test_flash_kernel import DTYPE_IDS, DTYPES, assert_flash_close, max_err

pytestmark = pytest.mark.gpu

PATHS = ["default", "sm80"]
WINDOWS = [(0, 0), (1, 0), (64, 0), (100, 50), (-1, 10), (10, -1), (0, -1), (300, 300)]
SEQLENS = [(1, 1), (113, 113), (255, 17), (17, 255), (1023, 1023), (700, 1500)]


def _path(path: str):
    return kernel_overrides(fwd="sm80", bwd="sm80") if path == "sm80" else kernel_overrides()


def reference(q, k, v, do, causal, window, scale, upcast):
    leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    o, lse = naive_attention(*leaves, causal=causal, softmax_scale=scale, upcast=upcast, window_size=window)
    o.backward(do.to(o.dtype))
    return (o.detach(), lse.detach().float(), *(t.grad for t in leaves))


def run_window(B, seqlen_q, seqlen_k, Hq, Hkv, D, dtype, causal, window, path, deterministic=False):
    q = torch.randn(B, seqlen_q, Hq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, seqlen_k, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, seqlen_k, Hkv, D, device="cuda", dtype=dtype)
    do = torch.randn(B, seqlen_q, Hq, D, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(D)
    case = f"B={B} Tq={seqlen_q} Tk={seqlen_k} Hq={Hq} Hkv={Hkv} D={D} {dtype} causal={causal} window={window} {path}"
    C = _load_C()
    with _path(path):
        o = torch.full_like(q, math.nan)
        lse = torch.full((B, Hq, seqlen_q), math.nan, device="cuda")
        C.fwd(q, k, v, o, lse, scale, causal, *window)
        grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
        C.bwd(do, q, k, v, o, lse, *grads, scale, causal, deterministic, *window)
        if deterministic:
            again = [torch.full_like(t, math.nan) for t in (q, k, v)]
            C.bwd(do, q, k, v, o, lse, *again, scale, causal, True, *window)
            assert all(torch.equal(a, b) for a, b in zip(grads, again)), f"deterministic backward differs ({case})"
    ref = reference(q, k, v, do, causal, window, scale, upcast=True)
    pt = reference(q, k, v, do, causal, window, scale, upcast=False)
    for name, ours, r, p in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), ref, pt):
        assert_flash_close(name, ours, r, p, torch.float32 if name == "lse" else dtype, case)
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isinf(lse), ~finite), f"lse: rows without keys must be +inf, and only they ({case})"
    if finite.any():
        assert max_err(lse, ref[1]) <= 1e-3 * max(1.0, ref[1][finite].abs().max().item()), case


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_window_grid(D, causal, seqlen_q, seqlen_k, window, path):
    run_window(2, seqlen_q, seqlen_k, 4, 2, D, torch.bfloat16, causal, window, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 80, 96, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_window_other_head_dims(dtype, D, causal, path):
    run_window(1, 300, 257, 4, 1, D, dtype, causal, (70, 20), path)


@pytest.mark.parametrize("window", [(-1, -1), (128, 0), (5, 5)], ids=str)
def test_window_deterministic_bitwise(window):
    run_window(1, 333, 517, 4, 2, 128, torch.float16, True, window, "default", deterministic=True)


def test_causal_with_right_window_is_plain_causal():
    # FlashAttention's rule: causal sets right = 0, so (-1, 7) with causal is causal attention exactly.
    q, k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True, window_size=(-1, 7)),
                               flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_window_through_the_user_functions(causal):
    qkv = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    o = flash_attn_qkvpacked_func(qkv, causal=causal, window_size=(40, 8))
    do = torch.randn_like(o)
    o.backward(do)
    ref = reference(*qkv.detach().unbind(2), do, causal, (40, 8), 0.125, upcast=True)
    pt = reference(*qkv.detach().unbind(2), do, causal, (40, 8), 0.125, upcast=False)
    assert_flash_close("o", o, ref[0], pt[0], o.dtype, "qkvpacked window")
    for name, g, r, p in zip(("dq", "dk", "dv"), qkv.grad.unbind(2), ref[2:], pt[2:]):
        assert_flash_close(name, g, r, p, o.dtype, "qkvpacked window")
    leaves = [t.detach().requires_grad_() for t in qkv.detach().unbind(2)]
    o2 = flash_attn_func(*leaves, causal=causal, window_size=(40, 8))
    torch.testing.assert_close(o2, o, rtol=0, atol=0)


def test_window_ops_opcheck_and_compile():
    q, k, v = (torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.library.opcheck(torch.ops.flash_kernel.fwd.default, (q, k, v, 0.125, True, False, 16, 0))

    def loss(q, k, v):
        return flash_attn_func(q, k, v, causal=False, window_size=(16, 4)).float().square().sum()

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    loss(*leaves).backward()
    compiled_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.compile(loss, fullgraph=True)(*compiled_leaves).backward()
    for a, b in zip(compiled_leaves, leaves):
        torch.testing.assert_close(a.grad, b.grad)
