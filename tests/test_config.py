"""Every config group option and experiment composes; presets have the GPT-3 shapes; bad names are clear."""

from pathlib import Path

import pytest
import torch
from hydra.errors import MissingConfigException
from hydra.utils import instantiate

import train  # noqa: F401  (registers the resolvers conf/ uses)
from model.gpt import GPT, GPTConfig
from run_overrides import compose_train

CONF = Path(__file__).resolve().parents[1] / "conf"



def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group", ["attention", "model", "data", "optim", "trainer", "logger", "callbacks", "experiment"]
)
def test_every_option_composes(group):
    options = _options(group)
    assert options, f"conf/{group} is empty"
    for option in options:
        cfg = compose_train(f"{group}={option}")
        assert cfg.seq_len > 0 and cfg.attention.name in ("naive", "sdpa", "flex", "flash")


def test_everyday_launch_keys():
    cfg = compose_train("attention=flash", "seq_len=8192")
    assert cfg.attention.name == "flash"
    # one knob sets the model context and the data windows, one the attention everywhere
    assert cfg.seq_len == cfg.data.seq_len == cfg.model.seq_len == 8192
    assert cfg.model.attention == "flash"


# (params excluding position embeddings, in billions) for the GPT-3 presets as this repo builds them
@pytest.mark.parametrize(
    "preset, head_dim, billions",
    [("gpt3-125m", 64, 0.124), ("gpt3-350m", 64, 0.354), ("gpt3-760m", 96, 0.755),
     ("gpt3-1.3b", 128, 1.31), ("gpt3-2.7b", 80, 2.65)],
)
def test_gpt3_presets(preset, head_dim, billions):
    cfg = compose_train(f"model={preset}")
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**{**cfg.model, "seq_len": 2048}, vocab_size=50257))
    assert gpt.cfg.head_dim == head_dim
    assert gpt.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize(
    "name, model, seq_len, batch",
    [("fa2_gpt3_1.3b_2k", "gpt3-1.3b", 2048, 8), ("fa2_gpt3_1.3b_8k", "gpt3-1.3b", 8192, 2),
     ("fa2_gpt3_2.7b_2k", "gpt3-2.7b", 2048, 8), ("fa2_gpt3_2.7b_8k", "gpt3-2.7b", 8192, 2)],
)
def test_fa2_experiments(name, model, seq_len, batch):
    cfg = compose_train(f"experiment={name}")
    assert cfg.seq_len == seq_len and cfg.data.batch_size == batch
    assert seq_len * batch == 16384  # the FA2 paper's tokens per GPU step
    assert cfg.trainer.precision == "bf16-mixed"
    preset = {**compose_train(f"model={model}").model, "seq_len": seq_len}
    assert cfg.model == preset and cfg.model.seq_len == seq_len


def test_command_line_trainer_beats_experiment_default():
    cfg = compose_train("experiment=fa2_gpt3_1.3b_8k", "trainer=ddp", "trainer.devices=8")
    assert cfg.trainer.devices == 8
    assert cfg.trainer.strategy._target_ == "model.distributed.data_parallel"  # DDP on several GPUs


def test_strategies_instantiate_on_cpu():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    assert isinstance(instantiate(compose_train("trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2").trainer.strategy),
                      DDPStrategy)
    fsdp = instantiate(compose_train("trainer=fsdp", "trainer.strategy.activation_checkpointing=true").trainer.strategy)
    assert isinstance(fsdp, FSDPStrategy)


def test_fsdp2_strategy_takes_its_settings_and_refuses_bad_ones():
    import torch

    from model.fsdp2 import FSDP2Strategy

    fsdp2 = instantiate(compose_train("trainer=fsdp2").trainer.strategy)
    assert isinstance(fsdp2, FSDP2Strategy) and fsdp2.sharding_strategy == "SHARD_GRAD_OP"
    assert (fsdp2.param_dtype, fsdp2.reduce_dtype) == (torch.bfloat16, torch.float32)  # trainer=fsdp2 is bf16-mixed
    assert fsdp2._save_distributed_checkpoint
    full = instantiate(compose_train("trainer=fsdp2", "trainer.precision=32-true",
                                     "trainer.strategy.state_dict_type=full",
                                     "trainer.strategy.sharding_strategy=FULL_SHARD").trainer.strategy)
    assert (full.param_dtype, full.reduce_dtype, full._save_distributed_checkpoint) == (None, None, False)
    for key, value, match in (("sharding_strategy", "HYBRID_SHARD", "FSDP2 runs FULL_SHARD or SHARD_GRAD_OP"),
                              ("state_dict_type", "local", "use sharded or full"),
                              ("reduce_dtype", "fp16", "reduce_dtype='fp16': use one of fp32, bf16")):
        with pytest.raises(Exception, match=match):
            instantiate(compose_train("trainer=fsdp2", f"trainer.strategy.{key}={value}").trainer.strategy)
    with pytest.raises(Exception, match="param_dtype='fp8'"):  # refused under any precision, not only where it is used
        instantiate(compose_train("trainer=fsdp2", "trainer.precision=32-true",
                                  "trainer.strategy.param_dtype=fp8").trainer.strategy)


def test_cpu_trainer_instantiates():
    trainer = instantiate(compose_train("trainer=cpu", "output_dir=/tmp/x").trainer, logger=False, callbacks=[])
    assert trainer.max_steps > 0 and trainer.precision == "32-true"


def test_unknown_option_lists_valid_ones():
    with pytest.raises(MissingConfigException, match="Available options"):
        compose_train("attention=flashy")
