"""`PipelineProfiler`: a Lightning callback that profiles optimizer steps of `python train.py` as bench/profile_step.py
profiles its bare step, so that the two sum up alike (bench/trace.py) and a gap between the pipeline's rate and the
bare loop's shows where it goes: slower kernels, more kernels, or a GPU left idle by the host.

bench/profile_step.py --pipeline adds it to a run with `overrides`; every rank profiles, rank 0
writes `out` (JSON): bench/trace.step_summary's fields, the optimizer steps it covered and the micro-batches in them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from bench.trace import GcPauses, activities, rank_summary


def overrides(out: str | Path, warmup: int, steps: int, host: bool = False,
              trace: str | Path | None = None) -> list[str]:
    """train.py's Hydra overrides that add a PipelineProfiler writing `out`."""
    key = "+callbacks.pipeline_profiler"
    return [f"{key}._target_=bench.pipeline_profiler.PipelineProfiler", f"{key}.out={out}", f"{key}.warmup={warmup}",
            f"{key}.steps={steps}", f"{key}.host={str(host).lower()}", *([f"{key}.trace={trace}"] if trace else [])]


class PipelineProfiler(L.Callback):
    """torch.profiler (CUDA kernels; with `host` the host's ops too) over optimizer steps warmup .. warmup + steps - 1,
    from the first micro-batch of the first to the optimizer step of the last, the GPU synchronized at both ends. The
    wall time per step includes the profiler's own overhead, as bench/profile_step.py's bare step's does."""

    def __init__(self, out: str, warmup: int, steps: int, host: bool = False, trace: str | None = None) -> None:
        if warmup < 1 or steps < 1:
            raise ValueError(f"PipelineProfiler: warmup={warmup} and steps={steps} must be at least 1")
        self.out, self.warmup, self.steps, self.host = Path(out), warmup, steps, host
        self.trace = Path(trace) if trace else None  # every rank's GPU events, rank<N>.json.gz (bench/trace.py)
        self._prof: Any = None
        self._gc: GcPauses | None = None  # the collections while profiling
        self._t0 = 0.0
        self._micro_batches = 0
        self.done = False

    def _sync(self, trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._prof is None and not self.done and trainer.global_step == self.warmup:
            self._sync(trainer)
            on_gpu = trainer.strategy.root_device.type == "cuda"  # a CPU run records its ops, and no kernel
            self._prof = torch.profiler.profile(activities=activities(on_gpu, self.host))
            self._prof.__enter__()
            self._gc = GcPauses().__enter__()
            self._t0 = time.perf_counter()
        if self._prof is not None:
            self._micro_batches += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._prof is None or trainer.global_step < self.warmup + self.steps:
            return
        self._sync(trainer)
        wall_ms = (time.perf_counter() - self._t0) * 1e3 / self.steps
        self._prof.__exit__(None, None, None)
        prof, self._prof, self.done = self._prof, None, True
        self._gc.__exit__(None, None, None)
        summary = rank_summary(prof, self._gc, self.steps, wall_ms, trainer.global_rank, trainer.world_size,
                               self.host, self.trace)
        if summary is not None:
            covered = {"first_step": self.warmup, "last_step": trainer.global_step - 1,
                       "micro_batches": self._micro_batches}
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps({**covered, **summary}, indent=1) + "\n")
