"""Python's cyclic garbage collector kept off the training step's critical path.

A collection of the oldest generation walks every object the process holds: the model's modules and
parameters, Lightning's trainer, Hydra's config, the data pipeline. It runs whenever enough objects have been
allocated, in the middle of a forward or backward, and the host issues no kernel until it ends. On one GPU the
host is usually far enough ahead that the GPU never sees it; where the host synchronizes with the GPU (a flag
read back before every micro-batch, say), the GPU waits for the whole pause, and the other ranks wait at the next
collective. GPT3-1.3B under FSDP2 on two H200s, 8 micro-batches of 2 × 8k per step, with the host synchronizing
before every micro-batch: 130 ms per step in collections, the longest 503 ms, and the pipeline at 0.946 of one
GPU's tokens/s; with GarbageCollection's freeze 3.9 ms per step, the longest 1 ms, and 0.999 (docs/results.md
section 16).

`GarbageCollection` (callbacks.gc in conf/callbacks/default.yaml) moves everything that exists when training
starts into the permanent generation (gc.freeze), so that later collections walk only what the run allocates
from then on; with `every_n_steps` it also turns automatic collection off and collects generations 0 to
`generation` itself after every n-th optimizer step, at the step boundary, on every rank at the same step. What is
frozen is not collected until training ends (then the freeze is undone): set-up's objects that become garbage
during training wait until then.
"""

from __future__ import annotations

import gc
from typing import Any

import lightning as L


class GarbageCollection(L.Callback):
    """gc.freeze() when training starts; with every_n_steps, automatic collection off and gc.collect(generation)
    after every n-th optimizer step. The collector's state is put back when training ends or fails."""

    def __init__(self, every_n_steps: int | None = None, generation: int = 1) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"callbacks.gc.every_n_steps={every_n_steps!r}: a positive number of optimizer steps, "
                             "or null to leave collection automatic")
        if generation not in (0, 1, 2):
            raise ValueError(f"callbacks.gc.generation={generation!r}: Python's generations are 0, 1 and 2")
        self.every_n_steps, self.generation = every_n_steps, generation
        self._was_enabled: bool | None = None  # the collector's state before training, while ours is in force
        self._collected_at = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        gc.collect()  # what set-up left behind goes now, not into the permanent generation
        gc.freeze()
        self._was_enabled = gc.isenabled()
        if self.every_n_steps is not None:
            gc.disable()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # counts optimizer steps: the same on every micro-batch of a step
        if self.every_n_steps is not None and step % self.every_n_steps == 0 and step != self._collected_at:
            gc.collect(self.generation)
            self._collected_at = step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled is None:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
