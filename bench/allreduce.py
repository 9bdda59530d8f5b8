"""All-reduce time and bandwidth on this node's GPUs, per NCCL protocol and message size: what DDP's gradient
buckets (bucket_cap_mb, fp32 or bf16) and the tied embedding's last bucket cost on the wire.

Each protocol runs in its own torchrun world (NCCL reads NCCL_PROTO when the communicator starts); "auto"
leaves the choice to NCCL's tuner, and "copy_engine" is not NCCL's: model/copy_engine.py's mean on the copy
engines (fp32 only; its rows time a bucket's copies, mean and barriers on its own stream). Sizes are the
buffer's bytes; times are CUDA-event medians of --iters calls after --warmup. algbw = bytes / time;
busbw = algbw · 2(W-1)/W (what each link carries, the figure nccl-tests prints). The transport lines NCCL logs
(P2P, SHM, NVLS) come first.

    python bench/allreduce.py                            # every GPU, protocols auto LL LL128 Simple
    python bench/allreduce.py --protocols auto Simple --sizes-mb 25 412
    python bench/allreduce.py --protocols auto copy_engine --dtypes fp32

Rows merge into bench/results/allreduce.json, keyed by GPU, GPU count, protocol, dtype and size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import join_torchrun_group, merge_file  # noqa: E402

RESULTS = REPO / "bench" / "results"
PROTOCOLS = ("auto", "LL", "LL128", "Simple", "copy_engine")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRANSPORT = re.compile(r"via (P2P|SHM|NET)|coll channels|NVLS")


def worker(sizes_mb: list[float], dtypes: list[str], warmup: int, iters: int, copy_engine: bool) -> None:
    """One rank: time all_reduce (or, with copy_engine, model/copy_engine.py's mean) of each size and dtype;
    rank 0 prints one JSON line per case."""
    import torch.distributed as dist

    from model.copy_engine import CopyEngineAllReduce

    join_torchrun_group()
    world = dist.get_world_size()
    mean = CopyEngineAllReduce() if copy_engine else None
    for name in dtypes:
        dtype = DTYPES[name]
        if mean is not None and dtype != torch.float32:
            continue
        for mb in sizes_mb:
            x = torch.ones(int(mb * 2**20) // dtype.itemsize, dtype=dtype, device="cuda")
            times = []
            for i in range(warmup + iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                start.record()
                if mean is None:
                    dist.all_reduce(x)
                else:
                    mean(x).wait()  # the current stream waits for the copy engines' stream
                end.record()
                torch.cuda.synchronize()
                if i >= warmup:
                    times.append(start.elapsed_time(end) / 1e3)
            seconds = sorted(times)[len(times) // 2]
            algbw = x.numel() * dtype.itemsize / seconds / 1e9
            if dist.get_rank() == 0:
                print(json.dumps({"dtype": name, "mb": mb, "ms": seconds * 1e3, "algbw_gbs": algbw,
                                  "busbw_gbs": algbw * 2 * (world - 1) / world}), flush=True)
    dist.destroy_process_group()


def run_protocol(protocol: str, gpus: int, args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """(rows, NCCL transport lines) of one torchrun world under NCCL_PROTO=protocol."""
    env = {**os.environ, "NCCL_DEBUG": "INFO"}
    env.pop("NCCL_PROTO", None)
    if protocol not in ("auto", "copy_engine"):
        env["NCCL_PROTO"] = protocol
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", __file__,
           "--worker", "--sizes-mb", *map(str, args.sizes_mb), "--dtypes", *args.dtypes,
           "--warmup", str(args.warmup), "--iters", str(args.iters)]
    if protocol == "copy_engine":
        cmd.append("--copy-engine")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"NCCL_PROTO={protocol}: torchrun exited {proc.returncode}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    log = proc.stdout + proc.stderr
    transport = sorted({line.split("NCCL INFO", 1)[-1].strip() for line in log.splitlines()
                        if "NCCL INFO" in line and TRANSPORT.search(line)})
    return rows, transport


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    ap.add_argument("--sizes-mb", nargs="+", type=float, default=[0.25, 25, 412])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=180, help="seconds per protocol")
    ap.add_argument("--out", type=Path, default=RESULTS / "allreduce.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--copy-engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.sizes_mb, args.dtypes, args.warmup, args.iters, args.copy_engine)
    gpus = args.gpus or torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"bench/allreduce.py needs 2 or more GPUs; this machine has {torch.cuda.device_count()}")
    from bench.launchers import gpu_info  # the GPU's name from nvidia-smi: this process holds no GPU memory

    meta = {"gpu": gpu_info()["gpu"], "gpus": gpus, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "date": date.today().isoformat()}
    print(f"{gpus} × {meta['gpu']}, torch {meta['torch']}, NCCL {meta['nccl']}\n")
    new = []
    for i, protocol in enumerate(args.protocols):
        rows, transport = run_protocol(protocol, gpus, args)
        if i == 0:
            print("NCCL transport (rank logs):\n  " + "\n  ".join(transport[:12]) + "\n")
        new += [{**meta, "protocol": protocol, **r} for r in rows]
    print(table(merge(args.out, new), meta["gpu"], gpus))


def _key(r: dict) -> tuple:
    return (r["gpu"], r["gpus"], r["protocol"], r["dtype"], r["mb"])


def merge(path: Path, new: list[dict]) -> list[dict]:
    """The rows of `path` with `new` in place of those with the same key; written back and returned."""
    return merge_file(path, new, _key)


def table(rows: list[dict], gpu: str, gpus: int) -> str:
    """Markdown: this machine's rows (GPU name and count), by protocol, dtype and size."""
    lines = ["| NCCL_PROTO | dtype | MB | ms | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|---|"]
    mine = [r for r in rows if (r["gpu"], r["gpus"]) == (gpu, gpus)]
    order = {p: i for i, p in enumerate(PROTOCOLS)}
    for r in sorted(mine, key=lambda r: (order.get(r["protocol"], 9), r["dtype"], r["mb"])):
        lines.append(f"| {r['protocol']} | {r['dtype']} | {r['mb']:g} | {r['ms']:.3f} | {r['algbw_gbs']:.1f} | "
                     f"{r['busbw_gbs']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
