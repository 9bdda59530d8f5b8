"""Signalling a launched training run at a known point (imported by name: tests/ is on sys.path)."""

import time
from pathlib import Path


def signal_once_exists(proc, path: Path, signum: int, timeout: float) -> None:
    """Send `signum` to `proc` once `path` exists (e.g. a checkpoint the run writes), or once the run has exited or
    `timeout` seconds have passed, whichever comes first."""
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signum)
