"""Train a GPT with Lightning, configured by Hydra: `python train.py attention=flash seq_len=8192`.

`train(cfg)` builds the data, model, callbacks, logger and Trainer from a composed config and fits;
`main()` is the Hydra entry around it, so tests (and other scripts) can call `train` with a config
composed by `hydra.compose`. Config lives in conf/; see README.md for the knobs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf, open_dict

from model.attention import ATTENTION
from model.lit_gpt import LitGPT, NonFiniteLossError

REPO = Path(__file__).resolve().parent
WANDB_HOST = ("api.wandb.ai", 443)


class ConfigError(ValueError):
    """A config that cannot run; the message says which key to change."""


class TrainingOutOfMemory(RuntimeError):
    """CUDA ran out of memory; the message says which setting to change."""


def _auto_precision() -> str:
    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


def _wandb_offline() -> bool:
    """Offline unless an API key is configured AND the W&B host answers: never prompt, never hang."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "dryrun", "disabled"):
        return True
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    netrc = Path.home() / ".netrc"
    if not has_key and netrc.is_file():
        has_key = WANDB_HOST[0] in netrc.read_text(errors="ignore")
    if not has_key:
        return True
    try:
        socket.create_connection(WANDB_HOST, timeout=3).close()
        return False
    except OSError:
        return True


def _shared_launch_id() -> str | None:
    """An id that every rank of one torchrun / SLURM launch sees alike (None when there is none)."""
    # a multi-task srun; a lone `python train.py` inside an allocation keeps time-of-day names, so that
    # consecutive runs of one job do not share a directory
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm-{os.environ['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":  # torchrun --standalone (a fresh uuid) or --rdzv-id
        return f"torchrun-{run_id[:8]}"
    return None


def _launch_id() -> str:
    """The run directory's name stem (conf/train.yaml hydra.run.dir): the time of day for a plain launch;
    under torchrun or SLURM the launch's own id, since the ranks start at different seconds and must not
    each make their own run directory (checkpoint shards and logs would scatter)."""
    return _shared_launch_id() or datetime.now().strftime("%H-%M-%S")


def register_resolvers() -> None:
    for name, fn in (("auto_precision", _auto_precision), ("wandb_offline", _wandb_offline), ("launch_id", _launch_id)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def validate(cfg: DictConfig) -> None:
    """Catch configs that would fail late (after data preparation, on the first step) with a clear word."""
    name = cfg.attention.name
    if name not in ATTENTION:
        raise ConfigError(f"unknown attention {name!r}; valid: {', '.join(ATTENTION)}")
    if cfg.data.get("seq_len") is not None and cfg.data.seq_len != cfg.seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} differs from seq_len={cfg.seq_len}; set the top-level "
            "seq_len only (it sets both the model context and the data windows)"
        )
    if name == "flash":
        import flash_kernel

        on_cpu = cfg.trainer.get("accelerator") == "cpu"
        if on_cpu or not flash_kernel.is_available():
            why = "trainer.accelerator=cpu" if on_cpu else flash_kernel.unavailable_reason()
            raise ConfigError(
                f"attention=flash needs the compiled kernel on a CUDA GPU, but: {why}. "
                "Build it with `make build` on a GPU machine, or use attention=sdpa."
            )
        if not str(cfg.trainer.precision).startswith(("bf16", "16")):
            raise ConfigError(
                f"attention=flash runs in bf16/fp16, but trainer.precision={cfg.trainer.precision}; "
                "use trainer.precision=bf16-mixed"
            )
    # A file, or a directory: FSDP's sharded checkpoints (state_dict_type=sharded) are one file per rank.
    if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).exists():
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} does not exist; point it at a checkpoint of an earlier run")
    validate_trainer(cfg.trainer)


def _requested_gpus(devices: Any) -> int | None:
    """GPUs per node that `trainer.devices` asks for; None for "auto" / -1 (all there are)."""
    if isinstance(devices, str):
        devices = devices.strip()
        if devices in ("auto", "-1"):
            return None
        if "," in devices:  # "0,1": device indices
            return len([d for d in devices.split(",") if d.strip()])
        devices = int(devices)
    if isinstance(devices, int):
        return None if devices == -1 else devices
    return len(devices)  # a list of device indices


def validate_trainer(trainer: DictConfig) -> None:
    """GPUs, strategy and process-group backend, checked before any data or model work: Lightning would
    otherwise fail deep inside the launch (or on every rank at once)."""
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
        raise ConfigError(
            f"trainer.strategy={strategy!r} is not a strategy name; use trainer=ddp or trainer=fsdp "
            f"(conf/trainer/), or one of Lightning's: {', '.join(StrategyRegistry.available_strategies())}"
        )
    if str(trainer.get("accelerator")) not in ("gpu", "cuda"):
        return
    visible = torch.cuda.device_count()
    if visible == 0:
        raise ConfigError(
            "trainer.accelerator=gpu but no CUDA GPU is visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            "on a CPU machine use trainer=default or trainer.accelerator=cpu"
        )
    wanted = _requested_gpus(trainer.get("devices", "auto"))
    if wanted is not None and wanted > visible:
        raise ConfigError(
            f"trainer.devices={trainer.devices} asks for {wanted} GPUs per node, but this node has {visible}; "
            f"use trainer.devices={visible} (or auto), and trainer.num_nodes for more nodes"
        )
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy)
    backend = strategy.get("process_group_backend") if isinstance(strategy, DictConfig) else None
    distributed = any(name in target.lower() for name in ("ddp", "fsdp"))
    if distributed and backend in (None, "nccl") and not torch.distributed.is_nccl_available():
        raise ConfigError(
            f"trainer.strategy ({target}) on GPUs needs NCCL, which this torch build ({torch.__version__}) lacks; "
            "install a CUDA build of torch with NCCL, or set +trainer.strategy.process_group_backend=gloo (slow)"
        )


def _output_dir(cfg: DictConfig) -> str:
    if cfg.get("output_dir"):
        return str(cfg.output_dir)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("TORCHELASTIC_RUN_ID") and _shared_launch_id() is None:
        raise ConfigError(
            "torchrun without --standalone or --rdzv-id gives the ranks nothing in common to name one run "
            "directory by; add --standalone (one node) or --rdzv-id=<job id>, or pass output_dir=<shared path>"
        )
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.output_dir
    return os.getcwd()


def build_logger(cfg: DictConfig):
    if not cfg.get("logger") or "_target_" not in cfg.logger:
        return None
    logger = instantiate(cfg.logger)
    if getattr(logger, "_offline", False):
        rank_zero_info(
            f"W&B: no API key or no network, writing an offline run under {cfg.logger.save_dir}/wandb; "
            "upload it later with `wandb sync <that offline-run-* dir>`"
        )
    return logger


def finish_logger(logger, trainer: L.Trainer, ok: bool) -> None:
    """Close the W&B run so its files are complete when train() returns (not only at interpreter exit),
    which matters to callers that train several times in one process (tests, bench/e2e.py)."""
    from lightning.pytorch.loggers import WandbLogger

    if not (isinstance(logger, WandbLogger) and trainer.is_global_zero and logger._experiment is not None):
        return
    import wandb

    logger.experiment.finish(exit_code=0 if ok else 1)
    # finish() ends by informing the W&B service, without waiting (ServiceConnection.inform_finish), and the
    # service closes the run's .wandb log after that, on its own time: CI once read a header-only file right
    # after train() returned. teardown() waits for the service to exit, so the files are whole on return. It
    # would end the caller's other runs too, so it runs only when this was the process's last open run.
    if wandb.run is None:
        try:
            wandb.teardown()
        except SystemExit as err:  # wandb exits when its service failed; the training itself is done
            rank_zero_warn(f"W&B service exited with {err.code} while closing the run; see its debug-internal.log")


def build_callbacks(cfg: DictConfig, has_logger: bool) -> list[L.Callback]:
    callbacks = []
    for key, cb_cfg in (cfg.get("callbacks") or {}).items():
        if key == "lr_monitor" and not has_logger:
            continue  # LearningRateMonitor refuses to run without a logger
        callbacks.append(instantiate(cb_cfg))
    return callbacks


def set_accumulation(cfg: DictConfig, trainer: L.Trainer) -> None:
    """Keep the global batch what the config says whatever the GPU count: with global_batch_tokens set,
    accumulate micro-batches of data.batch_size × seq_len on each of world_size ranks until it is reached."""
    target = cfg.get("global_batch_tokens")
    if not target:
        return
    per_micro_step = cfg.data.batch_size * cfg.seq_len * trainer.world_size
    if target % per_micro_step:
        raise ConfigError(
            f"global_batch_tokens={target} is not a multiple of data.batch_size × seq_len × world_size = "
            f"{cfg.data.batch_size} × {cfg.seq_len} × {trainer.world_size} = {per_micro_step}"
        )
    trainer.accumulate_grad_batches = target // per_micro_step
    rank_zero_info(f"global batch {target} tokens = {trainer.accumulate_grad_batches} accumulation step(s) × {per_micro_step}")


def _explain_oom(cfg: DictConfig, err: torch.OutOfMemoryError) -> str:
    B, T, n_head = cfg.data.batch_size, cfg.seq_len, cfg.model.n_head
    msg = f"CUDA out of memory with model={cfg.model.n_layer}L/{cfg.model.d_model}d, seq_len={T}, data.batch_size={B}, attention={cfg.attention.name}. "
    if cfg.attention.name == "naive":
        score_gib = B * n_head * T * T * 2 / 2**30  # bf16 (B, H, T, T) per layer, kept for backward
        msg += (
            f"Naive attention materializes the (B, H, T, T) scores: {score_gib:.1f} GiB per layer in bf16. "
            "Use attention=flash or attention=sdpa, or lower data.batch_size / seq_len. "
        )
    else:
        msg += (
            "Lower data.batch_size and set global_batch_tokens to the tokens per step you want (gradient "
            "accumulation keeps the global batch), or set model.activation_checkpointing=true. "
        )
    return msg + f"({str(err).splitlines()[0]})"


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit the model described by `cfg`; returns the final logged metrics (floats)."""
    with open_dict(cfg):
        cfg.output_dir = _output_dir(cfg)
    validate(cfg)
    L.seed_everything(cfg.seed, workers=True)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers (e.g. the loss) on tensor cores
    torch.backends.cudnn.allow_tf32 = True

    datamodule = instantiate(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed)
    model_kwargs = {
        **OmegaConf.to_container(cfg.model, resolve=True),
        "seq_len": cfg.seq_len,
        "attention": cfg.attention.name,
        "vocab_size": datamodule.vocab_size,
    }
    module = LitGPT(
        model=model_kwargs,
        optimizer=instantiate(cfg.optim.optimizer),
        warmup_steps=cfg.optim.warmup_steps,
        min_lr_ratio=cfg.optim.min_lr_ratio,
        weight_decay=cfg.optim.weight_decay,
        grad_clip=cfg.optim.grad_clip,
        compile=cfg.compile,
    )
    logger = build_logger(cfg)
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=build_callbacks(cfg, logger is not None), logger=logger or False)
    set_accumulation(cfg, trainer)
    if logger is not None:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    ok = False
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        ok = True
    except torch.OutOfMemoryError as err:
        raise TrainingOutOfMemory(_explain_oom(cfg, err)) from err
    finally:
        finish_logger(logger, trainer, ok)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for cb in trainer.callbacks:
        metrics.update(getattr(cb, "last_metrics", {}))
    if trainer.is_global_zero:  # for scripts that launch train.py (bench/e2e.py --gpus N): one file per run
        summary = {**metrics, "world_size": trainer.world_size, "global_step": trainer.global_step}
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(summary, indent=1))
    return metrics


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        metrics = train(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (NonFiniteLossError, TrainingOutOfMemory) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    shown = ("train/loss", "val/loss", "perf/tokens_per_s", "perf/tflops_per_gpu", "perf/mfu", "perf/peak_mem_gib")
    summary = ", ".join(f"{k}={metrics[k]:.4g}" for k in shown if k in metrics)
    rank_zero_info(f"done: {summary}; run dir {cfg.output_dir}")


if __name__ == "__main__":
    main()
