"""What the benchmark scripts share: file names per device, and figures only where matplotlib is installed."""

from __future__ import annotations

import importlib.util
import re


def device_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (for results file names)."""
    return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def can_plot(script: str) -> bool:
    """matplotlib is optional (an offline GPU host may lack it): without it, say how to redraw the figure
    elsewhere instead of failing after the measurements."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print(f"no matplotlib here: no figure; redraw it with `python {script} --plot-only`")
    return False
