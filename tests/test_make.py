"""What a newcomer runs first: the make targets agree with each other, `make clean` keeps .venv, and a CPU
training run prints its launch lines and one W&B line, without the libraries' tips and warnings."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from run_overrides import tiny_run_overrides

REPO = Path(__file__).resolve().parents[1]


def _dry_run(*targets):
    """`make -n <targets>` with this interpreter: the commands make would run, one per line."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "-n", f"PYTHON={sys.executable}", *targets], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_data_prepares_what_make_train_trains_on():
    out = _dry_run("data", "train")
    data = next(line for line in out.splitlines() if line.startswith("run_args=") and "prepare_data" in line)
    train = next(line for line in out.splitlines() if line.startswith("run_args=") and "train.py" in line)
    assert data.split(";")[0] == train.split(";")[0]  # the same overrides, e.g. experiment=cpu_tiny on a CPU


def test_prepare_data_builds_the_cache_the_run_uses(data_cache):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from recipe.prepare_data import prepare_data

    overrides = [o for o in tiny_run_overrides(data_cache, "/unused") if o.startswith(("experiment=", "data."))]
    prepare_data(overrides)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    (cache,) = [p for p in Path(data_cache).iterdir() if p.name.startswith("stdlib-v512-")]
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    assert datamodule.cache_path == cache  # reused, not rebuilt elsewhere


def test_make_clean_keeps_the_venv(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for d in (".venv/lib/site/__pycache__", "model/__pycache__", ".cache/data"):
        (tmp_path / d).mkdir(parents=True)
    proc = subprocess.run(["make", "-f", str(REPO / "Makefile"), "clean"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / ".venv/lib/site/__pycache__").is_dir() and (tmp_path / ".cache/data").is_dir()
    assert not (tmp_path / "model/__pycache__").exists()


@pytest.mark.slow
def test_make_baseline_exports_a_commits_kernel_sources(tmp_path):
    """`make baseline REV=...` puts that commit's flash_kernel/ (what bench/device_run.sh's candidate stage builds with
    CANDIDATE_SRC) in BASELINE_DIR; without REV it says what to pass and writes nothing."""
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.skip("make and git are needed")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    out = tmp_path / "baseline"
    make = ["make", "-C", str(REPO), "baseline"]
    proc = subprocess.run([*make, "REV=HEAD", f"BASELINE_DIR={out}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    committed = subprocess.run(["git", "show", "HEAD:flash_kernel/csrc/flash_api.cpp"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout
    assert (out / "flash_kernel" / "csrc" / "flash_api.cpp").read_text() == committed
    assert (out / "flash_kernel" / "build.py").exists()
    proc = subprocess.run([*make, f"BASELINE_DIR={tmp_path / 'none'}"], capture_output=True, text=True)
    assert proc.returncode != 0 and "name the commit" in proc.stdout + proc.stderr
    assert not (tmp_path / "none").exists()


def test_a_first_cpu_run_prints_what_helps_and_nothing_else(data_cache, tmp_path):
    """`python train.py experiment=cpu_tiny` with the default W&B logger, no API key, no network setting: the
    first lines say the launch and the global batch, one line says where the offline W&B run is and how to
    sync it, and the run directory is named after what ran."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")  # no ~/.netrc: no W&B key
    overrides = [o for o in tiny_run_overrides(data_cache, tmp_path, "trainer.max_steps=2")
                 if not o.startswith(("output_dir=", "hydra.run.dir=", "logger="))]
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0] == "launch: 1 CPU process, one device"
    assert lines[1].startswith("global batch: 256 tokens per optimizer step")
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert run_dir.name.endswith("_cpu_tiny_sdpa")
    offline = [line for line in lines if "W&B" in line]
    assert len(offline) == 1 and "offline" in offline[0] and "wandb sync" in offline[0]
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    assert str(run.relative_to(tmp_path).parent) in offline[0]
    output = proc.stdout + proc.stderr
    for noise in ("Tip:", "LeafSpec", "anonymous", "wandb:", "TPU available", "dirpath has changed"):
        assert noise not in output, noise


def test_make_train_picks_flash_only_where_its_check_passes(monkeypatch):
    import torch

    from recipe import default_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_run.default_overrides() == (["experiment=cpu_tiny"], "no CUDA GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(default_run, "check_attention", lambda *args: None)
    assert default_run.default_overrides() == (["attention=flash"], None)

    def refuse(*args):
        raise ValueError("attention=flash needs the compiled kernel (test)")

    monkeypatch.setattr(default_run, "check_attention", refuse)
    overrides, why = default_run.default_overrides()
    assert overrides == ["attention=sdpa"] and "compiled kernel" in why
