"""Throughput and MFU logging: tokens/s, TFLOP/s per GPU, MFU, step time and peak memory.

Built on Lightning's `Throughput` (rolling rates over the last `window` log points, world-size aware)
fed with our FLOP count (model/flops.py: 6·N + 12·L·d·T per token) and our peak table, because
Lightning's ThroughputMonitor synchronizes the GPU every step and knows no H200.

The GPU is synchronized only at log points (every `trainer.log_every_n_steps` optimizer steps), so
timing does not stall the CPU's run-ahead between them. Validation time is excluded from the rates.
Values go to every logger from rank 0 under perf/*; the progress bar (recipe/progress.py) shows the headline ones,
`bar_metrics`, as plain numbers: no device tensor that Lightning would read back after every batch.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.utilities import rank_zero_only

from model.flops import peak_flops

GIB = 2**30
BAR_NAMES = {"perf/tokens_per_s": "tok/s", "perf/mfu": "mfu"}  # the logged names the progress bar shows, its names


def compute_dtype(precision: str) -> torch.dtype:
    """The matmul dtype a Lightning precision string runs at."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


class PerfMonitor(L.Callback):
    def __init__(self, peak_tflops: float | None = None, window: int = 2) -> None:
        """peak_tflops overrides the device table (e.g. for a GPU it lacks, or to get MFU on a CPU)."""
        super().__init__()
        self.peak_tflops = peak_tflops
        self.window = window
        self.last_metrics: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        # None on a CPU run (a GPU host may still train on the CPU): no syncs, no memory stats then
        self.cuda_device = device if device.type == "cuda" else None
        self.device_name = torch.cuda.get_device_name(device) if self.cuda_device else device.type
        self.peak = peak_flops(self.device_name, compute_dtype(str(trainer.precision)), self.peak_tflops)
        self.world_size = trainer.world_size

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.throughput = Throughput(available_flops=self.peak, world_size=self.world_size, window_size=self.window)
        self.t0 = time.perf_counter()
        self.paused = 0.0  # seconds spent in validation, taken out of the training rates
        self.samples = self.tokens = self.flops = 0
        self.start_step = self.logged_step = trainer.global_step  # > 0 on resume
        self.logged_flops = 0
        self.logged_time: float | None = None
        if self.cuda_device:
            torch.cuda.reset_peak_memory_stats(self.cuda_device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        x = batch[0]  # (B, T)
        self.samples += x.shape[0]
        self.tokens += x.numel()
        self.flops += pl_module.flops_per_batch(x.shape[0], x.shape[1])
        step = trainer.global_step
        if step == self.logged_step or step % trainer.log_every_n_steps:
            return  # mid gradient-accumulation, or not a log point
        if self.cuda_device:
            torch.cuda.synchronize(self.cuda_device)  # time what the GPU finished, not what was queued
        pl_module.check_finite()
        elapsed = time.perf_counter() - self.t0 - self.paused
        prev_step = self.logged_step
        self.throughput.update(
            time=elapsed,
            batches=step - self.start_step,
            samples=self.samples,
            lengths=self.tokens,
            flops=self.flops - self.logged_flops,
        )
        prev_time, self.logged_time = self.logged_time, elapsed
        self.logged_flops = self.flops
        self.logged_step = step
        rates = self.throughput.compute()
        if "device/items_per_sec" not in rates:
            return  # the window is not full yet (the first interval holds compile and warm-up)
        metrics = {
            "perf/tokens_per_s": rates["device/items_per_sec"],
            "perf/tokens_per_s_total": rates["device/items_per_sec"] * self.world_size,
            "perf/tflops_per_gpu": rates["device/flops_per_sec"] / 1e12,
            "perf/step_time_s": (elapsed - prev_time) / (step - prev_step) if prev_time is not None else float("nan"),
        }
        if "device/mfu" in rates:
            metrics["perf/mfu"] = rates["device/mfu"]
        if self.cuda_device:
            metrics["perf/peak_mem_gib"] = torch.cuda.max_memory_allocated(self.cuda_device) / GIB
        self.last_metrics = metrics
        self._emit(trainer, metrics, step)

    def bar_metrics(self) -> dict[str, float]:
        """The progress bar's tokens/s and MFU at the last log point ({} before the first full window)."""
        return {bar: self.last_metrics[key] for key, bar in BAR_NAMES.items() if key in self.last_metrics}

    @rank_zero_only
    def _emit(self, trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and hasattr(self, "_val_t0"):
            self.paused += time.perf_counter() - self._val_t0
