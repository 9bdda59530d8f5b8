"""Time of the GPT3 MLP alone, proj(gelu(fc(x))), as the model runs it under bf16 autocast on fp32 parameters:

- "unfused": F.linear with its bias, F.gelu(approximate="tanh"), F.linear (eager PyTorch);
- "fused bias-GELU": fc without bias, then model/fusion.py's compiled bias + GELU kernel (model.fused_bias_gelu;
  under no_grad it runs the plain bias add and GELU, as in the model: the function compiles where a gradient follows);
- "epilogues": model/gelu_mlp.py, the bias and GELU in fc's cuBLASLt epilogue and GELU's gradient in proj's
  input-gradient matmul (model.gelu_epilogue).

Shapes of GPT3-1.3B at 16k tokens: x (16384, 2048), d_ff 8192. Each method runs the forward (no_grad) and the
forward with every gradient (x's and the four parameters'); the backward is their difference. Each call is captured
once in a CUDA graph and timed by replaying it (triton.testing.do_bench_cudagraph), so the times are the GPU's alone;
medians of the replays, the methods interleaved over --rounds rounds. TFLOP/s count the two matmuls' 2·M·C·d_ff
each forward and twice that backward.

    python bench/gelu_mlp.py
    python bench/gelu_mlp.py --tokens 8192 --d-model 2560 --rounds 5      # GPT3-2.7B's width

Rows merge into bench/results/gelu_mlp.json (keyed by device, torch, method, M, C, d_ff).
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import fwd_bwd_times, merge_file  # noqa: E402
from model import fusion, gelu_mlp  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gelu_mlp.json"


def unfused(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def fused_bias_gelu(x, w1, b1, w2, b2):
    return F.linear(fusion.apply_bias_gelu(F.linear(x, w1), b1), w2, b2)


METHODS = {"unfused": unfused, "fused bias-GELU": fused_bias_gelu, "epilogues": gelu_mlp.gelu_mlp}


def timers(fn, m: int, c: int, d_ff: int):
    """(forward, forward + backward) callables of one method on fresh fp32 parameters under bf16 autocast."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, c, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()  # (M, C)
    params = [torch.randn(*shape, device="cuda", generator=g).div_(shape[-1] ** 0.5).requires_grad_()
              for shape in ((d_ff, c), (d_ff,), (c, d_ff), (c,))]  # w1, b1, w2, b2
    dy = torch.randn(m, c, device="cuda", dtype=torch.bfloat16, generator=g)  # (M, C)

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            fn(x, *params)

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(x, *params)
        torch.autograd.grad(out, [x, *params], dy)

    for _ in range(2):  # compiles, cuBLAS's first calls
        fwd(), fwd_bwd()
    torch.cuda.synchronize()
    return fwd, fwd_bwd


def measure(methods: list[str], m: int, c: int, d_ff: int, rounds: int) -> list[dict]:
    times = fwd_bwd_times({name: timers(METHODS[name], m, c, d_ff) for name in methods}, rounds)
    flops = 2 * 2 * m * c * d_ff  # the forward's two matmuls
    rows = []
    for name in methods:
        t = times[name]
        rows.append({"method": name, "fwd_ms": t["fwd_ms"], "fwd_bwd_ms": t["fwd_bwd_ms"], "bwd_ms": t["bwd_ms"],
                     "fwd_tflops": flops / t["fwd_ms"] / 1e9, "fwd_bwd_tflops": 3 * flops / t["fwd_bwd_ms"] / 1e9,
                     "rounds": t["rounds"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| device | M | C | d_ff | method | fwd ms | bwd ms | fwd + bwd ms | fwd TFLOP/s | fwd + bwd TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['device']} | {r['m']} | {r['c']} | {r['d_ff']} | {r['method']} | {r['fwd_ms']:.3f} | "
                     f"{r['bwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_tflops']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2 * 8192, help="rows M (batch × T)")
    ap.add_argument("--d-model", type=int, default=2048, help="C")
    ap.add_argument("--d-ff", type=int, default=None, help="the MLP's width (default 4 C)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each time is their median")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    d_ff = args.d_ff or 4 * args.d_model
    if min(args.tokens, args.d_model, d_ff, args.rounds) < 1:
        raise SystemExit("--tokens, --d-model, --d-ff and --rounds must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench/gelu_mlp.py times CUDA kernels; no CUDA device here")
    if "epilogues" in args.methods and not gelu_mlp.available():
        raise SystemExit("the epilogues need the extension with model/gelu_mlp.py's matmuls: run `make build`")
    if (args.d_model % gelu_mlp.ALIGN or d_ff % gelu_mlp.ALIGN) and "epilogues" in args.methods:
        raise SystemExit(f"the epilogues need --d-model and --d-ff in multiples of {gelu_mlp.ALIGN}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date.today().isoformat(),
            "m": args.tokens, "c": args.d_model, "d_ff": d_ff}
    new = [{**meta, **r} for r in measure(args.methods, args.tokens, args.d_model, d_ff, args.rounds)]
    merge_file(args.out, new, lambda r: (r["device"], r["torch"], r["method"], r["m"], r["c"], r["d_ff"]),
               order=lambda r: (r["device"], r["torch"], r["m"], r["c"], r["d_ff"], r["method"]))
    print(table(new))


if __name__ == "__main__":
    main()
