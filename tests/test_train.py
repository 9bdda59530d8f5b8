"""train.py end to end on CPU: W&B offline run files carry perf/mfu, CSV logs, resume, NaN stop, errors, DDP."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import train as train_mod
from run_overrides import tiny_run_overrides
from model.lit_gpt import LitGPT, NonFiniteLossError
from recipe.wandb_run import finish_logger

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _overrides(data_cache, out, *extra):
    return tiny_run_overrides(data_cache, out, *extra)


def _cfg(data_cache, out, *extra):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=_overrides(data_cache, out, *extra))


def test_wandb_offline_run_carries_perf_metrics(data_cache, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    metrics = train_mod.train(_cfg(data_cache, tmp_path, "logger=wandb"))
    assert metrics["perf/mfu"] > 0 and metrics["perf/tokens_per_s"] > 0
    assert torch.isfinite(torch.tensor(metrics["val/loss"]))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one offline run, ready for `wandb sync`"
    records = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    for key in (b"perf/mfu", b"perf/tflops_per_gpu", b"perf/tokens_per_s", b"train/loss", b"val/loss"):
        assert key in records, key
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_wandb_service_failure_on_close_warns_instead_of_exiting(tmp_path, monkeypatch):
    """wandb.teardown() raises SystemExit when its service died; after a finished training that must not
    end the caller's process (or mask the training's own error in train()'s finally)."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    logger.experiment.log({"train/loss": 1.0})
    real_teardown = wandb.teardown

    def failing_teardown(exit_code=None):
        real_teardown(exit_code)  # still shut the real service down, so no other test inherits it
        raise SystemExit(3)

    monkeypatch.setattr(wandb, "teardown", failing_teardown)
    with pytest.warns(UserWarning, match="W&B service exited with 3"):
        finish_logger(logger, type("Trainer", (), {"is_global_zero": True})(), ok=True)


def test_attention_is_checked_against_the_device_before_the_first_step(data_cache, tmp_path, monkeypatch):
    """LitGPT.on_fit_start asks whether the attention can run on the training device (flash on a GPU whose thread
    blocks lack the shared memory is refused there); what it raises ends the run before any step."""
    import model.lit_gpt as lit_gpt_mod

    seen = []

    def refuse(name, head_dim, device):
        seen.append((name, head_dim, device.type))
        raise RuntimeError("attention=sdpa cannot run here (test)")

    monkeypatch.setattr(lit_gpt_mod, "check_attention_runs_on", refuse)
    with pytest.raises(RuntimeError, match="cannot run here"):
        train_mod.train(_cfg(data_cache, tmp_path, "logger=none", "attention=sdpa"))
    assert seen == [("sdpa", 32, "cpu")]  # cpu_tiny: d_model 128 over 4 heads
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_csv_logger_and_loss_falls(data_cache, tmp_path):
    train_mod.train(_cfg(data_cache, tmp_path, "logger=csv", "trainer.max_steps=30", "trainer.log_every_n_steps=5",
                         "trainer.val_check_interval=15"))
    import csv

    (metrics_csv,) = (tmp_path / "csv").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_csv.open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    vals = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert any(r.get("perf/tokens_per_s") for r in rows)
    assert losses[-1] < losses[0] and vals[-1] < vals[0]


def test_the_fused_adamw_step_applies_the_clip(data_cache, tmp_path, monkeypatch):
    """No GradScaler (fp32 here, bf16 on a GPU) and a fused AdamW: LitGPT hands the clip to the step as its gradient
    scale, and no in-place multiply of the gradients runs (model/distributed.py clip_grads_with_norm_)."""
    import model.distributed as distributed

    handed, multiplied = [], []
    real = distributed.clip_grads_with_norm_
    monkeypatch.setattr(distributed, "clip_grads_with_norm_", lambda *a: handed.append(a[3]) or real(*a))
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: multiplied.append(a))
    train_mod.train(_cfg(data_cache, tmp_path, "logger=none", "+optim.optimizer.fused=true", "trainer.max_steps=4",
                         "trainer.val_check_interval=100"))
    # the optimizer itself, not a wrapper: its step reads grad_scale from itself
    assert len(handed) == 4 and all(type(o) is torch.optim.AdamW and o.defaults["fused"] for o in handed)
    assert isinstance(handed[-1].grad_scale, torch.Tensor) and multiplied == []


def _final_state(ckpt):
    return torch.load(ckpt, map_location="cpu", weights_only=False)


def test_resume_continues_step_optimizer_schedule_and_data(data_cache, tmp_path):
    """Resume an 8-step run from its step-4 checkpoint (as after a kill): the final weights equal the
    uninterrupted run's bit for bit, which needs the step count, optimizer state, LR schedule and data
    order all restored."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = ("logger=none", "trainer.max_steps=8", "ckpt_every=4", "trainer.val_check_interval=100")
    train_mod.train(_cfg(data_cache, full, *common))
    mid = full / "checkpoints" / "step0000004.ckpt"
    assert _final_state(mid)["global_step"] == 4
    train_mod.train(_cfg(data_cache, resumed, *common, f"ckpt_path={mid}"))
    a, b = _final_state(full / "checkpoints" / "last.ckpt"), _final_state(resumed / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 8
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    assert a["lr_schedulers"][0]["last_epoch"] == b["lr_schedulers"][0]["last_epoch"]


def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(data_cache, tmp_path, monkeypatch):
    real_loss = LitGPT._loss

    def poisoned(self, batch):
        loss = real_loss(self, batch)
        return loss * float("nan") if self.training and self.global_step >= 5 else loss

    monkeypatch.setattr(LitGPT, "_loss", poisoned)
    with pytest.raises(NonFiniteLossError, match=r"by step \d+.*last good checkpoint"):
        train_mod.train(_cfg(data_cache, tmp_path, "logger=none", "trainer.max_steps=12", "ckpt_every=4",
                             "trainer.val_check_interval=100"))
    state = _final_state(tmp_path / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in state["state_dict"].values())


@pytest.mark.parametrize(
    "extra, match",
    [
        (("attention=flash",), "attention=sdpa"),
        (("attention.name=flashy",), "unknown attention 'flashy'"),
        (("ckpt_path=/nonexistent.ckpt",), "does not exist"),
        (("trainer.strategy=nope",), "not a strategy name"),
    ],
)
def test_bad_config_fails_before_any_work(data_cache, tmp_path, extra, match):
    with pytest.raises(train_mod.ConfigError, match=match):
        train_mod.train(_cfg(data_cache, tmp_path, "logger=none", *extra))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("attention, advice", [("naive", "Use attention=flash or attention=sdpa"), ("sdpa", "global_batch_tokens")])
def test_out_of_memory_is_explained_with_the_setting_to_change(data_cache, tmp_path, monkeypatch, attention, advice):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.")

    monkeypatch.setattr(train_mod.L.Trainer, "fit", oom)
    cfg = _cfg(data_cache, tmp_path, "logger=none", f"attention={attention}")  # gpt-tiny: 4 heads, 64 × 4 batch
    with pytest.raises(train_mod.TrainingOutOfMemory, match=advice) as err:
        train_mod.train(cfg)
    assert "seq_len=64, data.batch_size=4" in str(err.value) and "Tried to allocate 8.00 GiB" in str(err.value)
    if attention == "naive":
        assert f"{4 * 4 * 64 * 64 * 2 / 2**30:.1f} GiB per layer" in str(err.value)  # B × H × T² × 2 bytes


two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="multi-GPU launch: needs 2 CUDA GPUs"
)


def _launch(data_cache, out, *extra, cpu=False):
    """`python train.py ...` as a user runs it (Lightning starts the other ranks); returns rank 0's metrics.json.
    cpu: the ranks on the CPU in fp32 (gloo), no GPU visible."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    precision = ("trainer.accelerator=cpu", "trainer.precision=32-true") if cpu else ("trainer.precision=bf16-mixed",)
    cmd = [sys.executable, "train.py", *_overrides(data_cache, out, "logger=csv", *precision, *extra)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("attention", ["flash", "sdpa"])
def test_ddp_two_gpus(data_cache, tmp_path, attention):
    metrics = _launch(data_cache, tmp_path, "trainer=ddp", "trainer.devices=2", f"attention={attention}")
    assert metrics["world_size"] == 2 and metrics["global_step"] == 6
    assert torch.isfinite(torch.tensor(metrics["val/loss"]))
    assert len(list((tmp_path / "csv").rglob("metrics.csv"))) == 1


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@pytest.mark.parametrize("trainer", ["fsdp", "fsdp2"])
def test_fsdp_checkpoint_resume_continues_the_run(data_cache, tmp_path, trainer, state_dict_type):
    """FSDP and FSDP2 on 2 GPUs, two micro-batches per rank and step: resuming from the step-4 checkpoint (a
    directory of shards, or one gathered file) ends at the same step with the same loss as the uninterrupted run
    (up to atomics in the attention backward)."""
    common = (f"trainer={trainer}", "trainer.devices=2", "attention=flash", "global_batch_tokens=2048",
              f"trainer.strategy.state_dict_type={state_dict_type}", "trainer.max_steps=8", "ckpt_every=4",
              "trainer.val_check_interval=100")
    full = _launch(data_cache, tmp_path / "full", *common)
    mid = tmp_path / "full" / "checkpoints" / "step0000004.ckpt"
    assert mid.is_dir() if state_dict_type == "sharded" else mid.is_file()
    resumed = _launch(data_cache, tmp_path / "resumed", *common, f"ckpt_path={mid}")
    assert full["global_step"] == resumed["global_step"] == 8
    assert resumed["train/loss"] == pytest.approx(full["train/loss"], rel=2e-2)


@pytest.mark.gpu
@two_gpus
def test_fsdp2_compiled_on_two_gpus_trains_as_eager(data_cache, tmp_path):
    """trainer=fsdp2 with compile=true (each Block compiled on its own, model/lit_gpt.py) on 2 GPUs, two
    micro-batches per rank and step: it trains through validation, and its loss follows the eager run's."""
    common = ("trainer=fsdp2", "trainer.devices=2", "attention=flash", "global_batch_tokens=2048")
    eager = _launch(data_cache, tmp_path / "eager", *common)
    compiled = _launch(data_cache, tmp_path / "compiled", *common, "compile=true")
    assert compiled["world_size"] == 2 and compiled["global_step"] == eager["global_step"] == 6
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], rel=2e-2)


@pytest.mark.parametrize("trainer, global_batch_tokens", [("ddp", 512), ("fsdp2", 1024)])
def test_two_ranks_train_like_one_accumulating_rank(data_cache, tmp_path, trainer, global_batch_tokens):
    """Same global batch, same seed: 2 ranks (gloo, CPU) and 1 rank accumulating their micro-batches see the same
    windows per optimizer step, so their validation losses agree to float reduction order. DDP's ranks take one
    micro-batch a step; FSDP2's take two, the first without a reduce-scatter (model/fsdp2.py accumulating)."""
    from bench.loss_curves import compare, read_curves

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    curves = {}
    micro_batches = global_batch_tokens // (4 * 64)  # per step, over the ranks: data.batch_size 4 × seq_len 64
    for name, extra in (("one", ("trainer=cpu", f"trainer.val_check_interval={4 * micro_batches}")),
                        ("two", (f"trainer={trainer}", "trainer.accelerator=cpu", "trainer.devices=2",
                                 "trainer.precision=32-true", f"trainer.val_check_interval={4 * micro_batches // 2}"))):
        out = tmp_path / name
        cmd = [sys.executable, "train.py", *_overrides(data_cache, out, "logger=csv",
               f"global_batch_tokens={global_batch_tokens}", "trainer.max_steps=8", "~callbacks.checkpoint",
               "+trainer.enable_checkpointing=false", *extra)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (metrics_csv,) = (out / "csv").rglob("metrics.csv")
        curves[name] = read_curves(metrics_csv)
    result = compare(curves["one"], curves["two"])
    assert len(result["val_steps"]) == 2  # validation at the same optimizer steps (4 and 8) in both runs
    assert result["max_rel_val_diff"] < 1e-4


def test_fsdp2_checkpoints_resume_and_hold_the_same_weights_on_cpu(data_cache, tmp_path):
    """FSDP2 on 2 CPU ranks (gloo, fp32), two micro-batches per rank and step: resuming from the step-4 checkpoint,
    a directory of shards or one gathered file, ends where the uninterrupted run ends; the gathered file, damaged,
    is refused; the step-8 directory and file hold the same weights (model/checkpoint.py load_weights reads both)."""
    from model.checkpoint import load_weights, read_metadata
    from model.gpt import GPT, GPTConfig

    common = ("trainer=fsdp2", "trainer.devices=2", "global_batch_tokens=1024", "trainer.max_steps=8",
              "ckpt_every=4", "trainer.val_check_interval=100")
    weights = {}
    for kind in ("sharded", "full"):
        full = _launch(data_cache, tmp_path / kind, *common, f"trainer.strategy.state_dict_type={kind}", cpu=True)
        mid, last = (tmp_path / kind / "checkpoints" / f"step000000{n}.ckpt" for n in (4, 8))
        assert mid.is_dir() if kind == "sharded" else (mid.is_file() and mid.with_name(f"{mid.name}.sha256").is_file())
        resumed = _launch(data_cache, tmp_path / f"{kind}-resumed", *common, f"trainer.strategy.state_dict_type={kind}",
                          f"ckpt_path={mid}", cpu=True)
        assert full["global_step"] == resumed["global_step"] == 8
        assert resumed["train/loss"] == pytest.approx(full["train/loss"], rel=1e-5)
        if kind == "full":  # a byte flipped in the file: refused by its checksum before torch.load, naming it
            data = bytearray(mid.read_bytes())
            data[len(data) // 2] ^= 0xFF
            mid.write_bytes(bytes(data))
            cmd = [sys.executable, "train.py", *_overrides(data_cache, tmp_path / "damaged", "trainer.accelerator=cpu",
                   "trainer.precision=32-true", *common, "trainer.strategy.state_dict_type=full", f"ckpt_path={mid}")]
            proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                                  text=True, timeout=300)
            assert proc.returncode != 0 and f"cannot resume from ckpt_path={mid}: its bytes do not match" in proc.stderr
        meta = read_metadata(last)
        gpt = GPT(GPTConfig(**meta["hyper_parameters"]["model"]))
        load_weights(gpt, last, meta)
        weights[kind] = gpt.state_dict()
    for name, tensor in weights["sharded"].items():
        torch.testing.assert_close(weights["full"][name], tensor, rtol=0, atol=0, msg=name)


def _in_data_loader(frame) -> bool:
    while frame is not None:
        if "torch/utils/data/" in frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("accumulation", [1, 2])
def test_steps_between_log_points_read_nothing_back_from_the_device(data_cache, tmp_path, monkeypatch, accumulation):
    """On a GPU, reading a device tensor on the host (.item(), float(), bool()) waits for every queued kernel, and
    the GPU idles while the host prepares the next step. Training reads values back at log points and progress-bar
    refreshes only (every 5 optimizer steps here, each of `accumulation` micro-batches); no other step reads
    anything. The CPU's AdamW reads its step counts (the fused CUDA step does not) and the fused loss's CPU
    reference checks its targets (the Triton kernels do not), so this run takes the fused AdamW and loss=torch.
    The data loader's tensors stay on the host (in its workers)."""
    reads: list[tuple[int, str]] = []  # (optimizer step whose training_step ran last, what read)
    step = [-1]
    real_step = LitGPT.training_step

    def training_step(self, batch, batch_idx):
        step[0] = self.trainer.global_step
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(LitGPT, "training_step", training_step)
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def reading(self, *args, _real=real, _name=name, **kwargs):
            if step[0] >= 0 and not _in_data_loader(sys._getframe(1)):
                reads.append((step[0], _name))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, reading)
    overrides = [o for o in _overrides(data_cache, tmp_path) if "progress_bar" not in o]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            *overrides, "logger=csv", "loss=torch", "+optim.optimizer.fused=true", "trainer.max_steps=20",
            "trainer.log_every_n_steps=5", "callbacks.progress_bar.refresh_rate=5", "+trainer.limit_val_batches=0",
            f"global_batch_tokens={accumulation * 4 * 64}"])  # micro-batches of data.batch_size 4 x seq_len 64
    train_mod.train(cfg)
    assert max(s for s, _ in reads) == 19, "the last step read back (the bar's last refresh), and the test saw it"
    # step s ends at global step s + 1: a log point and a refresh when that is a multiple of 5; the last step ends
    # the run (the final checkpoint and metrics)
    between = [(s, what) for s, what in reads if (s + 1) % 5 and s != 19]
    assert between == [], f"steps between log points read the device: {between[:5]}"
    (metrics_csv,) = (tmp_path / "csv").rglob("metrics.csv")
    assert "train/loss" in metrics_csv.read_text().splitlines()[0], "the loss still reaches the logger"


def test_progress_bar_of_a_resumed_run_has_a_total_and_counts_from_its_step():
    from types import SimpleNamespace

    from recipe.progress import StepProgressBar

    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_steps=300, global_step=210)  # resumed at step 210 of 300
    tqdm_bar = bar.init_train_tqdm()
    try:
        assert (tqdm_bar.total, tqdm_bar.n, tqdm_bar.initial) == (300, 210, 210)  # ETA from this run's steps
        assert "210/300" in str(tqdm_bar)
    finally:
        tqdm_bar.close()


def test_progress_bar_shows_the_loss_validation_and_throughput_it_reads_at_a_refresh():
    """The loss comes off the device at the refresh, validation's numbers from Lightning's bar metrics, tokens/s and
    MFU from PerfMonitor's last log point; the logger's version number is left out."""
    from types import SimpleNamespace

    from model.perf import PerfMonitor
    from recipe.progress import StepProgressBar

    perf = PerfMonitor()
    perf.last_metrics = {"perf/tokens_per_s": 65000.0, "perf/mfu": 0.64, "perf/step_time_s": 0.25}
    trainer = SimpleNamespace(callback_metrics={"train/loss": torch.tensor(2.5)}, loggers=[], callbacks=[perf],
                              progress_bar_metrics={"val/loss": 3.0, "val/ppl": 20.1, "v_num": 7})
    metrics = StepProgressBar().get_metrics(trainer, None)
    assert metrics == {"train/loss": 2.5, "val/loss": 3.0, "val/ppl": 20.1, "tok/s": 65000.0, "mfu": 0.64}
    assert list(metrics)[0] == "train/loss"
    assert StepProgressBar().get_metrics(SimpleNamespace(callback_metrics={}, loggers=[], callbacks=[PerfMonitor()],
                                                         progress_bar_metrics={}), None) == {}


def test_the_model_is_made_on_the_trainers_device_but_under_fsdp(data_cache, tmp_path):
    """train.init_device: every parameter and buffer of the module is made on the trainer's device (the meta device
    stands in for a GPU here: nothing lands on the CPU); on the CPU under FSDP, where Lightning's FSDP takes it, and
    where Lightning starts the ranks by multiprocessing (ddp_spawn), which CUDA in this process would break."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    cfg = _cfg(data_cache, tmp_path)
    on_meta = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("meta"), launcher=None))
    with train_mod.init_device(on_meta):
        module = train_mod.build_module(cfg, vocab_size=256)
    assert {t.device.type for t in [*module.parameters(), *module.buffers()]} == {"meta"}
    with train_mod.init_device(SimpleNamespace(strategy=FSDPStrategy())):
        assert torch.empty(1).device.type == "cpu"
    import lightning as L

    spawn = L.Trainer(accelerator="cpu", strategy="ddp_spawn", devices=2, logger=False)
    spawn.strategy.parallel_devices = [torch.device("meta")] * 2  # would be the GPUs: the context must not use them
    with train_mod.init_device(spawn):
        assert torch.empty(1).device.type == "cpu"
