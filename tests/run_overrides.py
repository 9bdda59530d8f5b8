"""The train config as the tests compose it, and the overrides of a few-step CPU training run (imported by name:
tests/ is on sys.path)."""

from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_train(*overrides):
    """conf/train.yaml with these Hydra overrides, as train.py composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def tiny_run_overrides(data_cache, out, *extra):
    """A few-step CPU training run of experiment=cpu_tiny writing only under `out` (run dir, logs, checkpoints)."""
    return [
        "experiment=cpu_tiny",
        "seq_len=64",
        "data.batch_size=4",
        "data.num_workers=0",
        "data.vocab_size=512",
        "data.max_documents=60",
        f"data.cache_dir={data_cache}",
        "data.val_batches=2",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=2",
        "trainer.val_check_interval=3",
        "trainer.enable_model_summary=false",
        "trainer.enable_progress_bar=false",  # a bar left open by a failing run would print after pytest's summary
        "~callbacks.progress_bar",
        "peak_tflops=1.0",  # a CPU has no table entry; an override makes MFU defined
        f"output_dir={out}",
        f"hydra.run.dir={out}",  # Hydra's own files too (when run as a script), never in the repository
        *extra,
    ]
