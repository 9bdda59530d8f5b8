"""Multi-GPU strategies built from config keys (DDP, FSDP) and the gradient clipping that FSDP's shards need.

What each setting moves per optimizer step, with N parameters and W ranks (ring collectives; an all-reduce
costs a reduce-scatter plus an all-gather, each moving (W-1)/W of its buffer through every link):

    DDP, fp32 all-reduce of the gradients            2·(W-1)/W · 4N bytes per rank
    FSDP FULL_SHARD, bf16 params, fp32 reduce         2 all-gathers of 2N + reduce-scatter of 4N: (W-1)/W · 8N
    FSDP SHARD_GRAD_OP (no re-gather in backward)     (W-1)/W · 6N

so FSDP's bytes equal DDP's; what it adds is per Block: three collectives and the Python hooks that issue
them (docs/CHANGELOG.md has the counts for GPT3-350M and 1.3B).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch.distributed.tensor import DTensor

from model.allreduce import AllReduceState, average_hook, ddp_hook
from model.gpt import Block

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def setting_dtype(key: str, name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"trainer.strategy.{key}={name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def requested_devices(devices: Any) -> int | list[int] | None:
    """What `trainer.devices` asks for per node: a count, a list of device indices, or None for "auto" / -1."""
    if isinstance(devices, str):
        devices = devices.strip()
        if devices in ("auto", "-1"):
            return None
        if "," in devices:  # "0,1": device indices
            return [int(d) for d in devices.split(",") if d.strip()]
        devices = int(devices)
    if isinstance(devices, int):
        return None if devices == -1 else devices
    return [int(d) for d in devices]  # a list of device indices


def processes_per_node(accelerator: str, devices: Any) -> int:
    """The ranks Lightning starts on a node for trainer.accelerator / trainer.devices ("auto": every GPU when
    the accelerator is a GPU, else one CPU process)."""
    wanted = requested_devices(devices)
    if isinstance(wanted, list):
        return len(wanted)
    if wanted is not None:
        return wanted
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return torch.cuda.device_count() if gpu else 1


SM_CARVEOUT_SCOPES = ("step", "backward")
COMM_HOOKS = ("average", "torch", "copy_engine")


def set_sm_carveout(sms: int, scope: str = "step") -> None:
    """Leave `sms` SMs of each GPU to the collectives that overlap compute: the persistent kernels (cuBLASLt's
    matmuls, the attention forward) launch one CTA per SM and give each CTA a fixed share of the tiles, so a CTA
    that finds its SM held by an all-reduce starts late and the whole kernel waits for it. With the carve-out
    they launch on the other SMs. 0 keeps every SM for compute.

    It sets process-wide state: cuBLASLt as the matmul backend, so that every matmul honours a carve-out, and with
    scope "step" torch's experimental matmul carve-out for every kernel from now on. With scope "backward" the
    carve-out itself is left to AveragingDDPStrategy, which holds it only while the backward runs: DDP's all-reduces
    overlap the backward alone, and a carve-out over the whole step costs the forward, the loss and the optimizer
    their SMs with no collective beside them."""
    if sms < 0:
        raise ValueError(f"trainer.strategy.sm_carveout={sms}: use 0 (off) or a number of SMs")
    if scope not in SM_CARVEOUT_SCOPES:
        raise ValueError(f"trainer.strategy.sm_carveout_scope={scope!r}: use one of {', '.join(SM_CARVEOUT_SCOPES)}")
    if sms == 0:
        return
    if scope == "step":
        torch._C._set_sm_carveout_experimental(sms)
    if torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library("cublaslt")


class AveragingDDPStrategy(DDPStrategy):
    """Lightning's DDP with model/allreduce.py's hooks: NCCL averages the gradients in `reduce_dtype`, and with
    sm_carveout > 0 every bucket but the last travels on a communicator of sm_carveout CTAs. With
    sm_carveout_scope "backward" the compute kernels leave those SMs free from pre_backward to post_backward only
    (Lightning calls both around loss.backward(), whose end waits for the last bucket's all-reduce). With
    copy_engine every bucket but the last travels on the copy engines (model/copy_engine.py) instead."""

    def __init__(self, reduce_dtype: torch.dtype, sm_carveout: int, sm_carveout_scope: str = "step",
                 copy_engine: bool = False, **ddp: Any) -> None:
        super().__init__(ddp_comm_state=AllReduceState(dtype=reduce_dtype), ddp_comm_hook=average_hook, **ddp)
        self.sm_carveout = sm_carveout
        self.sm_carveout_scope = sm_carveout_scope
        self.copy_engine = copy_engine

    def configure_ddp(self) -> None:
        if self.root_device.type == "cuda":  # the process group exists by now
            bucket_cap_mb = self._ddp_kwargs.get("bucket_cap_mb", 25)
            self._ddp_comm_state, self._ddp_comm_hook = ddp_hook(self._ddp_comm_state.dtype, self.sm_carveout,
                                                                 self.copy_engine, bucket_cap_mb)
        super().configure_ddp()

    def _backward_carveout(self) -> bool:
        return bool(self.sm_carveout) and self.sm_carveout_scope == "backward"

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._backward_carveout():
            torch._C._set_sm_carveout_experimental(self.sm_carveout)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._backward_carveout():
            torch._C._set_sm_carveout_experimental(None)
        super().post_backward(closure_loss)


def check_comm_hook(comm_hook: str, reduce_dtype: str = "fp32", sm_carveout: int = 0, num_nodes: int = 1) -> None:
    """Refuse, by name, a comm_hook with settings it cannot take (see data_parallel)."""
    if comm_hook not in COMM_HOOKS:
        raise ValueError(f"trainer.strategy.comm_hook={comm_hook!r}: use one of {', '.join(COMM_HOOKS)}")
    if comm_hook == "torch" and (reduce_dtype != "fp32" or sm_carveout):
        raise ValueError("trainer.strategy.comm_hook=torch reduces in fp32 on every SM: set reduce_dtype=fp32 "
                         "and sm_carveout=0, or use comm_hook=average")
    if comm_hook == "copy_engine" and (reduce_dtype != "fp32" or int(num_nodes) > 1):
        raise ValueError("trainer.strategy.comm_hook=copy_engine averages fp32 buckets through the peer memory of "
                         "one node's GPUs: set reduce_dtype=fp32 and num_nodes=1, or use comm_hook=average")


def data_parallel(
    accelerator: str = "auto",
    devices: Any = "auto",
    num_nodes: int = 1,
    reduce_dtype: str = "fp32",
    sm_carveout: int = 0,
    sm_carveout_scope: str = "step",
    comm_hook: str = "average",
    **ddp: Any,
) -> DDPStrategy | str:
    """DDP with these settings when the run has several ranks; "auto" (Lightning's one-device strategy, no
    wrapper and no all-reduce) when it has one.

    The gradients are averaged by NCCL in reduce_dtype (model/allreduce.py); bf16: half the bytes, and each
    averaged gradient rounded to bf16 once more per step. sm_carveout and sm_carveout_scope (the whole step or
    the backward): see set_sm_carveout and model/allreduce.py. comm_hook="torch" keeps torch's own fp32
    all-reduce (divide, then sum), the baseline the hook is measured against; it takes neither a bf16 wire nor a
    carve-out. comm_hook="copy_engine" averages every bucket but the last on the copy engines of one node's
    GPUs (model/copy_engine.py), fp32 only; a carve-out then leaves its SMs to the one-CTA barrier kernels that
    wait for the peers beside the backward, so that no persistent matmul CTA waits behind one.
    """
    check_comm_hook(comm_hook, reduce_dtype, sm_carveout, num_nodes)
    if processes_per_node(str(accelerator), devices) * int(num_nodes) <= 1:
        return "auto"
    if comm_hook == "torch":
        return DDPStrategy(**ddp)
    set_sm_carveout(int(sm_carveout), sm_carveout_scope)
    return AveragingDDPStrategy(setting_dtype("reduce_dtype", reduce_dtype), int(sm_carveout), sm_carveout_scope,
                                copy_engine=comm_hook == "copy_engine", **ddp)


def fsdp_strategy(
    sharding_strategy: str = "FULL_SHARD",
    state_dict_type: str = "sharded",
    activation_checkpointing: bool = False,
    precision: str | None = None,
    param_dtype: str = "bf16",
    reduce_dtype: str = "fp32",
    backward_prefetch: str | None = "BACKWARD_PRE",
    **kwargs: Any,
) -> FSDPStrategy:
    """FSDP with one unit per transformer Block (gathered just before use, freed right after).

    Under bf16-mixed the gathered weights are bf16 (param_dtype; autocast would cast them to bf16 anyway)
    and the gradients are reduced in fp32 (reduce_dtype), as DDP's all-reduce: Lightning's own bf16-mixed
    setting reduces them in bf16. Other precisions keep Lightning's setting for them.

    Activation checkpointing here wraps each Block in FSDP's own checkpoint wrapper; leave
    model.activation_checkpointing off when using it, or blocks are recomputed twice.
    """
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision

    mixed_precision = None
    if precision == "bf16-mixed":
        # buffer_dtype None: float buffers keep their dtype (GPT has none; a RoPE table would stay exact)
        mixed_precision = MixedPrecision(param_dtype=setting_dtype("param_dtype", param_dtype),
                                         reduce_dtype=setting_dtype("reduce_dtype", reduce_dtype))
    return FSDPStrategy(
        auto_wrap_policy={Block},
        activation_checkpointing_policy={Block} if activation_checkpointing else None,
        sharding_strategy=sharding_strategy,
        state_dict_type=state_dict_type,
        mixed_precision=mixed_precision,
        backward_prefetch=BackwardPrefetch[backward_prefetch] if backward_prefetch else None,
        use_orig_params=True,  # torch.compile and per-parameter weight-decay groups need the real params
        **kwargs,
    )


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Scale the gradients whose total 2-norm is total_norm to at most max_norm, as torch's clip_grads_with_norm_
    (a factor of min(1, max_norm / (total_norm + 1e-6)), on the device: no host sync).

    With an optimizer whose fused step takes a gradient scale (torch's fused Adam and AdamW: the attribute
    GradScaler sets, `grad_scale`), the scaling is the step's: its kernel divides each gradient by grad_scale as it
    reads it and stores the quotient back, so the gradients end the step clipped as before and the separate
    multiply, one read and one write of every gradient, is not run (GPT3-1.3B: 10.5 GB of fp32 gradients a step
    read and written, 5.2 GB of it saved). Pass an optimizer only when no GradScaler drives the step: the
    scaler sets grad_scale itself.
    """
    if optimizer is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        clip_coef = (max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0)
        optimizer.grad_scale = clip_coef.reciprocal()
        return
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)


@torch.no_grad()
def clip_sharded_grad_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Clip gradients that are sharded over `group` (each rank holds a disjoint part of every gradient) to a
    total 2-norm of max_norm; returns that norm. The norm is taken over all shards: sqrt of the sum over ranks
    of each rank's sum of squares. optimizer: see clip_grads_with_norm_.

    FSDP's clip_grad_norm_ computes the same, one norm and one multiply per parameter tensor (about 600
    kernel launches for GPT3-350M); torch's foreach kernels do it in a few.
    """
    parameters = list(parameters)
    # FSDP2's gradients are DTensors: each rank's local shard is its disjoint part
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    if grads:
        local = torch.nn.utils.get_total_norm(grads, 2.0).float()
    else:  # this rank holds no part of any gradient
        local = torch.zeros((), device=parameters[0].device if parameters else "cpu")
    squares = local.square()
    dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    clip_grads_with_norm_(parameters, max_norm, total, optimizer)
    return total


def clip_grad_norm_(module: torch.nn.Module, strategy: Any, max_norm: float,
                    optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Clip `module`'s gradients to a total 2-norm of max_norm under the run's strategy; returns the norm.
    optimizer: the step that applies the clip where it can (clip_grads_with_norm_)."""
    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import ShardingStrategy

        root = strategy.model
        if root.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            return clip_sharded_grad_norm_(module.parameters(), max_norm, root.process_group, optimizer)
        return root.clip_grad_norm_(max_norm)  # replicated or hybrid shards: FSDP knows which ranks to sum
    parameters = [p for p in module.parameters() if p.grad is not None]
    if parameters and isinstance(parameters[0].grad, DTensor):  # FSDP2 (model/fsdp2.py): shards over its mesh
        return clip_sharded_grad_norm_(parameters, max_norm, parameters[0].grad.device_mesh.get_group(), optimizer)
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)  # both run without autograd
    clip_grads_with_norm_(parameters, max_norm, total, optimizer)
    return total
