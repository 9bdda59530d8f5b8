"""Checks that run before the first step, so a run fails in seconds instead of at its first checkpoint:
the run directory is writable (output_dir, and hydra.run.dir through a Hydra callback), a plain
`python train.py` on a machine without a GPU says what it is about to do, and a GPU run whose config asks for the
GELU epilogues where they cannot run says which MLP it runs instead.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf

from recipe.checks import ConfigError


class RunDirError(ConfigError):
    """The run directory cannot be written; the message names the key that sets it."""


def check_writable(path: str | os.PathLike, key: str) -> None:
    """Create `path` if needed and write a probe file in it; raise RunDirError naming `key` otherwise."""
    path = Path(path)
    probe = path / f".write-check-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise RunDirError(
            f"{key}={path} is not a writable directory ({err.strerror or err}): checkpoints and logs go there; "
            f"set {key} to a directory you can write"
        ) from None


class RunDirCheck(HydraCallback):
    """Hydra callback (conf/train.yaml hydra.callbacks): refuse an unwritable hydra.run.dir with one line
    before Hydra itself fails creating it with a bare traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)  # the dir interpolates ${hydra:...}; Hydra sets it next anyway
        try:
            check_writable(config.hydra.run.dir, "hydra.run.dir")
        except RunDirError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)


# Matmul parameters in the blocks above which a model is GPU-sized: gpt-tiny has 0.8M, GPT3-125M 85M.
CPU_SIZED_BLOCK_PARAMS = 10_000_000


def describe_cpu_default(cfg: DictConfig) -> str | None:
    """cpu_default_hint for this process: its CUDA devices and Hydra's model choice."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    choice = HydraConfig.get().runtime.choices.get("model") if HydraConfig.initialized() else None
    return cpu_default_hint(cfg, torch.cuda.is_available(), choice)


def cpu_default_hint(cfg: DictConfig, cuda_available: bool, model_choice: str | None = None) -> str | None:
    """The line to print when a GPU-sized model is about to train on a CPU (None otherwise): a plain
    `python train.py` on a laptop starts GPT3-125M for trainer.max_steps steps."""
    from model.flops import block_matmul_params
    from model.gpt import GPTConfig

    model = GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True), vocab_size=cfg.data.vocab_size)
    block_params = block_matmul_params(model)  # what model/flops.py counts, for every model option
    on_cpu = not cuda_available or cfg.trainer.get("accelerator") == "cpu"
    if not on_cpu or block_params <= CPU_SIZED_BLOCK_PARAMS:
        return None
    name = f"model={model_choice} " if model_choice else ""
    return (
        f"training {name}({cfg.model.n_layer} layers, d_model {cfg.model.d_model}, {block_params / 1e6:.0f}M "
        f"parameters in its blocks) for trainer.max_steps={cfg.trainer.max_steps} steps on the CPU: hours or "
        "more. For a run of a few minutes use `python train.py experiment=cpu_tiny` (what `make train` runs "
        "without a GPU)"
    )


def describe_gelu_epilogue(cfg: DictConfig) -> str | None:
    """gelu_epilogue_hint for this process: whether it has a GPU, and why the epilogues cannot run here if not."""
    import torch

    from model import gelu_mlp

    if not cfg.model.get("gelu_epilogue") or not torch.cuda.is_available():
        return None
    return gelu_epilogue_hint(cfg, cuda_available=True, reason=gelu_mlp.unavailable_reason())


def gelu_epilogue_hint(cfg: DictConfig, cuda_available: bool, reason: str | None) -> str | None:
    """The line to print when a GPU run's config turns on model.gelu_epilogue (the GPT3-1.3B and 2.7B presets) but
    the epilogue matmuls cannot run here, for `reason` (None otherwise). The model then runs the MLP the other way:
    fused_bias_gelu's kernel where that is on, else unfused; on a CPU that is the expected path and says nothing."""
    on_gpu = cuda_available and cfg.trainer.get("accelerator") != "cpu"
    if not cfg.model.get("gelu_epilogue") or not on_gpu or reason is None:
        return None
    other = "fused_bias_gelu's compiled bias + GELU" if cfg.model.get("fused_bias_gelu") else "the unfused GELU"
    return f"model.gelu_epilogue=true, but {reason}: the GELU MLPs run {other} instead (model/gelu_mlp.py)"
