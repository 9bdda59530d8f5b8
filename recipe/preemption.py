"""Preemption: SIGTERM (sent by SLURM and Kubernetes before they kill a job), SIGINT (Ctrl-C) and SLURM's
`--signal` (SIGUSR1 by default) end a run at the next step boundary with a checkpoint and a non-zero exit.

Lightning's signal connector already catches SIGTERM: it sets `trainer.received_sigterm` and the loop raises
`SIGTERMException`, a SystemExit with status 0, without saving. `Preemption` adds what a scheduler and the user
need:
  - SIGINT, and SIGUSR1 when no SLURM auto-requeue handler owns it, raise the same flag, so Ctrl-C also lets
    the optimizer step finish instead of interrupting it halfway; a second Ctrl-C interrupts at once;
  - on the SIGTERMException it writes checkpoints/step<N>.ckpt and last.ckpt (unless step N was just saved),
    as it does when training ends between two periodic checkpoints;
  - `stopped(trainer)` turns the exception into `Preempted`, whose exit status is 128 + the signal number
    (143 for SIGTERM), so a scheduler sees a failure, not a success.
Under SLURM, Lightning's SLURMEnvironment(auto_requeue=True) (its default when it detects SLURM) saves
hpc_ckpt_<n>.ckpt on the requeue signal and requeues the job; `sbatch --signal=USR1@90` asks for it.

On several ranks every rank must stop after the same micro-batch, or one waits forever in a collective that the
others never reach. Lightning's SIGTERM handler broadcasts from inside the handler, where the broadcast pairs with
whatever collective another rank is in (a 2-rank CPU run hangs in it), and its loop broadcasts rank 0's flag and
reads it back on the host before every micro-batch (1.5-2.5 ms of idle GPU per micro-batch on GPT3-1.3B,
docs/results.md section 16). There `Preemption` takes SIGTERM too: a signal only marks the rank, and
`StepBoundaryStop`, in place of the loop's broadcast, all-reduces the marks on the first micro-batch of each
optimizer step and reads them one step later, so the host never waits for the GPU; when any rank was signalled,
every rank stops at the same step boundary, one step after the step in flight.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from recipe.checkpoint_files import checksum_path


class Preempted(RuntimeError):
    """The run stopped on a signal after a whole step; the message says where to resume from."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class Preemption(L.Callback):
    """Finish the step, checkpoint and stop on SIGTERM / SIGINT / SIGUSR1 (see the module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the signal that stopped the run (SIGTERM when Lightning saw it first)
        self.checkpoint: str | None = None
        self.ranks_agree = False  # several ranks: they stop together at a step boundary (StepBoundaryStop)

    # Installed once training starts, after Lightning registered its own handlers, which it restores (ours
    # gone with them) when fit() ends.
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signum = self.checkpoint = None
        owned = [signal.SIGINT]
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):  # else SLURM requeue handles it
            owned.append(signal.SIGUSR1)
        self.ranks_agree = dist.is_available() and dist.is_initialized() and trainer.world_size > 1
        if self.ranks_agree:
            owned.append(signal.SIGTERM)  # in place of Lightning's handler and its broadcast (see the docstring)
            loop = trainer.fit_loop.epoch_loop
            loop._broadcast_sigterm_tensor = StepBoundaryStop(trainer, lambda: self.signum is not None)
        for signum in owned:
            signal.signal(signum, lambda s, frame, trainer=trainer: self._request_stop(trainer, s))

    def _request_stop(self, trainer: L.Trainer, signum: int) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        self.signum = signum
        steps = "this step and the next (every rank stops at one step)" if self.ranks_agree else "this step"
        print(f"\n{signal.Signals(signum).name}: finishing {steps}, then saving a checkpoint and stopping "
              "(Ctrl-C again to stop at once)", flush=True)
        if not self.ranks_agree:
            # Lightning's own SIGTERM flag: its loop stops after this micro-batch (the data resume at the last
            # step boundary, data/datamodule.py)
            trainer._signal_connector.received_sigterm = True

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        self.signum = self.signum or signal.SIGTERM
        self.checkpoint = save_step(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run whose trainer.max_steps is not a multiple of ckpt_every ends between two periodic saves: its
        # last steps go into step<N>.ckpt and last.ckpt too.
        save_step(trainer)


class StepBoundaryStop:
    """The training loop's SIGTERM check on several ranks, in place of Lightning's `_broadcast_sigterm_tensor`
    (called before every micro-batch). On the first micro-batch of each optimizer step it all-reduces (max)
    whether this rank was signalled, and reads the all-reduce of the step before, which finished long ago: the
    host never waits for the GPU here. When any rank was signalled, every rank sets Lightning's flag and raises
    SIGTERMException at the same micro-batch, the step after the one in flight when the signal came. Every rank
    counts the same calls from the fit's first one, so the all-reduces pair up."""

    def __init__(self, trainer: L.Trainer, signalled: Callable[[], bool]):
        self.trainer, self.signalled = trainer, signalled
        self.every = max(1, int(trainer.accumulate_grad_batches))
        self.calls = itertools.count()
        self.flag: torch.Tensor | None = None  # the last step's reduced flag, on the host (pinned on a GPU)
        self.reduced: torch.cuda.Event | None = None  # recorded behind the flag's copy to the host (on a GPU)

    def __call__(self) -> None:
        if next(self.calls) % self.every:
            return
        if self.flag is not None:
            if self.reduced is not None:
                self.reduced.synchronize()
            if self.flag.item():
                self.trainer._signal_connector.received_sigterm = True
                raise SIGTERMException()
        device = self.trainer.strategy.root_device
        flag = torch.full((1,), int(self.signalled()), dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if device.type != "cuda":
            self.flag = flag
            return
        if self.reduced is None:  # one pinned buffer and one event, reused: last step's flag is read above first
            self.flag, self.reduced = torch.empty(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
        self.flag.copy_(flag, non_blocking=True)
        self.reduced.record()


def save_step(trainer: L.Trainer) -> str | None:
    """Write checkpoints/step<N>.ckpt for the current step (unless the checkpoint callback just did) and
    make last.ckpt the same file; returns its path (None when checkpointing is off)."""
    cb = trainer.checkpoint_callback
    if not isinstance(cb, ModelCheckpoint) or cb.dirpath is None:
        return None
    metrics = {"step": trainer.global_step, "epoch": trainer.current_epoch}
    path = cb.format_checkpoint_name(metrics)
    if getattr(cb, "_last_global_step_saved", None) != trainer.global_step or not os.path.exists(path):
        trainer.save_checkpoint(path)
        if cb.save_last and trainer.is_global_zero and os.path.isfile(path):
            link_checkpoint(path, cb.format_checkpoint_name(metrics, cb.CHECKPOINT_NAME_LAST))
        rank_zero_info(f"saved {path} at step {trainer.global_step}")
    return path


def link_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make `dst` (e.g. last.ckpt) the same file as `src`, atomically, with its checksum file: a hard link
    instead of a second write of the whole checkpoint while the job's grace period runs out."""
    src, dst = Path(src), Path(dst)
    for a, b in ((checksum_path(src), checksum_path(dst)), (src, dst)):
        tmp = b.with_name(f".{b.name}.link-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        if a.name.endswith(".sha256"):
            tmp.write_text(a.read_text().replace(f"  {src.name}\n", f"  {dst.name}\n"))
        else:
            os.link(a, tmp)
        os.replace(tmp, b)


def stopped(trainer: L.Trainer) -> Preempted:
    """The Preempted error for a fit() that ended in SIGTERMException (to raise from train())."""
    cb = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None)
    signum = (cb.signum if cb else None) or signal.SIGTERM
    name = signal.Signals(signum).name
    step = trainer.global_step
    if cb is not None and cb.checkpoint:
        return Preempted(f"stopped by {name} after step {step}; resume with ckpt_path={cb.checkpoint}", signum)
    return Preempted(f"stopped by {name} after step {step}; no checkpoint was written (checkpointing is off)", signum)
