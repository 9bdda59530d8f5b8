"""Checks that refuse a config or a launch before any data or model work, naming the key to change.

Lightning would otherwise fail deep inside the launch, on every rank at once, or not at all: two ranks
given one GPU each train on cuda:0 until it runs out of memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from model.attention import check_attention, check_window
from model.distributed import requested_devices
from model.loss import check_loss
from recipe.launch import Launcher, detect_launcher, visible_gpus


class ConfigError(ValueError):
    """A config or launch that cannot run; the message says which key or launcher setting to change."""


def validate(cfg: DictConfig, launcher: Launcher | None = None) -> None:
    try:
        check_attention(cfg.attention.name, _accelerator(cfg.trainer), str(cfg.trainer.precision))
        check_loss(cfg.loss)
        check_window(cfg.attention.get("window"))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # A file, or a directory: FSDP's sharded checkpoints (state_dict_type=sharded) are one file per rank.
    if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).exists():
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} does not exist; point it at a checkpoint of an earlier run")
    validate_trainer(cfg.trainer, launcher or detect_launcher())


def _accelerator(trainer: DictConfig) -> str:
    """The accelerator the Trainer will pick: "gpu" or "cpu" (Lightning's "auto" takes a GPU when there is one)."""
    name = str(trainer.get("accelerator", "auto"))
    if name == "auto":
        return "gpu" if visible_gpus() else "cpu"
    return "gpu" if name == "cuda" else name


def validate_trainer(trainer: DictConfig, launcher: Launcher) -> None:
    """GPUs, ranks, strategy and process-group backend."""
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
        raise ConfigError(
            f"trainer.strategy={strategy!r} is not a strategy name; use trainer=ddp, trainer=fsdp or trainer=fsdp2 "
            f"(conf/trainer/), or one of Lightning's: {', '.join(StrategyRegistry.available_strategies())}"
        )
    on_gpu = _accelerator(trainer) == "gpu"
    visible = visible_gpus()
    if on_gpu and visible == 0:
        raise ConfigError(
            "trainer.accelerator=gpu but no CUDA GPU is visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            "on a CPU machine use trainer=default or trainer.accelerator=cpu"
        )
    wanted = requested_devices(trainer.get("devices", "auto"))
    if isinstance(wanted, list) and len(set(wanted)) < len(wanted):
        raise ConfigError(f"ranks would share a GPU: trainer.devices={list(wanted)} names a device twice")
    count = len(wanted) if isinstance(wanted, list) else wanted
    if launcher.external:
        _check_launch_world(trainer, launcher, count, visible if on_gpu else None)
    elif on_gpu and count is not None and count > visible:
        raise ConfigError(
            f"more ranks than GPUs: trainer.devices={trainer.devices} asks for {count} GPUs per node, but this node "
            f"has {visible}; use trainer.devices={visible} (or auto), and trainer.num_nodes for more nodes"
        )
    if on_gpu:
        ranks = launcher.world_size if launcher.external else (
            (count if count is not None else visible) * int(trainer.get("num_nodes", 1)))
        _check_nccl(strategy, ranks)


def _check_launch_world(trainer: DictConfig, launcher: Launcher, count: int | None, visible: int | None) -> None:
    """Under torchrun / srun the launcher fixed the world; the Trainer's devices × num_nodes must be that world,
    and each rank of a node needs a GPU of its own."""
    what = f"{launcher.name} started {launcher.ranks_per_node} rank(s) per node, {launcher.world_size} in all"
    if visible is not None and launcher.ranks_per_node > visible:
        raise ConfigError(
            f"more ranks than GPUs: {what}, but this node has {visible} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {visible} "
            "ranks per node (torchrun --nproc_per_node, srun --ntasks-per-node), each rank seeing every GPU of the node"
        )
    per_node = count if count is not None else (visible if visible is not None else 1)  # Lightning's "auto"
    if per_node < launcher.ranks_per_node:
        device = "GPU" if visible is not None else "CPU device"
        raise ConfigError(
            f"ranks would share a {device}: {what}, but trainer.devices={trainer.devices} gives this node {per_node} "
            f"device(s), so ranks {per_node}..{launcher.ranks_per_node - 1} would run on a device another rank uses. "
            "Leave trainer.devices at its default (it follows the launch), or set "
            f"trainer.devices={launcher.ranks_per_node}"
        )
    num_nodes = int(trainer.get("num_nodes", 1))
    if per_node * num_nodes != launcher.world_size:
        raise ConfigError(
            f"the launch's world does not match the Trainer's: {what}, but trainer.devices × trainer.num_nodes = "
            f"{per_node} × {num_nodes} = {per_node * num_nodes}. Leave both at their defaults (they follow the "
            f"launch), or set trainer.devices={launcher.ranks_per_node} trainer.num_nodes={launcher.num_nodes}"
        )


def _check_nccl(strategy: Any, ranks: int) -> None:
    """A strategy that starts a process group on GPUs needs NCCL: DDP and FSDP by name, and
    model.distributed.data_parallel (conf/trainer/strategy/) when the run has several ranks."""
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy)
    backend = strategy.get("process_group_backend") if isinstance(strategy, DictConfig) else None
    distributed = any(name in target.lower() for name in ("ddp", "fsdp")) or (
        target.endswith(".data_parallel") and ranks > 1)
    if distributed and backend in (None, "nccl") and not torch.distributed.is_nccl_available():
        raise ConfigError(
            f"trainer.strategy ({target}) on GPUs needs NCCL, which this torch build ({torch.__version__}) lacks; "
            "install a CUDA build of torch with NCCL, or set +trainer.strategy.process_group_backend=gloo (slow)"
        )
