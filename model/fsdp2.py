"""FSDP2 (torch's `fully_shard`) for the pipeline: `trainer=fsdp2`, conf/trainer/strategy/fsdp2.yaml.

One FSDP2 unit per transformer Block and one for the rest of the GPT (embeddings, final norm, head), every
parameter a DTensor sharded over the data-parallel ranks. What sets it apart from FSDP (model/distributed.py
fsdp_strategy, torch's FullyShardedDataParallel) is gradient accumulation: on every micro-batch of a step but the
last, the gradients stay unsharded and unreduced on each rank (summed in fp32, the reduce dtype) and the gathered
weights stay gathered after backward, so a step of K micro-batches reduce-scatters once, as DDP all-reduces once;
FSDP reduce-scatters every micro-batch. The price is memory between micro-batches: each rank holds the whole
fp32 gradient (4 bytes per parameter, as DDP does), and with SHARD_GRAD_OP the bf16 weights too (2 bytes).

GPT3-1.3B, 128k tokens per GPU per optimizer step (8 micro-batches), two H200s (NV18), the bare step's wall time
per step against one GPU's (bench/profile_step.py; docs/results.md section 15):

    sharding                      2 × 8k      8 × 2k
    FSDP2 SHARD_GRAD_OP           0.984       0.973
    FSDP2 FULL_SHARD              0.947       0.940
    FSDP FULL_SHARD               0.938
    DDP                           0.979       0.982

Through the pipeline (`bench/e2e.py --strategy fsdp2`, the same sharding as the first row) GPT3-1.3B runs 0.999 and
0.998 of one GPU's tokens/s, within 0.5% of the same step without Lightning around it, with Python's garbage
collector kept out of the step (recipe/garbage_collection.py; without it 0.946 and 0.934, section 16).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from model.distributed import setting_dtype
from model.gpt import Block

RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}  # fsdp.yaml's names for FSDP2's choice


def check_sharding(sharding_strategy: str) -> bool:
    """FSDP2's reshard_after_forward for fsdp.yaml's sharding_strategy name; ValueError for one FSDP2 lacks."""
    if sharding_strategy not in RESHARD_AFTER_FORWARD:
        raise ValueError(f"trainer.strategy.sharding_strategy={sharding_strategy!r}: FSDP2 runs "
                         f"{' or '.join(RESHARD_AFTER_FORWARD)}")
    return RESHARD_AFTER_FORWARD[sharding_strategy]


def shard_gpt(gpt: torch.nn.Module, mesh: Any, sharding_strategy: str, param_dtype: torch.dtype | None = None,
              reduce_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard `gpt` in place with fully_shard over `mesh` (a 1-D DeviceMesh of the data-parallel ranks): each Block,
    then the root. FULL_SHARD frees each Block's gathered weights after its forward and gathers them again for its
    backward; SHARD_GRAD_OP keeps them from forward to backward. param_dtype: the dtype weights are gathered and
    computed in (None: the parameters' own); reduce_dtype: the dtype gradients are reduce-scattered and
    accumulated in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = check_sharding(sharding_strategy)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in [m for m in gpt.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return fully_shard(gpt, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)


@contextmanager
def accumulating(gpt: torch.nn.Module) -> Iterator[None]:
    """The context of one micro-batch that is not its step's last: no reduce-scatter after its backward (the
    gradients add up unsharded) and no reshard (the next micro-batch finds the weights gathered)."""
    gpt.set_requires_gradient_sync(False)
    gpt.set_reshard_after_backward(False)
    try:
        yield
    finally:
        gpt.set_requires_gradient_sync(True)
        gpt.set_reshard_after_backward(True)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy as data parallelism alone (the whole world on its mesh's data-parallel
    dimension, tensor parallelism 1), sharding LitGPT's GPT itself (shard_gpt) before Lightning sets the optimizer
    up, and accumulating micro-batches without a reduce-scatter (accumulating). state_dict_type sharded writes a
    directory of shards (torch.distributed.checkpoint, with meta.pt); full gathers one file on rank 0, written and
    verified like every other single-file checkpoint (recipe/checkpoint_io.py)."""

    def __init__(self, sharding_strategy: str = "SHARD_GRAD_OP", state_dict_type: str = "sharded",
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"trainer.strategy.state_dict_type={state_dict_type!r}: use sharded or full")
        check_sharding(sharding_strategy)
        super().__init__(data_parallel_size=1, tensor_parallel_size=1,  # set to the world in _setup_distributed
                         save_distributed_checkpoint=state_dict_type == "sharded", **kwargs)
        self.sharding_strategy = sharding_strategy
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1

    def setup(self, trainer) -> None:
        gpt = self.lightning_module.model
        if not hasattr(gpt, "set_requires_gradient_sync"):  # a second fit() or test() finds it sharded
            shard_gpt(gpt, self.device_mesh["data_parallel"], self.sharding_strategy, self.param_dtype,
                      self.reduce_dtype)
        super().setup(trainer)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with accumulating(self.lightning_module.model):
            yield

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        from recipe.checkpoint_files import verify_or_warn

        if not Path(checkpoint_path).is_dir():  # a full checkpoint: its checksum, before torch.load reads it
            verify_or_warn(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


def fsdp2_strategy(sharding_strategy: str = "SHARD_GRAD_OP", state_dict_type: str = "sharded",
                   precision: str | None = None, param_dtype: str = "bf16", reduce_dtype: str = "fp32",
                   **kwargs: Any) -> FSDP2Strategy:
    """FSDP2Strategy from conf/trainer/strategy/fsdp2.yaml's keys. Under bf16-mixed the weights are gathered in
    param_dtype (autocast computes in bf16 anyway) and the gradients reduce-scattered and accumulated in
    reduce_dtype; other precisions keep the parameters' own dtype for both."""
    dtypes = setting_dtype("param_dtype", param_dtype), setting_dtype("reduce_dtype", reduce_dtype)  # checked always
    param, reduce = dtypes if precision == "bf16-mixed" else (None, None)
    return FSDP2Strategy(sharding_strategy, state_dict_type, param_dtype=param, reduce_dtype=reduce, **kwargs)
