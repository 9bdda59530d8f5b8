"""The causal hd96 / hd80 backward of candidate.patch's build under each FLASH_EXP_VARIANT (0-7: one block per tile,
the code shifted by that many instructions; 8-15: persistent, shifted by 0-7), beside the default (-1), in interleaved
rounds that visit the variants in a rotated order. Run from the repository root:
`python align_bench.py ROUNDS OUT.json HDIMS SEQLENS`, e.g. `5 align_hd96.json 96 1024,2048,4096,8192,16384`."""
import json, os, sys, statistics
import torch
from triton.testing import do_bench
sys.path.insert(0, ".")
from flash_kernel import flash_attn_func

rounds = int(sys.argv[1]); out = sys.argv[2]
hdims = [int(x) for x in sys.argv[3].split(",")]
seqlens = [int(x) for x in sys.argv[4].split(",")]
cases = []
for hd in hdims:
    for T in seqlens:
        B, H = max(1, 16384 // T), 2048 // hd
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16)
        variants = [-1] + list(range(8)) + (list(range(8, 16)) if hd > 80 else [])
        cases.append((hd, T, q, k, v, do, variants))
res = {}
def run(hd, T, q, k, v, do, var):
    os.environ["FLASH_EXP_VARIANT"] = str(var)
    o = flash_attn_func(q, k, v, causal=True)
    def step():
        o.backward(do, retain_graph=True)
    ms = do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
    return ms
# correctness: every variant's grads equal variant -1's exactly (same arithmetic; order of dq atomics may differ)
for hd, T, q, k, v, do, variants in cases[:2]:
    ref = None
    for var in variants:
        os.environ["FLASH_EXP_VARIANT"] = str(var)
        for t in (q, k, v): t.grad = None
        flash_attn_func(q, k, v, causal=True).backward(do)
        g = [t.grad.float().clone() for t in (q, k, v)]
        if ref is None: ref = g
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(g, ref))
        print(f"check hd{hd} T{T} variant {var}: max |grad - ref| / max |ref| {err:.3g}", flush=True)
        assert err < 1e-2, err
for r in range(rounds):
    for hd, T, q, k, v, do, variants in cases:
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for var in order:
            res.setdefault(f"{hd},{T},{var}", []).append(run(hd, T, q, k, v, do, var))
    print(f"round {r} done", flush=True)
json.dump(res, open(out, "w"))
for hd, T, *_ , variants in cases:
    base = statistics.median(res[f"{hd},{T},-1"])
    cells = " ".join(f"{var}:{base / statistics.median(res[f'{hd},{T},{var}']):.3f}" for var in variants[1:])
    print(f"hd{hd} T{T} base {base:.3f} ms | {cells}")
