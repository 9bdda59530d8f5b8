"""End-to-end GPT training throughput and MFU through the real pipeline (FA2 paper, Table 1).

Each case runs `train.train(cfg)` (Hydra config, Lightning Trainer, the real data module, the perf
callback) for `--warmup` + `--steps` optimizer steps and reads the perf/* rates of the last `--steps`
steps; a bare PyTorch loop (same GPT, same batch shape, same fused AdamW, bf16 autocast, clipping,
no Lightning, no data loader) runs beside it so the table shows what the pipeline costs.

Protocol: a fixed number of tokens per GPU step, 16k by default (batch = 16384 // seq_len: the FA2 paper's
micro-batch at 2k), bf16, an optimizer step after every forward. The FA2 paper's runs (flash-attention's
training/configs/experiment/pile/gpt3xl-flash.yaml and gpt3xl-flash-8k.yaml) step the optimizer once per 1M
tokens on 8 GPUs, 128k tokens per GPU: `--tokens-per-step 131072 --micro-batch 8` at 2k (their micro-batch),
`--micro-batch 2` at 8k (theirs is 4 sequences), rows marked "× 8 acc.". GPT3-2.7B does not fit 16k tokens in one
forward on an 80 GB GPU (weights, grads and AdamW state alone are 43 GB): run it with `--micro-batch 1`, which keeps
the 16k tokens per optimizer step as micro-batches of one sequence with their gradients accumulated
(global_batch_tokens, recipe/batch.py), or with `--tokens-per-step 8192`.
FLOPs per token = 6·N + 12·L·d·T (model/flops.py). OOM is recorded as OOM, not hidden.

    python bench/e2e.py                                   # everything (long: run by parts)
    python bench/e2e.py --models gpt3-1.3b --seqlens 8192 --attentions sdpa flash --compile both
    python bench/e2e.py --models gpt3-2.7b --seqlens 8192 --micro-batch 1   # 2 micro-batches per step
    python bench/e2e.py --models gpt3-1.3b --seqlens 8192 --tokens-per-step 131072 --micro-batch 2 --warmup 2 \\
        --steps 4 --modes pipeline                        # the FA2 paper's 128k tokens per GPU per optimizer step
    python bench/e2e.py --models llama-1b --seqlens 8192 --attentions sdpa flash --compile both --modes pipeline
    python bench/e2e.py --models llama-1b --seqlens 8192 --attentions sdpa flash --modes pipeline --rounds 3
                                                          # sdpa, flash, sdpa, flash, ...: medians of 3 runs each
    python bench/e2e.py --plot-only                       # redraw table and figure from the JSON
    python bench/e2e.py --gpus 1 2 --strategy ddp --attentions flash   # per-GPU scaling, 1 vs 2 GPUs
    python bench/e2e.py --models gpt3-1.3b --seqlens 8192 --attentions flash --gpus 2 --strategy fsdp \\
        --strategy-set sharding_strategy=SHARD_GRAD_OP            # a strategy setting changed, pipeline and bare
    python bench/e2e.py --models gpt3-1.3b --seqlens 8192 --attentions flash --loss torch  # loss=torch rows
    python bench/e2e.py --models gpt3-1.3b --seqlens 8192 --attentions flash --set fused_add_norm=true  # model fields
    python bench/e2e.py --models gpt3-1.3b --seqlens 8192 --attentions flash --modes pipeline --rounds 3 \\
        --vs fused_add_norm=true fused_bias_gelu=true     # default, fused, default, fused, ...: the options timed
    python bench/e2e.py --models gpt3-1.3b --seqlens 8192 --attentions flash flex sdpa --document-mask both \\
        --modes pipeline                                  # document masking beside the unmasked rows

With --gpus N > 1 each pipeline case is `python train.py trainer=<strategy> trainer.devices=N ...` in a
subprocess (Lightning starts the ranks), read back from the run's metrics.json (rank 0's rates; tokens
per GPU step stay --tokens-per-step, so the global batch grows with N), and the bare loop runs under
`torchrun --nproc_per_node=N` wrapped in the same DDP, FSDP or FSDP2 (bench/strategies.py), rank 0 timing it. Their
rows record the GPU0-GPU1 link (`nvidia-smi topo -m`, e.g. NV18), which the table's GPUs column shows.
`--strategy-set KEY=VALUE` changes settings of the strategy's conf/trainer/strategy/ file in both (the rows are
their own cases; the GPUs column names the settings). The per-GPU ratio is against the one-GPU row of the same
invocation where it has one (--gpus 1 N), else the file's one-GPU row when the row merged; the row keeps that rate.
Parts merge into bench/results/e2e.json (keyed by device, case and GPU count), so runs of a few minutes each add up.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import date, datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (can_plot, device_slug, merge_file, parse_sets, rates, read_rows,  # noqa: E402
                          seconds_per_call)
from bench.launchers import gpu_info  # noqa: E402
from bench.strategies import backward_sync, check_settings, shards_gradients, wrap_for  # noqa: E402
from flash_kernel import KERNEL_VERSION  # noqa: E402
from flash_kernel.interface import EXTENSION_ENV  # noqa: E402
from model.distributed import clip_grad_norm_, clip_sharded_grad_norm_  # noqa: E402
from model.flops import flops_per_token, peak_flops  # noqa: E402
from model.gpt import GPT, GPTConfig, packs_qkv  # noqa: E402
from model.loss import LOSSES, next_token_loss  # noqa: E402
from train import TrainingOutOfMemory, train  # noqa: E402

RESULTS = REPO / "bench" / "results"
TOKENS_PER_STEP = 16384  # the FA2 paper's micro-batch at 2k, one optimizer step each (module docstring)
CHOICES = {"no": [False], "yes": [True], "both": [False, True]}  # --compile and --document-mask: the runs each asks
GIB = 2**30
# FA2 paper Table 1, 8×A100, TFLOP/s per GPU with FlashAttention-2 (for the README's comparison column)
FA2_PAPER_A100 = {("gpt3-1.3b", 2048): 196, ("gpt3-1.3b", 8192): 220, ("gpt3-2.7b", 2048): 205, ("gpt3-2.7b", 8192): 225}


def _overrides(model: str, seq_len: int, batch: int, attention: str, compile: bool, steps: int, log_every: int,
               trainer: str = "gpu", loss: str = "torch", document_mask: bool = False, accumulation: int = 1,
               gpus: int = 1, sets: tuple[str, ...] = (), strategy_sets: tuple[str, ...] = ()) -> list[str]:
    """train.py's overrides for one case: `batch` sequences per forward, `accumulation` forwards per optimizer step
    on each of `gpus` GPUs (global_batch_tokens holds the product; recipe/batch.py derives the accumulation);
    `sets` are --set's key=value model fields, applied after the preset, `strategy_sets` --strategy-set's
    key=value settings of the trainer's strategy."""
    held = [f"global_batch_tokens={batch * seq_len * accumulation * gpus}"] if accumulation > 1 else []
    return [
        *held,
        f"data.document_mask={str(document_mask).lower()}",
        f"model={model}",
        f"loss={loss}",
        f"attention={attention}",
        f"seq_len={seq_len}",
        f"compile={str(compile).lower()}",
        f"data.batch_size={batch}",
        f"trainer={trainer}",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={log_every}",
        "+trainer.limit_val_batches=0",
        "+trainer.enable_checkpointing=false",
        "trainer.enable_model_summary=false",
        "~callbacks.checkpoint",
        "logger=none",
        *(f"model.{item}" for item in sets),
        *(f"trainer.strategy.{item}" for item in strategy_sets),
    ]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@functools.lru_cache(maxsize=None)
def _model_config(model: str, attention: str, seq_len: int = 1024, sets: tuple[str, ...] = ()) -> Mapping:
    """The preset's GPTConfig fields as train.py composes them (conf/train.yaml sets seq_len and attention), with
    --set's fields; composed once per case (every row's labels read them, in every round), read-only."""
    return MappingProxyType(dict(_compose([f"model={model}", f"attention={attention}", f"seq_len={seq_len}",
                                           *(f"model.{item}" for item in sets)]).model))


def batch_and_accumulation(tokens_per_step: int, seq_len: int, micro_batch: int | None) -> tuple[int, int]:
    """(sequences per forward, forwards per optimizer step) for `tokens_per_step` tokens of `seq_len` each: one forward
    of all of them, or micro-batches of `micro_batch` sequences."""
    batch = max(1, tokens_per_step // seq_len)
    if micro_batch is None:
        return batch, 1
    if micro_batch < 1 or tokens_per_step % (micro_batch * seq_len):
        raise SystemExit(f"--micro-batch {micro_batch} at T = {seq_len}: --tokens-per-step {tokens_per_step} must be a "
                         f"whole number of micro-batches of {micro_batch} × {seq_len} tokens")
    return micro_batch, tokens_per_step // (micro_batch * seq_len)


def _check_steps(warmup: int, steps: int) -> None:
    if steps % warmup:
        raise SystemExit("--steps must be a multiple of --warmup (the perf callback logs every --warmup steps)")


def run_pipeline(model: str, seq_len: int, batch: int, attention: str, compile: bool, warmup: int, steps: int,
                 loss: str = "torch", document_mask: bool = False, accumulation: int = 1,
                 sets: tuple[str, ...] = ()) -> dict:
    """The real pipeline on one GPU, in this process; returns the perf/* rates over the last `steps` steps."""
    _check_steps(warmup, steps)
    cfg = _compose([*_overrides(model, seq_len, batch, attention, compile, warmup + steps, warmup, loss=loss,
                                document_mask=document_mask, accumulation=accumulation, sets=sets),
                    f"output_dir={RESULTS / 'runs'}"])
    cfg.callbacks.perf.window = steps // warmup + 1  # one rate over all timed steps
    return rates(train(cfg))


def launch_train(overrides: list[str], run_dir: Path, timeout: float = 900) -> dict:
    """`python train.py <overrides>` in a subprocess, as a user launches it (for several GPUs Lightning
    starts the other ranks); returns rank 0's metrics.json. The run's output goes to run_dir/train.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "train.py"), *overrides, "~callbacks.progress_bar", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    (run_dir / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        if "out of memory" in proc.stderr.lower():
            raise TrainingOutOfMemory(proc.stderr.strip().splitlines()[-1])
        raise RuntimeError(f"train.py exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads((run_dir / "metrics.json").read_text())


def run_pipeline_multi(model: str, seq_len: int, batch: int, attention: str, compile: bool, warmup: int, steps: int,
                       gpus: int, strategy: str, loss: str = "torch", document_mask: bool = False,
                       accumulation: int = 1, sets: tuple[str, ...] = (),
                       strategy_sets: tuple[str, ...] = ()) -> dict:
    """The real launch path on `gpus` GPUs with conf/trainer/<strategy>.yaml and `strategy_sets`' settings."""
    _check_steps(warmup, steps)
    run_dir = RESULTS / "runs" / (f"{model}_{batch}x{seq_len}{f'x{accumulation}acc' if accumulation > 1 else ''}_"
                                  f"{attention}{'_compiled' if compile else ''}_{gpus}x{strategy}"
                                  f"{'_fused_loss' if loss == 'fused' else ''}{'_docmask' if document_mask else ''}"
                                  f"{''.join('_' + item.replace('=', '-') for item in (*sets, *strategy_sets))}")
    overrides = [*_overrides(model, seq_len, batch, attention, compile, warmup + steps, warmup, trainer=strategy,
                             loss=loss, document_mask=document_mask, accumulation=accumulation, gpus=gpus,
                             sets=sets, strategy_sets=strategy_sets),
                 f"trainer.devices={gpus}", f"callbacks.perf.window={steps // warmup + 1}"]
    return rates(launch_train(overrides, run_dir))


def bare_step(model: str, seq_len: int, batch: int, attention: str, compile: bool, loss: str = "torch",
              wrap=None, accumulation: int = 1, **model_overrides):
    """One training step of the GPT with nothing around it: bf16 autocast, the pipeline's loss (`loss`, compiled
    with the model when compile and loss=torch, as LitGPT), `accumulation` forwards and backwards of `batch`
    sequences each (the loss scaled by 1 / accumulation, as Lightning scales it; under DDP all-reduced once, after
    the last), fused AdamW, the pipeline's clipping (applied by the fused step, model/distributed.py
    clip_grads_with_norm_). Returns (step, GPTConfig);
    model_overrides set GPTConfig fields (e.g. fp32_residual=True); `wrap(gpt)` (e.g. DDP) runs the forward; where
    it shards the gradients over the world (FSDP), the norm is summed over the ranks."""
    cfg = GPTConfig(**{**_model_config(model, attention, seq_len), **model_overrides}, vocab_size=50257)
    torch.manual_seed(0)
    with torch.device("cuda"):  # made and initialized on the GPU, as train.py's init_device has it
        gpt = GPT(cfg)
    loss_fn = next_token_loss
    if compile:
        gpt.compile()
        if loss == "torch":
            loss_fn = torch.compile(next_token_loss)
    forward = wrap(gpt) if wrap else gpt
    sharded = shards_gradients(forward)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device="cuda")
    inp, tgt = x[:, :-1], x[:, 1:]

    def step():
        for i in range(accumulation):  # one batch of random tokens: the kernels' time does not depend on them
            with backward_sync(forward, last=i == accumulation - 1):  # DDP: one all-reduce a step, as Lightning
                with torch.autocast("cuda", dtype=torch.bfloat16):  # as Lightning's bf16-mixed: the loss inside
                    value = loss_fn(forward(inp), tgt, loss)
                (value / accumulation if accumulation > 1 else value).backward()
        if sharded:
            clip_sharded_grad_norm_(gpt.parameters(), 1.0, None, opt)
        else:
            clip_grad_norm_(gpt, None, 1.0, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, cfg


def run_bare(model: str, seq_len: int, batch: int, attention: str, compile: bool, warmup: int, steps: int,
             loss: str = "torch", accumulation: int = 1, sets: tuple[str, ...] = (), wrap=None) -> dict:
    """The same GPT step with nothing around it: the yardstick for the pipeline's overhead (per GPU, this
    rank's time, under `wrap` as bare_step takes it)."""
    step, cfg = bare_step(model, seq_len, batch, attention, compile, loss, wrap=wrap, accumulation=accumulation,
                          **parse_sets(list(sets)))
    torch.cuda.reset_peak_memory_stats()
    dt = seconds_per_call(step, warmup, steps)
    tokens_per_s = batch * seq_len * accumulation / dt
    flops = flops_per_token(cfg, seq_len) * tokens_per_s
    peak = peak_flops(torch.cuda.get_device_name(), torch.bfloat16)
    return {
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / GIB,
        "step_time_s": dt,
    }


BARE_RESULT = "[e2e bare] "  # how a multi-GPU bare loop's rank 0 prints its result line (JSON follows)


def run_bare_multi(model: str, seq_len: int, batch: int, attention: str, compile: bool, warmup: int, steps: int,
                   gpus: int, strategy: str, loss: str = "torch", accumulation: int = 1,
                   sets: tuple[str, ...] = (), strategy_sets: tuple[str, ...] = (), timeout: float = 900) -> dict:
    """The bare loop on `gpus` GPUs: `torchrun --standalone --nproc_per_node=gpus bench/e2e.py --bare-rank SPEC`,
    each rank running bare_step in the pipeline's DDP, FSDP or FSDP2 (bench/strategies.py) with `strategy_sets`'
    settings; rank 0's rates, per GPU."""
    spec = {"model": model, "seq_len": seq_len, "batch": batch, "attention": attention, "compile": compile,
            "warmup": warmup, "steps": steps, "strategy": strategy, "loss": loss, "accumulation": accumulation,
            "sets": list(sets), "strategy_sets": list(strategy_sets)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           str(Path(__file__).resolve()), "--bare-rank", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    results = [json.loads(line[len(BARE_RESULT):]) for line in proc.stdout.splitlines() if line.startswith(BARE_RESULT)]
    if results and results[-1].get("status") == "OOM":
        raise TrainingOutOfMemory(f"the bare loop on {gpus} GPUs ({strategy}) ran out of memory")
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"the bare loop on {gpus} GPUs ({strategy}) exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return results[-1]


def bare_rank(spec: dict) -> None:
    """One torchrun rank of run_bare_multi: the bare loop wrapped as the pipeline's strategy; rank 0 prints its
    result after BARE_RESULT, and a rank out of memory its status."""
    import torch.distributed as dist

    from bench.common import join_torchrun_group

    local = join_torchrun_group()
    settings = parse_sets(spec["strategy_sets"], "--strategy-set")
    wrap = wrap_for(spec["strategy"], local, settings)
    try:
        out = run_bare(spec["model"], spec["seq_len"], spec["batch"], spec["attention"], spec["compile"],
                       spec["warmup"], spec["steps"], spec["loss"], spec["accumulation"], tuple(spec["sets"]),
                       wrap=wrap)
    except torch.OutOfMemoryError:
        out = {"status": "OOM"}
    if dist.get_rank() == 0 or out.get("status") == "OOM":  # any rank's OOM is the case's
        print(BARE_RESULT + json.dumps(out), flush=True)
    if out.get("status") == "OOM":
        os._exit(3)  # a peer may be waiting in a collective: end the world, torchrun stops the others
    dist.destroy_process_group()


def combine_rounds(runs: list[dict]) -> dict:
    """One result from a case's rounds: each rate's median and the peak memory's maximum, with every round's
    tokens/s under 'rounds' when there are several. A round that did not finish (OOM, error) is the result."""
    failed = [r for r in runs if r["status"] != "ok"]
    if failed or len(runs) == 1:
        return dict(failed[-1] if failed else runs[0])
    out = {"status": "ok", "rounds": [r["tokens_per_s"] for r in runs]}
    for field in runs[0]:
        values = [r.get(field) for r in runs]
        if field != "status" and all(isinstance(v, (int, float)) for v in values):
            out[field] = max(values) if field == "peak_mem_gib" else statistics.median(values)
    return out


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_case(mode: str, model: str, seq_len: int, batch: int, attention: str, compile: bool, warmup: int, steps: int,
             gpus: int = 1, strategy: str = "single", loss: str = "torch", document_mask: bool = False,
             accumulation: int = 1, sets: tuple[str, ...] = (), strategy_sets: tuple[str, ...] = ()) -> dict:
    try:
        if gpus > 1 and mode == "pipeline":
            out = run_pipeline_multi(model, seq_len, batch, attention, compile, warmup, steps, gpus, strategy, loss,
                                     document_mask, accumulation, sets, strategy_sets)
        elif gpus > 1:
            out = run_bare_multi(model, seq_len, batch, attention, compile, warmup, steps, gpus, strategy, loss,
                                 accumulation, sets, strategy_sets)
        elif mode == "pipeline":
            out = run_pipeline(model, seq_len, batch, attention, compile, warmup, steps, loss, document_mask,
                               accumulation, sets)
        else:
            out = run_bare(model, seq_len, batch, attention, compile, warmup, steps, loss, accumulation, sets)
        out["status"] = "ok"
    except (torch.OutOfMemoryError, TrainingOutOfMemory):
        out = {"status": "OOM"}
    except (RuntimeError, subprocess.TimeoutExpired) as err:  # a failed multi-GPU launch: keep the other cases
        print(f"[e2e] failed: {err}", flush=True)
        out = {"status": "error"}
    finally:
        _free_cuda()
    return out


# --- results: JSON merge, table, figure --------------------------------------------------------------

def _gpus(r: dict) -> tuple[int, str]:
    """(GPUs, strategy): 'single', 'ddp', or the strategy with the settings --strategy-set changed
    ('fsdp sharding_strategy=SHARD_GRAD_OP'), so that such a row is a case of its own."""
    strategy = r.get("strategy", "single")  # rows from before multi-GPU runs: one GPU
    return r.get("gpus", 1), f"{strategy} {r['strategy_set']}" if r.get("strategy_set") else strategy


def _attention(r: dict) -> str:
    """attention=flash rows carry the kernel version they ran (flash_kernel.KERNEL_VERSION): 'flash v5';
    rows with the bf16 residual stream (model.fp32_residual=false) say so: 'flash v14, bf16 residual', and
    rows whose blocks passed the fused qkv whole (model/attention.py's qkv-packed form): '..., qkv packed'.
    Rows from before these carry no 'residual' / 'qkv' field: an fp32 residual stream, q, k, v views. Rows of
    loss=fused (model/cross_entropy.py) end in ', fused loss', then the fusion options their config turned on
    (', fused add + norm, fused bias-GELU, GELU epilogues'); rows with data.document_mask=true say so: 'flash vN,
    document mask, ...'; rows run with --set name its model fields last: '..., fused_add_norm=true'."""
    return _label(r, details=True)


def _label(r: dict, details: bool) -> str:
    """A row's attention word, document masking and --set / --vs fields; with details also its kernel version,
    residual dtype, qkv layout, loss and fused options (_attention's order)."""
    parts = [f"{r['attention']} {r['kernel']}" if details and r.get("kernel") else r["attention"]]
    parts += ["document mask"] if r.get("document_mask") else []
    if details:
        parts += ["bf16 residual"] if r.get("residual") == "bf16" else []
        parts += ["qkv packed"] if r.get("qkv") == "packed" else []
        parts += ["fused loss"] if r.get("loss") == "fused" else []
        parts += [FUSED_OPTIONS[name] for name in r.get("fused", ())]
    return ", ".join([*parts, *([r["set"]] if r.get("set") else [])])


def _accumulation(r: dict) -> int:
    return r.get("accumulation", 1)  # forwards per optimizer step; rows from before --micro-batch: one


def _batch(batch: int, accumulation: int) -> str:
    """The batch column: 'B', or 'B × K acc.' for K micro-batches of B sequences accumulated per optimizer step."""
    return f"{batch}" if accumulation == 1 else f"{batch} × {accumulation} acc."


def _bar(r: dict) -> str:
    """The attention word of a row, whether it masked documents and the model fields it set (--set, --vs): one bar
    each in the figure, so a run with other options never stands in for the default's latest."""
    return _label(r, details=False)


def residual_dtype(model: str, sets: tuple[str, ...] = ()) -> str:
    """'bf16' or 'fp32': the residual stream a model's config (with --set's fields) runs under bf16 autocast
    (model/gpt.py)."""
    return "fp32" if _model_config(model, "sdpa", sets=sets).get("fp32_residual", False) else "bf16"


# GPTConfig field -> row label: model/fusion.py's kernels and model/gelu_mlp.py's epilogues
FUSED_OPTIONS = {"fused_add_norm": "fused add + norm", "fused_bias_gelu": "fused bias-GELU",
                 "gelu_epilogue": "GELU epilogues"}


def fused_options(model: str, sets: tuple[str, ...] = ()) -> list[str]:
    """The FUSED_OPTIONS (GPTConfig fields) that a model's config, with --set's fields, turns on. Rows from before
    the GPT3-1.3B and 2.7B presets turned them on carry no 'fused' field: they ran without."""
    cfg = _model_config(model, "sdpa", sets=sets)
    return [name for name in FUSED_OPTIONS if cfg.get(name, False)]


def qkv_layout(model: str, attention: str, sets: tuple[str, ...] = ()) -> str:
    """'packed' where a model's blocks hand the fused projection whole to the attention (model/gpt.py packs_qkv:
    flash, H key/value heads, learned positions), else 'views' (q, k, v views; GQA and RoPE models)."""
    return "packed" if packs_qkv(GPTConfig(**_model_config(model, attention, sets=sets))) else "views"


def kernel_label(label: str | None, other_build: str | None) -> str:
    """The kernel that attention=flash rows name: KERNEL_VERSION for the package's build. A build that
    FLASH_KERNEL_EXT names (python -m flash_kernel.build --out) must be named with --kernel-label, so that its rows
    are their own case, never merged into the package build's."""
    if other_build and not label:
        raise SystemExit(f"{EXTENSION_ENV}={other_build} runs another build of the kernels: name it with "
                         "--kernel-label (e.g. --kernel-label v33+overlap-bc128) so its rows stay apart")
    return label or KERNEL_VERSION


def _key(r: dict) -> tuple:
    return (r["device"], r["mode"], r["model"], r["seq_len"], r["batch"], _accumulation(r), _attention(r),
            r["compile"], *_gpus(r))


def _one_gpu_key(r: dict) -> tuple:
    """_key of the one-GPU row that a row on several GPUs scales against: same device, mode and case."""
    return _key(r)[:-2] + (1, "single")


def anchor_one_gpu(new: list[dict], old: list[dict]) -> list[dict]:
    """`new` with each row on several GPUs given the one-GPU rate it scales against (one_gpu_tokens_per_s, and
    one_gpu_run: the invocation that measured it), unless it has one: the one-GPU row of `new` (the same
    invocation), else the one in `old` (the file's). A one-GPU row measured again later leaves the ratios of
    the rows measured before it as they were."""
    ones = {_key(r): r for r in old if _gpus(r)[0] == 1} | {_key(r): r for r in new if _gpus(r)[0] == 1}
    anchored = []
    for r in new:
        one = ones.get(_one_gpu_key(r))
        if _gpus(r)[0] > 1 and "one_gpu_tokens_per_s" not in r and one and one["status"] == "ok":
            r = {**r, "one_gpu_tokens_per_s": one["tokens_per_s"], "one_gpu_run": one.get("run")}
        anchored.append(r)
    return anchored


def merge(path: Path, new: list[dict]) -> list[dict]:
    old = read_rows(path)
    return merge_file(path, anchor_one_gpu(new, old), _key, old=old,
                      order=lambda r: (r["device"], r["model"], r["seq_len"], -r["batch"], _accumulation(r),
                                       _attention(r), r["compile"], _gpus(r), r["mode"]))


def _fmt(r: dict | None, field: str, scale: float = 1.0, digits: int = 0) -> str:
    if r is None:
        return "–"
    if r["status"] != "ok":
        return r["status"]
    v = r.get(field)
    return "–" if v is None else f"{v * scale:.{digits}f}"


def _one_gpu_rate(r: dict, one: dict | None) -> float | None:
    """The one-GPU tokens/s a row on several GPUs scales against: its own (anchor_one_gpu), else the one-GPU row's."""
    if "one_gpu_tokens_per_s" in r:
        return r["one_gpu_tokens_per_s"]
    return one["tokens_per_s"] if one and one["status"] == "ok" else None


def table(rows: list[dict]) -> str:
    """Markdown: one line per (device, model, T, batch, attention, compile, GPUs); pipeline vs bare loop
    side by side, and on several GPUs per-GPU tokens/s against one GPU's: the pipeline's, then the bare loop's
    against the one-GPU bare loop ('0.987; bare 0.994')."""
    by_key = {_key(r): r for r in rows}
    cases = sorted({k[:1] + k[2:] for k in by_key}, key=lambda k: (k[0], k[1], k[2], -k[3], *k[4:]))
    lines = [
        "| device | model | T | batch/GPU | attention | compile | GPUs | tokens/s/GPU | TFLOP/s/GPU | MFU % | peak GiB "
        "| bare tokens/s | pipeline / bare | per GPU / 1 GPU | FA2 paper 8×A100 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dev, model, T, B, K, attn, comp, gpus, strategy in cases:
        p = by_key.get((dev, "pipeline", model, T, B, K, attn, comp, gpus, strategy))
        b = by_key.get((dev, "bare", model, T, B, K, attn, comp, gpus, strategy))
        one = by_key.get((dev, "pipeline", model, T, B, K, attn, comp, 1, "single"))
        one_bare = by_key.get((dev, "bare", model, T, B, K, attn, comp, 1, "single"))
        ratio = scaling = "–"
        # Only a pair measured by one invocation: a pipeline row re-measured later is not compared with an
        # older bare loop (rows written before the "run" field have none, and pair as they were measured).
        if p and b and p["status"] == b["status"] == "ok" and p.get("run") == b.get("run"):
            ratio = f"{p['tokens_per_s'] / b['tokens_per_s']:.3f}"
        base = p and p["status"] == "ok" and _one_gpu_rate(p, one)
        if gpus > 1 and base:
            scaling = f"{p['tokens_per_s'] / base:.3f}"
            base_bare = b and b["status"] == "ok" and _one_gpu_rate(b, one_bare)
            if base_bare:  # the bare loop's own scaling beside it
                scaling += f"; bare {b['tokens_per_s'] / base_bare:.3f}"
        paper = FA2_PAPER_A100.get((model, T), "–") if attn.startswith("flash") else "–"
        lines.append(
            f"| {dev} | {model} | {T} | {_batch(B, K)} | {attn} | {'yes' if comp else 'no'} | {_gpus_cell(p or b)} | "
            f"{_fmt(p, 'tokens_per_s')} | {_fmt(p, 'tflops_per_gpu', 1, 1)} | {_fmt(p, 'mfu', 100, 1)} | "
            f"{_fmt(p, 'peak_mem_gib', 1, 1)} | {_fmt(b, 'tokens_per_s')} | {ratio} | {scaling} | {paper} |"
        )
    return "\n".join(lines)


def _gpus_cell(r: dict) -> str:
    """The GPUs column: '1', or the count, strategy and the GPU0-GPU1 link where the row recorded it ('2 ddp, NV18')."""
    gpus, strategy = _gpus(r)
    if gpus == 1:
        return "1"
    return f"{gpus} {strategy}" + (f", {r['interconnect']}" if r.get("interconnect") else "")


def latest_bars(rows: list[dict]) -> dict[tuple, dict]:
    """The figure's bars: (model, T, batch, accumulation, bar name, compile, GPUs, strategy) -> the latest row. One bar
    per attention word and case (the table keeps every kernel version and residual dtype; a bar for each made the
    figure too wide to read). Rows from before the "run" field count as the oldest."""
    return {(r["model"], r["seq_len"], r["batch"], _accumulation(r), _bar(r), r["compile"], *_gpus(r)): r
            for r in sorted(rows, key=lambda r: r.get("run") or "")}


def bar_layout(cases: list[tuple]) -> tuple[list[tuple[float, tuple]], list[tuple[float, tuple]]]:
    """Where the figure's bars go: for each group (model, T, batch, accumulation) only the variants it has, side by
    side one unit apart, a group at least three units wide (room for its tick label), one unit between groups.
    Returns (x, case) per bar and (x, group) per group centre: a file with many variants measured on few cases
    stays as wide as its bars."""
    bars, centres, x = [], [], 0.0
    for group in sorted({case[:4] for case in cases}):
        mine = sorted(case for case in cases if case[:4] == group)
        span = max(len(mine), 3)
        first = x + (span - len(mine)) / 2
        bars += [(first + k, case) for k, case in enumerate(mine)]
        centres.append((x + (span - 1) / 2, group))
        x += span + 1
    return bars, centres


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipe = [r for r in rows if r["mode"] == "pipeline"]
    by_case = latest_bars(pipe)
    if not by_case:
        return
    bars, centres = bar_layout(list(by_case))
    variants = sorted({case[4:] for case in by_case})
    colors = plt.get_cmap("tab20" if len(variants) > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * (max(x for x, _ in bars) + 2)), 4.5))
    labelled = set()
    for x, case in bars:
        r, variant = by_case[case], case[4:]
        attn, comp, gpus, strategy = variant
        label = f"{attn}{' +compile' if comp else ''}{f' ({gpus}× {strategy})' if gpus > 1 else ''}"
        ok = r["status"] == "ok"
        (bar,) = ax.bar([x], [r["tflops_per_gpu"] if ok else 0.0], 0.85, color=colors(variants.index(variant)),
                        label=None if variant in labelled else label)
        labelled.add(variant)
        ax.annotate(f"{r['tflops_per_gpu']:.0f}" if ok else "OOM", (x, bar.get_height()), ha="center", va="bottom",
                    fontsize=6)
    ax.set_xticks([x for x, _ in centres], [f"{m}\n{_batch(B, K)}×{T}" for _, (m, T, B, K) in centres], fontsize=8)
    ax.set_ylabel("TFLOP/s per GPU (6N + 12LdT)")
    devices = ", ".join(sorted({r["device"] for r in pipe}))
    ax.set_title(f"End-to-end GPT training step (batch × T), bf16, latest run per case — {devices}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: inside, it covered bar labels
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def variants(sets: list[str], vs: list[str]) -> list[tuple[str, ...]]:
    """The model fields each case runs with: --set's, and with --vs also --set's updated by --vs's (a key in both
    takes --vs's value), each a sorted tuple of key=value items."""
    def by_key(items: list[str]) -> dict[str, str]:
        return {item.partition("=")[0]: item for item in items}

    both = [by_key(sets), {**by_key(sets), **by_key(vs)}] if vs else [by_key(sets)]
    return [tuple(sorted(fields.values())) for fields in both]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt3-1.3b", "gpt3-2.7b"])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[2048, 4096, 8192])
    ap.add_argument("--attentions", nargs="+", default=["naive", "sdpa", "flash"])
    ap.add_argument("--compile", choices=list(CHOICES), default="no")
    ap.add_argument("--document-mask", choices=list(CHOICES), default="no",
                    help="data.document_mask: attention within each document (pipeline rows only)")
    ap.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP, help="tokens per GPU step: batch = this // T")
    ap.add_argument("--micro-batch", type=int, default=None, metavar="B",
                    help="sequences per forward: the --tokens-per-step of each optimizer step come as micro-batches "
                         "of B sequences with their gradients accumulated; default all in one forward")
    ap.add_argument("--modes", nargs="+", choices=["pipeline", "bare"], default=["pipeline", "bare"])
    ap.add_argument("--gpus", nargs="+", type=int, default=[1], help="GPU counts to run (N > 1: train.py with --strategy)")
    ap.add_argument("--strategy", choices=["ddp", "fsdp", "fsdp2"], default="ddp",
                    help="multi-GPU strategy (conf/trainer/)")
    ap.add_argument("--strategy-set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="settings of the strategy's conf/trainer/strategy/ file for the --gpus N > 1 cases, the "
                         "pipeline's (trainer.strategy.KEY=VALUE) and the bare loop's alike, e.g. --strategy fsdp "
                         "--strategy-set sharding_strategy=SHARD_GRAD_OP; the GPUs column names them")
    ap.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps (also the log interval)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps (a multiple of --warmup)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every case this many times in turn; rows hold each rate's median and every round's "
                         "tokens/s ('rounds')")
    ap.add_argument("--loss", choices=LOSSES, default=None,
                    help="the loss key: torch or fused (model/cross_entropy.py); default conf/train.yaml's, what "
                         "`python train.py` runs")
    ap.add_argument("--kernel-label", default=None, metavar="NAME",
                    help="what attention=flash rows say they ran, for a build that FLASH_KERNEL_EXT names "
                         "(e.g. v33+overlap-bc128); default flash_kernel.KERNEL_VERSION")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="model fields for every case, after the preset (e.g. fused_add_norm=true); rows name them")
    ap.add_argument("--vs", nargs="+", default=[], metavar="KEY=VALUE",
                    help="model fields of a second variant of every case, after --set's, run in turn with the first "
                         "(in every round): e.g. --vs fused_add_norm=true times the option beside the default")
    ap.add_argument("--out", type=Path, default=RESULTS / "e2e.json")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--bare-rank", metavar="JSON", help=argparse.SUPPRESS)  # run_bare_multi's ranks
    args = ap.parse_args(argv)
    args.loss = args.loss or _compose([]).loss
    args.batches = {T: batch_and_accumulation(args.tokens_per_step, T, args.micro_batch) for T in args.seqlens}
    parse_sets(args.set), parse_sets(args.vs, "--vs")  # a malformed item stops here, before any case runs
    args.variants = variants(args.set, args.vs)
    args.strategy_sets = tuple(sorted(args.strategy_set))
    if args.strategy_sets:
        if max(args.gpus) == 1:
            raise SystemExit("--strategy-set changes the multi-GPU strategy: give --gpus N > 1")
        try:
            settings = parse_sets(args.strategy_set, "--strategy-set", "a setting of the strategy's conf file")
            check_settings(args.strategy, settings, bare="bare" in args.modes)
        except ValueError as err:
            raise SystemExit(f"--strategy-set: {err}") from None
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: run every case at least once")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.bare_rank:
        return bare_rank(json.loads(args.bare_rank))

    rows = json.loads(args.out.read_text()) if args.out.is_file() else []
    if not args.plot_only:
        kernel = kernel_label(args.kernel_label, os.environ.get(EXTENSION_ENV))
        if not torch.cuda.is_available():
            raise SystemExit("bench/e2e.py measures GPU training; no CUDA device here (use --plot-only to redraw)")
        if max(args.gpus) > torch.cuda.device_count():
            raise SystemExit(f"--gpus {max(args.gpus)} but this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.cuda.get_device_name()
        meta = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "date": date.today().isoformat(),
                "run": datetime.now(timezone.utc).isoformat(timespec="seconds")}  # this invocation
        link = gpu_info()["interconnect"] if max(args.gpus) > 1 else None  # nvidia-smi topo: e.g. NV18
        compiles, masks = (CHOICES[args.compile], CHOICES[args.document_mask])
        # naive last: an OOM leaves the allocator fragmented for whatever runs after it
        attentions = sorted(args.attentions, key=lambda a: a == "naive")
        new = {}
        runs = defaultdict(list)  # (case, mode) -> its result in each round so far
        cases = list(itertools.product(args.models, args.seqlens, attentions, compiles, args.gpus, masks,
                                       args.variants))
        # Rounds run every case in turn, so that a drift of the GPU's clocks or temperature over the run reaches
        # every case alike (METHOD: medians over interleaved rounds).
        for rnd, (model, T, attn, comp, gpus, docs, sets) in ((i, c) for i in range(args.rounds) for c in cases):
            strategy, strategy_sets = (args.strategy, args.strategy_sets) if gpus > 1 else ("single", ())
            B, K = args.batches[T]
            variant = " ".join(sets)  # the row's "set" field; "" for the preset as it is
            # the bare loop has no data: no documents
            for mode in args.modes if not docs else ["pipeline"]:
                done = runs[(model, T, attn, comp, gpus, docs, sets, mode)]
                if done and done[-1]["status"] != "ok":
                    continue  # out of memory (or failed) once: not run again
                t0 = time.perf_counter()
                done.append(run_case(mode, model, T, B, attn, comp, args.warmup, args.steps, gpus, strategy, args.loss,
                                     docs, K, sets, strategy_sets))
                r = combine_rounds(done)
                r.update(meta, mode=mode, model=model, seq_len=T, batch=B, attention=attn, compile=comp,
                         **({"accumulation": K} if K > 1 else {}), **({"set": variant} if variant else {}),
                         gpus=gpus, strategy=strategy, residual=residual_dtype(model, sets), loss=args.loss,
                         qkv="views" if docs else qkv_layout(model, attn, sets),  # documents: q, k, v views
                         **({"fused": fused} if (fused := fused_options(model, sets)) else {}),
                         **({"kernel": kernel} if attn == "flash" else {}),
                         **({"document_mask": True} if docs else {}),
                         **({"interconnect": link} if gpus > 1 and link else {}),
                         **({"strategy_set": " ".join(strategy_sets)} if strategy_sets else {}))
                new[(model, T, attn, comp, gpus, docs, sets, mode)] = r
                this = done[-1]
                print(
                    f"[e2e] {mode:8s} {model} {_batch(B, K)}×{T} {attn:5s} compile={comp!s:5s} gpus={gpus} "
                    f"{' '.join((strategy, *strategy_sets))} "
                    f"{'document mask ' if docs else ''}{variant + ' ' if variant and len(args.variants) > 1 else ''}"
                    f"{f'round {rnd + 1}/{args.rounds} ' if args.rounds > 1 else ''}"
                    f"-> {this['status']} {_fmt(this, 'tokens_per_s')} tok/s/GPU {_fmt(this, 'tflops_per_gpu', 1, 1)} "
                    f"TFLOP/s MFU {_fmt(this, 'mfu', 100, 1)}% ({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
                rows = merge(args.out, list(new.values()))
    md = table(rows)
    args.out.with_suffix(".md").write_text(md + "\n")
    if can_plot("bench/e2e.py"):
        for dev in sorted({r["device"] for r in rows}):
            plot([r for r in rows if r["device"] == dev], RESULTS / f"e2e_{device_slug(dev)}.png")
    print(md)


if __name__ == "__main__":
    main()
