"""Checkpoint files that survive a crash and announce damage: atomic writes and a verified sha256 (torch
only; recipe/checkpoint_io.py plugs them into Lightning).

Writing `step0000100.ckpt`:
  1. torch.save streams into `.step0000100.ckpt.tmp-<pid>` in the same directory, hashed as it is written,
     then fsync;
  2. `step0000100.ckpt.sha256` (sha256sum format, so `sha256sum -c` checks it too) is replaced atomically,
     listing the new digest and the digest of the file it replaces;
  3. the temporary file is renamed over `step0000100.ckpt` (atomic on POSIX) and the directory is fsynced.
A process killed at any point leaves the previous file whole, and it still matches its checksum file (step 2
lists both digests, so a kill between 2 and 3 is no false alarm).

Loading verifies the sha256 before torch.load, and every failure (missing, a directory, truncated, random
bytes, changed bytes) is one `CheckpointError` naming the file and the other checkpoints beside it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

CHECKSUM_SUFFIX = ".sha256"
_TMP_TAG = ".tmp-"
_READ_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


def checksum_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_CHUNK):
            digest.update(block)
    return digest.hexdigest()


class _HashingWriter:
    """A write-only file object that hashes what passes through it (torch.save writes sequentially)."""

    def __init__(self, file) -> None:
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}{_TMP_TAG}{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _listed_digests(sums: Path) -> list[str]:
    try:
        return [line.split()[0] for line in sums.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError):
        return []


def atomic_save(obj: Any, path: str | os.PathLike) -> str:
    """torch.save `obj` to `path` atomically with its checksum file (see the module docstring); returns the
    sha256 of the file."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{_TMP_TAG}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        digest = writer.digest.hexdigest()
        sums = checksum_path(path)
        previous = _listed_digests(sums)[:1] if path.is_file() else []
        _replace_text(sums, "".join(f"{d}  {path.name}\n" for d in [digest, *previous]))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return digest


def other_checkpoints(path: str | os.PathLike) -> list[str]:
    """The other checkpoints beside `path`, newest first: what the user can resume from instead."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    found = [p for p in path.parent.glob("*.ckpt") if p.name != path.name and not p.name.startswith(".")]
    return [str(p) for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]


def refuse(path: Path, what: str) -> CheckpointError:
    others = other_checkpoints(path)
    instead = f"resume from another checkpoint, e.g. ckpt_path={others[0]}" if others else "start without ckpt_path"
    return CheckpointError(f"cannot resume from ckpt_path={path}: {what}; {instead}")


def verify_or_warn(path: str | os.PathLike) -> None:
    """verify_checkpoint, with a warning (from rank 0) where the file has no checksum to verify against."""
    from lightning.pytorch.utilities import rank_zero_warn

    if not verify_checkpoint(path):
        rank_zero_warn(f"{path} has no {checksum_path(path).name} beside it: loading it unverified")


def verify_checkpoint(path: str | os.PathLike) -> bool:
    """Raise CheckpointError unless `path` is a file whose sha256 is listed in its checksum file. A file
    without a checksum file (written elsewhere) passes unverified: returns whether it was verified."""
    path = Path(path)
    if path.is_dir():
        raise refuse(path, "it is a directory, not a checkpoint file (a sharded checkpoint resumes only with the "
                            "trainer that wrote it, trainer=fsdp or fsdp2, and "
                            "trainer.strategy.state_dict_type=sharded)")
    if not path.is_file():
        raise refuse(path, "no such file")
    sums = checksum_path(path)
    if not sums.is_file():
        return False
    if sha256_file(path) not in _listed_digests(sums):
        raise refuse(path, f"its bytes do not match {sums} (the file was damaged or changed after it was written)")
    return True
