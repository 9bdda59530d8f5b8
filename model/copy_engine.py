"""The mean of a gradient bucket over the GPUs of one node, moved by the GPUs' copy engines instead of SMs.

NCCL's all-reduce kernels hold SMs (24 CTAs on two NVLink-connected H200s) for as long as a bucket travels, and
the backward's matmuls and norms that run beside them lose those SMs (docs/results.md section 6). Here the bytes
travel as cudaMemcpy between this GPU's memory and its peers' (torch's symmetric memory maps every rank's
workspace into every rank's address space), which the copy engines carry over NVLink; SMs run only the mean
itself, one read of the bucket, and two barrier kernels of one CTA.

A bucket of n elements is cut into W chunks of `stride` elements (the last ones shorter or empty); rank k owns
chunk k. Every rank's workspace holds W inbox slots and one slot for the mean, `stride` elements each:

    push    every rank writes its chunk k into rank k's inbox slot [own rank]    (W copies, W-1 of them remote)
    barrier
    reduce  rank k averages its W inbox slots into its mean slot                  (one SM kernel)
    barrier
    pull    every rank reads chunk k's mean from rank k's mean slot               (W copies, W-1 of them remote)

Each chunk's mean is computed once, by its owner, so every rank ends with the same bits. The buckets of a step
run one after another on one stream per rank, which is why two barriers suffice: a rank pushes the next bucket
only after the second barrier, when every owner has read its inbox, and an owner overwrites its mean slot only
after the next first barrier, when every rank has pulled from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

ALIGN = 64  # elements: every chunk starts 256 bytes (fp32) apart, the alignment the copies and the mean read best
GRANULARITY = 2 << 20  # bytes: the workspace grows in steps of the driver's 2 MiB mapping granularity


@dataclass(frozen=True)
class Chunks:
    """How a bucket of n elements is cut over `world` ranks."""

    n: int
    world: int

    @property
    def stride(self) -> int:
        """Elements per chunk and per workspace slot: ceil(n / world), rounded up to ALIGN."""
        per_rank = -(-self.n // self.world)
        return -(-per_rank // ALIGN) * ALIGN

    def span(self, k: int) -> tuple[int, int]:
        """(first element, length) of chunk k in the bucket; the length is 0 past the bucket's end."""
        start = k * self.stride
        return start, max(0, min(self.stride, self.n - start))

    def workspace_elements(self) -> int:
        """W inbox slots and one mean slot."""
        return (self.world + 1) * self.stride


class Workspaces(Protocol):
    """Every rank's workspace, as views this rank can read and write."""

    def buffer(self, rank: int, offset: int, numel: int) -> torch.Tensor:
        """(numel,) elements of `rank`'s workspace from element `offset` on."""


def push(mem: Workspaces, rank: int, grads: torch.Tensor, chunks: Chunks) -> None:
    """Copy this rank's part of every chunk into its owner's inbox, at slot `rank`; the own chunk first, then
    the peers' in ring order, so that no two ranks write to the same peer at once."""
    for step in range(chunks.world):
        owner = (rank + step) % chunks.world
        start, length = chunks.span(owner)
        if length:
            mem.buffer(owner, rank * chunks.stride, length).copy_(grads[start:start + length])


def reduce(mem: Workspaces, rank: int, chunks: Chunks) -> None:
    """Average the W parts of this rank's own chunk (its inbox) into its mean slot."""
    _, length = chunks.span(rank)
    if length:
        inbox = mem.buffer(rank, 0, chunks.world * chunks.stride).view(chunks.world, chunks.stride)
        torch.mean(inbox[:, :length], dim=0, out=mem.buffer(rank, chunks.world * chunks.stride, length))


def pull(mem: Workspaces, rank: int, grads: torch.Tensor, chunks: Chunks) -> None:
    """Copy every chunk's mean from its owner's mean slot into this rank's bucket, in ring order."""
    for step in range(chunks.world):
        owner = (rank + step) % chunks.world
        start, length = chunks.span(owner)
        if length:
            grads[start:start + length].copy_(mem.buffer(owner, chunks.world * chunks.stride, length))


def symmetric_memory():
    """torch's symmetric memory (torch.distributed._symmetric_memory), imported where it is used."""
    from torch.distributed import _symmetric_memory

    return _symmetric_memory


class CopyEngineAllReduce:
    """In-place mean of fp32 buckets over the ranks of `group`, all on this node, through torch's symmetric
    memory. The copies and the mean run on a stream of their own, after the work the caller's stream has
    queued so far; the returned future completes when the bucket holds the mean."""

    def __init__(self, group: dist.ProcessGroup | None = None, bucket_elements: int = 0) -> None:
        self._symm_mem = symm_mem = symmetric_memory()
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.stream = torch.cuda.Stream()
        self._tensor: torch.Tensor | None = None  # this rank's workspace (bytes), kept alive with its mapping
        self._handle = None  # the rendezvous: every rank's workspace, barriers
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group.group_name)
        if bucket_elements:  # the workspace of a bucket this large, up front
            self._reserve(Chunks(bucket_elements, self.world).workspace_elements() * 4)

    def _reserve(self, nbytes: int) -> None:
        """A workspace of at least nbytes on every rank. A collective: every rank asks for it at the same
        bucket (DDP's buckets come in one order on every rank). The old workspace is released only after the
        stream's queued copies have used it."""
        nbytes = -(-nbytes // GRANULARITY) * GRANULARITY
        if self._tensor is not None:
            self.stream.synchronize()
        self._handle = self._tensor = None
        try:
            self._tensor = self._symm_mem.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
            self._handle = self._symm_mem.rendezvous(self._tensor, self.group)
        except RuntimeError as err:
            raise RuntimeError(
                f"trainer.strategy.comm_hook=copy_engine maps every rank's {nbytes / 2**20:.0f} MiB workspace into "
                "every other rank's GPU (torch's symmetric memory), which needs peer access between the GPUs of one "
                "node (NVLink, or PCIe with P2P); it failed here, so use comm_hook=average (NCCL): " + str(err)
            ) from err

    def buffer(self, rank: int, offset: int, numel: int) -> torch.Tensor:
        return self._handle.get_buffer(rank, (numel,), torch.float32, offset)

    def __call__(self, grads: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Replace grads, (n,) fp32 and contiguous, by its mean over the ranks; the future's value is grads."""
        if grads.dtype != torch.float32 or not grads.is_contiguous():
            raise ValueError("CopyEngineAllReduce averages contiguous fp32 buckets, got "
                             f"{grads.dtype}{'' if grads.is_contiguous() else ', not contiguous'}")
        chunks = Chunks(grads.numel(), self.world)
        nbytes = chunks.workspace_elements() * grads.element_size()
        if self._tensor is None or self._tensor.numel() < nbytes:
            self._reserve(nbytes)
        self.stream.wait_stream(torch.cuda.current_stream())
        future = torch.futures.Future(devices=[grads.device])
        with torch.cuda.stream(self.stream):
            push(self, self.rank, grads, chunks)
            self._handle.barrier()
            reduce(self, self.rank, chunks)
            self._handle.barrier()
            pull(self, self.rank, grads, chunks)
            future.set_result(grads)  # records the stream's event: DDP's wait orders its stream after it
        return future
