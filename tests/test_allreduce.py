"""model/allreduce.py: DDP's gradient all-reduce hooks. On the CPU with a stand-in for NCCL (the op, the
communicator, the dtype on the wire); on two GPUs against torch's own DDP all-reduce, and model/copy_engine.py's
mean against NCCL's."""

import pytest
import torch
import torch.distributed as dist

import model.allreduce as allreduce
from model.allreduce import AllReduceState, CopyEngineState, average_hook, copy_engine_hook
from two_ranks import spawn_two_ranks


class Bucket:
    """The two methods of torch's GradBucket the hook reads."""

    def __init__(self, grads: torch.Tensor, last: bool):
        self.grads, self.last = grads, last

    def buffer(self) -> torch.Tensor:
        return self.grads

    def is_last(self) -> bool:
        return self.last


@pytest.fixture
def nccl(monkeypatch):
    """dist.all_reduce as NCCL would run it between this rank and a peer holding `peer`: records each call's
    (op, group, dtype) and averages in the wire's dtype."""
    calls = []

    def all_reduce(tensor, op, group, async_op):
        assert async_op
        calls.append((op, group, tensor.dtype))
        tensor.add_(nccl.peer.to(tensor.dtype)).div_(2)
        fut = torch.futures.Future()
        fut.set_result([tensor])
        return type("Work", (), {"get_future": lambda self: fut})()

    monkeypatch.setattr(allreduce.dist, "all_reduce", all_reduce)
    nccl.calls = calls
    return nccl


def test_fp32_buckets_are_averaged_in_place_on_the_slim_communicator_but_the_last(nccl):
    slim = object()
    state = AllReduceState(dtype=torch.float32, slim=slim)
    grads = torch.tensor([1.0, 2.0, 3.0])
    nccl.peer = torch.tensor([3.0, 0.0, -3.0])
    out = average_hook(state, Bucket(grads, last=False)).wait()
    assert out is grads and torch.equal(grads, torch.tensor([2.0, 1.0, 0.0]))
    average_hook(state, Bucket(torch.zeros(3), last=True)).wait()
    assert nccl.calls == [(dist.ReduceOp.AVG, slim, torch.float32), (dist.ReduceOp.AVG, None, torch.float32)]
    average_hook(AllReduceState(), Bucket(torch.zeros(3), last=False)).wait()
    assert nccl.calls[-1][1] is None  # no carve-out: the world's communicator for every bucket


def test_bf16_wire_rounds_the_mean_once_into_the_fp32_gradients(nccl):
    grads = torch.tensor([1.0 + 2**-12, 1.0, 5.0])
    nccl.peer = torch.tensor([1.0, 3.0, 1.0 + 2**-10])
    out = average_hook(AllReduceState(dtype=torch.bfloat16), Bucket(grads, last=True)).wait()
    assert out is grads and grads.dtype == torch.float32
    assert nccl.calls == [(dist.ReduceOp.AVG, None, torch.bfloat16)]
    assert torch.equal(grads, torch.tensor([1.0, 2.0, 3.0]))  # 1 + 2^-12 and 5 + 2^-10 are below bf16's step


def test_the_copy_engine_hook_leaves_the_last_bucket_to_nccl(nccl):
    moved = []

    def copy_engines(grads):
        moved.append(grads)
        fut = torch.futures.Future()
        fut.set_result(grads)
        return fut

    state = CopyEngineState(copy_engines, last=AllReduceState())
    early, last = torch.ones(3), torch.ones(3)
    nccl.peer = torch.zeros(3)
    assert copy_engine_hook(state, Bucket(early, last=False)).wait() is early
    assert copy_engine_hook(state, Bucket(last, last=True)).wait() is last
    assert moved == [early] and nccl.calls == [(dist.ReduceOp.AVG, None, torch.float32)]
    assert torch.equal(last, torch.full((3,), 0.5))


def test_ddp_hook_builds_what_the_settings_ask_for(monkeypatch):
    slim = object()
    monkeypatch.setattr(allreduce, "slim_group", lambda ctas: slim if ctas == 4 else None)
    monkeypatch.setattr(allreduce.CopyEngineState, "for_buckets",
                        classmethod(lambda cls, mb, last: cls(copy_engines=("workspace for", mb), last=last)))
    state, hook = allreduce.ddp_hook(torch.bfloat16)
    assert hook is average_hook and state == AllReduceState(torch.bfloat16, None)
    state, hook = allreduce.ddp_hook(torch.float32, sm_carveout=4)
    assert hook is average_hook and state.slim is slim
    state, hook = allreduce.ddp_hook(torch.float32, sm_carveout=4, copy_engine=True, bucket_cap_mb=100)
    assert hook is copy_engine_hook and state.copy_engines == ("workspace for", 100)
    assert state.last == AllReduceState(torch.float32, None)  # the last bucket on the world's communicator


# --- two GPUs: the hooks against torch's own DDP all-reduce ------------------------------------------------------
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL all-reduce: needs 2 CUDA GPUs")


def _ddp_grads(rank: int, results) -> None:
    """Rank `rank` of 2: the same small GPT and per-rank batch under torch's DDP all-reduce, under average_hook
    (fp32 with a 2-CTA communicator, then bf16) and under copy_engine_hook; each run's gradients after one
    backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from model.allreduce import slim_group
    from model.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32, vocab_size=97, attention="sdpa")
    idx = torch.randint(0, 97, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    slim = slim_group(2)
    grads = {}
    for name, hook, state in (
        ("torch", None, None), ("fp32", average_hook, AllReduceState(torch.float32, slim)),
        ("bf16", average_hook, AllReduceState(torch.bfloat16)),
        ("copy_engine", copy_engine_hook, CopyEngineState.for_buckets(0.01, last=AllReduceState())),
    ):
        torch.manual_seed(0)
        model = DDP(GPT(cfg).cuda(), device_ids=[rank], gradient_as_bucket_view=True, bucket_cap_mb=0.01)
        if hook is not None:
            model.register_comm_hook(state, hook)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(idx).float().square().mean().backward()
        grads[name] = [p.grad.cpu() for p in model.parameters()]
    results[rank] = grads


@pytest.mark.gpu
@two_gpus
def test_the_hook_averages_as_torchs_ddp_does_on_two_gpus():
    results = spawn_two_ranks(_ddp_grads)
    for rank in (0, 1):
        g = results[rank]
        for ours, copied, theirs, bf16 in zip(g["fp32"], g["copy_engine"], g["torch"], g["bf16"]):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(copied, theirs, rtol=1e-6, atol=1e-9)
            assert (bf16 - theirs).norm() <= 2**-7 * theirs.norm()  # each rank's gradient and the mean rounded
    for name in ("fp32", "copy_engine"):
        for a, b in zip(results[0][name], results[1][name]):
            assert torch.equal(a, b)  # both ranks hold the same mean


SIZES = (1, 3, 64, 1000, 65_537, 2**22 + 5)  # elements: shorter than one slot, odd, aligned, several MB


def _means(rank: int, results) -> None:
    """Rank `rank` of 2: CopyEngineAllReduce and NCCL's AVG on the same per-rank vectors of each size, the
    workspace growing from the smallest to the largest; the copy engines' means and NCCL's."""
    from model.copy_engine import CopyEngineAllReduce

    mean = CopyEngineAllReduce()
    found = {}
    for n in SIZES:
        x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(1000 * rank + n))
        nccl = x.clone()
        dist.all_reduce(nccl, op=dist.ReduceOp.AVG)
        assert mean(x).wait() is x
        torch.cuda.synchronize()
        found[n] = (x.cpu(), nccl.cpu())
    results[rank] = found


@pytest.mark.gpu
@two_gpus
def test_the_copy_engines_average_as_nccl_does_on_two_gpus():
    results = spawn_two_ranks(_means)
    for n in SIZES:
        for rank in (0, 1):
            ours, theirs = results[rank][n]
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
        assert torch.equal(results[0][n][0], results[1][n][0])
