"""model/copy_engine.py on the CPU: how a bucket is cut into chunks, the push / reduce / pull phases run rank by rank
over stand-in workspaces, and how the workspace grows and fails (the GPU run against NCCL: tests/test_allreduce.py)."""

import pytest
import torch

from model.copy_engine import ALIGN, Chunks, pull, push, reduce


class Workspaces:
    """Every rank's workspace as one CPU tensor each, filled with NaN so that a read of an unwritten slot shows."""

    def __init__(self, chunks: Chunks):
        self.slots = [torch.full((chunks.workspace_elements(),), float("nan")) for _ in range(chunks.world)]

    def buffer(self, rank: int, offset: int, numel: int) -> torch.Tensor:
        assert 0 <= offset and offset + numel <= self.slots[rank].numel()
        return self.slots[rank][offset:offset + numel]


@pytest.mark.parametrize("n, world", [(1, 2), (5, 4), (63, 2), (64, 2), (65, 3), (1000, 8), (4099, 2), (130, 3)])
def test_chunks_cover_the_bucket_once_in_aligned_slots(n, world):
    chunks = Chunks(n, world)
    assert chunks.stride % ALIGN == 0 and chunks.stride * world >= n
    covered = torch.zeros(n, dtype=torch.int64)
    for k in range(world):
        start, length = chunks.span(k)
        assert 0 <= length <= chunks.stride
        covered[start:start + length] += 1
    assert torch.equal(covered, torch.ones(n, dtype=torch.int64))
    assert chunks.workspace_elements() == (world + 1) * chunks.stride


@pytest.mark.parametrize("n, world", [(1, 2), (5, 4), (64, 2), (65, 3), (1000, 8), (4099, 2), (200, 3)])
def test_the_phases_leave_every_rank_the_mean_with_the_same_bits(n, world):
    chunks = Chunks(n, world)
    mem = Workspaces(chunks)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(world)]
    expected = torch.stack(grads).mean(dim=0)
    for rank in range(world):  # each phase on every rank, then the barrier
        push(mem, rank, grads[rank], chunks)
    for rank in range(world):
        reduce(mem, rank, chunks)
    for rank in range(world):
        pull(mem, rank, grads[rank], chunks)
    for rank in range(world):
        torch.testing.assert_close(grads[rank], expected)
        assert torch.equal(grads[rank], grads[0])  # each chunk's mean is computed once, by its owner


def test_a_rank_pushes_its_own_chunk_first_and_its_peers_in_ring_order():
    chunks = Chunks(4 * ALIGN, 4)
    writes = []

    class Recording(Workspaces):
        def buffer(self, rank, offset, numel):
            writes.append((rank, offset // chunks.stride))
            return super().buffer(rank, offset, numel)

    push(Recording(chunks), 2, torch.zeros(chunks.n), chunks)
    assert writes == [(2, 2), (3, 2), (0, 2), (1, 2)]  # (owner, inbox slot): every write lands in slot 2


class FakeStream:
    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def _on_two_ranks_without_gpus(monkeypatch, rendezvous):
    """CopyEngineAllReduce built on the CPU: a world of two, a stream that counts its synchronizations, and a
    symmetric memory whose workspaces are CPU tensors (rendezvous(tensor, group) -> handle)."""
    import types

    import model.copy_engine as copy_engine

    monkeypatch.setattr(copy_engine.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(copy_engine.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(copy_engine.dist, "group", types.SimpleNamespace(WORLD=types.SimpleNamespace(group_name="0")))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    symm_mem = types.SimpleNamespace(empty=lambda n, dtype, device: torch.empty(n, dtype=dtype), rendezvous=rendezvous)
    monkeypatch.setattr(copy_engine, "symmetric_memory", lambda: symm_mem)
    return copy_engine.CopyEngineAllReduce


def test_the_workspace_grows_in_whole_mappings_after_the_queued_copies(monkeypatch):
    from model.copy_engine import GRANULARITY

    handles = []
    mean = _on_two_ranks_without_gpus(monkeypatch, lambda t, group: handles.append(t.numel()) or object())(
        bucket_elements=25 * 2**20 // 4)
    assert handles == [GRANULARITY * 19]  # a 25 MiB bucket: two 12.5 MiB inboxes and a mean slot, 37.5 -> 38 MiB
    assert mean.stream.synchronized == 0
    mean._reserve(GRANULARITY * 19 + 1)
    assert handles[-1] == GRANULARITY * 20 and mean.stream.synchronized == 1  # the old one outlives its copies
    with pytest.raises(ValueError, match="contiguous fp32 buckets, got torch.bfloat16"):
        mean(torch.zeros(4, dtype=torch.bfloat16))


def test_a_workspace_that_cannot_be_mapped_names_the_fallback(monkeypatch):
    def no_peer_access(tensor, group):
        raise RuntimeError("CUDA driver error: peer access is not supported between these two devices")

    with pytest.raises(RuntimeError, match="needs peer access between the GPUs of one node .* use comm_hook=average"):
        _on_two_ranks_without_gpus(monkeypatch, no_peer_access)(bucket_elements=1000)
