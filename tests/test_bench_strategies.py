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
