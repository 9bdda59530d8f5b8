"""GPU correctness of flash_kernel's varlen (packed sequences) forward and backward, with causal masks and sliding
windows, against a per-sequence dense fp32 reference (flash_kernel.reference.naive_attention_varlen).

Criterion: flash-attn's, as in test_flash_kernel.py (max error vs the fp32 reference within twice PyTorch's own
error in the same low precision, plus a rounding slack), for o, lse, dq, dk, dv. Outputs are NaN-poisoned before the
kernels write them, so rows a kernel forgets (or, in a zero-length sequence, must not touch) show. Every case runs
under both kernel paths: "default" (what a GPU picks) and "sm80" (kernel_overrides(fwd="sm80", bwd="sm80")), so the
Hopper kernels are covered by the same cases wherever they take varlen calls.
"""

import contextlib
import math
import random

import pytest
import torch

import flash_kernel
from flash_kernel import flash_attn_varlen_func
from flash_kernel.interface import _load_C, kernel_overrides
from flash_kernel.reference import naive_attention_varlen
from test_flash_kernel import DTYPE_IDS, DTYPES, LSE_RTOL, SMEM_LIMITS, assert_flash_close, max_err

pytestmark = pytest.mark.gpu

PATHS = ["default", "sm80"]
HEAD_DIMS = [32, 64, 80, 96, 128, 256]  # 80 runs the 96 kernels with zero-filled columns
# (len_q, len_k) per sequence: empty sequences (q, k or both), length 1, shorter than one tile, several tiles, and
# unequal q and k lengths either way (causal then leaves rows without keys, bottom-right aligned).
MIXED = [(0, 0), (1, 1), (17, 17), (0, 5), (5, 0), (130, 130), (300, 257), (1, 300), (200, 45), (64, 64)]
WINDOWS = [(-1, -1), (37, 5), (0, 0)]


def _path(path: str):
    """"sm80": the mma.sync kernels on every GPU; "default": what the GPU picks; "current": the overrides as set."""
    if path == "current":
        return contextlib.nullcontext()
    return kernel_overrides(fwd="sm80", bwd="sm80") if path == "sm80" else kernel_overrides()


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device="cuda")


def varlen_inputs(pairs, Hq, Hkv, D, dtype):
    lens_q, lens_k = [p[0] for p in pairs], [p[1] for p in pairs]
    total_q, total_k = sum(lens_q), sum(lens_k)
    q = torch.randn(total_q, Hq, D, device="cuda", dtype=dtype)  # (total_q, Hq, D)
    k = torch.randn(total_k, Hkv, D, device="cuda", dtype=dtype)  # (total_k, Hkv, D)
    v = torch.randn(total_k, Hkv, D, device="cuda", dtype=dtype)
    do = torch.randn(total_q, Hq, D, device="cuda", dtype=dtype)
    return q, k, v, do, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k)


def kernel_varlen(q, k, v, do, cu_q, cu_k, max_q, max_k, causal, window, scale, deterministic=False):
    """_C.varlen_fwd and _C.varlen_bwd into NaN-poisoned outputs: o, lse (Hq, total_q), dq, dk, dv."""
    C = _load_C()
    o, lse = _poisoned(q.shape, q.dtype), _poisoned((q.shape[1], q.shape[0]), torch.float32)
    C.varlen_fwd(q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal, *window)
    dq, dk, dv = _poisoned(q.shape, q.dtype), _poisoned(k.shape, k.dtype), _poisoned(v.shape, v.dtype)
    C.varlen_bwd(do, q, k, v, o, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, *window)
    return o, lse, dq, dk, dv


def reference_varlen(q, k, v, do, cu_q, cu_k, causal, window, scale, upcast):
    """o, lse, dq, dk, dv of the per-sequence dense attention: fp32 (upcast) or the inputs' own dtype."""
    leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    o, lse = naive_attention_varlen(*leaves, cu_q, cu_k, causal, scale, upcast, window)
    if o.numel():
        o.backward(do.to(o.dtype))
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return (o.detach(), lse.detach().float(), *grads)


def check_varlen(outs, q, k, v, do, cu_q, cu_k, causal, window, scale, case):
    ref = reference_varlen(q, k, v, do, cu_q, cu_k, causal, window, scale, upcast=True)
    pt = reference_varlen(q, k, v, do, cu_q, cu_k, causal, window, scale, upcast=False)
    for name, ours, r, p in zip(("o", "lse", "dq", "dk", "dv"), outs, ref, pt):
        assert ours.shape == r.shape, f"{name} shape {tuple(ours.shape)} != {tuple(r.shape)} ({case})"
        if ours.numel() == 0:
            continue
        assert_flash_close(name, ours, r, p, torch.float32 if name == "lse" else q.dtype, case)
        if name != "lse":
            assert torch.isfinite(ours).all(), f"{name} has inf ({case})"
    lse, lse_ref = outs[1], ref[1]
    finite = torch.isfinite(lse_ref)
    if finite.any():
        tol = LSE_RTOL * max(1.0, lse_ref[finite].abs().max().item())
        assert max_err(lse, lse_ref) <= tol, f"lse ({case}): {max_err(lse, lse_ref):.3g} > {tol:.3g}"
    assert torch.equal(torch.isinf(lse), ~finite), f"lse: rows without keys must be +inf, and only they ({case})"


def run_varlen(pairs, Hq, Hkv, D, dtype, causal, window, path, deterministic=False):
    q, k, v, do, cu_q, cu_k, max_q, max_k = varlen_inputs(pairs, Hq, Hkv, D, dtype)
    scale = 1.0 / math.sqrt(D)
    case = f"{pairs} Hq={Hq} Hkv={Hkv} D={D} {dtype} causal={causal} window={window} path={path}"
    with _path(path):
        outs = kernel_varlen(q, k, v, do, cu_q, cu_k, max_q, max_k, causal, window, scale, deterministic)
        check_varlen(outs, q, k, v, do, cu_q, cu_k, causal, window, scale, case)
        if deterministic:
            again = kernel_varlen(q, k, v, do, cu_q, cu_k, max_q, max_k, causal, window, scale, deterministic)
            for name, a, b in zip(("dq", "dk", "dv"), outs[2:], again[2:]):
                assert torch.equal(a, b), f"deterministic {name} differs between two runs ({case})"


# ------------------------------------------------------------------------------------------------- the grid
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_grid(dtype, D, causal, gqa, window, path):
    run_varlen(MIXED, 2 * gqa, 2, D, dtype, causal, window, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_varlen_random_lengths(D, causal, seed, path):
    rng = random.Random(seed)
    pairs = []
    for _ in range(rng.randint(1, 12)):
        len_q = rng.choice([0, 1, rng.randint(2, 63), rng.randint(64, 700)])
        len_k = len_q if rng.random() < 0.6 else rng.choice([0, 1, rng.randint(2, 700)])
        pairs.append((len_q, len_k))
    window = rng.choice([(-1, -1), (rng.randint(0, 300), rng.randint(-1, 40)), (-1, rng.randint(0, 64))])
    run_varlen(pairs, 4, 2, D, torch.bfloat16, causal, window, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [(-1, -1), (100, 0)], ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_varlen_deterministic_bitwise(D, window, path):
    run_varlen([(300, 300), (0, 7), (129, 517), (1, 1)], 4, 1, D, torch.float16, True, window, path, deterministic=True)


@pytest.mark.parametrize("path", PATHS)
def test_varlen_long_sequences(path):
    run_varlen([(2049, 2049), (1500, 3000), (3000, 1100)], 8, 2, 128, torch.bfloat16, True, (-1, -1), path)
    run_varlen([(2049, 2049), (1023, 1023)], 8, 2, 64, torch.bfloat16, False, (256, 0), path)


@pytest.mark.parametrize("limit", sorted(SMEM_LIMITS))
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_varlen_smaller_smem_configs(overrides, D, limit):
    # The configs an A100 or an sm_86 / sm_89 GPU runs, chosen here by the max_smem_per_block override.
    overrides(fwd="sm80", bwd="sm80", max_smem_per_block=SMEM_LIMITS[limit])
    run_varlen(MIXED, 4, 2, D, torch.bfloat16, True, (37, 0), "current")
    run_varlen(MIXED[:6], 2, 2, D, torch.float16, False, (-1, -1), "current", deterministic=True)


def test_varlen_all_sequences_empty():
    # No rows at all on the query side, or no keys: no launch may fail and the gradients are 0.
    for pairs in ([(0, 5), (0, 3)], [(4, 0), (2, 0)]):
        run_varlen(pairs, 2, 2, 64, torch.bfloat16, False, (-1, -1), "default")


def test_max_seqlen_above_the_longest_sequence():
    # max_seqlen only sizes the grid: blocks past every sequence's end exit without writing.
    q, k, v, do, cu_q, cu_k, max_q, max_k = varlen_inputs([(70, 70), (3, 130)], 4, 2, 64, torch.float16)
    scale = 0.125
    outs = kernel_varlen(q, k, v, do, cu_q, cu_k, max_q + 300, max_k + 500, True, (-1, -1), scale)
    check_varlen(outs, q, k, v, do, cu_q, cu_k, True, (-1, -1), scale, "max_seqlen + 300/500")


# ---------------------------------------------------------------------------------------- the Python entry
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_autograd(causal):
    q, k, v, do, cu_q, cu_k, max_q, max_k = varlen_inputs(MIXED, 4, 2, 64, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=causal, window_size=(50, 3))
    o.backward(do)
    ref = reference_varlen(q, k, v, do, cu_q, cu_k, causal, (50, 3), 0.125, upcast=True)
    pt = reference_varlen(q, k, v, do, cu_q, cu_k, causal, (50, 3), 0.125, upcast=False)
    for name, ours, r, p in zip(("o", "dq", "dk", "dv"), (o, *(t.grad for t in leaves)), ref[:1] + ref[2:],
                                pt[:1] + pt[2:]):
        assert_flash_close(name, ours, r, p, q.dtype, f"flash_attn_varlen_func causal={causal}")


def test_varlen_ops_opcheck_and_compile():
    q, k, v, do, cu_q, cu_k, max_q, max_k = varlen_inputs([(33, 33), (0, 2), (70, 90)], 4, 2, 64, torch.bfloat16)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, 0.125, True, -1, -1, False)
    torch.library.opcheck(torch.ops.flash_kernel.varlen_fwd.default, args)
    o, lse = torch.ops.flash_kernel.varlen_fwd(*args)
    torch.library.opcheck(torch.ops.flash_kernel.varlen_bwd.default,
                          (do, q, k, v, cu_q, cu_k, o, lse, max_q, max_k, 0.125, True, -1, -1, False))

    def loss(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).float().square().sum()

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = loss(*leaves)
    eager.backward()
    compiled_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(loss, fullgraph=True)(*compiled_leaves)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_leaves, leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_bad_cu_seqlens_values_are_refused_before_a_launch():
    q, k, v, _, cu_q, cu_k, max_q, max_k = varlen_inputs([(10, 10), (20, 20)], 2, 2, 64, torch.bfloat16)
    bad = {
        "must be non-decreasing": torch.tensor([0, 31, 30], dtype=torch.int32, device="cuda"),
        "must be 0": torch.tensor([1, 10, 30], dtype=torch.int32, device="cuda"),
        "packed length": torch.tensor([0, 10, 29], dtype=torch.int32, device="cuda"),
    }
    for msg, cu in bad.items():
        with pytest.raises(ValueError, match=msg):
            flash_attn_varlen_func(q, k, v, cu, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="more than max_seqlen_q"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, max_k)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    # A tensor that passed is not read again until it changes (its version counter moves).
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    cu_q[1] = 25
    with pytest.raises(ValueError, match="more than max_seqlen_q"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    assert flash_kernel.is_available()
