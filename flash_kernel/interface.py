"""The PyTorch face of the FlashAttention-2 CUDA extension: custom ops, fake impls, autograd, input checks.

Kernel: FlashAttention-2 (Dao, 2023), Algorithm 1 forward and Algorithm 2 backward, in flash_kernel/csrc.
Here it becomes torch.library custom ops,

    flash_kernel::fwd(q, k, v, softmax_scale, causal, deterministic, window_left=-1, window_right=-1) -> (o, lse)
    flash_kernel::bwd(do, q, k, v, o, lse, softmax_scale, causal, deterministic, window_left=-1,
                      window_right=-1) -> (dq, dk, dv)
    flash_kernel::fwd_qkvpacked(qkv, softmax_scale, causal, deterministic, window_left=-1, window_right=-1) -> (o, lse)
    flash_kernel::bwd_qkvpacked(do, qkv, o, lse, softmax_scale, causal, deterministic, window_left=-1,
                                window_right=-1) -> dqkv
    flash_kernel::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                             causal, window_left, window_right, deterministic) -> (o, lse)
    flash_kernel::varlen_bwd(do, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, window_left, window_right, deterministic) -> (dq, dk, dv)

with fake (meta) implementations and autograd registered, so torch.compile(fullgraph=True) traces
through them without graph breaks and torch.library.opcheck passes. The packed pair runs the same
kernels on qkv (B, T, 3, H, D) and writes the gradient as one dqkv tensor (no stack of dq, dk, dv).
The varlen pair takes packed sequences, FlashAttention's layout: q (total_q, Hq, D), k/v (total_k, Hkv, D),
cu_seqlens (batch + 1,) int32 row offsets, lse (Hq, total_q). `window_size=(left, right)` is FlashAttention's
sliding window: after the bottom-right alignment, query i sees key j iff i - left <= j <= i + right (-1:
unbounded), intersected with causal. `flash_attn_func` / `flash_attn_qkvpacked_func` / `flash_attn_varlen_func`
are the user entries:
under torch.compile they call the ops; in eager mode they call the same kernels through a plain
torch.autograd.Function, because torch.library's per-call layers (dispatch, aliasing checks, the
registered autograd) cost about 0.4 ms of host time per forward + backward, more than the GPU time of a
small attention call (docs/results.md, "Host time per call").

The compiled module flash_kernel._C is imported lazily, inside the op, so `import flash_kernel` works on
a machine without CUDA or without the built extension; `is_available()` / `unavailable_reason()` say
which. Layout is (B, T, H, D) with a contiguous last dim and arbitrary other strides (views of a fused
qkv projection need no copy); k/v may have fewer heads than q (GQA/MQA). Head dims: multiples of
HEAD_DIM_MULTIPLE up to MAX_HEAD_DIM, forward and backward.

`set_kernel_overrides` / `kernel_overrides` are the tests' and benchmarks' switches (the sm80 kernels on a Hopper
GPU, a smaller shared-memory limit, the causal block orders' groups); nothing else changes which kernel runs or how
its work is ordered.

Another build of the extension (`python -m flash_kernel.build --out DIR`, e.g. with a kernel trait flipped) runs in
place of flash_kernel._C when FLASH_KERNEL_EXT names its file, or for the body of `using_extension(module)` with a
module from `load_extension(path)`: two builds timed in one process, on the same tensors (bench/kernel.py
--candidate).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
from collections.abc import Iterator
from types import ModuleType

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8  # 16-byte vector loads of fp16/bf16; the kernel rounds head dims up to its tile inside
MAX_HEAD_DIM = 256  # largest head-dim instantiation in csrc, fwd and bwd: kernel_traits.h's kMaxHeadDim (a test checks)
STRIDE_MULTIPLE = 8  # cp.async moves 16 bytes = 8 fp16/bf16: every row start must be 16-byte aligned

_BUILD_HINT = "build it with `make build` (or `python -m flash_kernel.build`)"

EXTENSION_ENV = "FLASH_KERNEL_EXT"  # the file of a build to run in place of flash_kernel._C

_C: ModuleType | None = None
_C_import_error: str | None = None
_loaded_extensions: dict[str, ModuleType] = {}  # load_extension's modules by real path


def load_extension(path: str | os.PathLike) -> ModuleType:
    """The built extension in the file `path` (`python -m flash_kernel.build --out DIR` prints it) as a module of its
    own, beside flash_kernel._C: each build keeps its own kernels and its own set_kernel_overrides switches. Raises
    ImportError for a file that is missing or does not load."""
    real = os.path.realpath(path)
    if real not in _loaded_extensions:
        if not os.path.isfile(real):
            raise ImportError(f"{path} is not a file; `python -m flash_kernel.build --out DIR` builds one in DIR")
        # The module's last name is _C: a compiled module's init function is found by that name (PyInit__C).
        name = f"flash_kernel_build_{len(_loaded_extensions)}._C"
        spec = importlib.util.spec_from_file_location(name, real)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not a loadable module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded_extensions[real] = module
    return _loaded_extensions[real]


def _try_import_C() -> ModuleType | None:
    """Import flash_kernel._C (or the build FLASH_KERNEL_EXT names) once and remember why it failed, if it did."""
    global _C, _C_import_error
    if _C is None and _C_import_error is None:
        path = os.environ.get(EXTENSION_ENV)
        try:
            _C = load_extension(path) if path else importlib.import_module("flash_kernel._C")
        except ImportError as e:  # not built, or built against another torch/CUDA (undefined symbols)
            _C_import_error = f"{type(e).__name__}: {e}"
    return _C


def _import_failure() -> str:
    """Why the extension did not import, with what to do about it."""
    path = os.environ.get(EXTENSION_ENV)
    if path:
        return (f"the build that {EXTENSION_ENV}={path} names does not load ({_C_import_error}); unset {EXTENSION_ENV} "
                "to run the package's own build")
    return f"the CUDA extension flash_kernel._C is not importable ({_C_import_error}); {_BUILD_HINT}"


@contextlib.contextmanager
def using_extension(module: ModuleType) -> Iterator[None]:
    """Every kernel call in the body runs `module`'s kernels (a build from load_extension), the default's after."""
    global _C
    before = _C
    _C = module
    try:
        yield
    finally:
        _C = before


def unavailable_reason(
    head_dim: int | None = None, device: torch.device | str | int | None = None, deterministic: bool = False
) -> str | None:
    """Why flash_attn_func cannot run here, or None if it can.

    With a head_dim, also whether its forward and backward kernels can train at that head dim on `device`
    (default: the current CUDA device): a head dim outside the contract, or a GPU that gives a thread block less
    shared memory than its smallest kernel configs ask for (or set_kernel_overrides' max_smem_per_block), is a reason
    too.
    """
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False); flash_kernel runs on NVIDIA GPUs only"
    C = _try_import_C()
    if C is None:
        return _import_failure()
    if head_dim is None:
        return None
    if head_dim % HEAD_DIM_MULTIPLE or not 0 < head_dim <= MAX_HEAD_DIM:
        return f"head dim {head_dim} is not a multiple of {HEAD_DIM_MULTIPLE} in [8, {MAX_HEAD_DIM}]"
    index = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if index.type != "cuda":
        return f"device {index} is not a CUDA device; flash_kernel runs on NVIDIA GPUs only"
    index = index.index if index.index is not None else torch.cuda.current_device()
    return C.unsupported_reason(head_dim, index, deterministic) or None


def is_available(head_dim: int | None = None, device: torch.device | str | int | None = None,
                 deterministic: bool = False) -> bool:
    """True when a CUDA device is present and flash_kernel._C imports (and, given a head_dim, its kernels fit
    `device`; see unavailable_reason)."""
    return unavailable_reason(head_dim, device, deterministic) is None


def _load_C() -> ModuleType:
    C = _try_import_C()
    if C is None:
        raise RuntimeError(_import_failure())
    return C


KERNEL_PATHS = ("auto", "sm80")  # a pass's kernels on a Hopper GPU: sm_90a wgmma where built, or mma.sync


def set_kernel_overrides(fwd: str = "auto", bwd: str = "auto", causal_group_heads: int = 0,
                         max_smem_per_block: int = 0, bwd_causal_group_heads: int = 0) -> None:
    """Switches for tests and benchmarks, for every later call in this process; called with no arguments, the
    defaults that every other caller gets.

    fwd / bwd: "auto" (the sm_90a wgmma kernel where one is built for the head dim) or "sm80" (the mma.sync kernel
    every sm80+ GPU runs), for the forward / backward on a Hopper GPU. causal_group_heads: 0 (sized to L2) or the
    number of (batch, head) pairs per group of the causal forward's block order. max_smem_per_block: 0 (the
    device's) or the bytes of shared memory a thread block may have, as on a smaller GPU: the sm80 kernels then
    choose and refuse configs as there (A100: 166912, sm_86 / sm_89: 101376; the Hopper kernels ignore it, so pair
    it with fwd = bwd = "sm80"). bwd_causal_group_heads: 0 (the default: from 2048 keys, groups sized to L2) or
    the number of (batch, head) pairs per group of the Hopper causal backward's block order at every length (1: each
    head's key blocks in turn, the grid's own order). A bad value raises ValueError and leaves the switches as they
    were.
    """
    for name, path, what in (("fwd", fwd, "forward"), ("bwd", bwd, "backward")):
        if path not in KERNEL_PATHS:
            _fail(f"{name}={path} is not a {what} path; use auto (the default) or sm80")
    for name, value in (("causal_group_heads", causal_group_heads), ("bwd_causal_group_heads", bwd_causal_group_heads)):
        if value < 0:
            _fail(f"{name}={value} is not a positive integer (or 0: the default order)")
    if max_smem_per_block < 0:
        _fail(f"max_smem_per_block={max_smem_per_block} is not a positive number of bytes (or 0: the device's)")
    _load_C().set_overrides(fwd == "sm80", bwd == "sm80", int(causal_group_heads), int(max_smem_per_block),
                            int(bwd_causal_group_heads))


@contextlib.contextmanager
def kernel_overrides(**overrides) -> Iterator[None]:
    """set_kernel_overrides(**overrides) for the body of a with statement, then the defaults again."""
    set_kernel_overrides(**overrides)
    try:
        yield
    finally:
        set_kernel_overrides()


def _fail(msg: str) -> None:
    raise ValueError(f"flash_kernel: {msg}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, check_device: bool = True) -> None:
    """Validate q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D) before they reach the kernel; raises ValueError naming the tensor.

    check_device=False skips the CUDA-device check only, so the same checks run on CPU/meta tensors in tests.
    """
    named = (("q", q), ("k", k), ("v", v))
    _check_tensors(named, check_device)
    if check_device:
        for name, t in named[1:]:
            if t.device != q.device:
                _fail(f"{name} is on {t.device} but q is on {q.device}; q, k, v must be on the same device")
    _check_dtypes(named)
    _check_ranks(named, 4, "(B, T, H, D)", "(B, Tk, Hkv, D)")
    B, seqlen_q, Hq, D = q.shape
    if k.shape[0] != B:
        _fail(f"k has batch size {k.shape[0]} but q has {B}; expected k (B={B}, Tk, Hkv, D={D})")
    if k.shape[3] != D:
        _fail(f"k has head dim {k.shape[3]} but q has {D}; expected k (B={B}, Tk, Hkv, D={D})")
    _check_heads(Hq, k.shape[2], D)
    for name, t in named:
        if t.numel() == 0:
            _fail(f"{name} is empty, shape {tuple(t.shape)}; batch, sequence length and heads must be >= 1")
    for name, t in named:
        _check_strides(name, t)


def _check_tensors(named, check_device: bool) -> None:
    """Each (name, tensor) is a torch.Tensor, and on a CUDA device when check_device."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if check_device:
        for name, t in named[:3]:
            if t.device.type != "cuda":
                _fail(f"{name} must be a CUDA tensor, got device '{t.device}'; move q, k, v to the GPU (.cuda())")


def _check_dtypes(named) -> None:
    """q, k, v (the first three of named) in fp16 or bf16, all in q's."""
    for name, t in named:
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(f"{name} has dtype {t.dtype}; expected torch.float16 or torch.bfloat16 (cast, or use autocast)")
    for name, t in named[1:]:
        if t.dtype != named[0][1].dtype:
            _fail(f"{name} has dtype {t.dtype} but q has {named[0][1].dtype}; q, k, v must share one dtype")


def _check_ranks(named, rank: int, layout: str, kv_layout: str) -> None:
    """q, k, v of `rank` dims in `layout` (for the message), k and v of one shape (kv_layout)."""
    for name, t in named:
        if t.dim() != rank:
            _fail(f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}")
    (_, k), (_, v) = named[1], named[2]
    if k.shape != v.shape:
        _fail(f"k and v must have the same shape {kv_layout}, got k {tuple(k.shape)} and v {tuple(v.shape)}")


def _check_heads(Hq: int, Hkv: int, D: int, need_q_heads: bool = False) -> None:
    """Hq query heads over Hkv key/value heads (GQA), of a head dim the kernels have; need_q_heads refuses Hq = 0
    here (the dense check refuses it as an empty q)."""
    if (need_q_heads and Hq == 0) or Hkv == 0 or Hq % Hkv != 0:
        _fail(f"q has {Hq} heads, not a multiple of the {Hkv} heads of k and v (GQA needs Hq % Hkv == 0)")
    if D % HEAD_DIM_MULTIPLE != 0 or D > MAX_HEAD_DIM or D == 0:
        _fail(f"q has head dim {D}; expected a multiple of {HEAD_DIM_MULTIPLE} in [8, {MAX_HEAD_DIM}] (pad the head dim)")


def _check_strides(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        _fail(
            f"{name} must have a contiguous last dim (stride(-1) == 1), got strides {tuple(t.stride())}; "
            f"pass {name}.contiguous() or a (B, T, H, D) view of a row-major tensor"
        )
    # Batch/seq/head strides are free, but each row must start 16-byte aligned for the kernel's cp.async
    # (size-1 dims are exempt: their stride is never used).
    if not _kernel_friendly(t):
        _fail(
            f"{name} must start at, and have batch/seq/head strides that are, multiples of {STRIDE_MULTIPLE} "
            f"elements (16 bytes), got strides {tuple(t.stride())} and storage offset {t.storage_offset()}; "
            f"pass {name}.contiguous()"
        )


def check_bwd_inputs(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    check_device: bool = True,
) -> None:
    """check_inputs plus do/o like q, lse float32 (B, Hq, Tq) on q's device, and a head dim the backward has."""
    check_inputs(q, k, v, check_device=check_device)
    B, seqlen_q, Hq, _ = q.shape
    _check_do_o_lse(do, o, lse, q, (B, Hq, seqlen_q), "(B, Hq, Tq)", check_device)


def _check_do_o_lse(do, o, lse, q: torch.Tensor, lse_shape: tuple, lse_layout: str, check_device: bool) -> None:
    """do and o like q (shape, dtype, device, strides); lse float32 of lse_shape, contiguous, on q's device."""
    for name, t in (("do", do), ("o", o)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape:
            _fail(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            _fail(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if check_device and t.device != q.device:
            _fail(f"{name} is on {t.device} but q is on {q.device}")
        _check_strides(name, t)
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != lse_shape:
        got = f"{lse.dtype} {tuple(lse.shape)}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        _fail(f"lse must be float32 of shape {lse_layout} = {lse_shape}, got {got}")
    if check_device and lse.device != q.device:
        _fail(f"lse is on {lse.device} but q is on {q.device}")
    if not lse.is_contiguous():
        _fail(f"lse must be contiguous, got strides {tuple(lse.stride())}")


def _check_window(window_size) -> tuple[int, int]:
    """window_size = (left, right), ints >= -1 (-1: unbounded); raises ValueError naming it."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        _fail(f"window_size must be a pair (left, right), got {window_size!r}")
    for name, w in (("left", left), ("right", right)):
        if isinstance(w, bool) or not isinstance(w, int) or w < -1:
            _fail(f"window_size {name} = {w!r} is not an int >= -1 (-1: unbounded); got window_size={window_size!r}")
    return left, right


@torch.library.custom_op("flash_kernel::fwd", mutates_args=())
def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` is unused by the forward (it is deterministic anyway); it is an input here so that
    # setup_context can hand it to the backward, which is registered on this op.
    check_inputs(q, k, v)
    return _fwd_impl(q, k, v, softmax_scale, causal, deterministic, window_left, window_right)


def _fwd_impl(q, k, v, softmax_scale: float, causal: bool, deterministic: bool = False, window_left: int = -1,
              window_right: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on checked inputs: o (B, Tq, Hq, D), lse (B, Hq, Tq) float32."""
    C = _load_C()
    B, seqlen_q, Hq, D = q.shape
    # Fresh contiguous outputs (not empty_like: q may be a strided view); the fake impl must match.
    o = torch.empty((B, seqlen_q, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, seqlen_q), dtype=torch.float32, device=q.device)
    C.fwd(q, k, v, o, lse, softmax_scale, causal, window_left, window_right)
    return o, lse


@_fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
    check_inputs(q, k, v)
    B, seqlen_q, Hq, D = q.shape
    o = q.new_empty((B, seqlen_q, Hq, D))
    lse = q.new_empty((B, Hq, seqlen_q), dtype=torch.float32)
    return o, lse


@torch.library.custom_op("flash_kernel::bwd", mutates_args=())
def _bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_bwd_inputs(do, q, k, v, o, lse)
    return _bwd_impl(do, q, k, v, o, lse, softmax_scale, causal, deterministic, window_left, window_right)


def _bwd_impl(do, q, k, v, o, lse, softmax_scale: float, causal: bool, deterministic: bool, window_left: int = -1,
              window_right: int = -1):
    """The backward kernels on checked inputs: dq, dk, dv shaped like q, k, v."""
    C = _load_C()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    C.bwd(do, q, k, v, o, lse, dq, dk, dv, softmax_scale, causal, deterministic, window_left, window_right)
    return dq, dk, dv


@_bwd.register_fake
def _bwd_fake(do, q, k, v, o, lse, softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
    check_bwd_inputs(do, q, k, v, o, lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _kernel_friendly(t: torch.Tensor) -> bool:
    """The layout _check_strides accepts: contiguous last dim, 16-byte aligned rows."""
    strides_ok = t.stride(-1) == 1 and all(
        t.shape[d] <= 1 or t.stride(d) % STRIDE_MULTIPLE == 0 for d in range(t.dim() - 1)
    )
    # Dynamo cannot trace storage_offset() (a graph break); the op's real and fake impls check it instead.
    if torch.compiler.is_dynamo_compiling():
        return strides_ok
    return strides_ok and t.storage_offset() % STRIDE_MULTIPLE == 0


def _setup_context(ctx, inputs, output) -> None:
    # inputs: the forward op's tensors (q, k, v or qkv; varlen: and cu_seqlens_q, cu_seqlens_k), then its
    # non-tensor arguments, which its backward op takes in the same order after (do, *tensors, o, lse).
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    o, lse = output
    ctx.save_for_backward(*tensors, o, lse)
    ctx.params = tuple(inputs[len(tensors):])


def _grads(bwd, ctx, do):
    """The inputs' gradients (dq, dk, dv, or dqkv) through `bwd` (an op or its implementation), and none for
    the other inputs."""
    *tensors, o, lse = ctx.saved_tensors
    if not _kernel_friendly(do):  # e.g. the expanded gradient of a .sum(): all strides 0
        do = do.contiguous()
    grads = bwd(do, *tensors, o, lse, *ctx.params)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return (*grads, *([None] * (len(tensors) + len(ctx.params) - len(grads))))


def _backward(ctx, do, dlse):
    # lse is an auxiliary output for the backward; a gradient flowing into it is not supported and ignored
    # (flash_attn_func never returns lse to the user).
    return _grads(_bwd, ctx, do)


_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------- qkv packed
# The model's fused projection gives one (B, T, 3, H, D) tensor. Called with its three views, autograd
# stacks dq, dk and dv back into one tensor after the backward (unbind's backward: a copy of 3 x B T H D
# elements per layer, 3.3 ms of a GPT3-1.3B step at 8k). Here the backward writes them into one dqkv
# buffer instead: the kernels take strided outputs, so each is a view of it.


def _check_qkv_packed(qkv: torch.Tensor) -> None:
    if not isinstance(qkv, torch.Tensor):
        _fail(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        _fail(f"qkv must have shape (B, T, 3, H, D), got {tuple(qkv.shape)}")


@torch.library.custom_op("flash_kernel::fwd_qkvpacked", mutates_args=())
def _fwd_qkvpacked(
    qkv: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_qkv_packed(qkv)
    q, k, v = qkv.unbind(dim=2)
    check_inputs(q, k, v)
    return _fwd_impl(q, k, v, softmax_scale, causal, deterministic, window_left, window_right)


def _fwd_qkvpacked_impl(qkv, *args) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(*qkv.unbind(dim=2), *args)


@_fwd_qkvpacked.register_fake
def _fwd_qkvpacked_fake(qkv, softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
    _check_qkv_packed(qkv)
    return _fwd_fake(*qkv.unbind(dim=2), softmax_scale, causal, deterministic)


@torch.library.custom_op("flash_kernel::bwd_qkvpacked", mutates_args=())
def _bwd_qkvpacked(
    do: torch.Tensor,
    qkv: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    window_left: int = -1,
    window_right: int = -1,
) -> torch.Tensor:
    _check_qkv_packed(qkv)
    check_bwd_inputs(do, *qkv.unbind(dim=2), o, lse)
    return _bwd_qkvpacked_impl(do, qkv, o, lse, softmax_scale, causal, deterministic, window_left, window_right)


def _bwd_qkvpacked_impl(do, qkv, o, lse, softmax_scale: float, causal: bool, deterministic: bool, window_left: int = -1,
                        window_right: int = -1) -> torch.Tensor:
    """The backward kernels on checked inputs: dqkv (B, T, 3, H, D), dq / dk / dv written as its views."""
    C = _load_C()
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    C.bwd(do, *qkv.unbind(dim=2), o, lse, *dqkv.unbind(dim=2), softmax_scale, causal, deterministic, window_left,
          window_right)
    return dqkv


@_bwd_qkvpacked.register_fake
def _bwd_qkvpacked_fake(do, qkv, o, lse, softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
    _check_qkv_packed(qkv)
    check_bwd_inputs(do, *qkv.unbind(dim=2), o, lse)
    return qkv.new_empty(qkv.shape)


def _backward_qkvpacked(ctx, do, dlse):
    return _grads(_bwd_qkvpacked, ctx, do)


_fwd_qkvpacked.register_autograd(_backward_qkvpacked, setup_context=_setup_context)


# ----------------------------------------------------------------------------------- varlen (packed sequences)
# FlashAttention's varlen layout: the sequences of a batch back to back, q (total_q, Hq, D), k/v (total_k, Hkv, D);
# sequence s holds rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1 and attends only within itself (causal and window
# per sequence, bottom-right aligned with its own lengths). lse is (Hq, total_q).


def check_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    check_device: bool = True,
) -> None:
    """Validate the packed q (total_q, Hq, D), k/v (total_k, Hkv, D) and cu_seqlens of a varlen call; raises
    ValueError naming the argument. The checks that need no values: cu_seqlens int32, on q's device, 1-D of one
    length (batch + 1 >= 2) for q and k; max_seqlen ints >= 0. check_values_of_cu_seqlens does the rest.
    check_device=False skips the CUDA-device checks, so the same checks run on CPU/meta tensors in tests."""
    named = (("q", q), ("k", k), ("v", v))
    cus = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    _check_tensors(named + cus, check_device)
    for name, t in named[1:] + cus:
        if t.device != q.device:
            _fail(f"{name} is on {t.device} but q is on {q.device}; q, k, v and cu_seqlens must be on one device")
    _check_dtypes(named)
    _check_ranks(named, 3, "(total, H, D) in the varlen layout", "(total_k, Hkv, D)")
    total_q, Hq, D = q.shape
    if k.shape[2] != D:
        _fail(f"k has head dim {k.shape[2]} but q has {D}; expected k (total_k, Hkv, D={D})")
    _check_heads(Hq, k.shape[1], D, need_q_heads=True)  # packed rows may be 0 (empty sequences), heads not
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            _fail(f"{name} has dtype {cu.dtype}; expected torch.int32 (pass {name}.to(torch.int32))")
        if cu.dim() != 1 or cu.shape[0] < 2:
            _fail(f"{name} must be 1-D of length batch + 1 >= 2 (0 first, then each sequence's end), got shape "
                  f"{tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        _fail(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got {cu_seqlens_q.shape[0]} and "
              f"{cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # SymInt: a size that torch.compile traces symbolically
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or m < 0:
            _fail(f"{name} must be a Python int >= 0 (the longest sequence), got {m!r}")
    for name, t in named:
        _check_strides(name, t)


_CHECKED_ATTR = "_flash_kernel_checked"  # a cu_seqlens tensor's (version, packed rows, max_seqlen) last found valid


def check_values_of_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                               max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The values of a varlen call's cu_seqlens: 0 first, non-decreasing, the packed length (total_q / total_k) last,
    no sequence longer than max_seqlen_q / max_seqlen_k; raises ValueError naming the tensor and the bad entry.

    Reading them waits for the device, so this runs once per tensor and contents: a tensor that passed is marked
    with its version counter (which every in-place write bumps) and its totals, and a later call on it with the same
    ones skips the check. The model's layers share one cu_seqlens per batch, so a step checks it once, not per layer;
    cu_seqlens_to checks a host-built one before it moves, and its copy is never read back.
    An inference tensor (made under torch.inference_mode, as Lightning's validation makes its batches) has no
    version counter: it is checked on every call.
    """
    pending = [(name, cu, total, max_len, _checked_key(cu, total, max_len))
               for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                                ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k))]
    pending = [p for p in pending if p[4] is None or getattr(p[1], _CHECKED_ATTR, None) != p[4]]
    if not pending:
        return
    # One small reduction per tensor and one device-to-host copy: first, last, min and max of the lengths.
    lengths = [cu.diff() for _, cu, _, _, _ in pending]
    stats = torch.stack([torch.stack([cu[0], cu[-1], n.min(), n.max()])
                         for (_, cu, _, _, _), n in zip(pending, lengths)]).tolist()
    for (name, cu, total, max_len, key), (first, last, shortest, longest) in zip(pending, stats):
        which = name[-1]  # "q" or "k"
        if first != 0:
            _fail(f"{name}[0] is {first}; it must be 0 (the first sequence starts at row 0)")
        if shortest < 0:
            at = int(torch.nonzero(cu[1:] < cu[:-1])[0, 0]) + 1
            _fail(f"{name} must be non-decreasing, but {name}[{at}] = {int(cu[at])} < {name}[{at - 1}] = "
                  f"{int(cu[at - 1])}")
        if last != total:
            _fail(f"{name}[-1] is {last} but {which} has {total} rows; it must end at the packed length")
        if longest > max_len:
            _fail(f"a sequence of {name} has {longest} rows, more than max_seqlen_{which} = {max_len}; pass the "
                  f"longest sequence's length (or more)")
        if key is not None:
            setattr(cu, _CHECKED_ATTR, key)


def cu_seqlens_to(cu_seqlens: torch.Tensor, device: torch.device | str, total: int, max_seqlen: int) -> torch.Tensor:
    """cu_seqlens on `device`, its values checked where they are first (check_values_of_cu_seqlens for q and k of
    `total` rows and sequences of at most `max_seqlen`: on a host copy that waits for nothing) and the copy marked
    as checked, so that the varlen ops skip their own check of it, which would wait for the device. A data pipeline
    that builds cu_seqlens on the host passes each batch's through here (model/lit_gpt.py). The copy is a normal
    tensor even under torch.inference_mode, so that its mark holds there too."""
    check_values_of_cu_seqlens(cu_seqlens, cu_seqlens, total, total, max_seqlen, max_seqlen)
    with torch.inference_mode(False):
        moved = cu_seqlens.to(device, non_blocking=True)
        if moved.is_inference():  # already on `device`, and .to handed the inference tensor back
            moved = moved.clone()
    setattr(moved, _CHECKED_ATTR, _checked_key(moved, total, max_seqlen))
    return moved


def _checked_key(cu: torch.Tensor, total: int, max_len: int) -> tuple[int, int, int] | None:
    """What check_values_of_cu_seqlens marks a valid cu_seqlens with; None for an inference tensor (no version)."""
    return None if cu.is_inference() else (cu._version, total, max_len)


def _check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_values_of_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)


@torch.library.custom_op("flash_kernel::varlen_fwd", mutates_args=())
def _varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_left, window_right, deterministic)


def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, deterministic):
    """The forward kernel on checked varlen inputs: o (total_q, Hq, D), lse (Hq, total_q) float32."""
    C = _load_C()
    total_q, Hq, D = q.shape
    o = torch.empty((total_q, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, total_q), dtype=torch.float32, device=q.device)
    C.varlen_fwd(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_left, window_right)
    return o, lse


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, deterministic):
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    total_q, Hq, D = q.shape
    return q.new_empty((total_q, Hq, D)), q.new_empty((Hq, total_q), dtype=torch.float32)


@torch.library.custom_op("flash_kernel::varlen_bwd", mutates_args=())
def _varlen_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_varlen_bwd_tensors(do, q, o, lse)
    return _varlen_bwd_impl(do, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, deterministic)


def _check_varlen_bwd_tensors(do, q, o, lse) -> None:
    """do and o like q; lse float32 (Hq, total_q), contiguous, on q's device."""
    total_q, Hq, _ = q.shape
    _check_do_o_lse(do, o, lse, q, (Hq, total_q), "(Hq, total_q)", check_device=True)


def _varlen_bwd_impl(do, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, deterministic):
    """The backward kernels on checked varlen inputs: dq, dk, dv shaped like q, k, v."""
    C = _load_C()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    C.varlen_bwd(do, q, k, v, o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, deterministic, window_left, window_right)
    return dq, dk, dv


@_varlen_bwd.register_fake
def _varlen_bwd_fake(do, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, deterministic):
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_varlen_bwd_tensors(do, q, o, lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward_varlen(ctx, do, dlse):
    return _grads(_varlen_bwd, ctx, do)


_varlen_fwd.register_autograd(_backward_varlen, setup_context=_setup_context)


# ----------------------------------------------------------------------------------- user entries


class _EagerFlashAttention(torch.autograd.Function):
    """flash_attn_func (and the qkvpacked and varlen functions) outside torch.compile: the ops' kernels, context and
    gradients without their dispatch layers. Inputs were checked by the user entry; the saved tensors by the forward;
    the binding checks all. fwd_impl / bwd_impl: the pair of implementations, forward's inputs as the op's."""

    @staticmethod
    def forward(ctx, fwd_impl, bwd_impl, *inputs):
        o, lse = fwd_impl(*inputs)
        _setup_context(ctx, inputs, (o, lse))
        ctx.bwd_impl = bwd_impl
        return o

    @staticmethod
    def backward(ctx, do):
        return None, None, *_grads(ctx.bwd_impl, ctx, do)


def _run(op, fwd_impl, bwd_impl, args) -> torch.Tensor:
    """The op under torch.compile (traced through its fake impl and registered autograd) or a dispatch mode,
    else its implementations through _EagerFlashAttention."""
    if _through_ops():
        return op(*args)[0]
    return _EagerFlashAttention.apply(fwd_impl, bwd_impl, *args)


def _through_ops() -> bool:
    """Whether a call goes through the custom ops: under torch.compile, and under dispatch modes (FlopCounterMode,
    FakeTensorMode), which see the ops, not the eager path's direct kernel calls."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def _scale(softmax_scale, head_dim: int) -> float:
    return float(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """FlashAttention-2: q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D), fp16/bf16 on CUDA -> o (B, Tq, Hq, D).

    causal is aligned bottom-right (query i sees keys j <= i + Tk - Tq); softmax_scale defaults to
    1/sqrt(D); deterministic=True makes the backward bitwise reproducible (no atomics, a little slower).
    window_size=(left, right): sliding-window attention, query i sees keys i + Tk - Tq - left .. i + Tk - Tq + right
    (-1: unbounded; causal makes right 0). Rows that see no key give o = 0.
    """
    check_inputs(q, k, v)
    left, right = _check_window(window_size)
    args = (q, k, v, _scale(softmax_scale, q.shape[-1]), bool(causal), bool(deterministic), left, right)
    return _run(_fwd, _fwd_impl, _bwd_impl, args)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """flash_attn_func on q, k, v = qkv.unbind(dim=2), qkv (B, T, 3, H, D) -> o (B, T, H, D).

    The same kernels; the gradient is one (B, T, 3, H, D) tensor that the backward writes in place of
    dq, dk, dv, instead of three that autograd then stacks into one.
    """
    _check_qkv_packed(qkv)
    check_inputs(*qkv.unbind(dim=2))
    left, right = _check_window(window_size)
    args = (qkv, _scale(softmax_scale, qkv.shape[-1]), bool(causal), bool(deterministic), left, right)
    return _run(_fwd_qkvpacked, _fwd_qkvpacked_impl, _bwd_qkvpacked_impl, args)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    deterministic: bool = False,
) -> torch.Tensor:
    """FlashAttention-2 on packed sequences (FlashAttention's flash_attn_varlen_func): q (total_q, Hq, D), k/v
    (total_k, Hkv, D), cu_seqlens_q / cu_seqlens_k int32 (batch + 1,) on q's device, [0, end of sequence 0, ...,
    total] -> o (total_q, Hq, D).

    Sequence s of q (rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1) attends only to sequence s of k and v, with
    causal and window_size as in flash_attn_func on that pair alone (bottom-right aligned with its own lengths).
    max_seqlen_q / max_seqlen_k: Python ints >= every sequence's length (they size the grid). Sequences may be empty;
    a query row that sees no key gives o = 0 and zero gradients. The values of cu_seqlens are checked once per
    tensor (check_values_of_cu_seqlens), which waits for the device that once.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    left, right = _check_window(window_size)  # before the value check, which waits for the device
    if not _through_ops():  # else the op's implementation checks the values
        check_values_of_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, _scale(softmax_scale, q.shape[-1]),
            bool(causal), left, right, bool(deterministic))
    return _run(_varlen_fwd, _varlen_fwd_impl, _varlen_bwd_impl, args)
