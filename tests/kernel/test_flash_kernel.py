"""GPU correctness of the FlashAttention-2 CUDA kernels (flash_kernel._C) and their torch.library face.

Criterion (flash-attn's tests): for each of o, lse, dq, dk, dv,
    max|ours - ref32| <= 2 * max|pt - ref32| + slack,
where ref32 is materialised attention in float32 (flash_kernel.naive_attention, upcast) and pt is the same
materialised attention done by PyTorch in fp16/bf16: "no worse than twice what PyTorch itself gets in
that precision". The slack is the rounding error of the output dtype near the values' magnitude (as
flash-attn's `(x + 0.3 - 0.3 - x)`), floored at ABS_SLACK for outputs that are exactly zero.

Outputs are allocated full of NaN before each _C call, so an element the kernel forgets to write fails;
inputs are fresh per test (seeded from the test id in conftest.py). The grid: every dtype x head dim x
causal x GQA on short and odd lengths (incl. Tq != Tk, causal bottom-right), a subset at 1023-3000.
"""

import math

import pytest
import torch

import flash_kernel
from flash_kernel import flash_attn_func, flash_attn_qkvpacked_func, naive_attention
from flash_kernel.interface import _load_C
from model.attention import check_attention_runs_on

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
HEAD_DIMS = [32, 64, 80, 96, 128, 256]
# (Tq, Tk): equal, decode-like Tq < Tk, and Tq > Tk where causal leaves the first Tq - Tk rows empty.
SMALL_SEQLENS = [
    (1, 1), (17, 17), (113, 113), (255, 255),
    (1, 113), (113, 1), (17, 255), (255, 17), (113, 203), (203, 113),
]  # fmt: skip
LONG_SEQLENS = [(1023, 1023), (2049, 2049), (3000, 3000), (1023, 3000), (3000, 1023)]
ODD_HEAD_DIMS = [8, 40, 72, 88, 120, 200, 248]  # multiples of 8 the kernel must round up to its tile inside
# (88: hd81-96's three-warpgroup Hopper forward tile with zero columns past d)
HKV = 2  # kv heads; Hq = HKV * gqa
ABS_SLACK = 1e-4
LSE_RTOL = 1e-3  # lse relative to its magnitude; float32 math on exact products is ~1e-6


# ----------------------------------------------------------------------------------------------- helpers
def _randn_qkv(B, seqlen_q, seqlen_k, Hq, Hkv, D, dtype):
    q = torch.randn(B, seqlen_q, Hq, D, device="cuda", dtype=dtype)  # (B, Tq, Hq, D)
    k = torch.randn(B, seqlen_k, Hkv, D, device="cuda", dtype=dtype)  # (B, Tk, Hkv, D)
    v = torch.randn(B, seqlen_k, Hkv, D, device="cuda", dtype=dtype)
    do = torch.randn(B, seqlen_q, Hq, D, device="cuda", dtype=dtype)
    return q, k, v, do


def _poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device="cuda")


def kernel_fwd(q, k, v, causal, scale):
    """_C.fwd into NaN-poisoned o (B, Tq, Hq, D) and lse (B, Hq, Tq)."""
    B, seqlen_q, Hq, _ = q.shape
    o = _poisoned(q.shape, q.dtype)
    lse = _poisoned((B, Hq, seqlen_q), torch.float32)
    _load_C().fwd(q, k, v, o, lse, scale, causal)
    return o, lse


def kernel_bwd(do, q, k, v, o, lse, causal, scale, deterministic=False):
    """_C.bwd into NaN-poisoned dq, dk, dv."""
    dq, dk, dv = _poisoned(q.shape, q.dtype), _poisoned(k.shape, k.dtype), _poisoned(v.shape, v.dtype)
    _load_C().bwd(do, q, k, v, o, lse, dq, dk, dv, scale, causal, deterministic)
    return dq, dk, dv


def materialised(q, k, v, do, causal, scale, upcast):
    """o, lse, dq, dk, dv of naive attention: float32 leaves (upcast) or the inputs' own dtype (PyTorch low precision)."""
    leaves = [t.detach().float() if upcast else t.detach().clone() for t in (q, k, v)]
    leaves = [t.requires_grad_() for t in leaves]
    o, lse = naive_attention(*leaves, causal=causal, softmax_scale=scale, upcast=upcast)
    o.backward(do.to(o.dtype))
    return (o.detach(), lse.detach().float(), *(t.grad for t in leaves))


def max_err(a, b):
    # Equal infinities (lse of rows that see no key) are exact; NaN propagates to the max and fails `<=`.
    a, b = a.float(), b.float()
    return torch.where(a == b, 0.0, (a - b).abs()).max().item()


def rounding_slack(ref, dtype):
    r = ref[torch.isfinite(ref)].to(dtype)
    if r.numel() == 0:
        return ABS_SLACK
    return max(ABS_SLACK, 2 * ((r + 0.3 - 0.3) - r).abs().max().item())


def assert_flash_close(name, ours, ref, pt, dtype, case=""):
    assert not ours.isnan().any(), f"{name} has NaN ({case}): unwritten elements or 0/0"
    err, err_pt = max_err(ours, ref), max_err(pt, ref)
    slack = rounding_slack(ref, dtype)
    assert err <= 2 * err_pt + slack, (
        f"{name} ({case}): max|ours - fp32 ref| = {err:.3g} > 2 * {err_pt:.3g} (PyTorch {dtype}) + {slack:.3g}"
    )


def check_outputs(outs, q, k, v, do, causal, scale, case):
    """outs = (o, lse[, dq, dk, dv]) from the kernel, checked against the fp32 reference with the flash-attn criterion."""
    ref = materialised(q, k, v, do, causal, scale, upcast=True)
    pt = materialised(q, k, v, do, causal, scale, upcast=False)
    names = ("o", "lse", "dq", "dk", "dv")
    for name, ours, r, p in zip(names, outs, ref, pt):
        assert ours.shape == r.shape, f"{name} shape {tuple(ours.shape)} != {tuple(r.shape)} ({case})"
        out_dtype = torch.float32 if name == "lse" else q.dtype
        assert ours.dtype == out_dtype, f"{name} dtype {ours.dtype}, expected {out_dtype} ({case})"
        assert_flash_close(name, ours, r, p, out_dtype, case)
    lse = outs[1]
    # Stricter on lse: it is float32 from exact fp16/bf16 products, while the PyTorch yardstick rounds the
    # scores to the low precision (~1e-2 error), which would let an lse bias of ~1e-2 through.
    lse_tol = LSE_RTOL * max(1.0, ref[1][torch.isfinite(ref[1])].abs().max().item() if torch.isfinite(ref[1]).any() else 1.0)
    assert max_err(lse, ref[1]) <= lse_tol, f"lse ({case}): max|ours - fp32 ref| = {max_err(lse, ref[1]):.3g} > {lse_tol:.3g}"
    for name, t in zip(names, outs):
        if name != "lse":
            assert torch.isfinite(t).all(), f"{name} has inf ({case})"
    assert not torch.isneginf(lse).any(), f"lse has -inf ({case}); rows that see no key must give +inf"


def run_case(B, seqlen_q, seqlen_k, Hq, Hkv, D, dtype, causal, scale=None, deterministic=False, qk_gain=1.0):
    q, k, v, do = _randn_qkv(B, seqlen_q, seqlen_k, Hq, Hkv, D, dtype)
    if qk_gain != 1.0:
        q, k = (q.float() * qk_gain).to(dtype), (k.float() * qk_gain).to(dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    case = f"B={B} Tq={seqlen_q} Tk={seqlen_k} Hq={Hq} Hkv={Hkv} D={D} {dtype} causal={causal}"
    o, lse = kernel_fwd(q, k, v, causal, scale)
    dq, dk, dv = kernel_bwd(do, q, k, v, o, lse, causal, scale, deterministic)
    check_outputs((o, lse, dq, dk, dv), q, k, v, do, causal, scale, case)


# ------------------------------------------------------------------------------------- the accuracy grid
@pytest.mark.parametrize("seqlen_q,seqlen_k", SMALL_SEQLENS)
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grid_short(dtype, D, causal, gqa, seqlen_q, seqlen_k):
    run_case(2, seqlen_q, seqlen_k, HKV * gqa, HKV, D, dtype, causal)


@pytest.mark.parametrize("seqlen_q,seqlen_k", LONG_SEQLENS)
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grid_long(dtype, D, causal, gqa, seqlen_q, seqlen_k):
    run_case(1, seqlen_q, seqlen_k, HKV * gqa, HKV, D, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 80, 96, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_long_other_head_dims(dtype, D, causal):
    run_case(1, 2049, 2049, 4, 2, D, dtype, causal)


# ------------------------------------------------------------------ the two kernel paths per pass on Hopper
# On an sm_90 GPU the grid above runs the wgmma forward and backward (head dims 33-128); these keep the
# mma.sync kernels, which sm_90 runs under set_kernel_overrides(fwd="sm80") / (bwd="sm80") (and for the
# deterministic backward always) and every other GPU runs always, tested there.


def _kernel_name(pass_, D, deterministic=False):
    C, device = _load_C(), torch.cuda.current_device()
    return C.fwd_kernel_name(D, device) if pass_ == "fwd" else C.bwd_kernel_name(D, device, deterministic)


def _skip_unless_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (H100/H200): elsewhere the sm80 kernels are the only ones, tested above")


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("D", [40, 64, 72, 80, 96, 120, 128])  # 65-80: the 80-wide tiles; 81-96: hd96's
def test_hopper_kernels_are_the_default_on_sm90(pass_, D):
    _skip_unless_sm90()
    assert _kernel_name(pass_, D) == "sm90a-wgmma"
    assert _kernel_name(pass_, 32) == _kernel_name(pass_, 256) == "sm80-mma"  # head dims without a Hopper kernel
    if pass_ == "bwd":
        assert _kernel_name(pass_, D, deterministic=True) == "sm80-mma"  # ordered dq_accum splits: sm80 only


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 113), (113, 113), (255, 17), (1023, 3000), (2049, 2049)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_sm80_kernels_on_sm90(overrides, pass_, dtype, D, causal, seqlen_q, seqlen_k):
    _skip_unless_sm90()
    overrides(**{pass_: "sm80"})
    assert _kernel_name(pass_, D) == "sm80-mma"
    run_case(1, seqlen_q, seqlen_k, 4, 2, D, dtype, causal)


@pytest.mark.parametrize("pass_,name", [("fwd", "forward"), ("bwd", "backward")])
def test_unknown_kernel_path_is_refused(overrides, pass_, name):
    overrides(**{pass_: "sm80"})
    with pytest.raises(ValueError, match=f"{pass_}=wgmma is not a {name} path; use auto"):
        overrides(**{pass_: "wgmma"})
    assert _kernel_name(pass_, 64) == "sm80-mma"  # the refused call left the switches as they were


# (300, 2100): from 2048 keys the Hopper forward's wide key blocks (hopper_kernel_traits.h) under the same padding.
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 255), (255, 113), (300, 2100)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", ODD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_head_dims_rounded_up_inside(dtype, D, causal, seqlen_q, seqlen_k):
    run_case(2, seqlen_q, seqlen_k, 4, 2, D, dtype, causal)


@pytest.mark.parametrize("scale", [0.01, 0.5, 2.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softmax_scale(dtype, scale):
    run_case(2, 200, 300, 4, 4, 64, dtype, causal=True, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_scores_stay_finite(dtype, causal):
    # |q.k| * scale in the hundreds: exp overflows unless the running max is subtracted (online softmax).
    run_case(2, 255, 255, 4, 2, 64, dtype, causal, qk_gain=6.0)


def test_batch_and_many_heads():
    run_case(5, 129, 129, 12, 3, 64, torch.bfloat16, causal=True)


# The Hopper forward is persistent (fwd_tile_scheduler.h): one block per SM loops over query-block tiles, causal
# blocks taking theirs from a counter. Here every block runs 5-20 tiles of different lengths, the stages and
# barrier phases run on across them, and with Tq > Tk up to half of each head's query blocks see no key (written
# after the main tiles); o and lse are NaN-poisoned, so a tile never run shows. From 2048 keys up the causal hd80 and
# hd128 forwards run wider key blocks, the hd80 one 192 x 144 tiles (hopper_kernel_traits.h): the last three pairs of
# lengths. Non-causal, those head dims run 192-key blocks where their turns cost less (wider_blocks_pay): at every Tk
# here but 1400, where the 128-key blocks run; every Tk here ends inside its last key block.
# At hd64 the backward is persistent as well (bwd_tile_scheduler.h): blocks run 4-13 key-block tiles each on 132
# SMs, the query blocks' stages and mbarrier phases and the sdQ stages carrying dK_j / dV_j to their TMA stores run
# on across them, and tiles differ in length (causal: each key block from the first query block that sees it, the
# first rows seeing no key where Tq > Tk); dq, dk and dv are NaN-poisoned too.
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k",
    [(1500, 1500), (1500, 700), (700, 1500), (1600, 1600), (1400, 1400), (2600, 2600), (3000, 2100), (1500, 2600)],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 80, 96, 128])
def test_persistent_forward_many_tiles(D, causal, seqlen_q, seqlen_k):
    run_case(2, seqlen_q, seqlen_k, 40, 8, D, torch.bfloat16, causal)


# A tile's last key block runs S, its softmax and P V only over its keys up to the last one some row of the tile sees,
# in 64-key steps (FLASH_FWD_NARROW_LAST_BLOCK, hopper_kernel_traits.h): Tk here leaves 1, 64, 65, 128 and 129 keys in
# the last of 22 192-key blocks (the narrow steps' edges; 129 runs the whole block), which non-causal hd80 and hd128
# calls run; causal, every query tile's diagonal block narrows by where its last row falls (Tq < Tk: the last rows
# see every key), on 192-key blocks at hd128, 144 at hd80 and 128 at hd64 and hd96.
@pytest.mark.parametrize("seqlen_k", [4033, 4096, 4097, 4160, 4161])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 80, 96, 128])
def test_forward_narrowed_last_key_block(D, causal, seqlen_k):
    run_case(1, 333, seqlen_k, 4, 2, D, torch.bfloat16, causal)


def run_block_order_cases(D, group, tq_over_tk=False):
    """The causal block-order tests' cases: groups of 4 over 3 x 4 (batch, head) pairs (whole), any other over 2 x 5
    (groups of 3: the last one short), with Tq = Tk, Tq < Tk and, with tq_over_tk, Tq > Tk."""
    B, H = (3, 4) if group == 4 else (2, 5)
    run_case(B, 385, 385, H, 1, D, torch.bfloat16, causal=True)
    run_case(B, 200, 461, H, H, D, torch.float16, causal=True)  # Tq < Tk: bottom-right aligned
    if tq_over_tk:
        run_case(B, 461, 200, H, H, D, torch.bfloat16, causal=True)  # Tq > Tk: the first rows see no key


# Causal forward grids run in an order of their own (causal_order.h): groups of (batch, head) pairs, longest
# block first. Short shapes make one group of every pair; these force groups of 1, of 3 over 2 x 5 pairs (the
# last one short) and of 4 over 3 x 4 (whole): every query block written once (o is NaN-poisoned).
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("sm80", [False, True], ids=["default", "sm80"])
def test_causal_block_order_groups(overrides, sm80, D, group):
    overrides(causal_group_heads=group, **({"fwd": "sm80", "bwd": "sm80"} if sm80 else {}))
    run_block_order_cases(D, group)


def test_causal_block_order_group_override_is_checked(overrides):
    with pytest.raises(ValueError, match="causal_group_heads=-1 is not a positive integer"):
        overrides(causal_group_heads=-1)


# The Hopper causal backward's blocks run in that order too, key block 0 (each head's longest) first (bwd_block_coord;
# at hd64 the persistent blocks take their tiles in it, bwd_tile_coord):
# groups of 1 (the grid's own order), 3 (the last one short) and 4 (whole) over the grid's (batch, head) pairs, or
# the default (0: the grid's order below 2048 keys, groups sized to L2 from there; the last case). dk and dv are
# NaN-poisoned, so a key block never run shows.
@pytest.mark.parametrize("group", [0, 1, 3, 4])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_hopper_causal_backward_block_order(overrides, D, group):
    _skip_unless_sm90()
    overrides(bwd_causal_group_heads=group)
    run_block_order_cases(D, group, tq_over_tk=True)
    if group == 0:
        run_case(1, 2100, 2100, 6, 2, D, torch.bfloat16, causal=True)


# ----------------------------------------------------------------- GPUs with less shared memory per block
# set_kernel_overrides(max_smem_per_block=N) makes this GPU choose and check the sm80 kernels as one whose thread blocks get
# that many bytes would (flash_api.cpp, set_smem_limits). A100, 163 KiB: the hd128 backward runs its one-dO-stage
# SmallSmemTraits. sm_86 / sm_89, 99 KiB: the Smem99KiBTraits of kernel_traits.h (smaller backward tiles, a
# two-stage forward at head dim 96). An H100 picks neither on its own. Below what the smallest config needs, the
# kernel is refused before launch, saying what to use instead.
A100_SMEM_PER_BLOCK = 163 * 1024
SM89_SMEM_PER_BLOCK = 99 * 1024
TOO_SMALL_SMEM_PER_BLOCK = 48 * 1024  # only the hd32 forward fits
SMEM_LIMITS = {"a100": A100_SMEM_PER_BLOCK, "sm89": SM89_SMEM_PER_BLOCK}
HEAD_DIMS = (32, 64, 96, 128, 256)


def _emulate_smem_per_block(overrides, limit):
    overrides(fwd="sm80", bwd="sm80", max_smem_per_block=limit)  # the Hopper kernels do not heed the limit


def _smem_bytes(D, backward):
    return _load_C().sm80_smem_bytes(D, torch.cuda.current_device(), backward)


def test_full_smem_runs_every_head_dim_and_smaller_limits_pick_smaller_configs(overrides):
    for D in HEAD_DIMS:
        for deterministic in (False, True):
            assert flash_kernel.unavailable_reason(D, deterministic=deterministic) is None, D
    full = {D: (_smem_bytes(D, False), _smem_bytes(D, True)) for D in HEAD_DIMS}
    if full[128][1] <= A100_SMEM_PER_BLOCK:
        pytest.skip("this GPU runs the A100 backward configs already")
    _emulate_smem_per_block(overrides, A100_SMEM_PER_BLOCK)
    # SmallSmemTraits: one (64 x 128) bf16 dO stage less, and no dQ staging tiles (8 warps x 16 x 32 fp32)
    assert _smem_bytes(128, True) == full[128][1] - 64 * 128 * 2 - 8 * 16 * 32 * 4
    _emulate_smem_per_block(overrides, SM89_SMEM_PER_BLOCK)
    for D in HEAD_DIMS:  # every pass has a config that fits, and it is a smaller one wherever the full one does not
        for backward in (False, True):
            need = _smem_bytes(D, backward)
            assert need <= SM89_SMEM_PER_BLOCK, (D, backward, need)
            assert need == full[D][backward] or full[D][backward] > SM89_SMEM_PER_BLOCK, (D, backward, need)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 113), (255, 1023), (2049, 2049)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gpu", list(SMEM_LIMITS))
def test_smaller_smem_configs(overrides, gpu, dtype, D, causal, seqlen_q, seqlen_k):
    limit = SMEM_LIMITS[gpu]
    _emulate_smem_per_block(overrides, limit)
    assert _smem_bytes(D, False) <= limit and _smem_bytes(D, True) <= limit
    assert flash_kernel.unavailable_reason(D) is None
    run_case(1, seqlen_q, seqlen_k, 4, 2, D, dtype, causal)


@pytest.mark.parametrize("D", [32, 128])
def test_kernels_that_do_not_fit_are_refused_before_launch(overrides, D):
    _emulate_smem_per_block(overrides, TOO_SMALL_SMEM_PER_BLOCK)
    fits = {pass_: _smem_bytes(D, pass_ == "bwd") <= TOO_SMALL_SMEM_PER_BLOCK for pass_ in ("fwd", "bwd")}
    assert fits == {"fwd": D == 32, "bwd": False}
    with pytest.raises(RuntimeError, match=f"attention=flash cannot run at head dim {D} on cuda"):
        check_attention_runs_on("flash", D, torch.device("cuda", torch.cuda.current_device()))
    refused = rf"the {{}} kernel at head dim {D} needs [\d.]+ KiB of shared memory per thread block, but .* gives a " \
              r"block at most 48.0 KiB under the max_smem_per_block override\. .*attention=sdpa"
    q, k, v, do = _randn_qkv(1, 77, 77, 4, 2, D, torch.bfloat16)
    if fits["fwd"]:
        o, lse = kernel_fwd(q, k, v, True, 0.125)
        check_outputs((o, lse), q, k, v, do, True, 0.125, f"forward of D={D} at 48 KiB")
    else:  # the message names the smallest config: at hd128 the 2-block Traits (96.2 KiB), not OneBlockTraits
        with pytest.raises(RuntimeError, match=refused.format("forward").replace(r"[\d.]+", "96.2")):
            kernel_fwd(q, k, v, True, 0.125)
        o, lse = torch.zeros_like(q), torch.zeros(1, 4, 77, device="cuda")  # never read: refused before launch
    with pytest.raises(RuntimeError, match=refused.format("backward")):
        kernel_bwd(do, q, k, v, o, lse, True, 0.125)


def test_smem_limit_override_is_checked(overrides):
    with pytest.raises(ValueError, match="max_smem_per_block=-1 is not a positive number of bytes"):
        overrides(max_smem_per_block=-1)


# --------------------------------------------------------------------------------------- deterministic
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,gpu", [(64, None), (128, None), (64, "sm89"), (128, "sm89"), (256, "sm89")])
def test_deterministic_backward_is_bitwise_reproducible(overrides, D, gpu, causal, gqa):
    # gpu="sm89": the 99 KiB configs. The ordered splits size themselves by the full config's key blocks
    # (bwd_block_n); the smaller configs have as many or more, each split walking several.
    if gpu is not None:
        _emulate_smem_per_block(overrides, SMEM_LIMITS[gpu])
        assert flash_kernel.unavailable_reason(D, deterministic=True) is None
    dtype, scale = torch.bfloat16, 1.0 / math.sqrt(D)
    # Long enough that many K/V blocks add into each dq row (where atomics would reorder the sums).
    q, k, v, do = _randn_qkv(2, 2049, 2049, HKV * gqa, HKV, D, dtype)
    o, lse = kernel_fwd(q, k, v, causal, scale)
    o2, lse2 = kernel_fwd(q, k, v, causal, scale)
    assert torch.equal(o, o2) and torch.equal(lse, lse2), "forward is not bitwise reproducible"
    first = kernel_bwd(do, q, k, v, o, lse, causal, scale, deterministic=True)
    second = kernel_bwd(do, q, k, v, o, lse, causal, scale, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    check_outputs((o, lse, *first), q, k, v, do, causal, scale, f"deterministic D={D} causal={causal} gqa={gqa}")


def test_deterministic_flag_through_flash_attn_func():
    q, k, v, do = _randn_qkv(1, 1000, 1000, 8, 2, 128, torch.bfloat16)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*leaves, causal=True, deterministic=True).backward(do)
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


# ---------------------------------------------------------------------- strided inputs (no copy needed)
def _layout(name, B, T, Hq, Hkv, D, dtype):
    """A base tensor and a function base -> (q, k, v) views (B, T, H, D) with a contiguous last dim only."""
    if name == "fused_qkv":  # the model's fused projection viewed as (B, T, 3, H, D)
        base = torch.randn(B, T, 3, Hq, D, device="cuda", dtype=dtype)
        return base, lambda t: t.unbind(dim=2)
    if name == "fused_gqa":  # (B, T, Hq + 2 Hkv, D), split along heads
        base = torch.randn(B, T, Hq + 2 * Hkv, D, device="cuda", dtype=dtype)
        return base, lambda t: t.split([Hq, Hkv, Hkv], dim=2)
    if name == "bhtd":  # heads-major storage (B, 3, H, T, D), transposed to (B, T, H, D): seq stride = D
        base = torch.randn(B, 3, Hq, T, D, device="cuda", dtype=dtype)
        return base, lambda t: tuple(x.transpose(1, 2) for x in t.unbind(dim=1))
    if name == "padded":  # sequence and head-dim padding: odd seq offset, head stride D + 8, batch stride odd
        base = torch.randn(B, T + 5, 3, Hq, D + 8, device="cuda", dtype=dtype)
        return base, lambda t: t[:, 3 : 3 + T, :, :, :D].unbind(dim=2)
    raise ValueError(name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["fused_qkv", "fused_gqa", "bhtd", "padded"])
def test_strided_inputs(layout, causal):
    B, T, D, dtype = 2, 333, 64, torch.bfloat16
    Hq, Hkv = (8, 2) if layout == "fused_gqa" else (4, 4)
    base, views = _layout(layout, B, T, Hq, Hkv, D, dtype)
    q, k, v = views(base)
    assert q.stride(-1) == 1 and not q.is_contiguous()
    do = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(D)
    case = f"layout={layout} causal={causal}"

    # The raw kernels on the views, poisoned outputs.
    o, lse = kernel_fwd(q, k, v, causal, scale)
    dq, dk, dv = kernel_bwd(do, q, k, v, o, lse, causal, scale)
    check_outputs((o, lse, dq, dk, dv), q, k, v, do, causal, scale, case)

    # Through autograd: gradients land in the base tensor at the views' places.
    base = base.detach().requires_grad_()
    o = flash_attn_func(*views(base), causal=causal)
    o.backward(do)
    dq, dk, dv = views(base.grad)
    ref = materialised(q, k, v, do, causal, scale, upcast=True)
    pt = materialised(q, k, v, do, causal, scale, upcast=False)
    for name, ours, r, p in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), ref[:1] + ref[2:], pt[:1] + pt[2:]):
        assert_flash_close(name, ours, r, p, dtype, case + " via flash_attn_func")


# ------------------------------------------------------------------------------- the custom-op surface
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,gqa,causal,dtype",
    [
        (128, 128, 1, True, torch.bfloat16),
        (77, 200, 4, True, torch.float16),
        (200, 77, 4, True, torch.bfloat16),
        (301, 301, 2, False, torch.float16),
    ],
)
def test_flash_attn_func_autograd(seqlen_q, seqlen_k, gqa, causal, dtype):
    q, k, v, do = _randn_qkv(2, seqlen_q, seqlen_k, HKV * gqa, HKV, 64, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flash_attn_func(*leaves, causal=causal)
    o.backward(do)
    ref = materialised(q, k, v, do, causal, None, upcast=True)
    pt = materialised(q, k, v, do, causal, None, upcast=False)
    ours = (o, *(t.grad for t in leaves))
    for name, a, r, p in zip(("o", "dq", "dk", "dv"), ours, ref[:1] + ref[2:], pt[:1] + pt[2:]):
        assert_flash_close(name, a, r, p, dtype, f"flash_attn_func Tq={seqlen_q} Tk={seqlen_k}")


def test_backward_accepts_non_contiguous_grad():
    # o.sum() sends an expanded gradient (all strides 0); the autograd wrapper must make it usable.
    q, k, v, _ = _randn_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*leaves).sum().backward()
    ones = torch.ones_like(q)
    ref = materialised(q, k, v, ones, True, None, upcast=True)
    pt = materialised(q, k, v, ones, True, None, upcast=False)
    for name, leaf, r, p in zip(("dq", "dk", "dv"), leaves, ref[2:], pt[2:]):
        assert_flash_close(name, leaf.grad, r, p, torch.bfloat16, "sum() gradient")


@pytest.mark.parametrize("gqa,causal", [(1, True), (4, False)])
def test_opcheck_fwd(gqa, causal):
    q, k, v, _ = _randn_qkv(2, 97, 130, HKV * gqa, HKV, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    # deterministic=True so the eager and AOT-compiled backward compared inside opcheck agree exactly.
    torch.library.opcheck(torch.ops.flash_kernel.fwd.default, (q, k, v, 0.125, causal, True))


def test_opcheck_bwd():
    q, k, v, do = _randn_qkv(2, 97, 130, 8, 2, 64, torch.float16)
    o, lse = torch.ops.flash_kernel.fwd(q, k, v, 0.125, True, True)
    torch.library.opcheck(torch.ops.flash_kernel.bwd.default, (do, q, k, v, o, lse, 0.125, True, True))


def _attention_block(x, w_qkv, w_o, n_head, packed=False):
    B, T, C = x.shape
    qkv = (x @ w_qkv).view(B, T, 3, n_head, C // n_head)  # (B, T, 3, H, D)
    if packed:
        o = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)  # (B, T, H, D)
    else:
        q, k, v = qkv.unbind(dim=2)  # (B, T, H, D) views, no copy
        o = flash_attn_func(q, k, v, causal=True, deterministic=True)  # (B, T, H, D)
    return o.reshape(B, T, C) @ w_o  # (B, T, C)


@pytest.mark.parametrize("packed", [False, True], ids=["views", "qkvpacked"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic, packed):
    torch._dynamo.reset()
    C, n_head, dtype = 256, 4, torch.bfloat16
    w_qkv = (torch.randn(C, 3 * C, device="cuda", dtype=dtype) / math.sqrt(C)).requires_grad_()
    w_o = (torch.randn(C, C, device="cuda", dtype=dtype) / math.sqrt(C)).requires_grad_()
    compiled = torch.compile(_attention_block, fullgraph=True, dynamic=dynamic)  # a graph break raises
    for T in (128, 200):  # a second length: recompiles (static) or reuses the symbolic graph (dynamic)
        x = torch.randn(2, T, C, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(2, T, C, device="cuda")  # a random cotangent keeps every gradient O(1)
        y_eager = _attention_block(x, w_qkv, w_o, n_head, packed)
        grads_eager = torch.autograd.grad((y_eager.float() * g).sum(), (x, w_qkv, w_o))
        y_comp = compiled(x, w_qkv, w_o, n_head, packed)
        grads_comp = torch.autograd.grad((y_comp.float() * g).sum(), (x, w_qkv, w_o))
        # Inductor may fuse the surrounding matmuls differently, so close (bf16-level) rather than bitwise.
        for name, a, b in zip(("y", "dx", "dw_qkv", "dw_o"), (y_comp, *grads_comp), (y_eager, *grads_eager)):
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert rel < 2e-2, f"{name}: compiled vs eager relative error {rel:.3g} (T={T}, dynamic={dynamic})"


# ----------------------------------------------------------------------------------------- qkv packed
@pytest.mark.parametrize("T", [1, 113, 1000, 2049])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_qkvpacked(dtype, D, causal, T):
    B, H = 2, 4
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=dtype)  # (B, T, 3, H, D)
    do = torch.randn(B, T, H, D, device="cuda", dtype=dtype)
    case = f"qkvpacked T={T} D={D} {dtype} causal={causal}"
    packed = qkv.clone().requires_grad_()
    o = flash_attn_qkvpacked_func(packed, causal=causal)
    o.backward(do)
    views = qkv.clone().requires_grad_()
    o_views = flash_attn_func(*views.unbind(dim=2), causal=causal)
    o_views.backward(do)
    # The same kernels on the same data: o, dk, dv (no atomics) are bitwise those of the three views.
    assert torch.equal(o, o_views), case
    for name, a, b in zip(("dk", "dv"), packed.grad.unbind(dim=2)[1:], views.grad.unbind(dim=2)[1:]):
        assert torch.equal(a, b), f"{name} ({case}) differs from flash_attn_func's"
    assert packed.grad.shape == qkv.shape and packed.grad.is_contiguous()
    ref = materialised(*qkv.unbind(dim=2), do, causal, None, upcast=True)
    pt = materialised(*qkv.unbind(dim=2), do, causal, None, upcast=False)
    for name, ours, r, p in zip(("dq", "dk", "dv"), packed.grad.unbind(dim=2), ref[2:], pt[2:]):
        assert_flash_close(name, ours, r, p, dtype, case)


def test_qkvpacked_deterministic_is_bitwise_the_views():
    qkv = torch.randn(2, 777, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(2, 777, 4, 128, device="cuda", dtype=torch.bfloat16)
    packed, views = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    flash_attn_qkvpacked_func(packed, deterministic=True).backward(do)
    flash_attn_func(*views.unbind(dim=2), deterministic=True).backward(do)
    assert torch.equal(packed.grad, views.grad)


def test_opcheck_qkvpacked():
    qkv = torch.randn(2, 97, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.flash_kernel.fwd_qkvpacked.default, (qkv, 0.125, True, True))
    o, lse = torch.ops.flash_kernel.fwd_qkvpacked(qkv.detach(), 0.125, True, True)
    torch.library.opcheck(
        torch.ops.flash_kernel.bwd_qkvpacked.default, (torch.randn_like(o), qkv.detach(), o, lse, 0.125, True, True)
    )


def test_cuda_graph_capture():
    # Launching on anything but the current stream, or a device-wide synchronize, is an error under capture.
    q, k, v, do = _randn_qkv(2, 300, 300, 8, 2, 64, torch.bfloat16)
    scale = 0.125
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs recommends
        o, lse = torch.ops.flash_kernel.fwd(q, k, v, scale, True, True)
        torch.ops.flash_kernel.bwd(do, q, k, v, o, lse, scale, True, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = torch.ops.flash_kernel.fwd(q, k, v, scale, True, True)
        grads_g = torch.ops.flash_kernel.bwd(do, q, k, v, o_g, lse_g, scale, True, True)
    graph.replay()
    torch.cuda.synchronize()
    o_e, lse_e = kernel_fwd(q, k, v, True, scale)
    grads_e = kernel_bwd(do, q, k, v, o_e, lse_e, True, scale, deterministic=True)
    assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)
    for name, a, b in zip(("dq", "dk", "dv"), grads_g, grads_e):
        assert torch.equal(a, b), f"{name} from the replayed graph differs from eager"


def test_side_stream_results():
    q, k, v, do = _randn_qkv(2, 500, 500, 4, 4, 128, torch.float16)
    o_ref, lse_ref = kernel_fwd(q, k, v, True, 0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o, lse = torch.ops.flash_kernel.fwd(q, k, v, 0.1, True, False)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_is_available_on_this_machine():
    assert flash_kernel.is_available() and flash_kernel.unavailable_reason() is None


# ---------------------------------------------------------------------------------------- bad inputs
def _good():
    return _randn_qkv(2, 16, 16, 4, 2, 64, torch.bfloat16)[:3]


BAD_INPUTS = {
    "q_on_cpu": (lambda q, k, v: (q.cpu(), k, v), r"q must be a CUDA tensor"),
    "v_on_cpu": (lambda q, k, v: (q, k, v.cpu()), r"v must be a CUDA tensor"),
    "fp32": (lambda q, k, v: (q.float(), k.float(), v.float()), r"q has dtype torch.float32; expected"),
    "mixed_dtypes": (lambda q, k, v: (q, k.half(), v), r"k has dtype torch.float16 but q has torch.bfloat16"),
    "q_rank3": (lambda q, k, v: (q[0], k, v), r"q must have 4 dims"),
    "k_v_shapes_differ": (lambda q, k, v: (q, k, v[:, :8]), r"k and v must have the same shape"),
    "batch_mismatch": (lambda q, k, v: (q, k[:1], v[:1]), r"k has batch size 1 but q has 2"),
    "head_dim_mismatch": (lambda q, k, v: (q, k[..., :32], v[..., :32]), r"k has head dim 32 but q has 64"),
    "gqa_not_divisible": (lambda q, k, v: (q[:, :, :3], k, v), r"q has 3 heads, not a multiple of the 2 heads"),
    "head_dim_not_multiple_of_8": (lambda q, k, v: tuple(t[..., :12] for t in (q, k, v)), r"head dim 12; expected a multiple of 8"),
    "head_dim_too_large": (
        lambda q, k, v: tuple(torch.randn(*t.shape[:3], 264, device="cuda", dtype=t.dtype) for t in (q, k, v)),
        r"head dim 264; expected a multiple of 8",
    ),
    "row_stride_not_16_bytes": (
        lambda q, k, v: (torch.randn(2, 16, 4, 68, device="cuda", dtype=q.dtype)[..., :64], k, v),
        r"q must start at, and have batch/seq/head strides that are, multiples of 8",
    ),
    "last_dim_not_contiguous": (
        lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v),
        r"q must have a contiguous last dim",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_naming_the_tensor(case):
    make, match = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        flash_attn_func(*make(*_good()))
