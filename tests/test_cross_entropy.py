"""The fused cross-entropy (model/cross_entropy.py): the value and gradient of F.cross_entropy on float32-upcast
logits, ignore_index semantics, the in-place backward, bounded memory, and the `loss` key.

Criterion, for every output against F.cross_entropy on the float32 copy (ref32):
    losses, lse:  |ours - ref32| <= ARG_RTOL · max(1, max|x|)                      (float32 arithmetic)
    dlogits:      |ours - ref32| <= (ROUNDING[dtype] + e) · |ref32| + e · |dloss| + TINY[dtype],
                  e = ARG_RTOL · max(1, max|x|)
where e bounds the relative error of exp(x - lse) from float32 error in x - lse, ROUNDING is the rounding of the
logits' dtype (the gradient is stored in it, as torch's own cast does) and TINY its subnormal step. Outputs of
the kernel passes start as NaN, so an element a kernel forgets to write fails. CPU tests run the PyTorch passes
(model/cross_entropy_reference.py); the `gpu` tests run the Triton kernels.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import cross_entropy_reference
from model.cross_entropy import CrossEntropyRows, _passes, cross_entropy
from model.loss import next_token_loss

REPO = Path(__file__).resolve().parents[1]
ARG_RTOL = 2e-6  # float32 error of x - lse and of the exp, relative to the logits' magnitude
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
TINY = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 2.0**-24}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="the Triton cross-entropy kernels need a CUDA GPU and triton",
)


# ----------------------------------------------------------------------------------------------- helpers
def _logits(n, v, dtype, case, device, seed=0):
    """(logits (N, V), targets (N,)) for a case: normal, ignore (a third of the rows ignore_index), large
    (magnitudes ~1e4), neginf (-inf entries, a row whose first 20000 logits are -inf), target_neginf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 3  # (N, V)
    t = torch.randint(0, v, (n,), generator=g)  # (N,)
    if case == "ignore":
        t[torch.rand(n, generator=g) < 1 / 3] = -100
    elif case == "large":
        x = x * 3000
    elif case == "neginf":
        x[torch.rand(n, v, generator=g) < 0.1] = -math.inf
        x[0, : min(v - 1, 20000)] = -math.inf
        x[torch.arange(n), t] = torch.randn(n, generator=g)  # targets stay finite here
    elif case == "target_neginf":
        x[0, t[0]] = -math.inf
    return x.to(dtype).to(device), t.to(device)


def _ref32(x, t, dlosses, ignore_index=-100):
    """losses (N,), lse (N,), dlogits (N, V) of F.cross_entropy on the float32 copy, for incoming dlosses (N,)."""
    x32 = x.detach().float().requires_grad_()
    losses = F.cross_entropy(x32, t, ignore_index=ignore_index, reduction="none")
    losses.backward(dlosses)
    return losses.detach(), torch.logsumexp(x32.detach(), dim=-1), x32.grad


def _arg_err(x):
    finite = x[torch.isfinite(x)].float()
    return ARG_RTOL * max(1.0, finite.abs().max().item() if finite.numel() else 1.0)


def _max_excess(ours, ref, tol):
    """max(|ours - ref| - tol); equal values (infinities included) are exact; NaN anywhere propagates."""
    diff = torch.where(ours == ref, 0.0, (ours.float() - ref).abs())
    return (diff - tol).max().item()


def _assert_rows(name, ours, ref, x, case):
    assert ours.dtype == torch.float32 and ours.shape == ref.shape, f"{name} ({case}): {ours.dtype} {tuple(ours.shape)}"
    excess = _max_excess(ours, ref, _arg_err(x))
    assert excess <= 0, f"{name} ({case}): exceeds the tolerance by {excess:.3g}"


def _assert_dlogits(ours, ref, x, dlosses, case):
    assert ours.dtype == x.dtype and ours.shape == x.shape, f"dlogits ({case}): {ours.dtype} {tuple(ours.shape)}"
    e = _arg_err(x)
    tol = (ROUNDING[x.dtype] + e) * ref.abs() + e * dlosses.abs()[:, None] + TINY[x.dtype]  # (N, V)
    excess = _max_excess(ours, ref, tol)
    assert excess <= 0, f"dlogits ({case}): exceeds the tolerance by {excess:.3g} (max|ref| {ref.abs().max():.3g})"


def _check_passes(n, v, dtype, case, device, inplace=False):
    """The forward and backward passes for `device` into NaN-poisoned outputs, against ref32."""
    forward_rows, backward_rows = _passes(torch.device(device))
    x, t = _logits(n, v, dtype, case, device)
    losses = torch.full((n,), math.nan, device=device)
    lse = torch.full((n,), math.nan, device=device)
    forward_rows(x, t, -100, losses, lse)
    dlosses = torch.rand(n, device=device) + 0.5  # (N,) a different incoming gradient per row
    ref_losses, ref_lse, ref_dx = _ref32(x, t, dlosses)
    _assert_rows("losses", losses, ref_losses, x, case)
    _assert_rows("lse", lse, ref_lse, x, case)
    if inplace:  # the backward reads and writes the same buffer
        dx = x.clone()
        backward_rows(dlosses, dx, t, lse, -100, dx)
    else:
        dx = torch.full_like(x, math.nan)
        backward_rows(dlosses, x, t, lse, -100, dx)
    _assert_dlogits(dx, ref_dx, x, dlosses, case)


def _check_function(n, v, dtype, device, reduction="mean", inplace=False, ignore_all=False):
    """cross_entropy(...) and its gradient against F.cross_entropy on the float32 copy."""
    x, t = _logits(n, v, dtype, "ignore", device, seed=1)
    if ignore_all:
        t.fill_(-100)
    leaf = x.clone().requires_grad_()
    ours = cross_entropy(leaf * 1 if inplace else leaf, t, reduction=reduction, inplace_backward=inplace)
    x32 = x.float().clone().requires_grad_()
    ref = F.cross_entropy(x32, t, reduction=reduction)
    grad = torch.rand_like(ref) + 0.5
    ours.backward(grad)
    ref.backward(grad)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    if ignore_all and reduction == "mean":
        assert ours.isnan() and ref.isnan()  # 0 / 0, as torch
        return
    e = _arg_err(x)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=e, msg=lambda m: f"{reduction} loss: {m}")
    dlosses = (grad / (t != -100).sum() if reduction == "mean" else grad).expand(n)
    _assert_dlogits(leaf.grad, x32.grad, x, dlosses, f"{reduction}, inplace={inplace}")


# ------------------------------------------------------------------------------------ CPU: the reference
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ["normal", "ignore", "large", "neginf", "target_neginf"])
def test_reference_passes_match_torch(dtype, case):
    _check_passes(19, 20483, dtype, case, "cpu")


def test_reference_backward_in_place_and_chunked(monkeypatch):
    monkeypatch.setattr(cross_entropy_reference, "CHUNK_ELEMENTS", 3 * 301)  # 3 rows a chunk, 7 chunks
    _check_passes(21, 301, torch.bfloat16, "ignore", "cpu", inplace=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_function_matches_torch(reduction, inplace):
    _check_function(23, 517, torch.bfloat16, "cpu", reduction, inplace)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_rows_ignored_gives_torch_result(reduction):
    """mean over no row is 0/0 = NaN, sum is 0, as F.cross_entropy."""
    _check_function(5, 33, torch.float32, "cpu", reduction, ignore_all=True)


def test_inplace_backward_writes_over_the_logits_and_refuses_a_second_backward():
    x, t = _logits(6, 50, torch.float32, "normal", "cpu")
    leaf = x.clone().requires_grad_()
    logits = leaf * 1  # (N, V) a non-leaf, as the model's output
    loss = cross_entropy(logits, t, inplace_backward=True)
    loss.backward(retain_graph=True)
    assert torch.equal(logits.detach(), leaf.grad)  # the gradient lives in the logits' buffer
    x32 = x.clone().requires_grad_()
    F.cross_entropy(x32, t).backward()
    torch.testing.assert_close(leaf.grad, x32.grad)
    with pytest.raises(RuntimeError, match="inplace_backward=False"):
        loss.backward()


def test_next_token_loss_fused_equals_torch_and_keeps_leaf_logits():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 320, generator=g).bfloat16().requires_grad_()  # (B, T, V) a leaf
    targets = torch.randint(0, 320, (2, 7), generator=g)
    before = logits.detach().clone()
    fused = next_token_loss(logits, targets, "fused")
    fused.backward()
    assert torch.equal(logits.detach(), before)  # a leaf is never written over
    grad, logits.grad = logits.grad, None
    next_token_loss(logits, targets, "torch").backward()
    torch.testing.assert_close(fused, next_token_loss(logits, targets, "torch"), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, logits.grad, rtol=2**-7, atol=1e-9)  # both rounded to bf16: 1 ulp apart at most
    with pytest.raises(ValueError, match="loss='fast' is not one of torch, fused"):
        next_token_loss(logits, targets, "fast")


def test_fused_loss_is_a_graph_break_under_compile():
    """torch.compile runs the fused loss between compiled graphs: same value and gradient as eager."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 130, generator=g)
    targets = torch.randint(0, 130, (2, 9), generator=g)
    w = torch.randn(130, 130, generator=g)

    def step(x, w):
        return next_token_loss(x @ w, targets, "fused")  # in-place backward into the matmul's output

    compiled = torch.compile(step)
    a, b = ((x.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2))
    la, lb = step(*a), compiled(*b)
    la.backward()
    lb.backward()
    torch.testing.assert_close(lb, la)
    torch.testing.assert_close(b[0].grad, a[0].grad)
    torch.testing.assert_close(b[1].grad, a[1].grad)


@pytest.mark.parametrize(
    "logits, targets, kwargs, match",
    [
        (torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), {}, r"logits must be \(N, V\).*flatten"),
        (torch.zeros(4, 0), torch.zeros(4, dtype=torch.long), {}, r"V >= 1"),
        (torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long), {}, "float64 is not one of"),
        (torch.zeros(4, 5), torch.zeros(3, dtype=torch.long), {}, r"targets must be \(4,\) int64"),
        (torch.zeros(4, 5), torch.zeros(4), {}, r"targets must be .*torch.float32"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), {"reduction": "avg"}, "reduction='avg'"),
        (torch.zeros(4, 5), torch.tensor([0, 1, 5, 2]), {}, r"targets\[2\] = 5 is outside the vocabulary \[0, 5\)"),
        (torch.zeros(4, 5), torch.tensor([0, -1, 3, 2]), {}, r"targets\[1\] = -1 .*ignore_index=-100"),
    ],
)
def test_bad_input_is_refused_naming_the_tensor(logits, targets, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cross_entropy(logits, targets, **kwargs)


def test_loss_key_reaches_the_module_and_is_checked():
    import train  # noqa: F401  (registers the resolvers conf/ uses)
    from model.lit_gpt import LitGPT
    from recipe.checks import ConfigError, validate
    from recipe.schema import check_types
    from run_overrides import compose_train

    default = compose_train("trainer=cpu", "logger=none")
    bad = compose_train("trainer=cpu", "logger=none", "loss=fast")
    assert default.loss == "fused"
    check_types(default)
    with pytest.raises(ConfigError, match="loss='fast' is not one of torch, fused"):
        validate(bad)
    kwargs = dict(vocab_size=300, seq_len=64, n_layer=1, n_head=2, d_model=32, attention="sdpa")
    compiled = LitGPT(model=kwargs, loss="fused", compile=True)
    compiled.configure_model()  # compiles the model (lazily, at its first call), not the fused loss
    assert compiled.loss_fn is next_token_loss and compiled.hparams.loss == "fused"
    torch_module, fused = LitGPT(model=kwargs), LitGPT(model=kwargs, loss="fused")
    fused.load_state_dict(torch_module.state_dict())
    batch = tuple(torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7)) for _ in range(2))
    torch.testing.assert_close(fused._loss(batch), torch_module._loss(batch), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ GPU: the Triton kernels
# N: 1, odd < one block, many rows; V: GPT-2's 50257 (odd rows: unaligned loads), the model's padded 50304,
# a small odd one (one partial block), one past a forward block (FWD_BLOCK_V + 1).
GPU_SHAPES = [(1, 50257), (7, 50304), (333, 50257), (2048, 50304), (129, 37), (65, 16385)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, v", GPU_SHAPES)
@pytest.mark.parametrize("case", ["normal", "ignore"])
def test_kernel_passes_match_torch(dtype, n, v, case):
    _check_passes(n, v, dtype, case, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ["large", "neginf", "target_neginf"])
def test_kernel_passes_extreme_logits(dtype, case):
    _check_passes(97, 50304, dtype, case, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernel_backward_in_place(dtype):
    _check_passes(100, 50257, dtype, "ignore", "cuda", inplace=True)


@pytest.mark.gpu
@gpu
def test_kernel_row_of_only_neginf_is_nan_as_torch():
    x, t = _logits(4, 50304, torch.bfloat16, "normal", "cuda")
    x[1] = -math.inf
    losses = CrossEntropyRows.apply(x, t, -100, False)
    ref = F.cross_entropy(x.float(), t, reduction="none")
    assert torch.equal(losses.isnan(), ref.isnan()) and losses[1].isnan()
    torch.testing.assert_close(losses[[0, 2, 3]], ref[[0, 2, 3]], rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_kernel_function_matches_torch(dtype, reduction, inplace):
    _check_function(1001, 50304, dtype, "cuda", reduction, inplace)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kernel_all_rows_ignored_gives_torch_result(reduction):
    _check_function(17, 50257, torch.bfloat16, "cuda", reduction, ignore_all=True)


@pytest.mark.gpu
@gpu
def test_kernel_offsets_past_2_to_the_31():
    """N · V > 2^31 logits (8 × 8k tokens of GPT3-1.3B would be 3.3e9): the last rows' offsets need int64."""
    n, v = 42800, 50304  # 2.15e9 logits, 4.3 GB in bf16
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    tail = slice(n - 64, n)
    logits = x.clone().requires_grad_()
    losses = cross_entropy(logits, t, reduction="none")
    dlosses = torch.rand(n, device="cuda") + 0.5
    losses.backward(dlosses)
    ref_losses, _, ref_dx = _ref32(x[tail], t[tail], dlosses[tail])
    _assert_rows("losses", losses[tail].detach(), ref_losses, x[tail], "tail rows")
    _assert_dlogits(logits.grad[tail], ref_dx, x[tail], dlosses[tail], "tail rows")


@pytest.mark.gpu
@gpu
def test_kernel_memory_is_the_logits_alone():
    """bf16 logits of 4096 × 50304 (412 MB): the in-place loss adds < 1% of them at its peak, the copying backward
    one gradient buffer; torch on the float32 copy adds several times the logits (the measurement's check)."""
    n, v, d = 4096, 50304, 64
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(d, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    logits_bytes = n * v * 2

    def extra_peak(loss_fn):
        """Peak bytes beyond the logits from the loss's forward to the logits' gradient."""
        logits = h @ w  # (N, V) a non-leaf, read by the loss alone
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        (dlogits,) = torch.autograd.grad(loss_fn(logits), logits)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert dlogits.shape == (n, v) and torch.isfinite(dlogits).all()
        return peak

    inplace = extra_peak(lambda lg: cross_entropy(lg, t, inplace_backward=True))
    copying = extra_peak(lambda lg: cross_entropy(lg, t))
    upcast = extra_peak(lambda lg: F.cross_entropy(lg.float(), t))
    assert inplace < 0.01 * logits_bytes, f"in-place fused loss: {inplace / 2**20:.1f} MiB beyond the logits"
    assert copying < 1.05 * logits_bytes, f"copying fused loss: {copying / 2**20:.1f} MiB beyond the logits"
    assert upcast > 2 * logits_bytes, f"torch on fp32: only {upcast / 2**20:.1f} MiB beyond the logits"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_gpt_step_with_fused_loss_matches_torch_loss(compile):
    """A bf16-autocast step of a small GPT on the GPU (vocab 1000, padded to 1024), the model eager or compiled:
    LitGPT's loss=fused gives F.cross_entropy's loss and every parameter's gradient on the same model, the in-place
    backward inside the real autograd graph included."""
    from model.lit_gpt import LitGPT

    kwargs = dict(vocab_size=1000, seq_len=128, n_layer=2, n_head=4, d_model=128, attention="sdpa")
    torch.manual_seed(0)
    module = LitGPT(model=kwargs, loss="fused", compile=compile).cuda()
    module.configure_model()
    assert module.loss_fn is next_token_loss
    x, y = batch = tuple(torch.randint(0, 1000, (4, 128), device="cuda") for _ in range(2))
    losses, grads = {}, {}
    for impl in ("torch", "fused"):
        module.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = next_token_loss(module.model(x), y, "torch") if impl == "torch" else module._loss(batch)
        loss.backward()
        losses[impl], grads[impl] = loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}
    torch.testing.assert_close(losses["fused"], losses["torch"], rtol=1e-5, atol=1e-5)
    for name, ref in grads["torch"].items():
        err = (grads["fused"][name] - ref).norm() / ref.norm()
        assert err < 1e-2, f"{name}: |grad fused - grad torch| / |grad torch| = {err:.3g}"


# ------------------------------------------------------------------------------------ the benchmarks' rows
def _load_bench(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_e2e_rows_of_the_fused_loss_are_their_own_case():
    e2e = _load_bench("e2e")
    row = {"device": "GPU X", "mode": "pipeline", "model": "gpt3-1.3b", "seq_len": 8192, "batch": 2,
           "attention": "flash", "compile": False, "status": "ok", "tokens_per_s": 1.0, "tflops_per_gpu": 1.0}
    fused = {**row, "loss": "fused"}
    assert e2e._attention(fused) == "flash, fused loss" and e2e._attention({**row, "loss": "torch"}) == "flash"
    assert e2e._key(row) != e2e._key(fused)
    assert "loss=fused" in e2e._overrides("gpt3-1.3b", 8192, 2, "flash", False, 10, 5, loss="fused")


def test_profile_counts_the_fused_kernels_as_cross_entropy():
    trace = _load_bench("trace")  # the profiles' categories (bench/profile_step.py, bench/pipeline_profiler.py)
    assert trace.category("cross_entropy_fwd_kernel") == "cross-entropy"
    assert trace.category("cross_entropy_bwd_kernel") == "cross-entropy"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cross_entropy_bench_merges_rows_and_refuses_without_gpu(tmp_path):
    bench = _load_bench("cross_entropy")
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.main(["--out", str(tmp_path / "ce.json")])
    row = {"device": "GPU X", "method": "fused", "n": 16384, "vocab": 50304, "dtype": "bf16", "fwd_ms": 0.6,
           "fwd_bwd_ms": 1.9, "peak_beyond_logits_gib": 0.0, "logits_gib": 1.5}
    bench.merge(tmp_path / "ce.json", [row, {**row, "method": "torch fp32 (eager)", "fwd_bwd_ms": 9.0}])
    rows = bench.merge(tmp_path / "ce.json", [{**row, "fwd_bwd_ms": 1.8}])
    assert len(rows) == 2 and {r["fwd_bwd_ms"] for r in rows} == {1.8, 9.0}
    assert "| GPU X | 16384 | 50304 | bf16 | fused | 0.60 | 1.80 | 0.00 |" in bench.table(rows)


@pytest.mark.gpu
@gpu
def test_cross_entropy_bench_runs_on_gpu(tmp_path):
    """The benchmark at a small N: every method measured, the in-place fused loss with no gradient buffer."""
    bench = _load_bench("cross_entropy")
    bench.main(["--tokens", "1024", "--vocab", "50304", "--out", str(tmp_path / "ce.json")])
    import json

    rows = {r["method"]: r for r in json.loads((tmp_path / "ce.json").read_text())}
    assert set(rows) == set(bench.METHODS)
    assert rows["fused, in-place backward"]["peak_beyond_logits_gib"] < 0.01 * rows["fused"]["logits_gib"]
    assert all(r["fwd_bwd_ms"] > 0 for r in rows.values())
