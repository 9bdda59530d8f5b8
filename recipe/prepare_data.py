"""Prepare the data cache that `python train.py <overrides>` would use, without training:

    python -m recipe.prepare_data experiment=cpu_tiny      # what `make data` runs on a machine without a GPU

The overrides compose the same config as train.py (conf/train.yaml), so the tokenizer size, source and
cache directory are the run's own.
"""

from __future__ import annotations

import recipe.quiet  # noqa: F401  (first, as in train.py)

import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from recipe.resolvers import register_resolvers

CONF = Path(__file__).resolve().parents[1] / "conf"


def prepare_data(overrides: list[str]) -> None:
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    instantiate(cfg.data).prepare_data()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prepare_data(sys.argv[1:])
