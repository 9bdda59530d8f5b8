"""Do N GPUs train the same model as one? Loss curves of 1 vs N GPUs for the same global batch. With
--vs, the same question for a config change: loss curves of the defaults vs the overrides, on one GPU.

Both runs go through train.py as users launch it, with the same seed and global batch
(global_batch_tokens = N × data.batch_size × seq_len):
  - 1 GPU accumulates N micro-batches per optimizer step;
  - N GPUs (DDP or FSDP) take one micro-batch each.
The data module hands rank r of world size W the windows (step·W + r)·B ... so both runs see the same
windows in every optimizer step, and their curves should agree up to float reduction order (and the
atomics of the attention backward). Validation runs every --val-every optimizer steps over the same
fixed windows (sharded over the ranks, averaged with sync_dist), which is the comparison; the train loss
is plotted as logged (rank 0's last micro-batch), smoothed.

    python bench/loss_curves.py --gpus 2                      # GPT3-125M, 1k context, 200 steps
    python bench/loss_curves.py --gpus 2 --strategy fsdp --attention sdpa
    python bench/loss_curves.py --vs model.fp32_residual=true  # bf16 vs fp32 residual stream, 1 GPU
    python bench/loss_curves.py --vs data.document_mask=true   # unmasked vs document-masked attention
    python bench/loss_curves.py --plot-only

With --vs data.document_mask=true both runs read the same windows in the same order; each measures its val
loss with the attention it trains with (the masked run's val tokens see their own document only).
--device cpu runs the pair on the CPU (a tiny model: --model gpt-tiny --attention sdpa, and --overrides for the
rest), which is how the script is tested.

Writes bench/results/loss_curves.json (one entry per device and setting) and, next to it,
loss_curves_<device>.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e import RESULTS, launch_train  # noqa: E402
from bench.common import can_plot, device_slug  # noqa: E402


def read_curves(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) pairs of train/loss and val/loss from a CSVLogger file."""
    curves: dict[str, list[tuple[int, float]]] = {"train/loss": [], "val/loss": []}
    for row in csv.DictReader(metrics_csv.open()):
        for key, points in curves.items():
            if row.get(key):
                points.append((int(row["step"]), float(row[key])))
    return curves


def compare(one: dict, multi: dict) -> dict:
    """Largest |Δ| of the validation losses taken at the same steps (both runs must have them)."""
    a, b = dict(one["val/loss"]), dict(multi["val/loss"])
    common = sorted(set(a) & set(b))
    if not common:
        raise SystemExit(f"no validation step in common: {sorted(a)} vs {sorted(b)}")
    diffs = [abs(a[s] - b[s]) for s in common]
    return {"val_steps": common, "max_abs_val_diff": max(diffs), "max_rel_val_diff": max(d / a[s] for d, s in zip(diffs, common))}


def plan(args: argparse.Namespace) -> tuple[tuple[str, int, str, list[str]], ...]:
    """The two runs: (name, GPUs, conf/trainer name, extra overrides) each."""
    if args.vs:
        return ("base", 1, args.device, []), ("vs", 1, args.device, list(args.vs))
    return ("one", 1, "gpu", []), ("multi", args.gpus, args.strategy, [])


def labels(entry: dict) -> dict[str, str]:
    """Legend text per run name (entries written before --vs carry no labels: the 1 vs N GPU pair)."""
    return entry.get("labels") or {"one": "1 GPU (accumulating)", "multi": f"{entry['gpus']} GPUs ({entry['strategy']})"}


def run(args: argparse.Namespace) -> dict:
    runs = plan(args)
    gpus_max = max(gpus for _, gpus, _, _ in runs)
    tokens = gpus_max * args.batch * args.seq_len
    common = [
        f"model={args.model}", f"attention={args.attention}", f"seq_len={args.seq_len}", f"data.batch_size={args.batch}",
        f"global_batch_tokens={tokens}", f"trainer.max_steps={args.steps}", "trainer.log_every_n_steps=5",
        "logger=csv", "~callbacks.checkpoint", "+trainer.enable_checkpointing=false", f"seed={args.seed}",
        *args.overrides,
    ]
    vs = " ".join(args.vs)
    tag = f"{args.model}_{args.seq_len}_{args.attention}_" + (
        "vs_" + "_".join(o.replace("=", "-") for o in args.vs) if vs else f"{args.gpus}x{args.strategy}")
    curves = {}
    for name, gpus, trainer, extra in runs:
        accumulation = gpus_max // gpus
        # val_check_interval counts micro-batches: validate at the same optimizer steps in both runs
        overrides = [*common, f"trainer={trainer}", f"trainer.devices={gpus}",
                     f"trainer.val_check_interval={args.val_every * accumulation}", *extra]
        run_dir = args.out.parent / "runs" / f"loss_{tag}_{name}"
        metrics = launch_train(overrides, run_dir, timeout=args.timeout)
        (metrics_csv,) = (run_dir / "csv").rglob("metrics.csv")
        curves[name] = {**read_curves(metrics_csv), "tokens_per_s": metrics.get("perf/tokens_per_s"), "gpus": gpus}
        print(f"[loss] {name}: {gpus} GPU(s) {' '.join(extra)}, final val/loss {curves[name]['val/loss'][-1][1]:.4f}",
              flush=True)
    (a, _, _, _), (b, _, _, _) = runs
    entry = {
        "device": torch.cuda.get_device_name() if args.device == "gpu" else "cpu", "torch": torch.__version__,
        "date": date.today().isoformat(),
        "model": args.model, "seq_len": args.seq_len, "attention": args.attention, "gpus": gpus_max,
        "strategy": args.strategy if gpus_max > 1 else "single", "global_batch_tokens": tokens, "steps": args.steps,
        "seed": args.seed, **compare(curves[a], curves[b]), "curves": curves,
    }
    if vs:
        entry.update(vs=vs, labels={"base": "defaults", "vs": vs})
    return entry


def _key(r: dict) -> tuple:
    return (r["device"], r["model"], r["seq_len"], r["attention"], r["gpus"], r["strategy"], r.get("vs"), r["steps"])


PANELS_PER_ROW = 3  # one panel per comparison, wrapped into rows


def plot(entries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(PANELS_PER_ROW, len(entries))
    rows = -(-len(entries) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(entries):]:  # the last row's empty cells
        ax.set_visible(False)
    for ax, e in zip(axes.flat, entries):
        for (name, c), style in zip(e["curves"].items(), ("-", "--")):
            label = labels(e)[name]
            steps, losses = zip(*c["train/loss"])
            smooth = [sum(losses[max(0, i - 4):i + 1]) / len(losses[max(0, i - 4):i + 1]) for i in range(len(losses))]
            ax.plot(steps, smooth, style, alpha=0.6, label=f"train, {label}")
            vsteps, vloss = zip(*c["val/loss"])
            ax.plot(vsteps, vloss, style, marker="o", label=f"val, {label}")
        ax.set_title(f"{e['model']} T={e['seq_len']} {e['attention']}, {e['global_batch_tokens']} tokens per step: "
                     f"max |Δ val| = {e['max_abs_val_diff']:.4f}", fontsize=8)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    fig.suptitle(f"Same global batch, same seed — {entries[0]['device']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # the top 2% for the suptitle
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="where --vs runs its pair")
    ap.add_argument("--overrides", nargs="+", default=[], metavar="OVERRIDE", help="train.py overrides for both runs")
    ap.add_argument("--vs", nargs="+", default=[], metavar="OVERRIDE",
                    help="compare the defaults with these train.py overrides on one GPU, instead of 1 vs --gpus GPUs")
    ap.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--model", default="gpt3-125m")
    ap.add_argument("--attention", default="flash")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per GPU")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--val-every", type=int, default=25, help="optimizer steps between validations")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per train.py run")
    ap.add_argument("--out", type=Path, default=RESULTS / "loss_curves.json")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)

    entries = json.loads(args.out.read_text()) if args.out.is_file() else []
    if args.device == "cpu" and not args.vs:
        raise SystemExit("--device cpu runs a --vs pair; 1 vs N GPUs needs GPUs")
    if not args.plot_only:
        need = 0 if args.device == "cpu" else 1 if args.vs else args.gpus
        if torch.cuda.device_count() < need:
            raise SystemExit(f"{'--vs' if args.vs else f'--gpus {need}'} needs {need} GPU(s) but this machine has "
                             f"{torch.cuda.device_count()}")
        new = run(args)
        entries = [e for e in entries if _key(e) != _key(new)] + [new]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(entries, indent=1))
        print(f"[loss] max |Δ val/loss| over steps {new['val_steps']}: {new['max_abs_val_diff']:.5f} "
              f"(relative {new['max_rel_val_diff']:.2e})")
    if not can_plot("bench/loss_curves.py"):
        return
    for dev in sorted({e["device"] for e in entries}):
        plot([e for e in entries if e["device"] == dev], args.out.with_name(f"{args.out.stem}_{device_slug(dev)}.png"))


if __name__ == "__main__":
    main()
