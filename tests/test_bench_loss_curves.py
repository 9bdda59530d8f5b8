"""bench/loss_curves.py on CPU: the masked-vs-unmasked pair of a tiny model trains through train.py, and the
JSON and the figure land next to each other."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("bench_loss_curves", Path(__file__).resolve().parents[1] / "bench" / "loss_curves.py")
loss_curves = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loss_curves)


def short_documents(folder: Path, n: int = 120) -> Path:
    """Documents of 5 to 30 words, so that a 64-token window holds several (a stdlib file is thousands of tokens)."""
    words = "alpha beta gamma delta token window mask shard".split()
    rng = random.Random(0)
    folder.mkdir()
    for i in range(n):
        (folder / f"d{i:03d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))))
    return folder


@pytest.mark.slow
def test_document_mask_pair_on_cpu_writes_curves_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    corpus = short_documents(tmp_path / "corpus")
    out = tmp_path / "loss_curves.json"
    loss_curves.main([
        "--device", "cpu", "--vs", "data.document_mask=true", "--model", "gpt-tiny", "--attention", "sdpa",
        "--seq-len", "64", "--batch", "4", "--steps", "4", "--val-every", "2", "--out", str(out), "--overrides",
        "data=files", f"data.source=files:{corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300",
        "data.val_fraction=0.2", "data.num_workers=0",
        "data.val_batches=2", "model.n_layer=1", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
        "optim.warmup_steps=1", "optim.optimizer.lr=3e-3",
    ])
    (entry,) = json.loads(out.read_text())
    assert entry["device"] == "cpu" and entry["vs"] == "data.document_mask=true" and len(entry["val_steps"]) == 2
    base, masked = (dict(entry["curves"][name]["val/loss"]) for name in ("base", "vs"))
    assert base.keys() == masked.keys() and entry["max_abs_val_diff"] > 1e-4  # same steps, other attention
    assert (tmp_path / "loss_curves_cpu.png").stat().st_size > 1000
    run = tmp_path / "runs" / "loss_gpt-tiny_64_sdpa_vs_data.document_mask-true_vs"
    assert run.is_dir() and not (run / "checkpoints").exists()
