"""The training progress bar, in optimizer steps toward trainer.max_steps, so it has a total and an ETA.

Lightning's bar counts the batches of the current epoch; this recipe's train epoch is one stream of windows
sized by max_steps, and a resumed run starts mid-way (or in a new epoch) where that count has no total:
`Training: | 210/? ...`. This bar reads trainer.global_step instead, starts at the step the run resumed
from, and estimates the time left from this run's own steps.

Its numbers are read when it refreshes (every refresh_rate steps): the last step's loss, off the device, and
PerfMonitor's tokens/s and MFU. Values logged with prog_bar=True would be read back by Lightning after every batch
instead, a host sync per step.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from model.perf import PerfMonitor


class StepProgressBar(TQDMProgressBar):
    def init_train_tqdm(self) -> Tqdm:
        trainer = self.trainer
        return Tqdm(
            desc="Training (steps)",
            total=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None,
            initial=trainer.global_step,  # a resumed run starts here; tqdm's rate and ETA count from here
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        pass  # one bar for the whole run, across epochs

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, bar = trainer.global_step, self.train_progress_bar
        # once per optimizer step: with gradient accumulation, several batches end at the same step
        if self.is_enabled and step != bar.n and (step % self.refresh_rate == 0 or step == bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The last step's loss and PerfMonitor's tokens/s and MFU, read here: the one host sync per refresh."""
        metrics: dict[str, Any] = {}
        loss = trainer.callback_metrics.get("train/loss")  # the device tensor LitGPT.training_step logged
        if loss is not None:
            metrics["train/loss"] = loss.item()
        metrics.update(super().get_metrics(trainer, pl_module))  # val/loss and val/ppl once validation has run
        metrics.pop("v_num", None)  # the logger's version number: the run directory already says which run
        for callback in trainer.callbacks:
            if isinstance(callback, PerfMonitor):
                metrics.update(callback.bar_metrics())
        return metrics
