"""Generate text from a checkpoint of train.py, configured by Hydra (conf/sample.yaml):

    python sample.py ckpt_path=<run dir>/checkpoints/last.ckpt prompt="import os" max_new_tokens=200

`sample(cfg)` loads the model the checkpoint was trained with (a file, or FSDP's directory of shards) and the
tokenizer of the data cache it was trained on, and returns the texts; `main()` is the Hydra entry that prints
them. Generation uses a key/value cache (model/generate.py); on a GPU the model runs in bf16 with
attention=flash where the kernel is built, so the prompt goes through our kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from model.checkpoint import CheckpointModelMismatch, check_model_matches, load_weights, read_metadata
from model.generate import check_room, generate
from model.gpt import GPT, ContextLengthError, GPTConfig

DEFAULT_NEW_TOKENS = 200  # max_new_tokens=null: this many, or as many as the context has room for


class SampleConfigError(ValueError):
    """A sample.py setting that cannot work; the message names the key."""


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _attention(cfg: DictConfig, head_dim: int, device: torch.device) -> str:
    """The attention=<name> given (conf/attention/), else flash on a GPU whose kernel is built and runs this head
    dim, else sdpa."""
    if cfg.get("attention"):
        return cfg.attention.name
    if device.type == "cuda":
        import flash_kernel

        if flash_kernel.is_available(head_dim, device):
            return "flash"
    return "sdpa"


def load_tokenizer(cfg: DictConfig, meta: dict[str, Any]):
    """The tokenizer.json given as `tokenizer`, else the one of the data cache the checkpoint's run trained on
    (its datamodule hyper-parameters name the cache; data/ finds and checks it)."""
    from data.tokenizer import load_tokenizer as from_file

    if cfg.tokenizer:
        if not Path(cfg.tokenizer).is_file():
            raise SampleConfigError(f"tokenizer={cfg.tokenizer} is not a file; point it at a tokenizer.json")
        return from_file(cfg.tokenizer)
    data_hparams = meta.get("datamodule_hyper_parameters")
    if not data_hparams:
        raise SampleConfigError(f"{cfg.ckpt_path} does not name its data; pass tokenizer=<its tokenizer.json>")
    from data import TokenDataModule

    datamodule = TokenDataModule(**data_hparams)
    datamodule.setup()  # finds the cache and checks it is complete; says how to prepare it if not
    return datamodule.tokenizer


def sample(cfg: DictConfig) -> list[str]:
    """The texts (prompt + continuation), one per cfg.num_samples."""
    from data.tokenizer import eot_id

    meta = read_metadata(cfg.ckpt_path)
    saved = dict(meta["hyper_parameters"]["model"])
    if cfg.get("model"):  # a preset the checkpoint must be; data and context size come from the checkpoint
        configured = {"vocab_size": saved["vocab_size"], "seq_len": saved["seq_len"], **OmegaConf.to_container(cfg.model)}
        check_model_matches(saved, configured, cfg.ckpt_path)
    device = _device(cfg.device)
    head_dim = saved["d_model"] // saved["n_head"]
    model_cfg = GPTConfig(**{**saved, "attention": _attention(cfg, head_dim, device), "dropout": 0.0,
                             "activation_checkpointing": False})
    tokenizer = load_tokenizer(cfg, meta)
    ids = tokenizer.encode(cfg.prompt).ids or [eot_id(tokenizer)]  # an empty prompt starts a new document
    max_new_tokens = cfg.max_new_tokens
    if max_new_tokens is None:  # as many as fit, up to DEFAULT_NEW_TOKENS: a small model's context may be short
        max_new_tokens = min(DEFAULT_NEW_TOKENS, model_cfg.seq_len - len(ids))
    check_room(len(ids), max_new_tokens, model_cfg.seq_len)  # before loading the weights
    with device:  # made where it runs: no CPU init of weights the checkpoint replaces (train.py's init_device)
        model = GPT(model_cfg)
    load_weights(model, cfg.ckpt_path, meta)
    # bf16 on a GPU (the kernel's dtype), fp32 on the CPU
    model.to(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    prompt = torch.tensor([ids] * cfg.num_samples, device=device)  # (num_samples, T0)
    out = generate(model, prompt, max_new_tokens, cfg.temperature, cfg.top_k, generator)
    return [tokenizer.decode(row.tolist()) for row in out]


@hydra.main(version_base="1.3", config_path="conf", config_name="sample")
def main(cfg: DictConfig) -> None:
    try:
        texts = sample(cfg)
    except (SampleConfigError, CheckpointModelMismatch, ContextLengthError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print("\n\n-----\n\n".join(texts))


if __name__ == "__main__":
    main()
