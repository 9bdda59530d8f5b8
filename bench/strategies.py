"""The bare loop's DDP and FSDP, wrapped as the pipeline's `trainer=ddp` and `trainer=fsdp` wrap the GPT: the
settings come from the same conf/trainer/strategy/*.yaml files, so a bare step under torchrun runs what the
pipeline runs without Lightning around it (bench/e2e.py's multi-GPU bare loop, bench/profile_step.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
STRATEGY_CONF = REPO / "conf" / "trainer" / "strategy"
DDP_KWARGS = ("gradient_as_bucket_view", "broadcast_buffers", "bucket_cap_mb")  # the keys torch's DDP takes
FSDP_KWARGS = ("sharding_strategy", "param_dtype", "reduce_dtype", "limit_all_gathers", "forward_prefetch",
               "backward_prefetch")  # the keys that shape FSDP's step (not checkpointing's)


def backward_sync(forward: torch.nn.Module, last: bool):
    """The context one micro-batch's backward runs in, as Lightning runs it when accumulating gradients: DDP skips
    its all-reduce (no_sync) on every micro-batch but the step's last, so a step of K micro-batches all-reduces
    once; FSDP (and a model with no wrapper) runs as is, FSDP reduce-scattering every micro-batch's gradients
    (Lightning's ParallelStrategy.block_backward_sync does the same)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(forward, DistributedDataParallel) and not last:
        return forward.no_sync()
    return contextlib.nullcontext()


def strategy_settings(name: str, keys: tuple[str, ...]) -> dict:
    """The values of `keys` in conf/trainer/strategy/<name>.yaml (the pipeline's defaults)."""
    conf = yaml.safe_load((STRATEGY_CONF / f"{name}.yaml").read_text())
    missing = [k for k in keys if k not in conf]
    if missing:
        raise KeyError(f"conf/trainer/strategy/{name}.yaml has no {', '.join(missing)}")
    return {k: conf[k] for k in keys}


def ddp_wrap(local_rank: int, reduce_dtype: str = "fp32", sm_carveout: int = 0, hook: str = "average"):
    """A function that wraps the GPT in DDP as trainer=ddp does (data_parallel.yaml, model/allreduce.py's hooks);
    hook="torch": torch's own all-reduce (a divide kernel, then a sum), fp32 only; hook="copy_engine": every
    bucket but the last on the copy engines, fp32 only. Call it inside the process group."""
    from torch.nn.parallel import DistributedDataParallel

    from model.allreduce import ddp_hook
    from model.distributed import DTYPES, check_comm_hook

    settings = strategy_settings("data_parallel", DDP_KWARGS)
    check_comm_hook(hook, reduce_dtype, sm_carveout)
    state_and_hook = None if hook == "torch" else ddp_hook(DTYPES[reduce_dtype], sm_carveout, hook == "copy_engine",
                                                           settings["bucket_cap_mb"])

    def wrap(gpt: torch.nn.Module) -> torch.nn.Module:
        ddp = DistributedDataParallel(gpt, device_ids=[local_rank], **settings)
        if state_and_hook is not None:
            ddp.register_comm_hook(*state_and_hook)
        return ddp

    return wrap


def fsdp_wrap(local_rank: int):
    """A function that wraps the GPT in FSDP as trainer=fsdp does under bf16-mixed (fsdp.yaml; model/distributed.py
    fsdp_strategy): one unit per Block, bf16 gathered weights, gradients reduced in reduce_dtype, the original
    parameters kept (the optimizer is built on them after wrapping). Call it inside the process group."""
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from model.distributed import DTYPES
    from model.gpt import Block

    s = strategy_settings("fsdp", FSDP_KWARGS)

    def wrap(gpt: torch.nn.Module) -> torch.nn.Module:
        return FullyShardedDataParallel(
            gpt,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy[s["sharding_strategy"]],
            mixed_precision=MixedPrecision(param_dtype=DTYPES[s["param_dtype"]],
                                           reduce_dtype=DTYPES[s["reduce_dtype"]]),
            backward_prefetch=BackwardPrefetch[s["backward_prefetch"]] if s["backward_prefetch"] else None,
            forward_prefetch=s["forward_prefetch"],
            limit_all_gathers=s["limit_all_gathers"],
            use_orig_params=True,
            device_id=local_rank,
        )

    return wrap
