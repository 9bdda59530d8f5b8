"""Multi-GPU strategies that need Python objects a YAML file cannot spell (classes as wrap policies)."""

from __future__ import annotations

from lightning.pytorch.strategies import FSDPStrategy

from model.gpt import Block


def fsdp_strategy(
    sharding_strategy: str = "FULL_SHARD",
    state_dict_type: str = "sharded",
    activation_checkpointing: bool = False,
    **kwargs,
) -> FSDPStrategy:
    """FSDP with one unit per transformer Block (gathered just before use, freed right after).

    Activation checkpointing here wraps each Block in FSDP's own checkpoint wrapper; leave
    model.activation_checkpointing off when using it, or blocks are recomputed twice.
    """
    return FSDPStrategy(
        auto_wrap_policy={Block},
        activation_checkpointing_policy={Block} if activation_checkpointing else None,
        sharding_strategy=sharding_strategy,
        state_dict_type=state_dict_type,
        use_orig_params=True,  # torch.compile and per-parameter weight-decay groups need the real params
        **kwargs,
    )
