"""Train a GPT with Lightning, configured by Hydra: `python train.py attention=flash seq_len=8192`.

`train(cfg)` builds the Trainer, data, model, callbacks and logger from a composed config and fits; `main()`
is the Hydra entry around it, so tests (and other scripts) can call `train` with a config composed by
`hydra.compose`. Config lives in conf/; see README.md for the knobs. What surrounds the model lives in
recipe/: the launch and its world (launch.py), the checks before any work (checks.py, schema.py, preflight.py),
the global batch (batch.py), the logger (wandb_run.py), out-of-memory advice (oom.py), checkpoints and signals
(checkpoint_io.py, preemption.py; docs/reliability.md).
"""

from __future__ import annotations

import recipe.quiet  # noqa: F401  (first: library notices are silenced before the libraries import)

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from model.checkpoint import CheckpointModelMismatch
from model.lit_gpt import LitGPT, NonFiniteLossError, ResumeError
from recipe.batch import describe_global_batch, set_accumulation
from recipe.checkpoint_files import CheckpointError
from recipe.checks import ConfigError, validate
from recipe.launch import describe_launch, detect_launcher, output_dir, release_process_group
from recipe.oom import TrainingOutOfMemory, explain_oom
from recipe.preemption import Preempted, stopped
from recipe.preflight import check_writable, describe_cpu_default, describe_gelu_epilogue
from recipe.resolvers import register_resolvers
from recipe.schema import check_types
from recipe.wandb_run import build_logger, describe_logger, finish_logger

register_resolvers()


def build_callbacks(cfg: DictConfig, has_logger: bool) -> list[L.Callback]:
    callbacks = []
    for key, cb_cfg in (cfg.get("callbacks") or {}).items():
        if key == "lr_monitor" and not has_logger:
            continue  # LearningRateMonitor refuses to run without a logger
        callbacks.append(instantiate(cb_cfg))
    return callbacks


def build_module(cfg: DictConfig, vocab_size: int) -> LitGPT:
    """cfg.model carries seq_len and the attention name by interpolation (conf/train.yaml); the vocabulary
    is the tokenizer's."""
    return LitGPT(
        model={**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": vocab_size},
        optimizer=instantiate(cfg.optim.optimizer),
        warmup_steps=cfg.optim.warmup_steps,
        min_lr_ratio=cfg.optim.min_lr_ratio,
        weight_decay=cfg.optim.weight_decay,
        grad_clip=cfg.optim.grad_clip,
        compile=cfg.compile,
        loss=cfg.loss,
    )


def init_device(trainer: L.Trainer):
    """The device the model's weights are made and initialized on: the trainer's. On a CPU, GPT3-1.3B takes 20 s to
    make (2 cores; most of it the serial random draws of nn.Linear's init and GPT._init_weights, which more threads
    do not speed up). The dtype stays the model's; precision plugins convert it as before. On the CPU, as before,
    under FSDP (Lightning's FSDP moves each Block to its GPU as it shards it) and where Lightning starts the ranks
    by multiprocessing (ddp_spawn, ddp_fork: this process must not touch CUDA before they start)."""
    if isinstance(trainer.strategy, FSDPStrategy) or isinstance(trainer.strategy.launcher, _MultiProcessingLauncher):
        return contextlib.nullcontext()
    return trainer.strategy.root_device  # a torch.device is a context manager for where tensors are created


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the model described by `cfg`; returns the final logged metrics (floats). On several ranks, the process
    groups and their threads have ended when it returns or raises Preempted."""
    try:
        metrics = fit(cfg)
    except Preempted as err:  # every rank stopped at one step boundary: no collective is in flight
        err.__traceback__ = err.__context__ = None  # fit's frames, which hold the trainer and the model
        preempted = err
    else:
        preempted = None
    release_process_group()  # every rank is past fit, whose trainer and model (they hold the groups) are garbage
    if preempted is not None:
        raise preempted
    return metrics


def fit(cfg: DictConfig) -> dict[str, Any]:
    """train() up to the end of the run: the fit, the final metrics and the run summary."""
    check_types(cfg)
    launcher = detect_launcher()
    run_dir_key = "output_dir" if cfg.get("output_dir") else "hydra.run.dir"
    with open_dict(cfg):
        cfg.output_dir = output_dir(cfg)
    check_writable(cfg.output_dir, run_dir_key)
    validate(cfg, launcher)
    logger = build_logger(cfg)
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=build_callbacks(cfg, logger is not None), logger=logger or False)
    set_accumulation(cfg, trainer)
    for line in (describe_launch(trainer, launcher), describe_global_batch(cfg, trainer), describe_logger(logger),
                 describe_cpu_default(cfg), describe_gelu_epilogue(cfg)):
        if line:
            rank_zero_info(line)  # the run's first lines

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers (e.g. the loss) on tensor cores
    torch.backends.cudnn.allow_tf32 = True
    datamodule = instantiate(cfg.data)
    with init_device(trainer):
        module = build_module(cfg, datamodule.vocab_size)
    if logger is not None:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    ok = False
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        ok = True
    except SIGTERMException:  # Lightning's stop on a signal, after the checkpoint recipe/preemption.py wrote
        raise stopped(trainer) from None
    except torch.OutOfMemoryError as err:
        raise TrainingOutOfMemory(explain_oom(cfg, err, trainer.strategy.root_device)) from err
    finally:
        finish_logger(logger, trainer, ok)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for cb in trainer.callbacks:
        metrics.update(getattr(cb, "last_metrics", {}))
    write_run_summary(trainer, metrics, Path(cfg.output_dir))
    return metrics


def write_run_summary(trainer: L.Trainer, metrics: dict[str, float], out: Path) -> None:
    """metrics.json from rank 0 (what scripts that launch train.py read, e.g. bench/e2e.py --gpus N), and with
    several ranks ranks/<rank>.json: the device each rank trained on."""
    if trainer.world_size > 1:
        (out / "ranks").mkdir(parents=True, exist_ok=True)
        rank = {"rank": trainer.global_rank, "node_rank": trainer.node_rank, "device": str(trainer.strategy.root_device)}
        (out / "ranks" / f"{trainer.global_rank}.json").write_text(json.dumps(rank))
    if trainer.is_global_zero:
        summary = {**metrics, "world_size": trainer.world_size, "global_step": trainer.global_step}
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(summary, indent=1))


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        metrics = train(cfg)
    except (ConfigError, CheckpointError, CheckpointModelMismatch, ResumeError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Preempted as err:
        print(err, file=sys.stderr)
        sys.exit(err.exit_code)
    except (NonFiniteLossError, TrainingOutOfMemory) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    shown = ("train/loss", "val/loss", "perf/tokens_per_s", "perf/tflops_per_gpu", "perf/mfu", "perf/peak_mem_gib")
    summary = ", ".join(f"{k}={metrics[k]:.4g}" for k in shown if k in metrics)
    rank_zero_info(f"done: {summary}; run dir {cfg.output_dir}")


if __name__ == "__main__":
    main()
