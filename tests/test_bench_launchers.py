"""bench/launchers.py's bookkeeping on the CPU: the commands it launches, the config they compose, reading a
run's own logs, the GPU link, the table and its ratios (the launches themselves run on a node of >= 2 GPUs)."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import train  # noqa: F401  (registers the resolvers)
from run_overrides import compose_train

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_launchers", REPO / "bench" / "launchers.py")
launchers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launchers)


def test_cases_parse_and_bad_ones_say_the_form():
    assert launchers.parse_case("gpt3-1.3b:8192:2") == ("gpt3-1.3b", 8192, 2)
    with pytest.raises(Exception, match="model:seq_len:batch"):
        launchers.parse_case("gpt3-1.3b:8k")


def test_commands_are_the_users_launches():
    over = ["model=gpt3-350m"]
    assert launchers.command("python", 2, 2, over, python="python") == ["python", "train.py", "model=gpt3-350m"]
    assert launchers.command("torchrun", 2, 2, over, python="python")[:6] == [
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    assert launchers.command("fsdp", 2, 2, over, python="python")[2] == "trainer=fsdp"
    assert "trainer.devices=1" in launchers.command("1gpu", 2, 8, over, python="python")
    assert "trainer.devices=2" in launchers.command("python", 2, 8, over, python="python")  # 2 of 8 GPUs


def test_every_launch_composes_a_config(tmp_path):
    """Each launch's overrides name keys that exist (a typo would fail the run on the GPU node, not here)."""
    overrides = [o for o in launchers.run_overrides("gpt3-350m", 2048, 8, "flash", 10, 30, tmp_path)
                 if not o.startswith("hydra.")]
    for launch, (_, extra) in launchers.LAUNCHES.items():
        cfg = compose_train(*extra, *overrides)
        assert cfg.trainer.max_steps == 40 and cfg.trainer.log_every_n_steps == 10 and cfg.callbacks.perf.window == 4
        assert "checkpoint" not in cfg.callbacks and cfg.logger._target_.endswith("CSVLogger")
        assert cfg.data.batch_size == 8 and cfg.seq_len == 2048 and cfg.output_dir == str(tmp_path)
        for override in extra:
            key, value = override.split("=")
            if key == "trainer":
                assert cfg.trainer.strategy._target_ == "model.distributed.fsdp_strategy", launch
            else:
                assert str(OmegaConf.select(cfg, key)).lower() == value.lower(), launch


def _write_run(out: Path, devices, tokens_per_s=1000.0):
    """A run directory as train.py leaves it: the CSV log (Lightning's: one row per logging call, empty cells
    elsewhere), metrics.json and ranks/<rank>.json."""
    log = out / "csv" / "version_0"
    log.mkdir(parents=True)
    fields = ["epoch", "step", "train/loss", "perf/tokens_per_s", "perf/tokens_per_s_total", "perf/tflops_per_gpu",
              "perf/mfu", "perf/step_time_s", "perf/peak_mem_gib"]
    with open(log / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerow({"epoch": 0, "step": 9, "train/loss": 5.0})
        w.writerow({"step": 19, "perf/tokens_per_s": 1.0, "perf/tflops_per_gpu": 1.0})
        w.writerow({"step": 39, "perf/tokens_per_s": tokens_per_s, "perf/tokens_per_s_total": 2 * tokens_per_s,
                    "perf/tflops_per_gpu": 400.0, "perf/mfu": 0.4, "perf/step_time_s": 0.1, "perf/peak_mem_gib": 20.0})
        w.writerow({"epoch": 0, "step": 39, "train/loss": 4.0})
    (out / "metrics.json").write_text(json.dumps({"world_size": len(devices), "global_step": 40}))
    (out / "ranks").mkdir()
    for rank, device in enumerate(devices):
        (out / "ranks" / f"{rank}.json").write_text(json.dumps({"rank": rank, "device": device}))


def test_a_run_is_read_from_its_own_logs(tmp_path):
    _write_run(tmp_path, ["cuda:0", "cuda:1"])
    run = launchers.read_run(tmp_path)
    assert run["tokens_per_s"] == 1000.0 and run["tokens_per_s_total"] == 2000.0  # the last perf row
    assert run["tflops_per_gpu"] == 400.0 and run["mfu"] == 0.4 and run["step_time_s"] == 0.1
    assert run["world_size"] == 2 and run["devices"] == ["cuda:0", "cuda:1"] and run["global_step"] == 40


def test_a_log_without_a_rate_says_why(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss\n9,5.0\n")
    with pytest.raises(ValueError, match="no perf/tokens_per_s row"):
        launchers.last_perf_row(path)


TOPO = ("\x1b[4m\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tSYS\t0-15\t0\t\tN/A\nGPU1\tNV18\t X \tSYS\t0-15\t0\t\tN/A\n\nLegend:\n  X    = Self\n")


def test_interconnect_is_gpu0s_link_to_gpu1():
    assert launchers.interconnect(TOPO) == "NV18"
    assert launchers.interconnect(TOPO.replace("NV18", "PIX")) == "PIX"
    assert launchers.interconnect("\tGPU0\tCPU Affinity\nGPU0\t X \t0-15\n") is None  # one GPU


def _row(launch, tokens_per_s, status="ok", world_size=2, run="2026-11-26T00:00:00+00:00"):
    return {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 2, "interconnect": "NV18", "run": run,
            "model": "gpt3-350m", "seq_len": 2048, "batch": 8, "attention": "flash", "launch": launch, "status": status,
            "world_size": world_size, "devices": ["cuda:0", "cuda:1"][:world_size], "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tokens_per_s * 2.4e-3, "mfu": 0.4, "step_time_s": 0.1, "peak_mem_gib": 20.0}


def test_table_gives_ratios_to_the_plain_launch_and_to_one_gpu(tmp_path):
    path = tmp_path / "launchers.json"
    launchers.merge(path, [_row("1gpu", 200_000.0, world_size=1), _row("python", 190_000.0), _row("fsdp", 100.0)])
    rows = launchers.merge(path, [_row("torchrun", 188_100.0), _row("fsdp", 0.0, status="OOM")])  # replaces fsdp
    assert [r["launch"] for r in rows] == ["1gpu", "python", "torchrun", "fsdp"]
    md = launchers.table(rows)
    assert "2 × NVIDIA H100 80GB HBM3, GPU0-GPU1 link NV18" in md
    line = {cells[1].strip(): cells for cells in (l.split("|") for l in md.splitlines() if l.startswith("| "))}
    assert line["torchrun"][2].strip() == "2026-11-26 00:00"
    assert line["torchrun"][5].strip() == "188,100" and line["torchrun"][10:12] == [" 0.990 ", " 0.941 "]
    assert line["python"][10:12] == [" – ", " 0.950 "] and line["1gpu"][11] == " – "
    assert line["fsdp"][5].strip() == "OOM" and line["fsdp"][10].strip() == "–"


def test_table_gives_no_ratio_to_a_baseline_from_another_run(tmp_path):
    path = tmp_path / "launchers.json"
    launchers.merge(path, [_row("1gpu", 200_000.0, world_size=1), _row("python", 190_000.0),
                           _row("torchrun", 188_100.0)])
    later = "2026-11-28T07:33:08+00:00"  # a later run on another machine of the type: new baselines
    rows = launchers.merge(path, [_row("1gpu", 210_000.0, world_size=1, run=later), _row("python", 197_400.0, run=later)])
    line = {cells[1].strip(): cells for cells in (l.split("|") for l in launchers.table(rows).splitlines()
                                                  if l.startswith("| "))}
    assert line["python"][10:12] == [" – ", " 0.940 "]
    assert line["torchrun"][10:12] == [" – ", " – "]  # its run's baselines were replaced
