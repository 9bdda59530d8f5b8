"""The overrides `make train` and `make data` run with on this machine, printed on one line:

    attention=flash       a CUDA GPU and the built kernel
    attention=sdpa        a CUDA GPU without the kernel (the reason goes to stderr)
    experiment=cpu_tiny   no CUDA GPU: a tiny GPT that trains in minutes on a few cores

    python -m recipe.default_run
"""

from __future__ import annotations

import sys

import torch

from model.attention import check_attention


def default_overrides() -> tuple[list[str], str | None]:
    """(overrides, why flash is not used or None)."""
    if not torch.cuda.is_available():
        return ["experiment=cpu_tiny"], "no CUDA GPU"
    try:
        check_attention("flash", "gpu", "bf16-mixed")  # the check train.py runs
    except ValueError as err:
        return ["attention=sdpa"], str(err)
    return ["attention=flash"], None


if __name__ == "__main__":
    overrides, why = default_overrides()
    if why:
        print(f"make: not using attention=flash: {why}", file=sys.stderr)
    print(" ".join(overrides))
