"""CPU tests of the varlen and sliding-window face of flash_kernel: the named errors on bad input (before any
launch), the per-sequence reference, the FLOP formula over the unmasked pairs, and the ops' autograd, opcheck and
torch.compile through a CPU stand-in for flash_kernel._C (the GPU kernels are tests/kernel/test_varlen.py's)."""

import types

import pytest
import torch

import flash_kernel
from flash_kernel import interface
from flash_kernel.flop_count import visible_pairs
from flash_kernel.reference import naive_attention, naive_attention_varlen, visible_keys

LENGTHS = [(3, 3), (0, 2), (5, 0), (1, 1), (6, 9)]  # (len_q, len_k) per sequence, empty ones included


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(pairs=LENGTHS, Hq=4, Hkv=2, D=16, dtype=torch.float32):
    lens_q, lens_k = [p[0] for p in pairs], [p[1] for p in pairs]
    q = torch.randn(sum(lens_q), Hq, D, dtype=dtype)
    k = torch.randn(sum(lens_k), Hkv, D, dtype=dtype)
    v = torch.randn(sum(lens_k), Hkv, D, dtype=dtype)
    return q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k)


# ------------------------------------------------------------------------------------------------ validation
def _check(q, k, v, cu_q, cu_k, max_q, max_k):
    interface.check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k, check_device=False)
    interface.check_values_of_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)


def test_valid_varlen_inputs_pass():
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(dtype=torch.bfloat16)
    _check(q, k, v, cu_q, cu_k, max_q, max_k)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(cu_q=a["cu_q"].long()), "cu_seqlens_q has dtype torch.int64; expected torch.int32"),
        (lambda a: a.update(cu_k=a["cu_k"].float()), "cu_seqlens_k has dtype torch.float32"),
        (lambda a: a.update(cu_q=a["cu_q"][None]), "cu_seqlens_q must be 1-D"),
        (lambda a: a.update(cu_q=a["cu_q"][:1]), "cu_seqlens_q must be 1-D of length batch \\+ 1 >= 2"),
        (lambda a: a.update(cu_k=a["cu_k"][:-1]), "must have one length"),
        (lambda a: a.update(cu_k=a["cu_k"].to("meta")), "cu_seqlens_k is on meta but q is on cpu"),
        (lambda a: a.update(max_q=4.0), "max_seqlen_q must be a Python int"),
        (lambda a: a.update(max_k=-1), "max_seqlen_k must be a Python int >= 0"),
        (lambda a: a.update(q=a["q"][None]), "q must have 3 dims \\(total, H, D\\)"),
        (lambda a: a.update(q=a["q"].float()), "q has dtype torch.float32"),
    ],
)
def test_bad_varlen_metadata_is_named(change, message):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(dtype=torch.bfloat16)
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)
    change(args)
    with pytest.raises(ValueError, match=message):
        interface.check_varlen_inputs(*args.values(), check_device=False)


@pytest.mark.parametrize(
    "cu_q,max_q,message",
    [
        ([1, 3, 3, 8, 9, 15], 6, "cu_seqlens_q\\[0\\] is 1; it must be 0"),
        ([0, 3, 2, 8, 9, 15], 6, "must be non-decreasing, but cu_seqlens_q\\[2\\] = 2 < cu_seqlens_q\\[1\\] = 3"),
        ([0, 3, 3, 8, 9, 14], 6, "cu_seqlens_q\\[-1\\] is 14 but q has 15 rows"),
        ([0, 3, 3, 8, 9, 15], 5, "has 6 rows, more than max_seqlen_q = 5"),
    ],
)
def test_bad_cu_seqlens_values_are_named(cu_q, max_q, message):
    q, k, v, _, cu_k, _, max_k = _packed(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        _check(q, k, v, torch.tensor(cu_q, dtype=torch.int32), cu_k, max_q, max_k)


def test_cu_seqlens_values_are_read_once_per_version(monkeypatch):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(dtype=torch.bfloat16)
    reads = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **kw: reads.append(1) or stack(*a, **kw))
    for _ in range(3):
        interface.check_values_of_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    assert len(reads) > 0
    first = len(reads)
    interface.check_values_of_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    assert len(reads) == first, "an unchanged, checked cu_seqlens is read again"
    cu_q[-1] = 99  # an in-place write bumps the version counter: checked (and refused) again
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\] is 99"):
        interface.check_values_of_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    with pytest.raises(ValueError, match="more than max_seqlen_k"):  # another max_seqlen: checked again
        interface.check_values_of_cu_seqlens(_cu([3, 0]), cu_k, 3, k.shape[0], 3, max_k - 1)


def test_inference_tensors_are_checked_on_every_call(monkeypatch):
    """Lightning validates under torch.inference_mode, whose tensors have no version counter to cache on."""
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(dtype=torch.bfloat16)
    with torch.inference_mode():
        cu_q, cu_k = cu_q.clone(), cu_k.clone()
    reads = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **kw: reads.append(1) or stack(*a, **kw))
    interface.check_values_of_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    first = len(reads)
    interface.check_values_of_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    assert first > 0 and len(reads) == 2 * first
    with torch.inference_mode():
        bad = torch.tensor([1, q.shape[0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q\\[0\\] is 1"):
        interface.check_values_of_cu_seqlens(bad, cu_k[[0, -1]], q.shape[0], k.shape[0], max_q, k.shape[0])


def test_cu_seqlens_to_checks_on_the_host_and_marks_the_copy(monkeypatch):
    """A data pipeline's cu_seqlens, checked before it moves: the ops then never read it back (a device wait)."""
    reads = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **kw: reads.append(1) or stack(*a, **kw))
    cu = _cu([3, 0, 5, 1])  # 9 rows of q and k, sequences of at most 5
    for mode in (torch.enable_grad, torch.inference_mode):  # training, and Lightning's validation
        reads.clear()
        with mode():
            moved = interface.cu_seqlens_to(cu.clone(), "cpu", 9, 5)
            assert reads, "the values are checked on the way"
            checked = len(reads)
            interface.check_values_of_cu_seqlens(moved, moved, 9, 9, 5, 5)
        assert len(reads) == checked, f"under {mode.__name__}, the op's check reads the moved copy again"
        assert torch.equal(moved, cu)
    with pytest.raises(ValueError, match="more than max_seqlen_q = 4"):
        interface.cu_seqlens_to(cu, "cpu", 9, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\] is 9 but q has 10 rows"):
        interface.cu_seqlens_to(cu, "cpu", 10, 5)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1.5, 0), (True, 0), (3,), "ab", None])
def test_bad_window_is_named(window):
    with pytest.raises(ValueError, match="window_size"):
        interface._check_window(window)


def test_window_below_minus_one_refused_by_the_user_functions():
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="CUDA tensor|window_size"):
        flash_kernel.flash_attn_func(q, k, v, window_size=(-2, 0))
    qp, kp, vp, cu_q, cu_k, max_q, max_k = _packed(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensor"):  # the device, before anything reads cu_seqlens
        flash_kernel.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k)


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (2, 1), (0, 0), (-1, 3), (4, -1)])
def test_naive_attention_varlen_is_naive_attention_per_sequence(causal, window):
    q, k, v, cu_q, cu_k, _, _ = _packed(dtype=torch.float64)
    o, lse = naive_attention_varlen(q, k, v, cu_q, cu_k, causal, None, True, window)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for s in range(len(LENGTHS)):
        a, b, c, d = cu_q[s].item(), cu_q[s + 1].item(), cu_k[s].item(), cu_k[s + 1].item()
        if b == a:
            continue
        o_s, lse_s = naive_attention(q[None, a:b], k[None, c:d], v[None, c:d], causal, None, True, window)
        torch.testing.assert_close(o[a:b], o_s[0])
        torch.testing.assert_close(lse[:, a:b], lse_s[0])


def test_visible_keys_follow_flash_attention_semantics():
    # Tq = 3, Tk = 5: query i is aligned to key i + 2; window (1, 0) sees keys i + 1 .. i + 2.
    expected = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(visible_keys(3, 5, False, (1, 0)), expected)
    assert torch.equal(visible_keys(3, 5, True, (1, 7)), expected)  # causal makes right 0
    assert torch.equal(visible_keys(4, 4, True), torch.ones(4, 4, dtype=torch.bool).tril())
    assert not visible_keys(4, 2, True)[:2].any()  # Tq > Tk: the first Tq - Tk rows see nothing


def test_rows_without_keys_give_zero_and_inf():
    q, k, v, cu_q, cu_k, _, _ = _packed(dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    o, lse = naive_attention_varlen(*leaves, cu_q, cu_k, causal=False)
    rows = slice(cu_q[2].item(), cu_q[3].item())  # the sequence with 5 queries and no keys
    assert (o[rows] == 0).all() and torch.isinf(lse[:, rows]).all() and (lse[:, rows] > 0).all()
    o.sum().backward()
    assert (q.grad[rows] == 0).all() and all(torch.isfinite(t.grad).all() for t in leaves)


# ----------------------------------------------------------------------------------------------- FLOP count
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (2, 1), (0, 0), (-1, 3)])
def test_visible_pairs_counts_the_mask(causal, window):
    for seqlen_q, seqlen_k in ((5, 5), (3, 7), (7, 3), (0, 4), (4, 0)):
        expected = int(visible_keys(seqlen_q, seqlen_k, causal, window).sum())
        assert visible_pairs(seqlen_q, seqlen_k, causal, *window) == expected


# -------------------------------------------------------------------------------- the ops on a CPU stand-in
def _stand_in_C():
    """flash_kernel._C's varlen pair (and the dense pair with a window), computed by the fp32 reference."""

    def varlen_fwd(q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal, left=-1, right=-1):
        o_, lse_ = naive_attention_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, causal, scale, True, (left, right))
        o.copy_(o_)
        lse.copy_(lse_)

    def varlen_bwd(do, q, k, v, o, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, left=-1,
                   right=-1):
        # FA2's backward per sequence in fp32 (an op's implementation runs below autograd, so no autograd here).
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        n_rep = q.shape[1] // k.shape[1]
        dk.zero_()
        dv.zero_()
        for s in range(len(bounds_q) - 1):
            rows, keys = slice(bounds_q[s], bounds_q[s + 1]), slice(bounds_k[s], bounds_k[s + 1])
            q_s = q[rows].float().transpose(0, 1)  # (Hq, Tq, D)
            k_s = k[keys].float().transpose(0, 1).repeat_interleave(n_rep, 0)  # (Hq, Tk, D)
            v_s = v[keys].float().transpose(0, 1).repeat_interleave(n_rep, 0)
            do_s, o_s = do[rows].float().transpose(0, 1), o[rows].float().transpose(0, 1)
            mask = ~visible_keys(q_s.shape[1], k_s.shape[1], causal, (left, right))
            p = torch.exp((scale * q_s @ k_s.transpose(1, 2)).masked_fill(mask, -torch.inf) - lse[:, rows, None])
            ds = p * (do_s @ v_s.transpose(1, 2) - (do_s * o_s).sum(-1, keepdim=True))  # (Hq, Tq, Tk)
            dq[rows] = (scale * ds @ k_s).transpose(0, 1).to(dq.dtype)
            heads = (k.shape[1], n_rep, -1, k.shape[2])  # (Hkv, group, Tk, D): summed over the group
            dk[keys] = (scale * ds.transpose(1, 2) @ q_s).view(heads).sum(1).transpose(0, 1).to(dk.dtype)
            dv[keys] = (p.transpose(1, 2) @ do_s).view(heads).sum(1).transpose(0, 1).to(dv.dtype)

    return types.SimpleNamespace(varlen_fwd=varlen_fwd, varlen_bwd=varlen_bwd)


@pytest.fixture
def cpu_varlen(monkeypatch):
    monkeypatch.setattr(interface, "_load_C", _stand_in_C)
    check = interface.check_varlen_inputs
    monkeypatch.setattr(interface, "check_varlen_inputs", lambda *a, check_device=True: check(*a, check_device=False))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_autograd_through_the_ops(cpu_varlen, causal):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    o = flash_kernel.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=causal, window_size=(2, 1))
    do = torch.randn_like(o)
    o.backward(do)
    ref = [t.bfloat16().float().requires_grad_() for t in (q, k, v)]
    o_ref, _ = naive_attention_varlen(*ref, cu_q, cu_k, causal, None, True, (2, 1))
    o_ref.backward(do.float())
    torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=2e-2)
    for ours, r in zip(leaves, ref):
        assert ours.grad.dtype == torch.bfloat16
        torch.testing.assert_close(ours.grad.float(), r.grad, atol=3e-2, rtol=3e-2)


def test_varlen_opcheck_and_compile_fullgraph(cpu_varlen):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(dtype=torch.bfloat16)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, 0.25, True, -1, -1, False)
    torch.library.opcheck(torch.ops.flash_kernel.varlen_fwd.default, args)
    o, lse = torch.ops.flash_kernel.varlen_fwd(*args)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.flash_kernel.varlen_bwd.default,
                          (do, q, k, v, cu_q, cu_k, o, lse, max_q, max_k, 0.25, True, -1, -1, False))

    def loss(q, k, v):
        return flash_kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).float().sum()

    eager = [t.detach().requires_grad_() for t in (q, k, v)]
    loss(*eager).backward()
    compiled = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*compiled).backward()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad)


def test_varlen_flop_count_is_the_unmasked_work(cpu_varlen):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        flash_kernel.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=True).sum().backward()
    pairs = sum(visible_pairs(a, b, True) for a, b in LENGTHS)
    Hq, D = q.shape[1], q.shape[2]
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.flash_kernel.varlen_fwd] == 4 * Hq * D * pairs
    assert counts[torch.ops.flash_kernel.varlen_bwd] == 10 * Hq * D * pairs
