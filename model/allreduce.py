"""DDP's gradient all-reduce as a comm hook: NCCL averages inside the reduction, and with a carve-out the buckets
that overlap backward travel on a communicator of few CTAs while the last one travels on the full one.

torch's own all-reduce divides every gradient bucket by the world size in a kernel of its own before summing:
one more read and write of all fp32 gradients per step (3.4 ms for GPT3-1.3B at 2 × 8k on an H200,
docs/results.md section 6). NCCL's AVG folds the division into the reduction. The whole step does not show the
difference (0.943 against torch's 0.942 × one GPU's tokens/s per GPU, section 7).

NCCL's all-reduce kernels take SMs (24 CTAs on two NVLink-connected H200s) for as long as the bucket travels,
and the matmuls and norms that overlap them lose those SMs. A slim communicator (NCCL's max_ctas) takes fewer
SMs for longer, which backward hides; the last bucket, ready only when backward ends (it holds the tied
embedding's gradient: the embedding lookup's backward is the last op), overlaps nothing, so it goes on the
world's communicator, at full speed.

copy_engine_hook moves every bucket but the last on the GPUs' copy engines instead (model/copy_engine.py): SMs
run only each bucket's mean and two one-CTA barriers, and the last bucket goes on NCCL at full speed as above.

The annotations stay evaluated (no `from __future__ import annotations`): DDP's register_comm_hook compares the
hook's annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] and refuses strings.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from model.copy_engine import CopyEngineAllReduce


@dataclass
class AllReduceState:
    """What average_hook needs: the dtype on the wire and the slim communicator (None: the world's for all)."""

    dtype: torch.dtype = torch.float32
    slim: dist.ProcessGroup | None = None


def slim_group(max_ctas: int) -> dist.ProcessGroup:
    """A communicator over the whole world whose collectives run on at most `max_ctas` CTAs (SMs)."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    return dist.new_group(backend="nccl", pg_options=options)


def average_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce one DDP bucket to the mean of the ranks' gradients in state.dtype (bf16: each mean is rounded
    to bf16 once on the way), on the slim communicator unless it is the last bucket of the step."""
    grads = bucket.buffer()  # (numel,) the bucket's gradients, flat, in the parameters' dtype
    wire = grads.to(state.dtype)  # the same tensor when the dtypes agree
    group = None if bucket.is_last() or state.slim is None else state.slim
    work = dist.all_reduce(wire, op=dist.ReduceOp.AVG, group=group, async_op=True)

    def back_to_grads(fut: torch.futures.Future) -> torch.Tensor:
        if wire is not grads:
            grads.copy_(fut.value()[0])
        return grads

    return work.get_future().then(back_to_grads)


@dataclass
class CopyEngineState:
    """What copy_engine_hook needs: the copy-engine all-reduce and the NCCL setting for the last bucket."""

    copy_engines: CopyEngineAllReduce
    last: AllReduceState

    @classmethod
    def for_buckets(cls, bucket_cap_mb: float, last: AllReduceState) -> "CopyEngineState":
        """The state for DDP buckets of bucket_cap_mb MiB of fp32 gradients: the workspace of a full bucket up
        front (it grows if a bucket outgrows it). A collective over the world: every rank calls it."""
        return cls(CopyEngineAllReduce(bucket_elements=int(bucket_cap_mb * 2**20) // 4), last)


def copy_engine_hook(state: CopyEngineState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket of fp32 gradients in place: on the copy engines while the backward runs, on NCCL's
    world communicator for the last bucket of the step, which nothing overlaps."""
    if bucket.is_last():
        return average_hook(state.last, bucket)
    return state.copy_engines(bucket.buffer())


def ddp_hook(reduce_dtype: torch.dtype, sm_carveout: int = 0, copy_engine: bool = False,
             bucket_cap_mb: float = 25) -> tuple[AllReduceState | CopyEngineState, Callable]:
    """(state, hook) to register on a DDP model for the strategy's settings, built inside the process group: the copy
    engines with NCCL for the last bucket, or NCCL's average on a slim communicator of sm_carveout CTAs (on the
    world's with none). A carve-out with the copy engines is the compute kernels' only: no communicator to slim."""
    if copy_engine:
        return CopyEngineState.for_buckets(bucket_cap_mb, last=AllReduceState(dtype=reduce_dtype)), copy_engine_hook
    return AllReduceState(dtype=reduce_dtype, slim=slim_group(sm_carveout) if sm_carveout else None), average_hook
