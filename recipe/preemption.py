"""Preemption: SIGTERM (sent by SLURM and Kubernetes before they kill a job), SIGINT (Ctrl-C) and SLURM's
`--signal` (SIGUSR1 by default) end a run at the next step boundary with a checkpoint and a non-zero exit.

Lightning's signal connector already catches SIGTERM: it sets `trainer.received_sigterm` (broadcast from rank 0
at every step under DDP, so all ranks stop at the same step) and the loop raises `SIGTERMException`, a
SystemExit with status 0, without saving. `Preemption` adds what a scheduler and the user need:
  - SIGINT, and SIGUSR1 when no SLURM auto-requeue handler owns it, raise the same flag, so Ctrl-C also lets
    the optimizer step finish instead of interrupting it halfway; a second Ctrl-C interrupts at once;
  - on the SIGTERMException it writes checkpoints/step<N>.ckpt and last.ckpt (unless step N was just saved),
    as it does when training ends between two periodic checkpoints;
  - `stopped(trainer)` turns the exception into `Preempted`, whose exit status is 128 + the signal number
    (143 for SIGTERM), so a scheduler sees a failure, not a success.
Under SLURM, Lightning's SLURMEnvironment(auto_requeue=True) (its default when it detects SLURM) saves
hpc_ckpt_<n>.ckpt on the requeue signal and requeues the job; `sbatch --signal=USR1@90` asks for it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
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

    # Installed once training starts, after Lightning registered its own handlers, which it restores (ours
    # gone with them) when fit() ends.
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signum = self.checkpoint = None
        owned = [signal.SIGINT]
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):  # else SLURM requeue handles it
            owned.append(signal.SIGUSR1)
        for signum in owned:
            signal.signal(signum, lambda s, frame, trainer=trainer: self._request_stop(trainer, s))

    def _request_stop(self, trainer: L.Trainer, signum: int) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint and stopping "
              "(Ctrl-C again to stop at once)", flush=True)
        # Lightning's own SIGTERM flag: the loop then stops at the next step boundary on every rank
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
