"""The turn-cost model behind flash_kernel/csrc/hopper_kernel_traits.h's wider_blocks_pay: which of its two key-block
widths the Hopper forward runs in a dense non-causal call over T keys.

A thread block walks its query tile's keys in turns of one key block each. A turn costs its block's keys (the matmuls
and exponentials) plus a fixed part, `turn_keys` keys' worth (the barriers, the rows' max and sum, O's rescale), and a
partial last block costs as much as a whole one:

    cost(T, Bc) = ceil(T / Bc) * (Bc + turn_keys)

The 192-key blocks run where cost(T, 192) < cost(T, 128); the model's time ratio of the 128-key blocks over the
192-key ones is cost(T, 128) / cost(T, 192). Head dims 81-96 choose between 144- and 128-key blocks the same way
(`--wide 144`). With `--measured CSV` (rows hd, keys, t128_over_t192, ...: the medians of
the two tiles timed beside each other, e.g. bench/results/stage3_rounds/v47/tile_ratios.csv) it prints each row beside
the model and where the model's choice was the slower tile; `--plot PNG` draws both against the keys.

`--causal` prints the same count summed over a causal grid's query tiles of 128 rows (Tq = Tk: the k-th sees 128 k
keys), which at hd128 orders the tiles as kLongKeys does: the 128-key blocks below about 2k keys, the 192-key ones
above (results.md section 39; the causal diagonal's masking is not counted).

    python bench/turn_model.py                                   # the choice and the ratio, 128 to 4096 keys
    python bench/turn_model.py --wide 144                        # the same for hd81-96's 144-key blocks
    python bench/turn_model.py --causal                          # the same for causal calls, 128 to 16384 keys
    python bench/turn_model.py --measured bench/results/stage3_rounds/v47/tile_ratios.csv --plot fig.png
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/turn_model.py` from anywhere imports bench.common

TURN_KEYS = 24  # FLASH_FWD_TURN_KEYS's default
WIDE, NARROW = 192, 128  # the two tiles' key blocks (HopperFwdConfig<128>, the hd96 config's head dims up to 80)
WIDE_HD96 = 144  # the hd96 config's DenseTraits, head dims 81-96 (FLASH_FWD_HD96_BC144)


def turns_cost(keys: int, block_keys: int, turn_keys: int = TURN_KEYS) -> int:
    """A query tile's cost over `keys` keys in blocks of `block_keys`, in keys' worth of work."""
    return math.ceil(keys / block_keys) * (block_keys + turn_keys)


def wider_blocks_pay(keys: int, turn_keys: int = TURN_KEYS, wide: int = WIDE) -> bool:
    """What wider_blocks_pay returns for the `wide`- and 128-key tiles."""
    return turns_cost(keys, wide, turn_keys) < turns_cost(keys, NARROW, turn_keys)


def predicted_ratio(keys: int, turn_keys: int = TURN_KEYS, wide: int = WIDE) -> float:
    """The model's time of the 128-key blocks over the `wide`-key ones (> 1: the wider blocks are faster)."""
    return turns_cost(keys, NARROW, turn_keys) / turns_cost(keys, wide, turn_keys)


def causal_predicted_ratio(keys: int, turn_keys: int = TURN_KEYS, rows: int = NARROW) -> float:
    """predicted_ratio summed over a causal grid's query tiles of `rows` rows, Tq = Tk = keys: the k-th tile's turns
    cover its first min(rows * k, keys) keys."""
    tiles = range(1, math.ceil(keys / rows) + 1)
    seen = [min(rows * k, keys) for k in tiles]
    return (sum(turns_cost(t, NARROW, turn_keys) for t in seen) /
            sum(turns_cost(t, WIDE, turn_keys) for t in seen))


def read_measured(path: Path) -> list[dict]:
    """The rows of a measured CSV: hd and keys as ints, t128_over_t192 as a float, the other columns as text."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = {"hd", "keys", "t128_over_t192"} - set(rows[0] if rows else {})
    if missing:
        raise ValueError(f"{path}: no column {', '.join(sorted(missing))} (or no rows)")
    return [dict(r, hd=int(r["hd"]), keys=int(r["keys"]), t128_over_t192=float(r["t128_over_t192"])) for r in rows]


def choice_loss(row: dict, turn_keys: int = TURN_KEYS) -> float:
    """How much slower the model's tile ran than the other in this row (0.0 where it chose the faster one)."""
    measured = row["t128_over_t192"]
    faster_is_wide = measured > 1
    if wider_blocks_pay(row["keys"], turn_keys) == faster_is_wide:
        return 0.0
    return max(measured, 1 / measured) - 1


def report(rows: list[dict], turn_keys: int = TURN_KEYS) -> str:
    """A table of the rows beside the model's ratio and tile, and a last line: in how many rows, and by how much at
    most, the model's tile was the slower one."""
    lines = [f"turn_keys {turn_keys}", f"{'hd':>4} {'keys':>6} {'measured':>9} {'model':>7} {'choice':>7}  slower by"]
    losses = []
    for r in sorted(rows, key=lambda r: (-r["hd"], r["keys"])):
        loss = choice_loss(r, turn_keys)
        losses.append(loss)
        tile = WIDE if wider_blocks_pay(r["keys"], turn_keys) else NARROW
        lines.append(f"{r['hd']:>4} {r['keys']:>6} {r['t128_over_t192']:>9.3f} "
                     f"{predicted_ratio(r['keys'], turn_keys):>7.3f} {tile:>7}  {f'{loss:.1%}' if loss else ''}")
    wrong, worst = sum(loss > 0 for loss in losses), max(losses, default=0.0)
    lines.append(f"{len(rows)} rows: the model's tile the slower one in {wrong}, by at most {worst:.1%}")
    return "\n".join(lines)


# plot's measured points, by whether the model's tile was the slower one
POINT_STYLES = {
    False: dict(s=18, color="tab:blue", label="measured: the model picks the faster tile"),
    True: dict(s=30, marker="x", color="tab:red", label="measured: the model picks the slower one"),
}


def plot(rows: list[dict], path: Path, turn_keys: int = TURN_KEYS) -> Path:
    """One panel per head dim: the model's ratio as a line over the keys, the rows as points (a cross where the
    model's tile was the slower one); saved to path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common import save_figure

    hds = sorted({r["hd"] for r in rows}, reverse=True)
    keys = range(min(r["keys"] for r in rows), max(r["keys"] for r in rows) + 1)
    fig, axes = plt.subplots(len(hds), 1, figsize=(10, 3.2 * len(hds) + 0.8), sharex=True, squeeze=False)
    handles = []
    for ax, hd in zip(axes[:, 0], hds):
        model_line, = ax.plot(list(keys), [predicted_ratio(t, turn_keys) for t in keys], color="0.6", lw=1,
                              label=f"model (turn = block + {turn_keys} keys)")
        own = [r for r in rows if r["hd"] == hd]
        slower = [bool(choice_loss(r, turn_keys)) for r in own]
        points = []
        for picked_slower, style in POINT_STYLES.items():
            chosen = [r for r, x in zip(own, slower) if x == picked_slower]
            points.append(ax.scatter([r["keys"] for r in chosen], [r["t128_over_t192"] for r in chosen], zorder=3,
                                     **style))
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_ylabel(f"hd{hd}: time 128 / 192")
        ax.grid(alpha=0.3)
        handles = [model_line, *points]
    axes[-1, 0].set_xlabel("keys (T)")
    title = "Hopper forward, dense non-causal: 128-key over 192-key blocks (above 1: the 192-key blocks are faster)"
    return save_figure(fig, title, handles, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turn-keys", type=int, default=TURN_KEYS, help="a turn's fixed work, in keys")
    parser.add_argument("--measured", type=Path, help="CSV of measured ratios (hd, keys, t128_over_t192)")
    parser.add_argument("--plot", type=Path, help="draw the measured rows against the model (needs --measured)")
    parser.add_argument("--causal", action="store_true", help="the count summed over a causal grid's query tiles")
    parser.add_argument("--wide", type=int, choices=(WIDE, WIDE_HD96), default=WIDE,
                        help="the wider tile's key blocks in the table: 192 (hd128, head dims up to 80) or 144 "
                             "(head dims 81-96)")
    args = parser.parse_args(argv)
    if args.plot and not args.measured:
        parser.error("--plot draws measured rows: give --measured CSV")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib (pip install matplotlib)")
    if args.causal and args.measured:
        parser.error("--measured rows are dense non-causal calls: leave out --causal")
    if args.wide != WIDE and (args.causal or args.measured):
        parser.error("--wide 144 is the dense non-causal table's: causal calls and the measured rows are 192's")
    if args.causal:
        print(f"{'keys':>6} {'model 128/192, causal':>22}")
        for t in (512, 768, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 3072, 4096, 8192, 16384):
            print(f"{t:>6} {causal_predicted_ratio(t, args.turn_keys):>22.3f}")
        return 0
    if args.measured:
        rows = read_measured(args.measured)
        print(report(rows, args.turn_keys))
        if args.plot:
            print(f"figure: {plot(rows, args.plot, args.turn_keys)}")
        return 0
    print(f"{'keys':>6} {'tile':>5} {f'model 128/{args.wide}':>14}")
    for t in range(128, 4097, 64):
        print(f"{t:>6} {args.wide if wider_blocks_pay(t, args.turn_keys, args.wide) else NARROW:>5} "
              f"{predicted_ratio(t, args.turn_keys, args.wide):>14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
