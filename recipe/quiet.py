"""Silence the libraries' notices that do not help a user of this recipe, in one place, before they import.

train.py imports this module first. What goes, and why:
- Lightning's "💡 Tip: ... litlogger / litmodels" lines (advertising; no setting turns them off): a logging
  filter on Lightning's rank-zero logger.
- Lightning's "GPU available: ... / TPU available: ..." lines at Trainer start: the run's first line, from
  recipe/launch.py, says which devices, nodes and strategy run (a filter on the same logger).
- Lightning's "`Trainer.fit` stopped: `max_steps=N` reached": train.py's closing "done:" line follows.
- Lightning's warning on resume that the checkpoint directory changed: a resumed run writes to its own run
  directory by design.
- torch's FutureWarning that `isinstance(treespec, LeafSpec)` is deprecated, which Lightning's own pytree
  helper triggers: a warning filter for that message.
- W&B's own banners (offline notice, run summary, sync hint): WANDB_SILENT, unless the user set it.
  recipe/wandb_run.py prints the one line that matters (offline: where the run is and how to sync it;
  online: the run's URL) and drops the deprecated `anonymous` setting Lightning passes, which W&B warns of.
Set FA2GPT_VERBOSE=1 to see them all again.
"""

from __future__ import annotations

import logging
import os
import warnings

DROPPED_LINES = ("💡 Tip:", "GPU available:", "TPU available:", "HPU available:", "`Trainer.fit` stopped:")


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(DROPPED_LINES)


def silence() -> None:
    if os.environ.get("FA2GPT_VERBOSE"):
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines())


silence()
