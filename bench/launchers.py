"""Per-GPU training throughput by launcher on one multi-GPU node: the plain launch, torchrun and FSDP against
one GPU, through train.py as users launch it.

Each case (model, seq_len, batch per GPU) trains `--warmup` + `--steps` optimizer steps under each launch:

    1 GPU      python train.py trainer.devices=1 ...                       the scaling baseline
    python     python train.py ...                                         Lightning starts one rank per GPU (DDP)
    torchrun   torchrun --standalone --nproc_per_node=N train.py ...       the launcher's world (DDP)
    fsdp       python train.py trainer=fsdp ...                            one FSDP unit per Block

(and, by name with --launches, variants of their settings: see LAUNCHES). Each run's rates are its own
logs: the CSV logger's last perf/* row (model/perf.py: tokens/s and TFLOP/s per GPU over the timed steps,
validation excluded), the world size from its metrics.json and the device of each rank from ranks/*.json.
The table gives per GPU tokens/s, TFLOP/s and MFU, and their ratio to the plain launch and to one GPU,
under the GPU's name and the GPU0-GPU1 link (`nvidia-smi topo -m`). Tokens per GPU step are fixed, so the
global batch grows with the GPUs (the FA2 paper's protocol). Data: the embedded stdlib corpus (no network),
prepared once before the runs if its cache is missing.

    python bench/launchers.py                                     # GPT3-350M 8×2k, GPT3-1.3B 2×8k; 4 launches each
    python bench/launchers.py --cases gpt3-350m:2048:8 --launches python fsdp fsdp_shard_grad_op fsdp_bf16_reduce
    python bench/launchers.py --dry-run                           # the commands only
    python bench/launchers.py --table-only                        # the table again from the JSON

Results merge into bench/results/launchers.json (keyed by GPU, case, attention and launch) and launchers.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import merge_file, rates  # noqa: E402

RESULTS = REPO / "bench" / "results"
DEFAULT_CASES = ["gpt3-350m:2048:8", "gpt3-1.3b:8192:2"]
DEFAULT_LAUNCHES = ["1gpu", "python", "torchrun", "fsdp"]
# What a launcher sets in the environment: the benchmark's own launch must not leak it into the runs.
LAUNCH_KEYS = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_PROCID", "SLURM_LOCALID")

# name -> (how it starts, overrides): "python" is `python train.py`, "torchrun" one process per GPU by torchrun.
LAUNCHES: dict[str, tuple[str, tuple[str, ...]]] = {
    "1gpu": ("python", ("trainer.devices=1",)),
    "python": ("python", ()),
    "torchrun": ("torchrun", ()),
    "fsdp": ("python", ("trainer=fsdp",)),
    # variants: one setting of conf/trainer/strategy/ changed from its default
    "ddp_bf16_reduce": ("python", ("trainer.strategy.reduce_dtype=bf16",)),
    "ddp_bucket_100mb": ("python", ("trainer.strategy.bucket_cap_mb=100",)),
    "fsdp_shard_grad_op": ("python", ("trainer=fsdp", "trainer.strategy.sharding_strategy=SHARD_GRAD_OP")),
    "fsdp_bf16_reduce": ("python", ("trainer=fsdp", "trainer.strategy.reduce_dtype=bf16")),
    "fsdp_limit_all_gathers": ("python", ("trainer=fsdp", "trainer.strategy.limit_all_gathers=true",
                                          "trainer.strategy.forward_prefetch=false")),
    "ddp_torch_hook": ("python", ("trainer.strategy.comm_hook=torch",)),
    "ddp_sm_carveout_4": ("python", ("trainer.strategy.sm_carveout=4",)),
    "ddp_sm_carveout_8": ("python", ("trainer.strategy.sm_carveout=8",)),
    "ddp_sm_carveout_4_backward": ("python", ("trainer.strategy.sm_carveout=4",
                                              "trainer.strategy.sm_carveout_scope=backward")),
    "ddp_copy_engine": ("python", ("trainer.strategy.comm_hook=copy_engine",)),
    "ddp_copy_engine_bucket_100mb": ("python", ("trainer.strategy.comm_hook=copy_engine",
                                                "trainer.strategy.bucket_cap_mb=100")),
    "ddp_copy_engine_sm_carveout_1": ("python", ("trainer.strategy.comm_hook=copy_engine",
                                                 "trainer.strategy.sm_carveout=1",
                                                 "trainer.strategy.sm_carveout_scope=backward")),
}


def parse_case(spec: str) -> tuple[str, int, int]:
    """'gpt3-350m:2048:8' -> (model, seq_len, batch per GPU)."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"case {spec!r}: write model:seq_len:batch, e.g. gpt3-350m:2048:8")
    return parts[0], int(parts[1]), int(parts[2])


def run_overrides(model: str, seq_len: int, batch: int, attention: str, warmup: int, steps: int, out: Path) -> list[str]:
    """train.py overrides of one timed run: no validation, no checkpoints, the CSV logger under `out`; perf/*
    logged every `warmup` steps as one rate over the last `steps` (callbacks.perf.window)."""
    return [
        f"model={model}",
        f"attention={attention}",
        f"seq_len={seq_len}",
        f"data.batch_size={batch}",
        f"trainer.max_steps={warmup + steps}",
        f"trainer.log_every_n_steps={warmup}",
        f"callbacks.perf.window={steps // warmup + 1}",
        "+trainer.limit_val_batches=0",
        "+trainer.enable_checkpointing=false",
        "~callbacks.checkpoint",
        "trainer.enable_model_summary=false",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar",
        "logger=csv",
        f"output_dir={out}",
        f"hydra.run.dir={out}",
    ]


def command(launch: str, gpus: int, visible: int, overrides: list[str], python: str = sys.executable) -> list[str]:
    """The command line of `launch` on `gpus` of the node's `visible` GPUs: the plain launch takes them all
    (trainer.devices is named only when `gpus` is fewer)."""
    how, extra = LAUNCHES[launch]
    train = str(REPO / "train.py") if python == sys.executable else "train.py"
    if how == "torchrun":
        start = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", train]
    else:
        start = [python, train]
        if gpus < visible and not any(o.startswith("trainer.devices=") for o in extra):
            extra = (*extra, f"trainer.devices={gpus}")
    return [*start, *extra, *overrides]


def last_perf_row(metrics_csv: Path) -> dict[str, float]:
    """The last row of a Lightning CSV log that holds perf/tokens_per_s, as floats (empty cells dropped)."""
    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/tokens_per_s")]
    if not rows:
        raise ValueError(f"{metrics_csv} has no perf/tokens_per_s row: the run ended before its first full window")
    return {k: float(v) for k, v in rows[-1].items() if v not in ("", None)}


def read_run(out: Path) -> dict:
    """The rates one run logged (rank 0's CSV log), its world size and the device each rank trained on."""
    (metrics_csv,) = (out / "csv").rglob("metrics.csv")
    perf = last_perf_row(metrics_csv)
    summary = json.loads((out / "metrics.json").read_text())
    ranks = sorted(out.glob("ranks/*.json"), key=lambda p: int(p.stem))
    devices = [json.loads(p.read_text())["device"] for p in ranks] or ["cuda:0"]
    return {"world_size": int(summary["world_size"]), "global_step": int(summary["global_step"]), "devices": devices,
            **rates(perf)}


def run_launch(launch: str, gpus: int, visible: int, overrides: list[str], out: Path, timeout: float) -> dict:
    """One launch in a subprocess; its log is out/train.log. Returns read_run's fields and a status: ok, OOM,
    timeout, shared-gpu (two ranks on one device) or error."""
    if out.exists():
        shutil.rmtree(out)  # a stale metrics.csv must not stand in for this run's
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    cmd = command(launch, gpus, visible, overrides)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        (out / "train.log").write_text(f"{err.stdout or ''}{err.stderr or ''}")
        return {"status": "timeout", "wall_s": timeout}
    wall = time.perf_counter() - t0
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        status = "OOM" if "out of memory" in proc.stderr.lower() else "error"
        print(f"[launchers] {launch} exited {proc.returncode}; log {out / 'train.log'}:\n{proc.stderr.strip()[-1500:]}")
        return {"status": status, "wall_s": wall}
    row = {**read_run(out), "status": "ok", "wall_s": wall}
    if len(set(row["devices"])) < len(row["devices"]):
        row["status"] = "shared-gpu"  # each rank must train on a GPU of its own
    return row


def gpu_info() -> dict:
    """The GPUs' name and count (nvidia-smi, so that this process takes no GPU memory) and the GPU0-GPU1 link
    from `nvidia-smi topo -m` (NV<n>: NVLink with n links; PIX/PXB/PHB/NODE/SYS: PCIe paths)."""
    names: list[str] = []
    topo = ""
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        names = [line.strip() for line in q.stdout.splitlines() if line.strip()]
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    if not names:
        import torch

        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")  # nvidia-smi lists every GPU of the host; the runs see these
    gpus = len([d for d in mask.split(",") if d.strip()]) if mask is not None else len(names)
    return {"gpu": names[0] if names else "no GPU", "gpus": min(gpus, len(names)), "interconnect": interconnect(topo)}


def interconnect(topo: str) -> str | None:
    """GPU0's link to GPU1 in `nvidia-smi topo -m` output, e.g. 'NV18'; None when there is no second GPU."""
    columns: list[str] = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", topo).splitlines():
        cells = line.split()
        if not columns and line[:1].isspace() and cells[:1] == ["GPU0"]:
            columns = cells  # the header: GPU0 GPU1 ... NIC0 ... CPU Affinity ...
        elif columns and cells[:1] == ["GPU0"] and "GPU1" in columns:
            return cells[1 + columns.index("GPU1")]
    return None


# --- results: JSON merge and table -------------------------------------------------------------------------

def _case(r: dict) -> tuple:
    return (r["gpu"], r["model"], r["seq_len"], r["batch"], r["attention"])


def merge(path: Path, new: list[dict]) -> list[dict]:
    """The rows of `path` with `new` replacing those of the same GPU, case, attention and launch."""
    order = {name: i for i, name in enumerate(LAUNCHES)}
    return merge_file(path, new, key=lambda r: (*_case(r), r["launch"]),
                      order=lambda r: (_case(r), order.get(r["launch"], len(order)), r["launch"]))


def _fmt(value, digits: int = 0, scale: float = 1.0) -> str:
    return "–" if value is None else f"{value * scale:,.{digits}f}"


def _ratio(r: dict, base: dict | None) -> str:
    """r's per-GPU tokens/s over base's, when both ran in one invocation of this script ('run'): the same
    machine minutes apart; a baseline from another run would carry that machine's drift into the ratio."""
    if (base is None or base is r or base.get("status") != "ok" or r.get("status") != "ok"
            or base.get("run") != r.get("run")):
        return "–"
    return f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}"


def table(rows: list[dict]) -> str:
    """Markdown: a header line per (GPU, case), a line per launch with the run it came from; ratios of per-GPU
    tokens/s to the plain launch ('python') and to one GPU ('1gpu') of the same case and run."""
    lines = []
    for case in sorted({_case(r) for r in rows}):
        gpu, model, seq_len, batch, attention = case
        group = [r for r in rows if _case(r) == case]
        by_launch = {r["launch"]: r for r in group}
        first = group[0]
        lines += [
            f"**{model}, {batch} × {seq_len} per GPU, attention={attention}** — {first.get('gpus', '?')} × {gpu}, "
            f"GPU0-GPU1 link {first.get('interconnect') or 'unknown'}",
            "",
            "| launch | run (UTC) | ranks | devices | tokens/s per GPU | TFLOP/s per GPU | MFU % | step ms | peak GiB "
            "| / plain launch | / 1 GPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            ok = r.get("status") == "ok"
            lines.append(
                f"| {r['launch']} | {r.get('run', '')[:16].replace('T', ' ') or '–'} | {r.get('world_size', '–')} | "
                f"{' '.join(r.get('devices', [])) or '–'} | "
                + (f"{_fmt(r['tokens_per_s'])} | {_fmt(r['tflops_per_gpu'], 1)} | {_fmt(r.get('mfu'), 1, 100)} | "
                   f"{_fmt(r.get('step_time_s'), 1, 1000)} | {_fmt(r.get('peak_mem_gib'), 1)} | " if ok
                   else f"{r.get('status')} | – | – | – | – | ")
                + f"{_ratio(r, by_launch.get('python'))} | {_ratio(r, by_launch.get('1gpu'))} |"
            )
        lines.append("")
    return "\n".join(lines)


def flash_available() -> bool:
    """Whether flash_kernel is built and runs here, asked in a subprocess: this process keeps no CUDA context
    (it would hold memory on GPU 0 beside the runs)."""
    check = "import sys, flash_kernel; sys.exit(0 if flash_kernel.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True).returncode == 0


def prepare_data() -> None:
    """The default data cache (stdlib corpus, 50257-token BPE), built once if missing; offline."""
    sys.path.insert(0, str(REPO))
    from recipe.prepare_data import prepare_data as prepare

    prepare([])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in DEFAULT_CASES],
                    help="model:seq_len:batch per GPU")
    ap.add_argument("--launches", nargs="+", choices=list(LAUNCHES), default=DEFAULT_LAUNCHES)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for torchrun (default: every visible GPU)")
    ap.add_argument("--attention", default="flash")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps (also the perf log interval)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (a multiple of --warmup)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--out", type=Path, default=RESULTS / "launchers.json")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    os.chdir(REPO)  # the runs and the data cache (.cache/data) are relative to the repository
    if args.steps % args.warmup:
        ap.error("--steps must be a multiple of --warmup (perf/* is logged every --warmup steps)")

    if not args.table_only:
        info = gpu_info()
        gpus = args.gpus or info["gpus"]
        runs_dir = RESULTS / "runs" / "launchers"
        plan = [(case, launch) for case in args.cases for launch in args.launches]
        if args.dry_run:
            for (model, seq_len, batch), launch in plan:
                out = runs_dir / f"{model}_{batch}x{seq_len}_{launch}"
                overrides = run_overrides(model, seq_len, batch, args.attention, args.warmup, args.steps, out)
                print(" ".join(command(launch, gpus, info["gpus"], overrides, python="python")))
            return
        if not 2 <= gpus <= info["gpus"]:
            raise SystemExit(f"bench/launchers.py compares launches on 2 or more GPUs: --gpus {gpus}, "
                             f"and this machine has {info['gpus']}")
        if args.attention == "flash" and not flash_available():
            raise SystemExit("attention=flash needs the built kernel: `make build` first, or pass --attention sdpa")
        prepare_data()
        meta = {**info, "gpus": gpus, "run": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        print(f"[launchers] {gpus} × {info['gpu']}, GPU0-GPU1 link {info['interconnect']}", flush=True)
        for (model, seq_len, batch), launch in plan:
            out = runs_dir / f"{model}_{batch}x{seq_len}_{launch}"
            overrides = run_overrides(model, seq_len, batch, args.attention, args.warmup, args.steps, out)
            row = run_launch(launch, gpus, info["gpus"], overrides, out, args.timeout)
            row.update(meta, model=model, seq_len=seq_len, batch=batch, attention=args.attention, launch=launch,
                       command=" ".join(command(launch, gpus, info["gpus"], [], python="python")))
            merge(args.out, [row])
            print(f"[launchers] {model} {batch}×{seq_len} {launch:24s} -> {row['status']} "
                  f"{_fmt(row.get('tokens_per_s'))} tokens/s per GPU, {_fmt(row.get('tflops_per_gpu'), 1)} TFLOP/s "
                  f"({row['wall_s']:.0f} s)", flush=True)
    rows = json.loads(args.out.read_text()) if args.out.is_file() else []
    md = table(rows)
    args.out.with_suffix(".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
