"""The OmegaConf resolvers conf/ uses, registered once: ${auto_precision:}, ${wandb_offline:}, ${launch_id:},
${run_name:...}, ${launch_devices:}, ${launch_nodes:}."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from recipe.launch import launch_devices, launch_id, launch_nodes, run_name
from recipe.wandb_run import wandb_offline


def auto_precision() -> str:
    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


RESOLVERS = {
    "auto_precision": auto_precision,
    "wandb_offline": wandb_offline,
    "launch_id": launch_id,
    "run_name": run_name,
    "launch_devices": launch_devices,
    "launch_nodes": launch_nodes,
}


def register_resolvers() -> None:
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
