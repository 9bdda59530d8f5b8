"""The run's logger: W&B online only when it can be (never a prompt or a hang), its one offline line, its close.

conf/logger/wandb.yaml reads `offline: ${wandb_offline:}`; build_logger instantiates any conf/logger option
and finish_logger closes a W&B run so its files are whole when train() returns.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig

WANDB_HOST = ("api.wandb.ai", 443)


def wandb_offline() -> bool:
    """Offline unless an API key is configured AND the W&B host answers."""
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


def build_logger(cfg: DictConfig):
    """The configured logger, or None for logger=none."""
    if not cfg.get("logger") or "_target_" not in cfg.logger:
        return None
    logger = instantiate(cfg.logger)
    if isinstance(logger, WandbLogger):
        # Lightning passes W&B's deprecated `anonymous` setting, which makes W&B warn on every run
        logger._wandb_init.pop("anonymous", None)
    return logger


def describe_logger(logger) -> str | None:
    """W&B's own notices are silenced (recipe/quiet.py): this line says where the run is (rank 0 only)."""
    if not isinstance(logger, WandbLogger) or rank_zero_only.rank != 0:
        return None
    if logger._offline:
        where = Path(os.path.relpath(Path(logger.save_dir or ".") / "wandb"))
        return (
            f"W&B offline (WANDB_MODE, no API key, or no network): the run is written under {where}/; "
            f"upload it later with `wandb sync {where}/offline-run-*`"
        )
    return f"W&B run: {logger.experiment.url}"


def finish_logger(logger, trainer, ok: bool) -> None:
    """Close the W&B run so its files are complete when train() returns (not only at interpreter exit),
    which matters to callers that train several times in one process (tests, bench/e2e.py)."""
    if not (isinstance(logger, WandbLogger) and trainer.is_global_zero and logger._experiment is not None):
        return
    import wandb

    logger.experiment.finish(exit_code=0 if ok else 1)
    # finish() ends by informing the W&B service, without waiting, and the service closes the run's .wandb log
    # after that, on its own time: a reader right after train() returned could find a header-only file.
    # teardown() waits for the service to exit, so the files are whole on return. It would end the caller's
    # other runs too, so it runs only when this was the process's last open run.
    if wandb.run is None:
        try:
            wandb.teardown()
        except SystemExit as err:  # wandb exits when its service failed; the training itself is done
            rank_zero_warn(f"W&B service exited with {err.code} while closing the run; see its debug-internal.log")
