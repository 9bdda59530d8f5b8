"""CPU tests of flash_kernel's Python face (interface.py): importing without CUDA or the built extension,
is_available()/unavailable_reason(), the input checks (each bad input names its tensor), the fake
(meta) implementations under FakeTensorMode, and the custom-op + autograd wiring, exercised on CPU by
standing the tiled PyTorch reference in for the compiled flash_kernel._C (same fwd/bwd signatures)."""

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_kernel
from flash_kernel import interface
from flash_kernel.reference import naive_attention, reference_bwd, reference_fwd

REPO = Path(__file__).resolve().parents[1]


def _t(*shape, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device) if device == "cpu" else torch.empty(*shape, dtype=dtype, device=device)


def _qkv(dtype=torch.bfloat16, device="cpu"):
    return _t(2, 16, 4, 64, dtype=dtype, device=device), _t(2, 24, 2, 64, dtype=dtype, device=device), _t(2, 24, 2, 64, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------- availability
def test_import_and_availability_without_cuda():
    # A fresh interpreter with every GPU hidden, so this holds on the GPU machine as well as here.
    code = "import flash_kernel as fk; print(fk.is_available()); print(fk.unavailable_reason())"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    available, reason = out.stdout.strip().splitlines()
    assert available == "False" and "no CUDA device" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_is_available_false_here():
    assert flash_kernel.is_available() is False
    assert "CUDA" in flash_kernel.unavailable_reason()


def test_reason_names_the_build_step_when_extension_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(interface, "_C", None)
    monkeypatch.setattr(interface, "_C_import_error", None)
    monkeypatch.setattr(interface.importlib, "import_module", _raise_import_error)
    reason = flash_kernel.unavailable_reason()
    assert "flash_kernel._C" in reason and "make build" in reason and "No module named" in reason
    assert flash_kernel.is_available() is False
    with pytest.raises(RuntimeError, match="make build"):
        interface._load_C()


@pytest.fixture
def fresh_extension_state(monkeypatch):
    """No extension imported yet and none loaded from a file: what a new process starts with."""
    monkeypatch.setattr(interface, "_C", None)
    monkeypatch.setattr(interface, "_C_import_error", None)
    monkeypatch.setattr(interface, "_loaded_extensions", {})
    monkeypatch.delenv(interface.EXTENSION_ENV, raising=False)


def _stand_in_build(path: Path, name: str) -> Path:
    """A module file with the extension's unsupported_reason, answering with `name` (a compiled build is a .so; the
    loader takes either)."""
    path.write_text(f"def unsupported_reason(head_dim, device, deterministic):\n    return {name!r}\n")
    return path


def test_flash_kernel_ext_runs_another_build_in_place_of_the_packages(fresh_extension_state, monkeypatch, tmp_path):
    build = _stand_in_build(tmp_path / "candidate.py", "from the candidate")
    monkeypatch.setenv(interface.EXTENSION_ENV, str(build))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert interface.unavailable_reason(64) == "from the candidate"
    assert interface._load_C().__name__.endswith("._C")  # a compiled build's init function is PyInit__C
    assert interface.load_extension(build) is interface._load_C()  # one module per file


def test_a_missing_build_file_is_the_reason_with_the_command_that_makes_one(fresh_extension_state, monkeypatch,
                                                                            tmp_path):
    monkeypatch.setenv(interface.EXTENSION_ENV, str(tmp_path / "nowhere.so"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = flash_kernel.unavailable_reason()
    assert f"{interface.EXTENSION_ENV}={tmp_path / 'nowhere.so'} names does not load" in reason
    assert "nowhere.so is not a file" in reason and "python -m flash_kernel.build --out DIR" in reason
    assert f"unset {interface.EXTENSION_ENV}" in reason
    with pytest.raises(RuntimeError, match="nowhere.so is not a file"):
        interface._load_C()
    with pytest.raises(ImportError, match="nowhere.so is not a file"):
        interface.load_extension(tmp_path / "nowhere.so")


def test_using_extension_routes_the_ops_to_that_build_and_back(fresh_extension_state, monkeypatch):
    """The ops look _C up at each call: inside the with statement they reach the given build, after it the package's
    build again (here: none, so the call names the build step)."""
    monkeypatch.setattr(interface, "check_inputs", lambda q, k, v, check_device=True: _check(q, k, v))
    monkeypatch.setattr(interface.importlib, "import_module", _raise_import_error)
    calls = []
    build = _reference_C()
    build.fwd = lambda *args, fwd=build.fwd: calls.append("fwd") or fwd(*args)
    q, k, v = _qkv()
    with interface.using_extension(build):
        o = flash_kernel.flash_attn_func(q, k, v, causal=True)
    assert calls == ["fwd"] and o.shape == q.shape and interface._C is None
    with pytest.raises(RuntimeError, match="make build"):
        flash_kernel.flash_attn_func(q, k, v, causal=True)


def _gpu_with_kernel(monkeypatch, unsupported):
    """Pretend a CUDA device and a built _C whose unsupported_reason(head_dim, device_index, deterministic) is
    `unsupported`; returns the calls it saw."""
    calls = []

    def unsupported_reason(head_dim, device_index, deterministic):
        calls.append((head_dim, device_index, deterministic))
        return unsupported(head_dim)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(interface, "_C", types.SimpleNamespace(unsupported_reason=unsupported_reason))
    return calls


def test_reason_for_a_head_dim_asks_the_kernel_about_this_device(monkeypatch):
    # What the binding answers on a GPU whose thread blocks get less shared memory than the kernels ask for.
    too_small = "flash_kernel: the backward kernel at head dim 128 needs 149.2 KiB of shared memory per thread block"
    calls = _gpu_with_kernel(monkeypatch, lambda d: too_small if d == 128 else "")
    assert flash_kernel.unavailable_reason() is None and calls == []  # no head dim: the extension only
    assert flash_kernel.unavailable_reason(128) == too_small and not flash_kernel.is_available(128)
    assert flash_kernel.unavailable_reason(64, "cuda:1", deterministic=True) is None
    assert flash_kernel.is_available(64, "cuda:1", deterministic=True)
    assert flash_kernel.unavailable_reason(64, torch.device("cuda")) is None
    assert flash_kernel.unavailable_reason(64, 2) is None
    assert calls == [(128, 3, False), (128, 3, False), (64, 1, True), (64, 1, True), (64, 3, False), (64, 2, False)]
    assert "multiple of 8" in flash_kernel.unavailable_reason(20) and "multiple of 8" in flash_kernel.unavailable_reason(264)
    assert "not a CUDA device" in flash_kernel.unavailable_reason(64, "cpu")
    assert len(calls) == 6  # neither bad head dims nor CPU devices reach the binding


def test_trainer_refuses_flash_on_a_gpu_its_kernels_do_not_fit(monkeypatch):
    from model.attention import check_attention_runs_on

    _gpu_with_kernel(monkeypatch, lambda d: f"head dim {d} needs 149.2 KiB; use attention=sdpa")
    with pytest.raises(RuntimeError, match=r"attention=flash cannot run at head dim 128 on cuda:0: .*attention=sdpa"):
        check_attention_runs_on("flash", 128, torch.device("cuda", 0))
    check_attention_runs_on("sdpa", 128, torch.device("cuda", 0))  # other attentions: nothing to check
    check_attention_runs_on("flash", 128, torch.device("cpu"))  # flash on CPU fails at its first call, saying so


def _raise_import_error(name):
    raise ModuleNotFoundError(f"No module named '{name}'")


def test_flash_attn_func_on_cpu_tensors_says_to_use_cuda():
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor, got device 'cpu'"):
        flash_kernel.flash_attn_func(*_qkv())


def test_op_on_cpu_tensors_says_to_use_cuda():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        torch.ops.flash_kernel.fwd(q, k, v, 0.125, True, False)


# ---------------------------------------------------------------------------------------- input checks
BAD = {
    "q_not_tensor": (lambda q, k, v: (q.tolist(), k, v), r"q must be a torch.Tensor, got list"),
    "q_fp32": (lambda q, k, v: (q.float(), k, v), r"q has dtype torch.float32; expected torch.float16 or torch.bfloat16"),
    "k_int": (lambda q, k, v: (q, k.to(torch.int32), v), r"k has dtype torch.int32; expected"),
    "v_other_low_precision": (lambda q, k, v: (q, k, v.half()), r"v has dtype torch.float16 but q has torch.bfloat16"),
    "q_rank3": (lambda q, k, v: (q[0], k, v), r"q must have 4 dims \(B, T, H, D\)"),
    "v_rank5": (lambda q, k, v: (q, k, v[None]), r"v must have 4 dims"),
    "k_v_mismatch": (lambda q, k, v: (q, k, v[:, :5]), r"k and v must have the same shape"),
    "batch_mismatch": (lambda q, k, v: (q, k[:1], v[:1]), r"k has batch size 1 but q has 2"),
    "head_dim_mismatch": (lambda q, k, v: (q, k[..., :32], v[..., :32]), r"k has head dim 32 but q has 64"),
    "heads_not_divisible": (lambda q, k, v: (q[:, :, :3], k, v), r"q has 3 heads, not a multiple of the 2 heads of k and v"),
    "head_dim_12": (lambda q, k, v: tuple(t[..., :12] for t in (q, k, v)), r"head dim 12; expected a multiple of 8 in \[8, 256\]"),
    "head_dim_264": (lambda q, k, v: tuple(_t(*t.shape[:3], 264) for t in (q, k, v)), r"head dim 264; expected a multiple of 8"),
    "empty_seq": (lambda q, k, v: (q[:, :0], k, v), r"q is empty"),
    "q_head_stride_not_multiple_of_8": (lambda q, k, v: (_t(2, 16, 4, 68)[..., :64], k, v), r"q must start at, and have batch/seq/head strides that are, multiples of 8"),
    "v_storage_offset_misaligned": (lambda q, k, v: (q, k, _t(2 * 24 * 2 * 64 + 4)[4:].view(2, 24, 2, 64)), r"v must start at.*storage offset 4"),
    "q_last_dim_strided": (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), r"q must have a contiguous last dim"),
    "k_last_dim_strided": (lambda q, k, v: (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v), r"k must have a contiguous last dim"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_check_inputs_names_the_tensor(case):
    make, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        interface.check_inputs(*make(*_qkv()), check_device=False)


def test_check_inputs_accepts_good_inputs():
    interface.check_inputs(*_qkv(), check_device=False)
    interface.check_inputs(*_qkv(torch.float16), check_device=False)
    qkv = _t(2, 9, 3, 4, 64)  # (B, T, 3, H, D): strided views with a contiguous last dim are fine
    interface.check_inputs(*qkv.unbind(dim=2), check_device=False)
    # meta tensors: shape-only checks need no data
    q, k, v = _qkv(device="meta")
    interface.check_inputs(q, k, v, check_device=False)


def test_check_inputs_device_check():
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device 'meta'"):
        interface.check_inputs(*_qkv(device="meta"))
    with FakeTensorMode(allow_non_fake_inputs=True):  # fake CUDA tensors need no GPU
        q, k, v = _qkv(device="cuda")
        with pytest.raises(ValueError, match="k must be a CUDA tensor, got device 'cpu'"):
            interface.check_inputs(q, k.to("cpu"), v)
        if torch.cuda.device_count() != 1:  # with one real GPU, even a fake cuda:1 tensor is refused
            with pytest.raises(ValueError, match=r"v is on cuda:1 but q is on cuda:0"):
                interface.check_inputs(q, k, v.to("cuda:1"))
        interface.check_inputs(q, k, v)


def test_check_bwd_inputs():
    q, k, v = _qkv()
    o, do = torch.empty_like(q), torch.randn_like(q)
    lse = torch.empty(2, 4, 16)
    interface.check_bwd_inputs(do, q, k, v, o, lse, check_device=False)
    with pytest.raises(ValueError, match=r"do must have the shape of q"):
        interface.check_bwd_inputs(do[:, :5], q, k, v, o, lse, check_device=False)
    with pytest.raises(ValueError, match=r"o has dtype torch.float16 but q has torch.bfloat16"):
        interface.check_bwd_inputs(do, q, k, v, o.half(), lse, check_device=False)
    with pytest.raises(ValueError, match=r"lse must be float32 of shape \(B, Hq, Tq\) = \(2, 4, 16\)"):
        interface.check_bwd_inputs(do, q, k, v, o, lse.bfloat16(), check_device=False)
    with pytest.raises(ValueError, match=r"lse must be float32"):
        interface.check_bwd_inputs(do, q, k, v, o, lse.transpose(1, 2), check_device=False)
    q2, k2, v2 = (_t(*t.shape[:3], 256) for t in (q, k, v))  # the largest head dim has a backward too
    interface.check_bwd_inputs(_t(*q2.shape), q2, k2, v2, _t(*q2.shape), lse, check_device=False)
    with pytest.raises(ValueError, match=r"do must have a contiguous last dim"):
        interface.check_bwd_inputs(do.transpose(-1, -2).contiguous().transpose(-1, -2), q, k, v, o, lse, check_device=False)


# --------------------------------------------------------------------------------- fake implementations
def test_fake_impls_give_kernel_shapes():
    with FakeTensorMode():
        q = torch.empty(2, 17, 8, 80, dtype=torch.bfloat16, device="cuda")  # (B, Tq, Hq, D)
        k = torch.empty(2, 33, 2, 80, dtype=torch.bfloat16, device="cuda")  # (B, Tk, Hkv, D)
        v = torch.empty(2, 33, 2, 80, dtype=torch.bfloat16, device="cuda")
        o, lse = torch.ops.flash_kernel.fwd(q, k, v, 0.1, True, False)
        assert o.shape == q.shape and o.dtype == q.dtype and o.device == q.device and o.is_contiguous()
        assert lse.shape == (2, 8, 17) and lse.dtype == torch.float32 and lse.is_contiguous()
        dq, dk, dv = torch.ops.flash_kernel.bwd(torch.empty_like(o), q, k, v, o, lse, 0.1, True, True)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
        # strided input views still give contiguous outputs, as the real op allocates them
        qkv = torch.empty(2, 17, 3, 8, 80, dtype=torch.float16, device="cuda")  # (B, T, 3, H, D)
        o, _ = torch.ops.flash_kernel.fwd(*qkv.unbind(dim=2), 0.1, False, False)
        assert o.shape == (2, 17, 8, 80) and o.is_contiguous()


def test_fake_impl_runs_the_input_checks():
    with FakeTensorMode():
        q = torch.empty(2, 17, 6, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 33, 4, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="q has 6 heads"):
            torch.ops.flash_kernel.fwd(q, k, k, 0.1, True, False)


# ------------------------------------------------- op + autograd wiring, with the reference standing in for _C
def _reference_C():
    """A stand-in for flash_kernel._C with the contract's signatures, writing into caller-allocated outputs."""

    def fwd(q, k, v, o, lse, softmax_scale, causal, window_left=-1, window_right=-1):
        assert (window_left, window_right) == (-1, -1), "the tiled reference has no window"
        o_, lse_ = reference_fwd(q, k, v, causal, softmax_scale)
        o.copy_(o_)
        lse.copy_(lse_)

    def bwd(do, q, k, v, o, lse, dq, dk, dv, softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
        assert (window_left, window_right) == (-1, -1), "the tiled reference has no window"
        for out, g in zip((dq, dk, dv), reference_bwd(do, q, k, v, o, lse, causal, softmax_scale)):
            out.copy_(g)

    return types.SimpleNamespace(fwd=fwd, bwd=bwd)


@pytest.fixture
def cpu_op(monkeypatch):
    # The op bodies look up check_inputs/check_bwd_inputs/_load_C as module globals, so this reroutes them.
    monkeypatch.setattr(interface, "_load_C", _reference_C)
    monkeypatch.setattr(interface, "check_inputs", lambda q, k, v, check_device=True: _check(q, k, v))
    check_bwd = interface.check_bwd_inputs
    monkeypatch.setattr(interface, "check_bwd_inputs", lambda *a, check_device=True: check_bwd(*a, check_device=False))


_check_inputs_unpatched = interface.check_inputs


def _check(q, k, v):
    _check_inputs_unpatched(q, k, v, check_device=False)


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_through_the_ops(cpu_op, causal):
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    q16, k16, v16 = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    o = flash_kernel.flash_attn_func(q16, k16, v16, causal=causal)
    do = torch.randn_like(o)
    o.backward(do)
    o_ref, _ = naive_attention(q, k, v, causal)
    o_ref.backward(do.float())
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    assert (o.float() - o_ref).abs().max() < 2e-2
    for ours, ref in ((q16.grad, q.grad), (k16.grad, k.grad), (v16.grad, v.grad)):
        assert ours.dtype == torch.bfloat16 and torch.isfinite(ours).all()
        assert (ours.float() - ref).abs().max() < 3e-2 * max(1.0, ref.abs().max().item())


def test_eager_calls_skip_the_ops(cpu_op, monkeypatch):
    # Eager flash_attn_func runs the kernels without torch.library's per-call layers (host time, see
    # interface.py); the ops stay what torch.compile traces (test_torch_compile_fullgraph_on_cpu_stand_in).
    def no_op(*args):
        raise AssertionError("eager flash_attn_func went through the custom op")

    monkeypatch.setattr(interface, "_fwd", no_op)
    monkeypatch.setattr(interface, "_bwd", no_op)
    q, k, v = (t.requires_grad_() for t in _qkv())
    flash_kernel.flash_attn_func(q, k, v).float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_default_scale_and_expanded_grad(cpu_op):
    q, k, v = (t.requires_grad_() for t in _qkv(torch.float16))
    flash_kernel.flash_attn_func(q, k, v).sum().backward()  # expanded grad with stride(-1) == 0
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    o_default = flash_kernel.flash_attn_func(q, k, v)
    o_explicit = flash_kernel.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(64))
    assert torch.equal(o_default, o_explicit)


def test_opcheck_on_cpu_stand_in(cpu_op):
    q, k, v = (t.requires_grad_() for t in _qkv())
    torch.library.opcheck(torch.ops.flash_kernel.fwd.default, (q, k, v, 0.125, True, True))
    q, k, v = (t.detach() for t in (q, k, v))
    o, lse = torch.ops.flash_kernel.fwd(q, k, v, 0.125, True, True)
    torch.library.opcheck(torch.ops.flash_kernel.bwd.default, (torch.randn_like(o), q, k, v, o, lse, 0.125, True, True))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_on_cpu_stand_in(cpu_op, dynamic):
    # The GPU suite runs this against the kernel; here it proves the Python face traces (forward and
    # backward, through AOTAutograd and the fake impls) without a graph break.
    torch._dynamo.reset()

    def fn(q, k, v):
        return (flash_kernel.flash_attn_func(q, k, v, causal=True).float() * 2).square().mean()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for T in (16, 24):
        q, k, v = (t.requires_grad_() for t in (_t(2, T, 4, 64), _t(2, T + 8, 2, 64), _t(2, T + 8, 2, 64)))
        grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
        grads_eager = torch.autograd.grad(fn(q, k, v), (q, k, v))
        for a, b in zip(grads, grads_eager):
            torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------- qkv packed
def _graph_nodes(t: torch.Tensor) -> set[str]:
    """The names of every autograd node t's backward would run."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_the_three_views(cpu_op, causal):
    qkv = _t(2, 24, 3, 4, 64).requires_grad_()  # (B, T, 3, H, D)
    o = flash_kernel.flash_attn_qkvpacked_func(qkv, causal=causal)
    do = torch.randn_like(o)
    o.backward(do)
    views = qkv.detach().clone().requires_grad_()
    o_views = flash_kernel.flash_attn_func(*views.unbind(dim=2), causal=causal)
    o_views.backward(do)
    assert torch.equal(o, o_views)
    assert qkv.grad.shape == qkv.shape and torch.equal(qkv.grad, views.grad)
    # The point of the packed form: no UnbindBackward (a stack of dq, dk, dv) between the op and qkv.
    assert "UnbindBackward0" in _graph_nodes(o_views)
    assert "UnbindBackward0" not in _graph_nodes(o)


def test_qkvpacked_eager_calls_skip_the_ops(cpu_op, monkeypatch):
    def no_op(*args):
        raise AssertionError("eager flash_attn_qkvpacked_func went through the custom op")

    monkeypatch.setattr(interface, "_fwd_qkvpacked", no_op)
    monkeypatch.setattr(interface, "_bwd_qkvpacked", no_op)
    qkv = _t(2, 16, 3, 4, 64).requires_grad_()
    flash_kernel.flash_attn_qkvpacked_func(qkv).sum().backward()  # also an expanded (stride 0) grad
    assert torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize(
    "shape,match",
    [((2, 16, 4, 64), r"qkv must have shape \(B, T, 3, H, D\)"), ((2, 16, 2, 4, 64), r"qkv must have shape")],
)
def test_qkvpacked_shape_is_checked(shape, match):
    with pytest.raises(ValueError, match=match):
        flash_kernel.flash_attn_qkvpacked_func(_t(*shape))
    # A well-shaped qkv goes through flash_attn_func's checks, on its three views.
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor"):
        flash_kernel.flash_attn_qkvpacked_func(_t(2, 16, 3, 4, 64))


def test_qkvpacked_fake_impls():
    with FakeTensorMode():
        qkv = torch.empty(2, 17, 3, 8, 80, dtype=torch.bfloat16, device="cuda")
        o, lse = torch.ops.flash_kernel.fwd_qkvpacked(qkv, 0.1, True, False)
        assert o.shape == (2, 17, 8, 80) and o.is_contiguous() and lse.shape == (2, 8, 17)
        dqkv = torch.ops.flash_kernel.bwd_qkvpacked(torch.empty_like(o), qkv, o, lse, 0.1, True, False)
        assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype
        with pytest.raises(ValueError, match=r"qkv must have shape"):
            torch.ops.flash_kernel.fwd_qkvpacked(torch.empty(2, 17, 2, 8, 80, dtype=torch.bfloat16, device="cuda"), 0.1, True, False)


def test_qkvpacked_opcheck_on_cpu_stand_in(cpu_op):
    qkv = _t(2, 24, 3, 4, 64).requires_grad_()
    torch.library.opcheck(torch.ops.flash_kernel.fwd_qkvpacked.default, (qkv, 0.125, True, True))
    qkv = qkv.detach()
    o, lse = torch.ops.flash_kernel.fwd_qkvpacked(qkv, 0.125, True, True)
    torch.library.opcheck(torch.ops.flash_kernel.bwd_qkvpacked.default, (torch.randn_like(o), qkv, o, lse, 0.125, True, True))


@pytest.mark.parametrize("dynamic", [False, True])
def test_qkvpacked_torch_compile_fullgraph_on_cpu_stand_in(cpu_op, dynamic):
    torch._dynamo.reset()

    def fn(qkv):
        return (flash_kernel.flash_attn_qkvpacked_func(qkv, causal=True).float() * 2).square().mean()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for T in (16, 24):
        qkv = _t(2, T, 3, 4, 64).requires_grad_()
        (grad,) = torch.autograd.grad(compiled(qkv), (qkv,))
        (grad_eager,) = torch.autograd.grad(fn(qkv), (qkv,))
        torch.testing.assert_close(grad, grad_eager)


def test_model_with_flash_calls_the_packed_form(cpu_op, monkeypatch):
    # attention=flash in the GPT, with the reference standing in for the kernels: the blocks hand over the
    # fused projection whole, and the model computes what attention=flash_reference (q, k, v views) does.
    from model.gpt import GPT, GPTConfig

    monkeypatch.setattr(flash_kernel, "is_available", lambda: True)
    cfg = dict(vocab_size=64, seq_len=32, d_model=64, n_layer=2, n_head=2, dropout=0.0)
    torch.manual_seed(0)
    flash = GPT(GPTConfig(**cfg, attention="flash"))
    reference = GPT(GPTConfig(**cfg, attention="flash_reference"))
    reference.load_state_dict(flash.state_dict())
    idx = torch.randint(0, 64, (2, 32))
    losses = []
    for model in (flash, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx)
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        losses.append((loss, logits))
    assert "SplitWithSizesBackward0" not in _graph_nodes(losses[0][1])  # the q, k, v views' backward
    assert "SplitWithSizesBackward0" in _graph_nodes(losses[1][1])
    torch.testing.assert_close(losses[0][0], losses[1][0], atol=2e-2, rtol=0)
    for (name, a), b in zip(flash.named_parameters(), reference.parameters()):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("overrides,match", [
    ({"fwd": "wgmma"}, "fwd=wgmma is not a forward path; use auto"),
    ({"bwd": "sm90"}, "bwd=sm90 is not a backward path; use auto"),
    ({"causal_group_heads": -1}, "causal_group_heads=-1 is not a positive integer"),
    ({"max_smem_per_block": -1}, "max_smem_per_block=-1 is not a positive number of bytes"),
    ({"bwd_causal_group_heads": -2}, "bwd_causal_group_heads=-2 is not a positive integer"),
])
def test_kernel_overrides_are_checked_before_the_extension(overrides, match):
    """A bad switch is a ValueError naming it, raised in Python before the extension is reached (so here too)."""
    from flash_kernel.interface import set_kernel_overrides

    with pytest.raises(ValueError, match=match):
        set_kernel_overrides(**overrides)
