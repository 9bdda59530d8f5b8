"""The bare loop's DDP, FSDP and FSDP2, wrapped as the pipeline's `trainer=ddp`, `fsdp` and `fsdp2` wrap the GPT: the
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
FSDP2_KWARGS = ("sharding_strategy", "param_dtype", "reduce_dtype")  # and FSDP2's
DDP_HOOK_KEYS = ("reduce_dtype", "sm_carveout", "comm_hook")  # model/allreduce.py's hook for DDP's buckets
# a strategy's settings: conf/trainer/strategy/<file>.yaml
STRATEGY_FILES = {"ddp": "data_parallel", "fsdp": "fsdp", "fsdp2": "fsdp2"}
# The settings bench/e2e.py's bare loop runs as the pipeline does; the carve-out also needs the matmuls to leave SMs
# free (model/distributed.set_sm_carveout), which bench/profile_step.py sets and the bare loop does not.
BARE_KEYS = {"ddp": (*DDP_KWARGS, "reduce_dtype", "comm_hook"), "fsdp": FSDP_KWARGS, "fsdp2": FSDP2_KWARGS}
LAUNCH_KEYS = ("_target_", "accelerator", "devices", "num_nodes", "precision")  # the trainer's, not the strategy's


def backward_sync(forward: torch.nn.Module, last: bool):
    """The context one micro-batch's forward and backward run in, as Lightning runs them when accumulating
    gradients: DDP skips its all-reduce (no_sync) on every micro-batch but the step's last, so a step of K
    micro-batches all-reduces once; FSDP (and a model with no wrapper) runs as is, FSDP reduce-scattering every
    micro-batch's gradients (Lightning's ParallelStrategy.block_backward_sync does the same). FSDP2 (fsdp2_wrap)
    accumulates as DDP does, as trainer=fsdp2 has it (model/fsdp2.py accumulating): on all but the last micro-batch
    its gradients stay unsharded and unreduced and its weights gathered, so a step reduce-scatters once."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from model.fsdp2 import accumulating

    if last:
        return contextlib.nullcontext()
    if isinstance(forward, FSDPModule):
        return accumulating(forward)
    if isinstance(forward, DistributedDataParallel):
        return forward.no_sync()
    return contextlib.nullcontext()


def shards_gradients(forward: torch.nn.Module) -> bool:
    """Whether `forward` (a wrapped GPT) leaves each rank a disjoint shard of every gradient: FSDP, FSDP2."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(forward, (FullyShardedDataParallel, FSDPModule))


def _strategy_conf(name: str) -> dict:
    return yaml.safe_load((STRATEGY_CONF / f"{name}.yaml").read_text())


def strategy_settings(name: str, keys: tuple[str, ...], overrides: dict | None = None) -> dict:
    """The values of `keys` in conf/trainer/strategy/<name>.yaml (the pipeline's defaults), `overrides` (of the
    same keys) on top."""
    conf = _strategy_conf(name)
    missing = [k for k in keys if k not in conf]
    if missing:
        raise KeyError(f"conf/trainer/strategy/{name}.yaml has no {', '.join(missing)}")
    return {**{k: conf[k] for k in keys}, **(overrides or {})}


def check_settings(strategy: str, settings: dict, bare: bool) -> None:
    """Raise ValueError unless every key of `settings` is a setting of `strategy`'s conf/trainer/strategy/ file
    and, when the bare loop runs beside the pipeline (`bare`), one the bare loop runs (BARE_KEYS)."""
    name = STRATEGY_FILES[strategy]
    known = [k for k in _strategy_conf(name) if k not in LAUNCH_KEYS]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"conf/trainer/strategy/{name}.yaml has no setting {', '.join(unknown)}; "
                         f"its settings: {', '.join(known)}")
    unrun = sorted(set(settings) - set(BARE_KEYS[strategy]))
    if bare and unrun:
        raise ValueError(f"the bare loop does not run {', '.join(unrun)} (it runs {', '.join(BARE_KEYS[strategy])}): "
                         "time it through the pipeline alone")


def ddp_wrap(local_rank: int, overrides: dict | None = None):
    """A function that wraps the GPT in DDP as trainer=ddp does: data_parallel.yaml's settings, `overrides` (of the
    same keys) on top, and model/allreduce.py's hooks: comm_hook=torch is torch's own all-reduce (a divide kernel,
    then a sum), fp32 only; comm_hook=copy_engine moves every bucket but the last on the copy engines, fp32 only.
    Call it inside the process group."""
    from torch.nn.parallel import DistributedDataParallel

    from model.allreduce import ddp_hook
    from model.distributed import DTYPES, check_comm_hook

    settings = strategy_settings("data_parallel", (*DDP_KWARGS, *DDP_HOOK_KEYS), overrides)
    reduce_dtype, sm_carveout, hook = [settings.pop(key) for key in DDP_HOOK_KEYS]
    check_comm_hook(hook, reduce_dtype, sm_carveout)
    state_and_hook = None if hook == "torch" else ddp_hook(DTYPES[reduce_dtype], sm_carveout, hook == "copy_engine",
                                                           settings["bucket_cap_mb"])

    def wrap(gpt: torch.nn.Module) -> torch.nn.Module:
        ddp = DistributedDataParallel(gpt, device_ids=[local_rank], **settings)
        if state_and_hook is not None:
            ddp.register_comm_hook(*state_and_hook)
        return ddp

    return wrap


def fsdp_wrap(local_rank: int, overrides: dict | None = None):
    """A function that wraps the GPT in FSDP as trainer=fsdp does under bf16-mixed: the pipeline's own FSDPStrategy
    (model/distributed.py fsdp_strategy with fsdp.yaml's settings, `overrides` of the same keys on top) gives the
    arguments Lightning passes to FSDP, one unit per Block, bf16 gathered weights, the original parameters kept (the
    optimizer is built on them after wrapping). Call it inside the process group."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from model.distributed import fsdp_strategy

    pipeline = fsdp_strategy(precision="bf16-mixed", **strategy_settings("fsdp", FSDP_KWARGS, overrides))

    def wrap(gpt: torch.nn.Module) -> torch.nn.Module:  # as Lightning's FSDPStrategy._setup_model
        return FullyShardedDataParallel(gpt, cpu_offload=pipeline.cpu_offload,
                                        mixed_precision=pipeline.mixed_precision_config,
                                        sharding_strategy=pipeline.sharding_strategy, device_id=local_rank,
                                        **pipeline.kwargs)

    return wrap


def fsdp2_wrap(device_type: str = "cuda", overrides: dict | None = None):
    """A function that shards the GPT with FSDP2 as trainer=fsdp2 does under bf16-mixed: the pipeline's own
    FSDP2Strategy (model/fsdp2.py fsdp2_strategy with fsdp2.yaml's settings, `overrides` of the same keys on top)
    gives the sharding and dtypes shard_gpt takes (one unit per Block, one for the rest). Call it inside the
    process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from model.fsdp2 import fsdp2_strategy, shard_gpt

    pipeline = fsdp2_strategy(precision="bf16-mixed", **strategy_settings("fsdp2", FSDP2_KWARGS, overrides))

    def wrap(gpt: torch.nn.Module) -> torch.nn.Module:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        return shard_gpt(gpt, mesh, pipeline.sharding_strategy, pipeline.param_dtype, pipeline.reduce_dtype)

    return wrap


def wrap_for(strategy: str, local_rank: int, overrides: dict | None = None):
    """ddp_wrap, fsdp_wrap or fsdp2_wrap for a strategy's name (STRATEGY_FILES), on CUDA device `local_rank`."""
    if strategy == "fsdp2":
        return fsdp2_wrap("cuda", overrides)
    return {"ddp": ddp_wrap, "fsdp": fsdp_wrap}[strategy](local_rank, overrides)
