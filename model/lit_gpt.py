"""The LightningModule: next-token loss, AdamW with warmup + cosine decay, val loss and perplexity, a NaN guard.

Throughput/MFU logging lives in model/perf.py (a callback); checkpointing is the Trainer's; gradient
clipping is done here (on_before_optimizer_step), since Lightning will not clip for fused AdamW. The module
keeps only plain values in its hparams (no nn.Modules), so a checkpoint carries everything needed to
rebuild it.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from functools import partial
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from flash_kernel import cu_seqlens_to
from model.attention import check_attention_runs_on
from model.checkpoint import check_model_matches
from model.distributed import clip_grad_norm_
from model.flops import flops_per_token
from model.fsdp2 import FSDP2Strategy
from model.gpt import GPT, GPTConfig
from model.loss import check_loss, next_token_loss


class NonFiniteLossError(RuntimeError):
    """Raised when the training loss became NaN/inf; the last good checkpoint stays untouched."""


class ResumeError(ValueError):
    """A checkpoint that does not fit the config; the message names the config key."""


# Optimizer settings that a resume takes from the config (the checkpoint keeps the moments and step count).
OPTIMIZER_KEYS = ("lr", "betas", "eps")


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to min_lr_ratio at max_steps (GPT-3 style)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LitGPT(L.LightningModule):
    def __init__(
        self,
        model: dict[str, Any],
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        grad_clip: float | None = 1.0,
        compile: bool = False,
        loss: str = "fused",
    ) -> None:
        super().__init__()
        check_loss(loss)
        self.save_hyperparameters(ignore=["optimizer"])
        self.cfg = GPTConfig(**model)
        self.model = GPT(self.cfg)
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95))
        self.compile = compile
        self.loss_fn = next_token_loss  # compiled in configure_model when compile=true and loss=torch
        # A device-side "loss was ever non-finite" flag: checking it costs a host sync, so it is read only
        # at logging intervals and before every checkpoint save, never every step.
        self.register_buffer("_nonfinite", torch.zeros((), dtype=torch.bool), persistent=False)

    # --- FLOPs, read by the perf callback ---------------------------------------------------------------
    def flops_per_batch(self, batch_size: int, seq_len: int) -> int:
        return flops_per_token(self.cfg, seq_len) * batch_size * seq_len

    def configure_model(self) -> None:
        # In-place nn.Module.compile keeps module types and state_dict keys unchanged, so checkpoints load
        # into an uncompiled model and FSDP still finds the Blocks to wrap. Under FSDP and FSDP2 each block is
        # compiled on its own: a graph spanning FSDP units would break at every unit's hooks. The loss is
        # compiled too, so it reads the bf16 logits without an fp32 copy (GPT3-1.3B at 8k on an H100: its
        # kernels 8.8 ms per step eager, 2.5 ms compiled; bench/profile_step.py).
        if not self.compile or getattr(self, "_compiled", False):
            return
        if self.hparams.loss == "torch":  # loss=fused is its own kernels, compiled or not (model/cross_entropy.py)
            self.loss_fn = torch.compile(next_token_loss)
        if self._trainer is not None and isinstance(self.trainer.strategy, (FSDPStrategy, FSDP2Strategy)):
            for block in self.model.blocks:
                block.compile()
        else:
            self.model.compile()
        self._compiled = True

    def on_fit_start(self) -> None:
        # Before the sanity check and the first step (and their compiles): a kernel that cannot run on this GPU.
        check_attention_runs_on(self.cfg.attention, self.cfg.head_dim, self.device)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """A document batch's cu_seqlens (data/windows.py builds it on the host) is checked there and marked as such
        on its way to the device (flash_kernel.cu_seqlens_to): the varlen kernel's own check would read it back from
        the GPU, a host sync every step. Its bounds: the B·T tokens of the batch, documents no longer than T."""
        if isinstance(batch, (tuple, list)) and len(batch) == 3:
            x, y, cu_seqlens = batch
            x, y = super().transfer_batch_to_device((x, y), device, dataloader_idx)
            return x, y, cu_seqlens_to(cu_seqlens, device, x.numel(), x.shape[1])
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch[:2]  # (B, T) each; data.document_mask adds cu_seqlens (data/windows.py)
        return self.loss_fn(self.model(x, cu_seqlens=batch[2] if len(batch) > 2 else None), y, self.hparams.loss)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._nonfinite |= ~torch.isfinite(loss.detach())
        # Not prog_bar: Lightning turns every progress-bar value into a Python number after every batch, a host sync
        # that leaves the GPU idle while the host prepares the next step. The bar reads the loss when it refreshes.
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        return loss

    def on_validation_epoch_start(self) -> None:
        # Σ loss·batch size (on the device: no sync per step) and Σ batch size over this rank's batches
        self._val_loss_sum, self._val_samples = torch.zeros((), device=self.device), 0

    def validation_step(self, batch, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=batch[0].shape[0])  # a document batch (x, y, cu_seqlens) leaves Lightning guessing
        self._val_loss_sum += loss.detach().float() * batch[0].shape[0]
        self._val_samples += batch[0].shape[0]

    def on_validation_epoch_end(self) -> None:
        # Perplexity = exp(mean token loss) over every rank's batches: the exp of val/loss (weighted by batch size,
        # as Lightning averages it), not a mean of per-batch exps.
        sums = torch.stack((self._val_loss_sum, torch.tensor(float(self._val_samples), device=self.device)))
        loss_sum, samples = self.trainer.strategy.reduce(sums, reduce_op="sum")
        self.log("val/ppl", torch.exp(loss_sum / samples), prog_bar=True, on_step=False, on_epoch=True)

    def check_finite(self) -> None:
        if bool(self._nonfinite):
            ckpt = self._last_checkpoint()
            raise NonFiniteLossError(
                f"training loss became NaN/inf by step {self.trainer.global_step}; stopped without saving. "
                + (f"The last good checkpoint is {ckpt}. " if ckpt else "No checkpoint was written yet. ")
                + "Lower optim.optimizer.lr, raise optim.warmup_steps, or keep gradient clipping on, then "
                "resume with ckpt_path=<that checkpoint>."
            )

    def _last_checkpoint(self) -> str | None:
        cb = getattr(self.trainer, "checkpoint_callback", None)
        return (cb.last_model_path or cb.best_model_path or None) if cb is not None else None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume semantics: the weights, optimizer moments, step and data position come from the checkpoint;
        the model's shape must equal the config's (checked here, before the weights load, naming the key);
        every optimizer and schedule setting (optim.optimizer.lr / betas / eps, optim.weight_decay,
        optim.warmup_steps, optim.min_lr_ratio, optim.grad_clip, trainer.max_steps) comes from the config."""
        saved = checkpoint.get("hyper_parameters", {}).get("model")
        if saved:
            check_model_matches(saved, asdict(self.cfg), self._trainer.ckpt_path if self._trainer else "the checkpoint")
        step = int(checkpoint.get("global_step", 0))
        if self._trainer is not None and 0 < self.trainer.max_steps <= step:
            raise ResumeError(f"trainer.max_steps={self.trainer.max_steps} but the checkpoint is at step {step}: "
                              "raise trainer.max_steps to train further")
        self._apply_config_to_optimizer_state(checkpoint, step)

    def _apply_config_to_optimizer_state(self, checkpoint: dict[str, Any], step: int) -> None:
        """Rewrite the checkpoint's optimizer hyper-parameters and LR schedule with the config's before
        Lightning restores them (it restores them after this hook), and say what changed."""
        keywords = getattr(self.optimizer_factory, "keywords", {})
        wanted = {k: tuple(v) if k == "betas" else v for k, v in keywords.items() if k in OPTIMIZER_KEYS}
        lr = wanted.get("lr")
        schedulers = checkpoint.get("lr_schedulers", [])
        multiplier = self._schedule()(schedulers[0].get("last_epoch", step) if schedulers else step)
        changed: dict[str, tuple] = {}
        for state in checkpoint.get("optimizer_states", []):
            for i, group in enumerate(state["param_groups"]):  # configure_optimizers: decay, then no decay
                settings = {**wanted, "weight_decay": self.hparams.weight_decay if i == 0 else 0.0}
                for key, value in settings.items():
                    # the group's "lr" is the scheduled one; the configured peak is its "initial_lr"
                    old = group.get("initial_lr") if key == "lr" else group.get(key)
                    old = tuple(old) if key == "betas" else old
                    if old != value:
                        changed.setdefault(key, (old, value))
                    group[key] = value
                if lr is not None:
                    group["initial_lr"], group["lr"] = lr, lr * multiplier
        for scheduler in schedulers:
            if lr is not None and "base_lrs" in scheduler:
                scheduler["base_lrs"] = [lr] * len(scheduler["base_lrs"])
                scheduler["_last_lr"] = [lr * multiplier] * len(scheduler["base_lrs"])
        saved = checkpoint.get("hyper_parameters", {})
        for key in ("warmup_steps", "min_lr_ratio", "grad_clip"):
            if key in saved and saved[key] != self.hparams[key]:
                changed[key] = (saved[key], self.hparams[key])
        if changed:
            rank_zero_info("resume: the config's settings replace the checkpoint's: " + ", ".join(
                f"{k} {old} -> {new}" for k, (old, new) in changed.items()))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Raising here aborts the save before anything is written, so a NaN state never replaces the
        # last good checkpoint.
        self.check_finite()

    # --- optimisation -----------------------------------------------------------------------------------
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Clipping here, not through Trainer(gradient_clip_val): Lightning's mixed-precision plugin refuses
        # to clip for fused AdamW even in bf16, where no gradient scaler is involved. Runs once per
        # optimizer step, after DDP's all-reduce (or FSDP's reduce-scatter) and before the step.
        # With no GradScaler (bf16, fp32) the fused AdamW step applies the clip (clip_grads_with_norm_).
        if not self.hparams.grad_clip:
            return
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        norm = clip_grad_norm_(self, self.trainer.strategy, self.hparams.grad_clip,  # norm over all shards
                               optimizer if scaler is None else None)
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                # weight decay on matmul weights and embeddings only, not on biases and LayerNorm gains
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        factory = self.optimizer_factory
        extra = {}
        if "fused" not in getattr(factory, "keywords", {}) and self._fused_adamw_ok():
            extra["fused"] = True  # one kernel for all parameters instead of a loop of small ones
        optimizer = factory(groups, **extra)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._schedule())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _schedule(self) -> Callable[[int], float]:
        """The LR multiplier by optimizer step, from this config (trainer.max_steps, optim.*)."""
        trainer = self._trainer
        max_steps = trainer.max_steps if trainer is not None and trainer.max_steps and trainer.max_steps > 0 else 0
        return partial(
            warmup_cosine,
            warmup_steps=max(1, self.hparams.warmup_steps),
            max_steps=max_steps,
            min_lr_ratio=self.hparams.min_lr_ratio,
        )

    def _fused_adamw_ok(self) -> bool:
        factory = getattr(self.optimizer_factory, "func", self.optimizer_factory)
        return factory is torch.optim.AdamW and self.device.type == "cuda"
