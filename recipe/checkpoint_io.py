"""`VerifiedCheckpointIO`: Lightning's CheckpointIO plugin (conf/trainer/default.yaml) for single-file
checkpoints (one device, DDP, FSDP and FSDP2 with state_dict_type=full) that writes them atomically with a sha256 and
verifies it before loading (recipe/checkpoint_files.py). Sharded checkpoints (FSDP, FSDP2) are directories that
torch.distributed.checkpoint writes without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from recipe.checkpoint_files import atomic_save, checksum_path, refuse, verify_or_warn


class VerifiedCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with atomic, checksummed writes and verified, clearly failing reads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None):
        verify_or_warn(path)
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except Exception as err:
            # torch's own message suggests weights_only=False, which is no cure for a damaged file
            first_line = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
            reason = "" if "weights_only" in first_line else f" ({type(err).__name__}: {first_line[:200]})"
            raise refuse(Path(path), f"it is not a readable torch checkpoint{reason}") from None

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        checksum_path(path).unlink(missing_ok=True)
