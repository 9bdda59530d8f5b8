"""The types of the config's knobs, checked before anything is built, so that `seq_len=abc` is refused as
`seq_len` (not as `invalid literal for int()` under `full_key: data` at instantiation).

Each dataclass lists the typed keys of one part of conf/; keys not listed (targets, strategies, callbacks)
pass unchecked. OmegaConf validates by merging the composed config into the structured schema, which also
converts "8" to 8 and rejects "abc" with the key's full path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipe.checks import ConfigError


@dataclass
class DataSchema:
    source: str = "stdlib"
    seq_len: int = 1024
    seed: int = 1337
    batch_size: int = 8
    num_workers: int = 2
    vocab_size: int = 50257
    val_fraction: float = 0.05
    split_seed: int = 0
    val_batches: int = 16
    cache_dir: str = ".cache/data"
    max_documents: Optional[int] = None
    tokenize_procs: Optional[int] = None
    pin_memory: Optional[bool] = None
    document_mask: bool = False


@dataclass
class ModelSchema:
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    dropout: float = 0.0
    activation_checkpointing: bool = False
    bias: bool = True
    n_kv_head: Optional[int] = None
    pos_emb: str = "learned"
    rope_base: float = 10000.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    mlp_ratio: int = 4
    d_ff: Optional[int] = None
    fp32_residual: bool = False
    reset_position_ids: bool = True


@dataclass
class AttentionSchema:
    name: str = "sdpa"
    window: Optional[int] = None


@dataclass
class OptimizerSchema:
    lr: float = 6e-4
    eps: float = 1e-8


@dataclass
class OptimSchema:
    optimizer: OptimizerSchema = field(default_factory=OptimizerSchema)
    weight_decay: float = 0.1
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    grad_clip: Optional[float] = 1.0


@dataclass
class TrainerSchema:
    max_steps: int = 2000
    log_every_n_steps: int = 10
    accumulate_grad_batches: int = 1
    num_nodes: int = 1


@dataclass
class TrainSchema:
    seq_len: int = 1024
    seed: int = 1337
    compile: bool = False
    loss: str = "torch"
    ckpt_path: Optional[str] = None
    peak_tflops: Optional[float] = None
    global_batch_tokens: Optional[int] = None
    ckpt_every: int = 500
    output_dir: Optional[str] = None
    data: DataSchema = field(default_factory=DataSchema)
    attention: AttentionSchema = field(default_factory=AttentionSchema)
    model: ModelSchema = field(default_factory=ModelSchema)
    optim: OptimSchema = field(default_factory=OptimSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)


class ConfigTypeError(ConfigError):
    """A config value of the wrong type; the message names the key."""


def _typed_subset(node: DictConfig, schema: type) -> dict:
    """The keys of `node` that `schema` types (recursively), with interpolations resolved."""
    out = {}
    for name, f in schema.__dataclass_fields__.items():
        if name not in node:
            continue
        value = node[name]
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if nested is not None and dataclasses.is_dataclass(nested):
            out[name] = _typed_subset(value, nested) if isinstance(value, DictConfig) else value
        else:
            out[name] = value
    return out


def check_types(cfg: DictConfig) -> None:
    """Raise ConfigTypeError naming the first key whose value does not fit its type in TrainSchema."""
    try:
        OmegaConf.merge(OmegaConf.structured(TrainSchema), _typed_subset(cfg, TrainSchema))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigTypeError(f"config key {key}: {str(err.msg).splitlines()[0]}") from None
