"""Small checks of flash_kernel._C (or the build FLASH_KERNEL_EXT names) against plain PyTorch attention in fp32.

  python3 -m flash_kernel.sanitize            tiny fwd+bwd cases (causal and not, odd lengths, GQA, varlen and
                                              sliding windows): the
                                              compute-sanitizer target (`compute-sanitizer --tool memcheck
                                              python3 -m flash_kernel.sanitize`, same with racecheck)
  python3 -m flash_kernel.sanitize --full     many shapes: dtypes, every head dim incl. 80, Tq != Tk,
                                              GQA/MQA, fused-qkv strided views, deterministic bitwise
  python3 -m flash_kernel.sanitize --bench    TFLOP/s vs SDPA's FLASH backend (bf16, causal, B*T = 16k)
  python3 -m flash_kernel.sanitize --sm80     any of the above on the mma.sync kernels, which a Hopper GPU
                                              otherwise runs only where it has no wgmma kernel

Exits non-zero on any mismatch. Outputs are poisoned with NaN before every call so an unwritten element
fails. Pass criterion (flash-attn's): the kernel's error against an fp32 reference is at most twice the
error of the same attention computed by PyTorch in the input dtype, plus a small slack.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from flash_kernel.interface import _load_C, set_kernel_overrides
from flash_kernel.reference import naive_attention_varlen

_C = _load_C()  # flash_kernel._C, or the build that FLASH_KERNEL_EXT names (a candidate under the sanitizers)

SLACK = 1e-3  # relative-error slack on top of 2x PyTorch's own low-precision error


def reference(q, k, v, causal, scale, do=None):
    """Attention in the dtype of q/k/v (upcast them for fp32). (B, T, H, D) in, o and lse (B, H, T) out.
    Rows that see no key (causal, Tq > Tk) give o = 0 and lse = +inf, as the kernel does."""
    b, tq, h, d = q.shape
    tk, h_k = k.shape[1], k.shape[2]
    qt = q.transpose(1, 2)                                        # (B, H, Tq, D)
    kt = k.transpose(1, 2).repeat_interleave(h // h_k, dim=1)     # (B, H, Tk, D)
    vt = v.transpose(1, 2).repeat_interleave(h // h_k, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale                       # (B, H, Tq, Tk)
    if causal:
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (tk - tq), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = (p @ vt) / torch.where(l > 0, l, torch.ones_like(l))    # (B, H, Tq, D); empty rows: p = 0 -> o = 0
    lse = torch.where(l > 0, m + torch.log(l), torch.full_like(l, float("inf"))).squeeze(-1)
    return o.transpose(1, 2), lse.float()


def ref_grads(q, k, v, do, causal, scale, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    o, lse = reference(*leaves, causal, scale)
    o.backward(do.to(dtype))
    return o.detach(), lse.detach(), [x.grad for x in leaves]


ABS_FLOOR = 1e-2  # per-element magnitude below which differences count as absolute (e.g. dq = 0 when Tk = 1)


def rel_err(x, ref):
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("inf")
    floor = ABS_FLOOR * math.sqrt(ref.numel())
    return ((x - ref).norm() / ref.norm().clamp_min(floor)).item()


def make_qkv(b, tq, tk, h, h_k, d, dtype, fused):
    if fused:  # views of one fused projection: non-contiguous batch/row/head strides
        assert tq == tk
        qkv = torch.randn(b, tq, h + 2 * h_k, d, device="cuda", dtype=dtype)
        return qkv[:, :, :h], qkv[:, :, h:h + h_k], qkv[:, :, h + h_k:]
    q = torch.randn(b, tq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, tk, h_k, d, device="cuda", dtype=dtype)
    v = torch.randn(b, tk, h_k, d, device="cuda", dtype=dtype)
    return q, k, v


def run_kernel(q, k, v, do, causal, scale, deterministic=False):
    b, tq, h, d = q.shape
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, tq), float("nan"), device=q.device, dtype=torch.float32)
    _C.fwd(q, k, v, o, lse, scale, causal)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    _C.bwd(do, q, k, v, o, lse, dq, dk, dv, scale, causal, deterministic)
    return o, lse, dq, dk, dv


def check_case(b, tq, tk, h, h_k, d, dtype, causal, fused=False, deterministic=False, bwd=True) -> bool:
    torch.manual_seed(hash((b, tq, tk, h, h_k, d, causal, fused)) % 2**31)
    q, k, v = make_qkv(b, tq, tk, h, h_k, d, dtype, fused)
    scale = 1.0 / math.sqrt(d)
    do = torch.randn(b, tq, h, d, device="cuda", dtype=dtype)
    if bwd:
        o, lse, dq, dk, dv = run_kernel(q, k, v, do, causal, scale, deterministic)
        outs = {"o": o, "dq": dq, "dk": dk, "dv": dv}
    else:
        o = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, tq), float("nan"), device="cuda", dtype=torch.float32)
        _C.fwd(q, k, v, o, lse, scale, causal)
        outs = {"o": o}
    o32, lse32, g32 = ref_grads(q, k, v, do, causal, scale, torch.float32)
    olp, _, glp = ref_grads(q, k, v, do, causal, scale, dtype)
    refs = {"o": (o32, olp), "dq": (g32[0], glp[0]), "dk": (g32[1], glp[1]), "dv": (g32[2], glp[2])}
    ok = True
    msgs = []
    for name, x in outs.items():
        ref, lowp = refs[name]
        e, e_lp = rel_err(x, ref), rel_err(lowp, ref)
        good = e <= 2 * e_lp + SLACK
        ok &= good
        msgs.append(f"{name} {e:.1e}/{e_lp:.1e}{'' if good else ' FAIL'}")
    # LSE: finite rows compared, +inf rows must match exactly.
    inf_ref = torch.isinf(lse32)
    lse_ok = bool(torch.equal(torch.isinf(lse), inf_ref)) and not torch.isnan(lse).any().item()
    if lse_ok and (~inf_ref).any():
        lse_err = (lse[~inf_ref] - lse32[~inf_ref]).abs().max().item()
        lse_ok = lse_err < 1e-2
    else:
        lse_err = float("nan")
    ok &= lse_ok
    msgs.append(f"lse {lse_err:.1e}{'' if lse_ok else ' FAIL'}")
    if deterministic and bwd:
        again = run_kernel(q, k, v, do, causal, scale, True)
        first = (dq, dk, dv)
        same = all(torch.equal(x, y) for x, y in zip(first, again[2:]))
        ok &= same
        msgs.append("bitwise" if same else "NOT bitwise FAIL")
    tag = (f"b{b} tq{tq} tk{tk} h{h}/{h_k} d{d} {str(dtype)[6:]} causal={int(causal)}"
           f"{' fused' if fused else ''}{' det' if deterministic else ''}")
    print(f"{'ok  ' if ok else 'FAIL'} {tag}: " + "  ".join(msgs), flush=True)
    return ok


def check_varlen_case(pairs, h, h_k, d, dtype, causal, window=(-1, -1), deterministic=False) -> bool:
    """Packed sequences of (len_q, len_k) pairs through _C.varlen_fwd / varlen_bwd (a window too), checked as
    check_case checks the dense calls, against flash_kernel.reference.naive_attention_varlen. A dense call with the
    window rides along: the pairs' first (len_q, len_k), batch 2."""
    torch.manual_seed(hash((tuple(pairs), h, h_k, d, causal, window)) % 2**31)
    lens_q, lens_k = [p[0] for p in pairs], [p[1] for p in pairs]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype)  # (total_q, H, D)
    k = torch.randn(sum(lens_k), h_k, d, device="cuda", dtype=dtype)  # (total_k, Hk, D)
    v = torch.randn(sum(lens_k), h_k, d, device="cuda", dtype=dtype)
    do = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((h, q.shape[0]), float("nan"), device="cuda")
    _C.varlen_fwd(q, k, v, o, lse, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal, *window)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    _C.varlen_bwd(do, q, k, v, o, lse, *grads, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal, deterministic,
                  *window)
    outs = {"o": o, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    refs = {}
    for upcast in (True, False):
        leaves = [(t.float() if upcast else t.clone()).requires_grad_() for t in (q, k, v)]
        o_ref, lse_ref = naive_attention_varlen(*leaves, cu_q, cu_k, causal, scale, upcast, window)
        o_ref.backward(do.to(o_ref.dtype))
        refs[upcast] = {"o": o_ref.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad,
                        "lse": lse_ref.detach().float()}
    ok, msgs = True, []
    for name, x in outs.items():
        e, e_lp = rel_err(x, refs[True][name]), rel_err(refs[False][name], refs[True][name])
        good = e <= 2 * e_lp + SLACK
        ok &= good
        msgs.append(f"{name} {e:.1e}/{e_lp:.1e}{'' if good else ' FAIL'}")
    inf_ref = torch.isinf(refs[True]["lse"])
    lse_ok = bool(torch.equal(torch.isinf(lse), inf_ref)) and not torch.isnan(lse).any().item()
    if lse_ok and (~inf_ref).any():
        lse_ok = (lse[~inf_ref] - refs[True]["lse"][~inf_ref]).abs().max().item() < 1e-2
    ok &= lse_ok
    msgs.append("lse ok" if lse_ok else "lse FAIL")
    if window != (-1, -1) and pairs[0][0] > 0 and pairs[0][1] > 0:  # the same window on the dense kernels
        tq, tk = pairs[0]
        qd, kd, vd = (torch.randn(2, t, n, d, device="cuda", dtype=dtype) for t, n in ((tq, h), (tk, h_k), (tk, h_k)))
        od = torch.full_like(qd, float("nan"))
        lsed = torch.full((2, h, tq), float("nan"), device="cuda")
        _C.fwd(qd, kd, vd, od, lsed, scale, causal, *window)
        dgrads = [torch.full_like(t, float("nan")) for t in (qd, kd, vd)]
        _C.bwd(torch.ones_like(qd), qd, kd, vd, od, lsed, *dgrads, scale, causal, deterministic, *window)
        dense_ok = all(not torch.isnan(t).any().item() for t in (od, *dgrads))
        ok &= dense_ok
        msgs.append("dense window written" if dense_ok else "dense window NaN FAIL")
    tag = f"varlen {pairs} h{h}/{h_k} d{d} {str(dtype)[6:]} causal={int(causal)} window={window}"
    print(f"{'ok  ' if ok else 'FAIL'} {tag}: " + "  ".join(msgs), flush=True)
    return ok


def varlen_cases():
    # Empty sequences, length 1, shorter than a tile, several tiles, unequal lengths; causal and windowed.
    mixed = [(0, 0), (1, 1), (17, 40), (5, 0), (130, 130), (300, 257)]
    return [
        dict(pairs=mixed, h=2, h_k=1, d=64, dtype=torch.bfloat16, causal=True),
        dict(pairs=mixed, h=2, h_k=2, d=128, dtype=torch.float16, causal=False, window=(50, 10)),
        dict(pairs=[(300, 257), (0, 3), (129, 129)], h=2, h_k=1, d=96, dtype=torch.bfloat16, causal=True,
             window=(64, 0), deterministic=True),
        dict(pairs=[(200, 300), (1, 1)], h=2, h_k=1, d=256, dtype=torch.bfloat16, causal=False, window=(-1, 20)),
    ]


def tiny_cases():
    # Lengths span several K/V tiles so every shared-memory stage is refilled at least once.
    return [
        dict(b=1, tq=301, tk=301, h=2, h_k=1, d=64, dtype=torch.bfloat16, causal=False),
        # Causal hd64: 192-row tiles ending at Tq, so block 0 starts 83 rows before row 0 (csrc/fwd_tile_scheduler.h).
        dict(b=1, tq=301, tk=301, h=2, h_k=1, d=64, dtype=torch.bfloat16, causal=True),
        dict(b=1, tq=45, tk=70, h=2, h_k=2, d=40, dtype=torch.float16, causal=True),
        dict(b=1, tq=200, tk=331, h=2, h_k=2, d=128, dtype=torch.bfloat16, causal=True),
        # Head dim 80 on Hopper: 80-wide tiles, 64 columns in SW128 and 16 in SW32 from a second tensor map.
        dict(b=1, tq=257, tk=190, h=2, h_k=1, d=80, dtype=torch.bfloat16, causal=False),
        # More tiles than an H100 has SMs: the persistent Hopper forward's blocks (and the backward's: at hd64, and
        # at hd96 non-causal) run two or three each, causal with Tq > Tk leaving one query block per head without keys
        # (csrc/fwd_tile_scheduler.h, csrc/bwd_tile_scheduler.h). The hd96 shape is one whose reference matmuls run
        # cuBLAS kernels that racecheck reports nothing in (some shapes' do: docs/results.md, 45).
        dict(b=2, tq=400, tk=150, h=48, h_k=8, d=64, dtype=torch.bfloat16, causal=True),
        dict(b=4, tq=64, tk=1100, h=8, h_k=2, d=96, dtype=torch.bfloat16, causal=False),
        dict(b=2, tq=300, tk=300, h=48, h_k=8, d=128, dtype=torch.float16, causal=False),
        # Head dim 64 non-causal: three warpgroups on 192-row tiles, the last of each head partly past Tq.
        dict(b=2, tq=400, tk=300, h=48, h_k=8, d=64, dtype=torch.bfloat16, causal=False),
        # From 2048 keys up the hd65-80 and hd128 Hopper forwards run wider key blocks (non-causal: where their turns
        # cost less; csrc/hopper_kernel_traits.h) and the causal backward its longest-first order
        # (csrc/causal_order.h). Few queries keep them quick under racecheck.
        dict(b=1, tq=400, tk=2100, h=2, h_k=1, d=64, dtype=torch.bfloat16, causal=True),
        dict(b=1, tq=300, tk=2100, h=2, h_k=2, d=128, dtype=torch.float16, causal=False),
        # Head dims up to 80 on hd96's 80-column twins (causal from 2048 keys: 192 x 144 on three warpgroups); hd96
        # on its three-warpgroup tile (P through shared memory), long and short.
        dict(b=1, tq=300, tk=2100, h=2, h_k=1, d=80, dtype=torch.bfloat16, causal=True),
        dict(b=1, tq=257, tk=2100, h=2, h_k=2, d=96, dtype=torch.float16, causal=False),
        dict(b=1, tq=200, tk=331, h=2, h_k=1, d=96, dtype=torch.bfloat16, causal=True),
        dict(b=1, tq=150, tk=300, h=2, h_k=1, d=88, dtype=torch.bfloat16, causal=False),  # its columns past d
        # The Hopper causal backward's block order (csrc/causal_order.h) in groups of 3 (batch, head) pairs, the last
        # one short.
        dict(b=2, tq=400, tk=300, h=8, h_k=2, d=128, dtype=torch.bfloat16, causal=True,
             overrides=dict(bwd_causal_group_heads=3)),
    ]


def full_cases():
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in (32, 64, 80, 96, 128):
            for causal in (False, True):
                for tq, tk in ((1, 1), (17, 17), (113, 113), (255, 255), (1023, 1023), (113, 255), (255, 113), (1, 300)):
                    cases.append(dict(b=2, tq=tq, tk=tk, h=4, h_k=4 if d != 80 else 2, d=d, dtype=dtype, causal=causal))
    for d in (64, 128):
        for causal in (False, True):
            cases.append(dict(b=1, tq=2049, tk=2049, h=8, h_k=1, d=d, dtype=torch.bfloat16, causal=causal))
            cases.append(dict(b=2, tq=300, tk=300, h=6, h_k=2, d=d, dtype=torch.bfloat16, causal=causal, fused=True))
            cases.append(dict(b=2, tq=333, tk=517, h=4, h_k=2, d=d, dtype=torch.bfloat16, causal=causal, deterministic=True))
    for d in (256, 200):  # head dim 256: column-split backward; 200 runs it with zero-filled columns
        for causal in (False, True):
            cases.append(dict(b=2, tq=300, tk=257, h=2, h_k=1, d=d, dtype=torch.bfloat16, causal=causal))
        cases.append(dict(b=1, tq=129, tk=129, h=2, h_k=2, d=d, dtype=torch.float16, causal=True, deterministic=True))
    return cases


def bench(head_dims=(64, 128), seqlens=(2048, 4096, 8192)) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    print("hd  T     causal | kernel fwd  fwd+bwd | SDPA-FLASH fwd  fwd+bwd   (TFLOP/s, bf16, B*T=16k, hidden 2048)")
    for d in head_dims:
        h = 2048 // d
        for t in seqlens:
            b = 16384 // t
            q, k, v = make_qkv(b, t, t, h, h, d, torch.bfloat16, fused=False)
            do = torch.randn_like(q)
            scale = 1.0 / math.sqrt(d)
            flops_fwd = 4 * b * h * t * t * d / 2  # causal halves it (FA2 paper convention)
            o = torch.empty_like(q)
            lse = torch.empty(b, h, t, device="cuda", dtype=torch.float32)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

            def k_fwd():
                _C.fwd(q, k, v, o, lse, scale, True)

            def k_fwd_bwd():
                _C.fwd(q, k, v, o, lse, scale, True)
                _C.bwd(do, q, k, v, o, lse, dq, dk, dv, scale, True, False)

            qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            dos = do.transpose(1, 2).contiguous()

            def s_fwd():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

            def s_fwd_bwd():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                torch.autograd.grad(out, (qs, ks, vs), dos)

            res = []
            for fn, mult in ((k_fwd, 1.0), (k_fwd_bwd, 3.5), (s_fwd, 1.0), (s_fwd_bwd, 3.5)):
                with torch.no_grad() if fn in (k_fwd, s_fwd) else torch.enable_grad():
                    ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
                res.append(flops_fwd * mult / (ms * 1e-3) / 1e12)
            print(f"{d:<3} {t:<5} 1      | {res[0]:7.1f}  {res[1]:7.1f}    | {res[2]:7.1f}  {res[3]:7.1f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="many shapes instead of the tiny sanitizer cases")
    parser.add_argument("--bench", action="store_true", help="time against SDPA's FLASH backend")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="--bench head dims")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192], help="--bench sequence lengths")
    parser.add_argument("--sm80", action="store_true", help="the mma.sync kernels for both passes, also on Hopper")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flash_kernel.sanitize: no CUDA device")
        return 1
    paths = dict(fwd="sm80", bwd="sm80") if args.sm80 else {}
    set_kernel_overrides(**paths)
    if args.bench:
        bench(args.head_dims, args.seqlens)
        return 0
    cases = full_cases() if args.full else tiny_cases()
    results = []
    for check, c in [(check_case, c) for c in cases] + [(check_varlen_case, c) for c in varlen_cases()]:
        c = dict(c)
        set_kernel_overrides(**paths, **c.pop("overrides", {}))  # a case's own switches, for that case alone
        try:
            results.append(check(**c))
        except Exception as e:  # a failed launch or bad check counts as a failure, keep going
            print(f"FAIL {c}: {type(e).__name__}: {e}", flush=True)
            results.append(False)
    torch.cuda.synchronize()
    print(f"flash_kernel.sanitize: {sum(results)}/{len(results)} cases passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
