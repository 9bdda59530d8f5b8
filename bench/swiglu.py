"""Time of the Llama MLP's SwiGLU alone: the plain function (eager PyTorch), torch.compile's kernels (model/fusion.py
compiled it before, and a whole-model compile generates the same), and model/swiglu_kernel.py's Triton kernels.

Shapes of the Llama preset at 2 × 8k tokens: h (N, 2F) = (16384, 2 × 8192), bf16. Each method runs the forward
(no_grad) and the forward with the gradient of h (torch.autograd.grad, the incoming gradient fixed); the backward
is their difference. Each call is captured once in a CUDA graph and timed by replaying it
(triton.testing.do_bench_cudagraph), so the times are the GPU's alone: the host's Python and autograd calls, which
an event-timed call of a 0.3 ms kernel would include, are not in them. Medians of the replays, the methods interleaved
over --rounds rounds. Bandwidth counts what each pass must move at least: the forward reads gate and up and writes the
output (3·N·F elements), the backward reads gate, up and the incoming gradient and writes dh (5·N·F).

    python bench/swiglu.py
    python bench/swiglu.py --tokens 8192 --ffn 5632 --rounds 5
    python bench/swiglu.py --methods triton --triton-configs 2048x8 4096x8 512x4   # other launch shapes

Rows merge into bench/results/swiglu.json (keyed by device, torch, method, N, F, dtype).
"""

from __future__ import annotations

import argparse
import functools
import sys
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import fwd_bwd_times, merge_file  # noqa: E402
from model import fusion  # noqa: E402

RESULTS = REPO / "bench" / "results" / "swiglu.json"


@functools.cache
def _compiled():
    return torch.compile(fusion.swiglu, fullgraph=True)


METHODS = {
    "plain (eager)": fusion.swiglu,
    "torch.compile": lambda h: _compiled()(h),
    "triton": fusion.apply_swiglu,
}


def triton_with(block_f: int, num_warps: int):
    """model/swiglu_kernel.py's kernels launched with another column block and warp count (--triton-configs)."""
    from model import swiglu_kernel

    def run(h: torch.Tensor) -> torch.Tensor:
        saved = swiglu_kernel.BLOCK_F, swiglu_kernel.NUM_WARPS
        swiglu_kernel.BLOCK_F, swiglu_kernel.NUM_WARPS = block_f, num_warps
        try:
            return fusion.apply_swiglu(h)
        finally:
            swiglu_kernel.BLOCK_F, swiglu_kernel.NUM_WARPS = saved

    return run


def parse_config(text: str) -> tuple[int, int]:
    """'2048x8' -> (BLOCK_F 2048, 8 warps): a power of two of at least 16 columns, 1-32 warps."""
    try:
        block_f, num_warps = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--triton-configs {text!r}: BLOCKxWARPS, e.g. 2048x8") from None
    if block_f < 16 or block_f & (block_f - 1) or not 1 <= num_warps <= 32:
        raise SystemExit(f"--triton-configs {text!r}: the block a power of two >= 16, the warps 1-32")
    return block_f, num_warps


def min_bytes(n: int, ffn: int, element_size: int) -> tuple[int, int]:
    """The bytes the forward and the backward must move at least: 3·N·F and 5·N·F elements."""
    return 3 * n * ffn * element_size, 5 * n * ffn * element_size


def timers(method: str, n: int, ffn: int, dtype: torch.dtype):
    """(forward, forward + backward) callables of one method on fresh inputs, warmed up (compiled, autotuned)."""
    if method.startswith("triton "):  # "triton 2048x8"
        fn = triton_with(*parse_config(method.split()[1]))
    else:
        fn = METHODS[method]
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, 2 * ffn, device="cuda", dtype=dtype, generator=g).requires_grad_()  # (N, 2F)
    dout = torch.randn(n, ffn, device="cuda", dtype=dtype, generator=g)  # (N, F)

    def fwd():
        with torch.no_grad():
            fn(h)

    def fwd_bwd():
        torch.autograd.grad(fn(h), h, dout)

    fwd(), fwd_bwd()
    torch.cuda.synchronize()
    return fwd, fwd_bwd


def measure(methods: list[str], n: int, ffn: int, dtype: torch.dtype, rounds: int) -> list[dict]:
    times = fwd_bwd_times({m: timers(m, n, ffn, dtype) for m in methods}, rounds)
    fwd_bytes, bwd_bytes = min_bytes(n, ffn, torch.empty((), dtype=dtype).element_size())
    rows = []
    for m in methods:
        t = times[m]
        rows.append({"method": m, "fwd_ms": t["fwd_ms"], "fwd_bwd_ms": t["fwd_bwd_ms"], "bwd_ms": t["bwd_ms"],
                     "fwd_tb_s": fwd_bytes / t["fwd_ms"] / 1e9,
                     "bwd_tb_s": bwd_bytes / t["bwd_ms"] / 1e9 if t["bwd_ms"] > 0 else None, "rounds": t["rounds"]})
    return rows


def _key(r: dict) -> tuple:
    return r["device"], r["torch"], r["method"], r["n"], r["ffn"], r["dtype"]


def table(rows: list[dict]) -> str:
    lines = ["| device | torch | N | F | dtype | method | fwd ms | bwd ms | fwd TB/s | bwd TB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bwd_tb_s = "–" if r["bwd_tb_s"] is None else f"{r['bwd_tb_s']:.2f}"
        lines.append(f"| {r['device']} | {r['torch']} | {r['n']} | {r['ffn']} | {r['dtype']} | {r['method']} | "
                     f"{r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['fwd_tb_s']:.2f} | {bwd_tb_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2 * 8192, help="rows N (batch × T)")
    ap.add_argument("--ffn", type=int, default=8192, help="F: the MLP's width, half of fc's output")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each time is their median")
    ap.add_argument("--triton-configs", nargs="*", default=[], metavar="BLOCKxWARPS",
                    help="more rows of the Triton kernels with other column blocks and warps, e.g. 2048x8 4096x8 "
                         "(method 'triton 2048x8'); the module's own is BLOCK_F x NUM_WARPS")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.ffn < 1 or args.rounds < 1:
        raise SystemExit(f"--tokens {args.tokens}, --ffn {args.ffn} and --rounds {args.rounds} must be at least 1")
    methods = [*args.methods, *(f"triton {'x'.join(map(str, parse_config(c)))}" for c in args.triton_configs)]
    if not torch.cuda.is_available():
        raise SystemExit("bench/swiglu.py times CUDA kernels; no CUDA device here")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date.today().isoformat(),
            "n": args.tokens, "ffn": args.ffn, "dtype": args.dtype}
    new = [{**meta, **r} for r in measure(methods, args.tokens, args.ffn, dtype, args.rounds)]
    merge_file(args.out, new, _key,
               order=lambda r: (r["device"], r["torch"], r["n"], r["ffn"], r["dtype"], r["method"]))
    print(table(new))


if __name__ == "__main__":
    main()
