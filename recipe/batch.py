"""The global batch: what data.batch_size and global_batch_tokens mean when the GPU count changes.

data.batch_size is per rank and per micro-batch, so by default the tokens per GPU step are fixed and the
global batch grows with the GPUs: data.batch_size × seq_len × world_size tokens per optimizer step (16k tokens
per GPU in conf/experiment/fa2_*.yaml). With global_batch_tokens set, the global batch is fixed instead:
each rank accumulates micro-batches until the ranks together reach it (the FA2 paper's runs hold 1M tokens:
global_batch_tokens=1048576).
"""

from __future__ import annotations

import lightning as L
from omegaconf import DictConfig

from recipe.checks import ConfigError


def set_accumulation(cfg: DictConfig, trainer: L.Trainer) -> None:
    """With global_batch_tokens set: trainer.accumulate_grad_batches = that / (batch_size × seq_len × world)."""
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


def describe_global_batch(cfg: DictConfig, trainer: L.Trainer) -> str:
    """One line: the tokens per optimizer step, their factors, and what holds them."""
    B, T, W, A = cfg.data.batch_size, cfg.seq_len, trainer.world_size, trainer.accumulate_grad_batches
    held = (
        f"fixed by global_batch_tokens={cfg.global_batch_tokens}"
        if cfg.get("global_batch_tokens")
        else "per-rank batch fixed: more GPUs, larger global batch; global_batch_tokens=N holds it instead"
    )
    return (
        f"global batch: {B * T * W * A} tokens per optimizer step = data.batch_size {B} × seq_len {T} × "
        f"{W} rank{'s' if W > 1 else ''} × {A} accumulation step{'s' if A > 1 else ''} ({held})"
    )
