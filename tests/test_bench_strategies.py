"""bench/strategies.py reads the pipeline's DDP and FSDP settings from conf/trainer/strategy/, so that the bare loop
runs what `trainer=ddp` and `trainer=fsdp` build (the wrapping itself runs on GPUs, in bench/e2e.py's ranks)."""

import pytest
import torch
from hydra.utils import instantiate

import train  # noqa: F401  (registers the resolvers)
from bench import strategies
from model.distributed import DTYPES
from run_overrides import compose_train


def test_the_bare_loops_ddp_settings_are_the_pipelines(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    pipeline = instantiate(compose_train("trainer=ddp").trainer.strategy)
    assert strategies.strategy_settings("data_parallel", strategies.DDP_KWARGS) == pipeline._ddp_kwargs


def test_the_bare_loops_fsdp_settings_are_the_pipelines():
    pipeline = instantiate(compose_train("trainer=fsdp").trainer.strategy)
    bare = strategies.strategy_settings("fsdp", strategies.FSDP_KWARGS)
    assert bare["sharding_strategy"] == pipeline.sharding_strategy.name
    mp = pipeline.mixed_precision_config
    assert (DTYPES[bare["param_dtype"]], DTYPES[bare["reduce_dtype"]]) == (mp.param_dtype, mp.reduce_dtype)
    assert bare["backward_prefetch"] == pipeline.kwargs["backward_prefetch"].name
    for key in ("forward_prefetch", "limit_all_gathers"):
        assert bare[key] == pipeline.kwargs[key]


def test_a_setting_the_conf_lacks_is_named():
    with pytest.raises(KeyError, match="conf/trainer/strategy/fsdp.yaml has no bucket_cap_mb"):
        strategies.strategy_settings("fsdp", ("bucket_cap_mb", "sharding_strategy"))


def test_the_bare_loops_accumulation_all_reduces_once_a_step_under_ddp(tmp_path):
    """Three micro-batches in backward_sync, as bench/e2e.py's bare step runs them: DDP's hook runs for the last
    one only (Lightning's no_sync), and the gradient it averages holds all three; a module with no DDP around it
    gets a context that changes nothing."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
        reduced = []

        def hook(state, bucket):  # counts the all-reduces; world of one: the average is the bucket itself
            reduced.append(bucket.buffer().clone())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        xs = torch.randn(3, 5, 4)
        for i, x in enumerate(xs):
            with strategies.backward_sync(ddp, last=i == len(xs) - 1):
                ddp(x).sum().backward()
        assert len(reduced) == 1
        assert torch.allclose(ddp.module.bias.grad, torch.full((2,), 15.0))  # 3 micro-batches x 5 rows each
        assert torch.allclose(ddp.module.weight.grad, xs.sum(dim=(0, 1)).expand(2, 4))
    finally:
        dist.destroy_process_group()
    plain = torch.nn.Linear(4, 2)
    with strategies.backward_sync(plain, last=False) as ctx:
        assert ctx is None


def test_the_bare_loops_fsdp_takes_the_pipelines_arguments(monkeypatch):
    """fsdp_wrap hands FSDP what the pipeline's strategy holds: one unit per Block, bf16 gathered weights and fp32
    reduction, fsdp.yaml's sharding and prefetch, the original parameters, this rank's GPU."""
    import torch.distributed.fsdp as fsdp

    from model.gpt import Block

    seen = {}
    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", lambda module, **kwargs: seen.update(kwargs) or module)
    gpt = torch.nn.Linear(2, 2)
    assert strategies.fsdp_wrap(3)(gpt) is gpt
    assert seen["device_id"] == 3 and seen["use_orig_params"] is True
    assert seen["auto_wrap_policy"]._module_classes == {Block}
    mixed = seen["mixed_precision"]
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert seen["sharding_strategy"] == fsdp.ShardingStrategy.FULL_SHARD
    assert seen["backward_prefetch"] == fsdp.BackwardPrefetch.BACKWARD_PRE
    assert (seen["forward_prefetch"], seen["limit_all_gathers"]) == (True, False)


def test_the_bare_loops_strategies_take_changed_settings(monkeypatch):
    """--strategy-set's settings reach FSDP and DDP as the pipeline's trainer.strategy.<key> overrides would."""
    import torch.distributed.fsdp as fsdp
    import torch.nn.parallel as parallel

    seen = {}
    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", lambda module, **kwargs: seen.update(kwargs) or module)
    strategies.fsdp_wrap(0, {"sharding_strategy": "SHARD_GRAD_OP", "forward_prefetch": False})(torch.nn.Linear(2, 2))
    assert seen["sharding_strategy"] == fsdp.ShardingStrategy.SHARD_GRAD_OP and seen["forward_prefetch"] is False
    assert seen["backward_prefetch"] == fsdp.BackwardPrefetch.BACKWARD_PRE  # the rest as fsdp.yaml has it

    seen.clear()
    monkeypatch.setattr(parallel, "DistributedDataParallel", lambda module, **kwargs: seen.update(kwargs) or module)
    strategies.ddp_wrap(1, {"bucket_cap_mb": 100, "comm_hook": "torch"})(torch.nn.Linear(2, 2))
    assert seen == {"device_ids": [1], "gradient_as_bucket_view": True, "broadcast_buffers": False,
                    "bucket_cap_mb": 100}


def test_a_changed_setting_is_checked_against_the_conf_and_the_bare_loop():
    strategies.check_settings("fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}, bare=True)
    strategies.check_settings("fsdp", {"state_dict_type": "full"}, bare=False)  # the pipeline's alone
    with pytest.raises(ValueError, match="fsdp.yaml has no setting bucket_cap_mb; its settings: sharding_strategy"):
        strategies.check_settings("fsdp", {"bucket_cap_mb": 100}, bare=False)
    with pytest.raises(ValueError, match="data_parallel.yaml has no setting devices"):  # the launch's, not a setting
        strategies.check_settings("ddp", {"devices": 4}, bare=False)
    with pytest.raises(ValueError, match="the bare loop does not run sm_carveout"):
        strategies.check_settings("ddp", {"sm_carveout": 4, "bucket_cap_mb": 100}, bare=True)


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_fsdp2_accumulates_unreduced_and_clips_as_the_unsharded_model(tmp_path, param_dtype):
    """The bare loop's FSDP2 (fsdp2_wrap) in a world of one on the CPU: through backward_sync, no gradient is
    reduce-scattered (a DTensor) until the step's last micro-batch; then each holds, in fp32, the sum of the three
    micro-batches' gradients of the same GPT unwrapped (exactly with fp32 weights; bf16 weights round each
    micro-batch's gradient, and FSDP2 sums them in fp32, its reduce dtype). The sharded norm is the unwrapped model's,
    and with fp32 weights the clip (through the fused AdamW's grad_scale) and the step give its weights."""
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from model.distributed import clip_grad_norm_, clip_sharded_grad_norm_
    from model.gpt import GPT, GPTConfig

    tol = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=2e-2, atol=2e-3)}[param_dtype]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=97, attention="sdpa"))
        gpt = strategies.fsdp2_wrap("cpu", {"param_dtype": param_dtype})(copy.deepcopy(ref))
        assert strategies.shards_gradients(gpt) and not strategies.shards_gradients(ref)
        x = torch.randint(0, 97, (3, 2, 17))
        for i, xb in enumerate(x):
            last = i == len(x) - 1
            with strategies.backward_sync(gpt, last=last):
                gpt(xb[:, :-1]).float().logsumexp(-1).mean().backward()
            reduced = [isinstance(p.grad, DTensor) for p in gpt.parameters()]
            assert all(reduced) if last else not any(reduced)
            ref(xb[:, :-1]).float().logsumexp(-1).mean().backward()
        for p, r in zip(gpt.parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, **tol)

        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        norm = clip_sharded_grad_norm_(gpt.parameters(), 0.5, None, opt)
        torch.testing.assert_close(norm, clip_grad_norm_(ref, None, 0.5, ref_opt), **tol)
        assert norm > 0.5  # the clip scales the step
        opt.step()
        ref_opt.step()
        if param_dtype == "fp32":  # Adam's first step is about lr × sign(grad): bf16's rounding can flip a small one
            for p, r in zip(gpt.parameters(), ref.parameters()):
                torch.testing.assert_close(p.full_tensor(), r, **tol)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="sharding_strategy='NO_SHARD': FSDP2 runs FULL_SHARD or SHARD_GRAD_OP"):
        strategies.fsdp2_wrap("cpu", {"sharding_strategy": "NO_SHARD"})
