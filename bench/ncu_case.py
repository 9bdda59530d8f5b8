"""One attention case of the kernel benchmark, run a few times for a profiler to capture (ncu, nsys).

    ncu --section SpeedOfLight --section WarpStateStats -k regex:flash_fwd -c 1 \\
        python3 bench/ncu_case.py --method ours --hdim 128 --seqlen 8192 --mode fwd
    ncu ... -k regex:cudnn -c 1 python3 bench/ncu_case.py --method sdpa_cudnn ...

Same shapes, inputs and methods as bench/kernel.py (B*T = 16k, H = 2048 / hd, bf16); it times nothing
itself. The kernels of the first (warm-up) call are profiled like the others, so give ncu `-s` to skip them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernel import INPUTS, METHODS, MODES, make_method, shape_for  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=METHODS, default="ours")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", type=int, choices=[0, 1], default=0)
    p.add_argument("--mode", choices=MODES, default="fwd")
    p.add_argument("--iters", type=int, default=3, help="calls after the warm-up call")
    p.add_argument("--inputs", choices=INPUTS, default="native", help="what the method reads (bench/kernel.py --inputs)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")

    batch, heads = shape_for(args.seqlen, args.hdim)
    (q, k, v, do), fn, context = make_method(args.method, batch, heads, args.seqlen, args.hdim, bool(args.causal), torch.bfloat16,
                                          args.inputs)
    for _ in range(1 + args.iters):
        with context():
            if args.mode == "fwd":
                fn()
            else:
                o = fn()
                o.backward(do)
        q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    print(f"{args.method} hd{args.hdim} causal={args.causal} T={args.seqlen} B={batch} H={heads} {args.mode} "
          f"({args.inputs} inputs): {1 + args.iters} calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
