"""The multi-GPU strategies' settings (model/distributed.py, conf/trainer/strategy/) and the sharded gradient
clipping, on the CPU: the strategies are built, not launched (tests/test_launch.py launches them)."""

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

import model.distributed as distributed
import train  # noqa: F401  (registers the resolvers)
from model.allreduce import average_hook
from model.distributed import (clip_grad_norm_, clip_sharded_grad_norm_, data_parallel, fsdp_strategy,
                               processes_per_node)
from model.gpt import LayerNorm, RMSNorm
from run_overrides import compose_train
from two_ranks import spawn_two_ranks


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


@pytest.mark.parametrize(
    "accelerator, devices, visible, expected",
    [("auto", "auto", 8, 8), ("auto", "auto", 0, 1), ("gpu", -1, 4, 4), ("cpu", "auto", 8, 1), ("gpu", "0,1", 8, 2),
     ("gpu", [2, 3, 5], 8, 3), ("cuda", "2", 8, 2), ("cpu", 2, 0, 2), ("gpu", 1, 8, 1)],
)
def test_processes_per_node_follow_lightnings_reading_of_devices(gpus, accelerator, devices, visible, expected):
    gpus(visible)
    assert processes_per_node(accelerator, devices) == expected


def test_default_trainer_is_ddp_on_several_ranks_and_no_wrapper_on_one(gpus):
    gpus(2)
    strategy = instantiate(compose_train().trainer.strategy)  # the plain launch on a node of 2 GPUs
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_kwargs == {"gradient_as_bucket_view": True, "broadcast_buffers": False, "bucket_cap_mb": 25}
    assert strategy._ddp_comm_hook is average_hook and strategy._ddp_comm_state.dtype == torch.float32
    assert strategy.sm_carveout == 0
    assert instantiate(compose_train("trainer.devices=1").trainer.strategy) == "auto"
    assert instantiate(compose_train("trainer=gpu").trainer.strategy) == "auto"
    assert instantiate(compose_train("trainer.devices=1", "trainer.num_nodes=2").trainer.strategy)._ddp_kwargs
    gpus(0)
    assert instantiate(compose_train().trainer.strategy) == "auto"  # a CPU machine: one process


def test_ddp_reduces_in_bf16_only_when_asked(gpus):
    gpus(2)
    strategy = instantiate(compose_train("trainer=ddp", "trainer.strategy.reduce_dtype=bf16").trainer.strategy)
    assert strategy._ddp_comm_hook is average_hook and strategy._ddp_comm_state.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="trainer.strategy.reduce_dtype='fp16'"):
        data_parallel(devices=2, reduce_dtype="fp16")


def test_torch_hook_is_lightnings_plain_ddp_and_refuses_what_it_cannot_do(gpus):
    gpus(2)
    strategy = instantiate(compose_train("trainer=ddp", "trainer.strategy.comm_hook=torch").trainer.strategy)
    assert type(strategy) is DDPStrategy and strategy._ddp_comm_hook is None
    assert strategy._ddp_kwargs == {"gradient_as_bucket_view": True, "broadcast_buffers": False, "bucket_cap_mb": 25}
    for bad in ({"reduce_dtype": "bf16"}, {"sm_carveout": 4}):
        with pytest.raises(ValueError, match="comm_hook=torch reduces in fp32 on every SM"):
            data_parallel(devices=2, comm_hook="torch", **bad)
    with pytest.raises(ValueError, match="trainer.strategy.comm_hook='nccl'"):
        data_parallel(devices=2, comm_hook="nccl")


def test_copy_engine_hook_is_asked_for_by_name_and_refuses_what_it_cannot_do(gpus):
    gpus(2)
    strategy = instantiate(compose_train("trainer=ddp", "trainer.strategy.comm_hook=copy_engine").trainer.strategy)
    assert strategy.copy_engine and strategy._ddp_comm_hook is average_hook  # replaced once the group exists
    assert strategy._ddp_kwargs == {"gradient_as_bucket_view": True, "broadcast_buffers": False, "bucket_cap_mb": 25}
    assert not instantiate(compose_train("trainer=ddp").trainer.strategy).copy_engine
    for bad in ({"reduce_dtype": "bf16"}, {"num_nodes": 2}):
        with pytest.raises(ValueError, match="comm_hook=copy_engine averages fp32 buckets through the peer memory"):
            data_parallel(devices=2, comm_hook="copy_engine", **bad)


@pytest.fixture
def carveout_state():
    """set_sm_carveout changes process-wide state: torch's matmul carve-out, restored here."""
    yield
    torch._C._set_sm_carveout_experimental(None)


def test_sm_carveout_sets_the_matmul_carveout_only_when_asked(gpus, carveout_state):
    gpus(0)  # the CPU build has no cuBLASLt to prefer: the carve-out is what this checks
    assert instantiate(compose_train("trainer=ddp", "trainer.devices=2").trainer.strategy).sm_carveout == 0
    assert torch._C._get_sm_carveout_experimental() is None
    strategy = data_parallel(accelerator="cpu", devices=2, sm_carveout=8)
    assert strategy.sm_carveout == 8 and "sm_carveout" not in strategy._ddp_kwargs
    assert torch._C._get_sm_carveout_experimental() == 8
    assert data_parallel(accelerator="cpu", devices=1, sm_carveout=8) == "auto"  # one rank: nothing to overlap
    with pytest.raises(ValueError, match="trainer.strategy.sm_carveout=-1"):
        data_parallel(accelerator="cpu", devices=2, sm_carveout=-1)


def test_backward_scoped_carveout_holds_only_between_pre_and_post_backward(gpus, carveout_state):
    """sm_carveout_scope=backward: no carve-out when the strategy is built (the forward runs on every SM), the carve-out
    from pre_backward to post_backward, none after; the step scope keeps it through both hooks."""
    gpus(0)
    strategy = instantiate(compose_train("trainer=ddp", "trainer.devices=2", "trainer.strategy.sm_carveout=4",
                                         "trainer.strategy.sm_carveout_scope=backward").trainer.strategy)
    assert (strategy.sm_carveout, strategy.sm_carveout_scope) == (4, "backward")
    assert "sm_carveout_scope" not in strategy._ddp_kwargs
    loss = torch.zeros(())
    for _ in range(2):  # every step
        assert torch._C._get_sm_carveout_experimental() is None
        strategy.pre_backward(loss)
        assert torch._C._get_sm_carveout_experimental() == 4
        strategy.post_backward(loss)
        assert torch._C._get_sm_carveout_experimental() is None
    step = data_parallel(accelerator="cpu", devices=2, sm_carveout=4)
    step.pre_backward(loss)
    step.post_backward(loss)
    assert torch._C._get_sm_carveout_experimental() == 4
    with pytest.raises(ValueError, match="trainer.strategy.sm_carveout_scope='forward'"):
        data_parallel(accelerator="cpu", devices=2, sm_carveout=4, sm_carveout_scope="forward")


def test_fsdp_gathers_bf16_weights_and_reduces_fp32_gradients():
    from torch.distributed.fsdp import BackwardPrefetch

    strategy = instantiate(compose_train("trainer=fsdp").trainer.strategy)
    assert isinstance(strategy, FSDPStrategy)
    mp = strategy.mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.bfloat16, torch.float32, None)
    assert strategy.kwargs["limit_all_gathers"] is False and strategy.kwargs["forward_prefetch"] is True
    assert strategy.kwargs["backward_prefetch"] is BackwardPrefetch.BACKWARD_PRE
    assert strategy.kwargs["use_orig_params"] is True and strategy._state_dict_type == "sharded"
    bf16 = instantiate(compose_train("trainer=fsdp", "trainer.strategy.reduce_dtype=bf16").trainer.strategy)
    assert bf16.mixed_precision_config.reduce_dtype == torch.bfloat16
    # another precision keeps Lightning's own setting for it (the precision plugin's)
    assert fsdp_strategy(precision="32-true").mixed_precision is None
    with pytest.raises(ValueError, match="trainer.strategy.param_dtype='float16'"):
        fsdp_strategy(precision="bf16-mixed", param_dtype="float16")


def _params(seed, shapes=((5, 3), (7,), (2, 2))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return params


def test_sharded_clip_matches_torch_clip_of_the_whole(monkeypatch):
    """Two ranks, each holding a disjoint half of every gradient (as FSDP's flat shards): each gets the whole
    gradient's norm and scales its half as torch's clip_grad_norm_ scales the whole."""
    whole = _params(0)
    flat = torch.cat([p.grad.flatten() for p in whole])
    halves = flat.chunk(2)
    shards = [[torch.nn.Parameter(torch.zeros(len(h)))] for h in halves]
    for shard, half in zip(shards, halves):
        shard[0].grad = half.clone()
    squares = [h.square().sum() for h in halves]  # what the other rank contributes to the all-reduce
    norms = []
    for rank, shard in enumerate(shards):
        monkeypatch.setattr(distributed.dist, "all_reduce", lambda t, group=None, r=rank: t.add_(squares[1 - r]))
        norms.append(clip_sharded_grad_norm_(shard, max_norm=1.0))
    expected = torch.nn.utils.clip_grad_norm_(whole, max_norm=1.0)
    assert norms[0] == pytest.approx(expected.item(), rel=1e-6) and norms[1] == pytest.approx(expected.item(), rel=1e-6)
    clipped = torch.cat([p.grad.flatten() for p in whole])
    torch.testing.assert_close(torch.cat([s[0].grad for s in shards]), clipped)


def test_sharded_clip_of_a_rank_without_gradients(monkeypatch):
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda t, group=None: t.add_(25.0))
    params = [torch.nn.Parameter(torch.zeros(3))]  # no .grad: this rank holds no part of it
    assert clip_sharded_grad_norm_(params, max_norm=1.0).item() == pytest.approx(5.0)


@pytest.mark.parametrize("max_norm", [1.0, 1e3])  # clipped, and a norm under the limit (the factor is 1)
def test_fused_adamw_applies_the_clip_with_the_same_step(max_norm):
    """Handed the optimizer, the clip leaves the gradients to the fused AdamW step (grad_scale) and the step ends with
    the parameters, moments and gradients that clipping in place, then stepping gives. (torch's CPU fused AdamW
    takes grad_scale as its CUDA kernel does.)"""
    def run(fold):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=True)
        norms = []
        for _ in range(3):
            model(torch.randn(5, 8)).square().sum().mul(10).backward()
            norms.append(clip_grad_norm_(model, None, max_norm, opt if fold else None))
            assert (getattr(opt, "grad_scale", None) is not None) == fold
            opt.step()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.zero_grad()
        return norms, list(model.parameters()), grads, opt.state_dict()["state"]

    (norms, params, grads, state), (norms_f, params_f, grads_f, state_f) = run(False), run(True)
    assert max(n.item() for n in norms) > 1.0  # the clipped case clips
    torch.testing.assert_close(norms_f, norms, rtol=1e-6, atol=0)  # the steps before differ by rounding
    torch.testing.assert_close(params_f, params, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads_f, grads, rtol=1e-6, atol=1e-7)
    for i in state:
        torch.testing.assert_close(state_f[i], state[i], rtol=1e-6, atol=1e-7)


def test_an_optimizer_without_a_gradient_scale_is_clipped_in_place():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no fused step to take grad_scale
    model(torch.ones(2, 4)).sum().mul(100).backward()
    norm = clip_grad_norm_(model, None, 1.0, opt)
    assert norm > 1.0 and not hasattr(opt, "grad_scale")
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("norm_cls", [LayerNorm, RMSNorm])
def test_norm_writes_bf16_under_autocast_whatever_the_weights_dtype(norm_cls):
    """FSDP gathers bf16 weights; autocast would still run the norm in fp32 and write fp32 (two more passes over
    the activation). The output equals the fp32-weight path's, as DDP computes it."""
    torch.manual_seed(0)
    fp32 = norm_cls(64)
    with torch.no_grad():
        fp32.weight.normal_()
    bf16 = norm_cls(64).to(torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fp32(x), bf16(x)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a, b)
    assert bf16(x).dtype == torch.bfloat16  # outside autocast: nn.LayerNorm / nn.RMSNorm itself


# --- two GPUs: the sharded clip on FSDP's own shards ------------------------------------------------------------
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="FSDP shards: needs 2 CUDA GPUs"
)


def _clip_on_fsdp_shards(rank: int, results) -> None:
    """Rank `rank` of 2: a GPT with one FSDP unit per Block (as trainer=fsdp wraps it), one backward in bf16
    autocast, then FSDP's clip_grad_norm_ and ours on copies of the same sharded gradients."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from model.gpt import GPT, Block, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, n_head=2, d_model=64, seq_len=32, vocab_size=97, attention="sdpa")
    model = FSDP(GPT(cfg), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=rank,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    idx = torch.randint(0, 97, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(idx).float().square().mean().backward()
    params = list(model.parameters())
    saved = [None if p.grad is None else p.grad.clone() for p in params]
    theirs = model.clip_grad_norm_(1e-3)
    clipped_theirs = [None if p.grad is None else p.grad.clone() for p in params]
    for p, g in zip(params, saved):
        p.grad = g
    ours = clip_sharded_grad_norm_(params, 1e-3, model.process_group)
    same = all((a is None and b is None) or torch.allclose(a, b, rtol=1e-5, atol=0)
               for a, b in zip(clipped_theirs, [p.grad for p in params]))
    results[rank] = (float(theirs), float(ours), same, sum(g is not None for g in saved))


@pytest.mark.gpu
@two_gpus
def test_sharded_clip_equals_fsdps_own_on_two_gpus():
    results = spawn_two_ranks(_clip_on_fsdp_shards)
    for rank in (0, 1):
        theirs, ours, same, with_grads = results[rank]
        assert ours == pytest.approx(theirs, rel=1e-5) and theirs > 1e-3  # the clip acted
        assert same, f"rank {rank}: the clipped shards differ"
        assert with_grads > 0
