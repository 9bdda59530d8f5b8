"""The greedy-schedule model behind flash_kernel/csrc/causal_order.h: how far above the ideal makespan a causal grid
runs when its thread blocks start in a given order.

The hardware starts thread blocks in linear blockIdx order as SMs free up. The model gives each SM one block at a time
(the Hopper backward runs one per SM, as the persistent Hopper forward does one tile at a time), costs a block the
tiles it visits plus `overhead` (its prologue and epilogue, in tiles), hands each block in turn to the SM that frees
first, and reports makespan / (total cost / SMs): 1.0 is a perfect split of the work.

- forward: query block i visits the key blocks up to the diagonal, (i + 1) * block_m / block_n of them;
- backward: key block j is visited by the query blocks from the first that sees it, n_q - j * block_n / block_m.

Orders: `grid`, the grid's own (block fastest: the forward's shortest block first in each head, the backward's
longest), and `groups of N`, longest first across N (batch, head) pairs at a time (causal_order.h; N = B * H is the
whole grid longest-first), whose last group, where it has fewer blocks than there are SMs, takes in the group before
it as causal_order.h's does (--no-merge: the pairs left over as a group of their own). It knows nothing of L2: groups
exist because blocks running together share K and V (the forward) or Q and dO (the backward) there, which the
measured numbers, not this model, decide (docs/results.md).

    python bench/block_order_model.py                     # both passes on the FA2 grid (B*T = 16k, hidden 2048)
    python bench/block_order_model.py --pass bwd --hdims 128 --seqlens 8192 --groups 1 4 32
    python bench/block_order_model.py --pass bwd --hdims 80 --seqlens 4096 --groups 11 --overhead 2.4 --no-merge
"""

from __future__ import annotations

import argparse
import heapq
import sys
from typing import Callable

TOKENS, HIDDEN = 16 * 1024, 2048  # the FA2 paper's grid, as bench/kernel.py
# (block_m, block_n) of the Hopper kernels per pass and head dim (the tiles' ratio is what matters: a block's cost is
# counted in tiles): the forward's 128 query rows over 128 keys at hd64 and hd128, its causal tiles at hd80 from 2k keys
# (192 x 144) and at hd96 (192 x 128; hopper_kernel_traits.h); the backward's kBlockM x 128 keys (hopper_bwd_traits.h:
# 64 query rows at hd65-128, 128 at hd64).
BLOCKS = {("fwd", 64): (128, 128), ("fwd", 80): (192, 144), ("fwd", 96): (192, 128), ("fwd", 128): (128, 128),
          ("bwd", 64): (128, 128), ("bwd", 80): (64, 128), ("bwd", 96): (64, 128), ("bwd", 128): (64, 128)}


def block_costs(pass_: str, seqlen: int, block_m: int, block_n: int, overhead: float) -> list[float]:
    """Each block's cost in one (batch, head) pair, in grid order (block index 0, 1, ...)."""
    if pass_ == "fwd":
        n_blocks = -(-seqlen // block_m)
        return [-(-((i + 1) * block_m) // block_n) + overhead for i in range(n_blocks)]
    n_q = -(-seqlen // block_m)
    return [n_q - j * block_n // block_m + overhead for j in range(-(-seqlen // block_n))]


def group_sizes(pairs: int, group: int, n_blocks: int, sms: int | None) -> list[int]:
    """The pairs of each group of the longest-first order: `group` each, the pairs left over last; with `sms`, a last
    group of fewer than `sms` blocks takes in the group before it (causal_order.h)."""
    sizes = [group] * (pairs // group) + ([pairs % group] if pairs % group else [])
    if sms is not None and len(sizes) > 1 and sizes[-1] * n_blocks < sms:
        sizes[-2:] = [sizes[-2] + sizes[-1]]
    return sizes


def launch_order(costs: list[float], pairs: int, group: int | None, sms: int | None = None) -> list[float]:
    """The blocks' costs in the order they start: the grid's own (group None), or longest first in groups of pairs
    (group_sizes: the last group merged on `sms` SMs where it is short)."""
    if group is None:
        return costs * pairs
    longest_first = sorted(costs, reverse=True)
    order = []
    for in_group in group_sizes(pairs, group, len(costs), sms):
        for cost in longest_first:
            order += [cost] * in_group
    return order


def greedy_makespan(blocks: list, sms: int, cost: Callable | None = None) -> float:
    """Greedy list schedule of `blocks`, in order, on `sms` SMs that run one block each at a time: each block goes to
    the SM free first (the lower-numbered on a tie) and takes cost(block, the SM's block before it, or None), or the
    block itself as its cost where `cost` is None. Returns the makespan."""
    free = [(0, sm, None) for sm in range(sms)]  # (free at, SM, its last block): a heap already
    for block in blocks:
        at, sm, prev = heapq.heappop(free)
        heapq.heappush(free, (at + (block if cost is None else cost(block, prev)), sm, block))
    return max(at for at, _, _ in free)


def makespan_ratio(order: list[float], sms: int) -> float:
    """Greedy list schedule on `sms` SMs, one block each at a time: makespan over the ideal (total / sms)."""
    return greedy_makespan(order, sms) / (sum(order) / sms)


def model(pass_: str, head_dim: int, seqlen: int, group: int | None, sms: int = 132, overhead: float = 1.0,
          merge: bool = True) -> float:
    """makespan / ideal for the FA2 grid's shape at this T and head dim (B = 16k / T, H = 2048 / hd); merge: the
    last group as causal_order.h forms it, else the pairs left over as a group of their own."""
    block_m, block_n = BLOCKS[(pass_, head_dim)]
    pairs = max(1, TOKENS // seqlen) * (HIDDEN // head_dim)
    costs = block_costs(pass_, seqlen, block_m, block_n, overhead)
    return makespan_ratio(launch_order(costs, pairs, group, sms if merge else None), sms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pass", dest="passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    p.add_argument("--hdims", nargs="+", type=int, choices=[64, 80, 96, 128], default=[64, 128],
                   help="80: the forward's tile from 2k keys")
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--groups", nargs="+", type=int, default=[4, 16], help="pairs per group of the longest-first order")
    p.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM: 132)")
    p.add_argument("--overhead", type=float, default=1.0, help="a block's fixed cost, in tiles")
    p.add_argument("--no-merge", action="store_true", help="the pairs left over as a last group of their own, however short")
    args = p.parse_args(argv)
    if any(g < 1 for g in args.groups) or args.sms < 1 or args.overhead < 0:
        p.error("--groups and --sms must be >= 1, --overhead >= 0")
    header = ["pass", "hd", "T", "B*H", "grid"] + [f"groups of {g}" for g in args.groups] + ["all longest-first"]
    print("makespan / ideal (1.000 = perfect), greedy model, " f"{args.sms} SMs, overhead {args.overhead} tiles, "
          f"{'no merged last group' if args.no_merge else 'a short last group merged'}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for pass_ in args.passes:
        for hd in args.hdims:
            for t in args.seqlens:
                pairs = max(1, TOKENS // t) * (HIDDEN // hd)
                cells = [model(pass_, hd, t, g, args.sms, args.overhead, not args.no_merge)
                         for g in [None, *args.groups, pairs]]
                print(f"| {pass_} | {hd} | {t} | {pairs} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
