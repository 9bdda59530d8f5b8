"""A trained model back from a Lightning checkpoint: its config, its weights, and whether it is the model a
config describes.

A checkpoint is a file (one process, DDP, or FSDP and FSDP2 with state_dict_type=full) or a directory of shards
(FSDP's and FSDP2's sharded state dict: torch.distributed.checkpoint files plus Lightning's meta.pt with
everything else). Both hold the LightningModule's state, whose keys are the GPT's prefixed with "model.", and
its hyper_parameters, whose "model" entry is the GPTConfig the run built (model/lit_gpt.py).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from model.gpt import GPT, GPTConfig

SHARDED_METADATA = "meta.pt"  # Lightning's non-tensor part of a sharded checkpoint directory
SHARDED_MODEL_KEYS = ("model", "state_dict")  # where a sharded directory keeps the module's tensors: FSDP, FSDP2
PREFIX = "model."  # LitGPT.model

# The fields that only change how the same weights run; every other field changes the weights or the function.
RUNTIME_FIELDS = ("attention", "dropout", "activation_checkpointing", "fp32_residual", "fused_add_norm",
                  "fused_bias_gelu", "fp32_weight_grad", "gelu_epilogue")
# The config key that sets a GPTConfig field when it is not model.<field> (train.py fills these in).
CONFIG_KEY = {"vocab_size": "data.vocab_size", "seq_len": "seq_len"}


class CheckpointModelMismatch(ValueError):
    """A checkpoint holds another model than the config describes."""


def architecture(cfg: GPTConfig) -> dict[str, Any]:
    """The fields that define the weights and the function they compute, with defaults filled in, so that two
    configs of one model compare equal however they were spelled. seq_len counts only with learned positions
    (the position embedding's size); RoPE runs at any length."""
    arch = {k: v for k, v in asdict(cfg).items() if k not in RUNTIME_FIELDS}
    arch["n_kv_head"], arch["d_ff"] = cfg.kv_heads, cfg.ffn_dim
    arch.pop("mlp_ratio")  # counted through d_ff
    if cfg.pos_emb != "learned":
        arch.pop("seq_len")
    if cfg.pos_emb != "rope":
        arch.pop("rope_base")
    return arch


def _config(model: dict[str, Any]) -> GPTConfig:
    known = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in model.items() if k in known and k not in RUNTIME_FIELDS})


def model_differences(saved: dict[str, Any], configured: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(config key, checkpoint's value, config's value) for each way the model a checkpoint was trained with
    (its hyper_parameters["model"]) and a configured one differ. Keys a config does not spell take GPTConfig's
    defaults (checkpoints from before a key existed); runtime keys (attention, dropout, ...) may differ."""
    a, b = architecture(_config(saved)), architecture(_config(configured))
    return [(CONFIG_KEY.get(k, f"model.{k}"), a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def check_model_matches(saved: dict[str, Any], configured: dict[str, Any], ckpt_path: str | Path) -> None:
    """Raise CheckpointModelMismatch naming every differing key (see model_differences)."""
    diffs = model_differences(saved, configured)
    if diffs:
        listed = "; ".join(f"{key}: {a!r} in the checkpoint, {b!r} in the config" for key, a, b in diffs)
        raise CheckpointModelMismatch(
            f"{ckpt_path} holds another model than the config: {listed}. Set these keys to the checkpoint's values "
            "(or pick the model preset it was trained with), or point ckpt_path at a checkpoint of this model"
        )


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; point ckpt_path at <run dir>/checkpoints/last.ckpt")
    if path.is_dir() and not (path / SHARDED_METADATA).is_file():
        raise ValueError(f"{path} is a directory without {SHARDED_METADATA}: not a sharded Lightning checkpoint")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The checkpoint's entries other than its tensors' values (hyper_parameters, datamodule_hyper_parameters,
    global_step, ...); for a file, its state_dict too, memory-mapped rather than read."""
    path = Path(path)
    _check_exists(path)
    file = path / SHARDED_METADATA if path.is_dir() else path
    meta = torch.load(file, map_location="cpu", mmap=not path.is_dir(), weights_only=False)  # our own run's file
    if "model" not in meta.get("hyper_parameters", {}):
        raise ValueError(f"{path} is not a checkpoint of train.py (its hyper_parameters lack the model config)")
    return meta


def load_weights(model: GPT, path: str | Path, meta: dict[str, Any] | None = None) -> None:
    """Load the checkpoint's GPT weights into `model` (built with the checkpoint's config)."""
    path = Path(path)
    if not path.is_dir():
        state = (meta or read_metadata(path))["state_dict"]
        model.load_state_dict({k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)})
        return
    from torch.distributed.checkpoint import FileSystemReader, load

    # torch.distributed.checkpoint fills the tensors it is given, in one process as well: only the model's
    # (Lightning stores the optimizer's beside them), and only names the shards hold (tied weights may be one).
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    top = next((key for key in SHARDED_MODEL_KEYS if any(name.startswith(f"{key}.") for name in stored)), "model")
    wanted = {f"{PREFIX}{k}": v for k, v in model.state_dict().items() if f"{top}.{PREFIX}{k}" in stored}
    missing = {f"{PREFIX}{name}" for name, p in model.named_parameters()} - wanted.keys()  # one name per tensor
    if missing:
        raise ValueError(f"{path} lacks the weights {sorted(missing)[:4]}...: not a checkpoint of this model")
    load({top: wanted}, checkpoint_id=path, no_dist=True)
