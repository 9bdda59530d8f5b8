"""Where one GPT training step's GPU time goes: kernel time per step by category, and the largest kernels.

Profiles the benchmark's bare step (bench/e2e.py `bare_step`: the same model, loss, AdamW and clipping as
the pipeline, without Lightning) under `torch.profiler` after a few warm-up steps, and sums every CUDA
kernel's time into the categories below by its name. The sum is GPU busy time, not wall time: the table
prints the wall time of the profiled steps beside it, and the gaps in the GPU's timeline (no kernel, copy or
memset running), where the GPU waits for the host.

    python bench/profile_step.py --model gpt3-1.3b --seq-len 2048 --attention flash
    python bench/profile_step.py --seq-len 8192 --compile --set fp32_residual=true
    python bench/profile_step.py --seq-len 8192 --micro-batches 8   # 8 accumulated micro-batches per optimizer step
    python bench/profile_step.py --model llama-1b --seq-len 8192 --loss fused --compile \\
        --inductor max_pointwise_cat_inputs=1    # torch._inductor.config settings

Under torchrun (WORLD_SIZE > 1) the step runs in DDP with conf/trainer/strategy/data_parallel.yaml's settings
(--reduce-dtype and --sm-carveout are its keys of the same names; --hook torch runs torch's own all-reduce
instead of model/allreduce.py's, --hook copy_engine the copy engines', as comm_hook=copy_engine), and rank 0
also reports how the gradient all-reduce meets compute: the time NCCL kernels run, the part of it with no other
kernel running (exposed), and the CTAs (SMs) NCCL takes. The compute categories beside the one-GPU profile of the
same case show what the overlap costs compute.

    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --sm-carveout 4
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --hook torch
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --hook copy_engine
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --strategy fsdp
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --seq-len 8192 --micro-batches 8 --strategy fsdp2 \\
        --sharding-strategy FULL_SHARD    # FSDP2 (trainer=fsdp2): one reduce-scatter per step

--pipeline profiles `python train.py` with the same case instead (bench/pipeline_profiler.py: the model, data,
Lightning loop, AdamW and clipping of a real run), summed up as the bare step is (bench/trace.py), so that a gap
between the pipeline's tokens/s and the bare loop's (bench/e2e.py) shows where it goes: slower or more kernels, or
a GPU left idle by the host. On several GPUs Lightning starts the ranks (trainer=--strategy, --gpus N):

    python bench/profile_step.py --pipeline --seq-len 8192 --micro-batches 8 --loss fused
    python bench/profile_step.py --pipeline --gpus 2 --strategy fsdp2 --seq-len 8192 --micro-batches 8 --loss fused
    torchrun --standalone --nproc_per_node=2 bench/profile_step.py --strategy fsdp2 --seq-len 8192 --micro-batches 8 \\
        --loss fused                     # the bare step beside it

--host records the host's ops too (where it waits on the GPU, e.g. `cudaStreamSynchronize`), --trace DIR keeps each
rank's GPU events (DIR/rank<N>.json.gz, bench/trace.read_gpu_trace) to line the ranks' timelines up, and every
profile counts Python's garbage collections and their pauses. --overrides passes train.py overrides to --pipeline:

    python bench/profile_step.py --pipeline --gpus 2 --strategy fsdp2 --seq-len 8192 --micro-batches 8 --loss fused \\
        --trace /tmp/tp --overrides '~callbacks.gc'    # the run without recipe/garbage_collection.py

Rows merge into bench/results/profile.json, keyed by device and case (model, T, micro-batches, attention, loss,
compile, --set, pipeline or bare step, --host, --overrides, and the world size, strategy, sharding, all-reduce,
reduce dtype, carve-out and NCCL protocol).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import inductor_settings, join_torchrun_group, merge_file, parse_sets  # noqa: E402
from bench.e2e import TOKENS_PER_STEP  # noqa: E402
from bench.strategies import STRATEGY_FILES, wrap_for  # noqa: E402
from bench.trace import GcPauses, activities, rank_summary  # noqa: E402

RESULTS = REPO / "bench" / "results"
PIPELINE_OUT = RESULTS / "runs" / "profile_pipeline"  # the pipeline's run directory and its profiler's JSON


def profile(step, warmup: int, steps: int, world: int = 1, host: bool = False,
            trace: Path | None = None) -> dict | None:
    """`warmup` steps, then `steps` steps under torch.profiler (CUDA kernels, and with `host` the host's ops), summed
    up on rank 0 (bench/trace.rank_summary; other ranks: None); `trace`: a directory for each rank's GPU events."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities(host=host)) as prof, GcPauses() as pauses:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    return rank_summary(prof, pauses, steps, wall_ms, int(os.environ.get("RANK", "0")), world, host, trace)


def profile_pipeline(args: argparse.Namespace, batch: int, world: int, strategy_sets: tuple[str, ...]) -> dict:
    """`python train.py` for the case (bench/e2e.py's overrides: its model, data, AdamW and clipping), `world` GPUs,
    PipelineProfiler over --steps optimizer steps after --warmup; returns its summary (bench/trace.step_summary's
    fields, and the steps and micro-batches it covered)."""
    from bench.e2e import _overrides, launch_train
    from bench.pipeline_profiler import overrides as profiler

    out = PIPELINE_OUT / "profile.json"
    out.unlink(missing_ok=True)
    overrides = [*_overrides(args.model, args.seq_len, batch, args.attention, args.compile, args.warmup + args.steps,
                             args.warmup, trainer=args.strategy if world > 1 else "gpu", loss=args.loss,
                             accumulation=args.micro_batches, gpus=world, sets=tuple(args.set),
                             strategy_sets=strategy_sets),
                 f"trainer.devices={world}", *profiler(out, args.warmup, args.steps, args.host, args.trace),
                 *args.overrides]
    launch_train(overrides, PIPELINE_OUT)
    if not out.is_file():
        raise SystemExit(f"train.py ended without its profile ({out}); its output: {PIPELINE_OUT / 'train.log'}")
    return json.loads(out.read_text())


def table(row: dict, top: int) -> str:
    wall = row["wall_ms_per_step"]
    world = row.get("world_size", 1)
    proto = f", NCCL_PROTO={row['nccl_protocol']}" if row.get("nccl_protocol") else ""
    hook = {"torch": ", torch's all-reduce", "copy_engine": ", on the copy engines"}.get(row.get("hook"), "")
    if world == 1:
        where = row["device"]
    elif row.get("strategy") in ("fsdp", "fsdp2"):
        sharding = f", {row['sharding_strategy']}" if row.get("sharding_strategy") else ""
        strategy = row["strategy"].upper()
        conf = STRATEGY_FILES[row["strategy"]]
        where = f"{world} × {row['device']} ({strategy}, conf/trainer/strategy/{conf}.yaml{sharding}{proto})"
    else:
        where = f"{world} × {row['device']} (DDP, {row['reduce_dtype']} all-reduce{hook}{proto})"
    carveout = f" sm_carveout={row['sm_carveout']}" if row.get("sm_carveout") else ""
    micro = f" × {row['accumulation']} micro-batches" if row.get("accumulation", 1) > 1 else ""
    launch = f"train.py {row['overrides']}" if row.get("overrides") else "train.py"
    what = f"pipeline ({launch}): " if row.get("mode") == "pipeline" else ""
    loss = f" loss={row['loss']}" if row.get("loss", "torch") != "torch" else ""
    inductor = f" inductor: {row['inductor']}" if row.get("inductor") else ""
    lines = [f"{what}{row['model']} {row['batch']}×{row['seq_len']}{micro} attention={row['attention']}{loss} "
             f"compile={row['compile']} {row['set'] or ''}{carveout}{inductor} on {where}: wall {wall:.1f} ms per step",
             "", "| kernels | ms per step | share of kernel time |", "|---|---|---|"]
    total = row["categories"]["all kernels"]
    for cat, ms in row["categories"].items():
        lines.append(f"| {cat} | {ms:.1f} | {100 * ms / total:.1f}% |")
    if "timeline" in row:
        t = row["timeline"]
        lines += ["", f"The GPU's timeline: {t['span_ms']:.1f} ms per step from the first kernel to the last, "
                      f"{t['idle_ms']:.1f} ms of it with nothing running (the gaps the host leaves)."]
    if "overlap" in row:
        o = row["overlap"]
        lines += ["", f"NCCL kernels run {o['nccl_ms']:.1f} ms per step on up to {o['nccl_ctas']} CTAs; "
                      f"{o['exposed_ms']:.1f} ms of it with no other kernel running (exposed)."]
    if "gc" in row:
        g = row["gc"]
        per_gen = ", ".join(f"{n:g} of generation {gen}" for gen, n in g["collections_per_step"].items() if n)
        lines += ["", f"Python's garbage collector: {g['ms_per_step']:.1f} ms per step ({per_gen or 'no collection'}); "
                      f"the longest pause {g['longest_ms']:.1f} ms."]
    if "host_ops" in row:
        lines += ["", f"The host: {row['host_ms_in_ops']:.1f} ms per step inside recorded ops.", "",
                  f"| host ops by self time (top {top}) | ms per step |", "|---|---|"]
        lines += [f"| `{name.replace('|', '/')}` | {ms:.2f} |" for name, ms in list(row["host_ops"].items())[:top]]
    lines += ["", f"| largest kernels (top {top}) | ms per step |", "|---|---|"]
    for name, ms in sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {ms:.2f} |")
    return "\n".join(lines)


def _key(r: dict) -> tuple:
    return (r["device"], r["model"], r["seq_len"], r["batch"], r["attention"], r["compile"], r["set"], r.get("kernel"),
            r.get("world_size", 1), r.get("reduce_dtype"), r.get("sm_carveout", 0), r.get("nccl_protocol"), r.get("hook"),
            r.get("strategy", "ddp"), r.get("accumulation", 1), r.get("sharding_strategy"), r.get("mode", "bare"),
            r.get("loss", "torch"), r.get("host", False), r.get("overrides", ""), r.get("inductor", ""))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt3-1.3b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP, help="batch = this // seq-len")
    ap.add_argument("--micro-batches", type=int, default=1, metavar="K",
                    help="forwards and backwards of that batch per optimizer step, gradients accumulated (under DDP "
                         "all-reduced after the last, as Lightning); the table stays per optimizer step")
    ap.add_argument("--attention", default="flash")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="GPTConfig fields, e.g. fp32_residual=true")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (the table is per step)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32", help="the dtype on DDP's wire (torchrun)")
    ap.add_argument("--sm-carveout", type=int, default=0, help="SMs left to NCCL (model/distributed.set_sm_carveout)")
    ap.add_argument("--hook", choices=["average", "torch", "copy_engine"], default="average",
                    help="DDP's all-reduce: model/allreduce.py's (the pipeline's), torch's own, or the copy engines'")
    ap.add_argument("--strategy", choices=["ddp", "fsdp", "fsdp2"], default="ddp",
                    help="under torchrun: the pipeline's DDP (with --reduce-dtype, --sm-carveout, --hook), its FSDP, "
                         "or its FSDP2 (trainer=fsdp2: a reduce-scatter per optimizer step, not per micro-batch)")
    ap.add_argument("--sharding-strategy", choices=["FULL_SHARD", "SHARD_GRAD_OP"], default=None,
                    help="fsdp and fsdp2: the sharding_strategy of fsdp.yaml or fsdp2.yaml replaced")
    ap.add_argument("--nccl-protocol", choices=["LL", "LL128", "Simple"], default=None,
                    help="NCCL_PROTO (default: NCCL's choice per message size)")
    ap.add_argument("--loss", choices=["torch", "fused"], default="torch",
                    help="the loss both steps run (model/loss.py; conf/train.yaml's default is fused)")
    ap.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config settings for the bare step's compiled code (the whole model with "
                         "--compile, model/fusion.py's kernels without), e.g. max_pointwise_cat_inputs=1")
    ap.add_argument("--pipeline", action="store_true",
                    help="profile `python train.py` with the same case (bench/pipeline_profiler.py) instead of the "
                         "bare step; on several GPUs with --gpus N, Lightning starting the ranks")
    ap.add_argument("--host", action="store_true",
                    help="record the host's ops too (CPU activity): its time inside ops and the largest of them; "
                         "the profiler's overhead grows, so such rows are kept apart from the others")
    ap.add_argument("--trace", type=Path, default=None, metavar="DIR",
                    help="keep every rank's GPU events of the profiled steps in DIR/rank<N>.json.gz "
                         "(bench/trace.read_gpu_trace), to see when each rank's kernels and collectives ran")
    ap.add_argument("--overrides", nargs="*", default=[], metavar="OVERRIDE",
                    help="--pipeline: more of train.py's Hydra overrides, last (e.g. ~callbacks.gc); rows name them")
    ap.add_argument("--gpus", type=int, default=1, help="--pipeline's GPUs (trainer=--strategy when N > 1)")
    ap.add_argument("--out", type=Path, default=RESULTS / "profile.json")
    args = ap.parse_args(argv)
    overrides = parse_sets(args.set)
    if args.micro_batches < 1:
        raise SystemExit(f"--micro-batches {args.micro_batches}: an optimizer step takes at least one")
    if not torch.cuda.is_available():
        raise SystemExit("bench/profile_step.py profiles CUDA kernels; no CUDA device here")
    torchrun_world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.pipeline and torchrun_world > 1:
        raise SystemExit("--pipeline starts its own ranks: run it with python and --gpus N, not under torchrun")
    if args.overrides and not args.pipeline:
        raise SystemExit("--overrides are train.py's: they need --pipeline")
    if args.inductor and args.pipeline:
        raise SystemExit("--inductor sets this process's torch._inductor.config: the bare step's, not train.py's")
    for key, value in inductor_settings(args.inductor).items():
        setattr(torch._inductor.config, key, value)
    if not args.pipeline and args.gpus != 1:
        raise SystemExit("--gpus is --pipeline's: the bare step runs on torchrun's ranks (--nproc_per_node)")

    from bench.e2e import bare_step
    from flash_kernel import KERNEL_VERSION
    from model.distributed import set_sm_carveout

    if args.nccl_protocol:
        os.environ["NCCL_PROTO"] = args.nccl_protocol  # read when the communicator starts (train.py's ranks inherit it)
    world = args.gpus if args.pipeline else torchrun_world
    wrap, fsdp = None, world > 1 and args.strategy != "ddp"
    if fsdp and (args.reduce_dtype != "fp32" or args.sm_carveout or args.hook != "average"):
        conf = STRATEGY_FILES[args.strategy]
        raise SystemExit(f"--strategy {args.strategy} takes conf/trainer/strategy/{conf}.yaml's settings: no "
                         "--reduce-dtype, --sm-carveout or --hook")
    if args.sharding_strategy and not fsdp:
        raise SystemExit("--sharding-strategy is FSDP's: --strategy fsdp or fsdp2 on several GPUs (under torchrun, "
                         "or --pipeline --gpus N)")
    sharding = {"sharding_strategy": args.sharding_strategy} if args.sharding_strategy else {}
    ddp = {"reduce_dtype": args.reduce_dtype, "sm_carveout": args.sm_carveout, "comm_hook": args.hook}
    batch = max(1, args.tokens_per_step // args.seq_len)
    if args.pipeline:
        settings = (sharding if fsdp else ddp) if world > 1 else {}
        summary = profile_pipeline(args, batch, world, tuple(f"{k}={v}" for k, v in settings.items()))
    else:
        set_sm_carveout(args.sm_carveout)
        if world > 1:  # the pipeline's DDP, FSDP or FSDP2 (bench/strategies.py) in torchrun's process group
            wrap = wrap_for(args.strategy, join_torchrun_group(), sharding if fsdp else ddp)
        step, _ = bare_step(args.model, args.seq_len, batch, args.attention, args.compile, loss=args.loss, wrap=wrap,
                            accumulation=args.micro_batches, **overrides)
        summary = profile(step, args.warmup, args.steps, world, args.host, args.trace)
        if world > 1:
            torch.distributed.destroy_process_group()
            if int(os.environ["RANK"]) != 0:
                return
    row = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": date.today().isoformat(),
        "model": args.model, "seq_len": args.seq_len, "batch": batch,
        **({"accumulation": args.micro_batches} if args.micro_batches > 1 else {}), "attention": args.attention,
        "compile": args.compile, "set": " ".join(sorted(args.set)),
        **({"kernel": KERNEL_VERSION} if args.attention == "flash" else {}),
        "sm_carveout": args.sm_carveout,
        **({"sharding_strategy": args.sharding_strategy} if args.sharding_strategy else {}),
        **({"world_size": world, "strategy": args.strategy, "reduce_dtype": args.reduce_dtype, "hook": args.hook,
            "nccl_protocol": os.environ.get("NCCL_PROTO")} if world > 1 else {}),
        **({"mode": "pipeline"} if args.pipeline else {}), **({"loss": args.loss} if args.loss != "torch" else {}),
        **({"host": True} if args.host else {}), **({"overrides": " ".join(args.overrides)} if args.overrides else {}),
        **({"inductor": " ".join(sorted(args.inductor))} if args.inductor else {}),
        **summary,
    }
    merge_file(args.out, [row], _key)
    print(table(row, args.top))


if __name__ == "__main__":
    main()
