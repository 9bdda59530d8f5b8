"""Time and memory of the GPT's loss alone: PyTorch's cross-entropy on the float32-upcast logits (the eager
pipeline's loss=torch, and compiled, as compile=true runs it) against model/cross_entropy.py (loss=fused).

Shapes of GPT3-1.3B at 2 × 8k tokens: N = 16384 rows, V = 50304 (the model's padded vocabulary) and 50257
(GPT-2's, whose odd row length defeats vector loads), bf16 logits. Each method runs the loss forward and the
gradient of the logits (torch.autograd.grad, so no parameter gradient is counted); time is the median of
triton.testing.do_bench over CUDA events, memory the peak allocated beyond the logits. The in-place variant
writes its gradient over the logits, which it is timed on again: the loss's cost does not depend on the values.

    python bench/cross_entropy.py                      # both V, every method
    python bench/cross_entropy.py --tokens 8192 --vocab 50304

Rows merge into bench/results/cross_entropy.json (keyed by device, method, N, V, dtype).
"""

from __future__ import annotations

import argparse
import functools
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import merge_file  # noqa: E402
from model.cross_entropy import cross_entropy  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cross_entropy.json"
GIB = 2**30


def _torch_fp32(logits, targets):
    return F.cross_entropy(logits.float(), targets)


@functools.cache
def _compiled_torch_fp32():
    return torch.compile(_torch_fp32)


METHODS = {
    "torch fp32 (eager)": _torch_fp32,
    "torch fp32 (compiled)": lambda logits, targets: _compiled_torch_fp32()(logits, targets),
    "fused": lambda logits, targets: cross_entropy(logits, targets),
    "fused, in-place backward": lambda logits, targets: cross_entropy(logits, targets, inplace_backward=True),
}


def measure(method: str, n: int, vocab: int, dtype: torch.dtype) -> dict:
    """ms of forward and of forward + dlogits, and peak GiB beyond the logits, for one method."""
    from triton.testing import do_bench

    fn = METHODS[method]
    logits = torch.randn(n, vocab, device="cuda", dtype=dtype).requires_grad_()  # (N, V)
    targets = torch.randint(0, vocab, (n,), device="cuda")

    def fwd():
        with torch.no_grad():
            fn(logits, targets)

    def fwd_bwd():
        torch.autograd.grad(fn(logits, targets), logits)

    fwd_bwd()  # compiles, autotunes and warms the allocator
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {
        "fwd_ms": float(do_bench(fwd, return_mode="median")),
        "fwd_bwd_ms": float(do_bench(fwd_bwd, return_mode="median")),
        "peak_beyond_logits_gib": peak / GIB,
        "logits_gib": logits.numel() * logits.element_size() / GIB,
    }


def _key(r: dict) -> tuple:
    return r["device"], r["method"], r["n"], r["vocab"], r["dtype"]


def merge(path: Path, new: list[dict]) -> list[dict]:
    return merge_file(path, new, _key, order=lambda r: (r["device"], r["n"], r["vocab"], r["dtype"], r["method"]))


def table(rows: list[dict]) -> str:
    lines = ["| device | N | V | dtype | method | fwd ms | fwd+bwd ms | peak GiB beyond the logits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['device']} | {r['n']} | {r['vocab']} | {r['dtype']} | {r['method']} | {r['fwd_ms']:.2f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {r['peak_beyond_logits_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2 * 8192, help="rows N (batch × T)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[50304, 50257])
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/cross_entropy.py times CUDA kernels; no CUDA device here")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date.today().isoformat()}
    new = []
    for vocab in args.vocab:
        for method in args.methods:
            r = {**meta, "method": method, "n": args.tokens, "vocab": vocab, "dtype": args.dtype,
                 **measure(method, args.tokens, vocab, dtype)}
            print(f"[ce] N={args.tokens} V={vocab} {method}: fwd {r['fwd_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms, "
                  f"peak {r['peak_beyond_logits_gib']:.2f} GiB beyond the logits", flush=True)
            new.append(r)
            torch.cuda.empty_cache()
    merge(args.out, new)
    print(table(new))


if __name__ == "__main__":
    main()
