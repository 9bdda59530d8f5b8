"""Fault injection into real tiny training runs (CPU): each test breaks something a long run meets (a
signal, a kill during a save, damaged checkpoints and shards, a NaN, an unwritable directory, a resume with
other settings) and asserts that nothing is lost beyond what docs/reliability.md promises.

One 8-step run (checkpoints at steps 4 and 8) is the shared reference; runs that need a signal or kill -9
are subprocesses, the rest call train() in this process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import train as train_mod
from model.checkpoint import CheckpointModelMismatch
from model.lit_gpt import LitGPT, NonFiniteLossError, ResumeError
from recipe.checkpoint_files import CheckpointError, atomic_save, checksum_path, verify_checkpoint, verify_or_warn
from signal_run import signal_once_exists

REPO = Path(__file__).resolve().parents[1]
STEPS, CKPT_EVERY = 8, 4
pytestmark = pytest.mark.slow


def _overrides(cache, out, *extra):
    return [
        "experiment=cpu_tiny", "seq_len=32", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "data.batch_size=4", "data.num_workers=0", "data.vocab_size=300", "data.max_documents=30",
        f"data.cache_dir={cache}", "data.val_batches=1", f"trainer.max_steps={STEPS}", f"ckpt_every={CKPT_EVERY}",
        "trainer.val_check_interval=1000", "trainer.log_every_n_steps=2", "trainer.enable_model_summary=false",
        "trainer.enable_progress_bar=false", "~callbacks.progress_bar", "logger=none", f"output_dir={out}",
        f"hydra.run.dir={out}",  # Hydra's own files too, when train.py runs as a script: never in the repository
        *extra,
    ]


def _train(cache, out, *extra):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=_overrides(cache, out, *extra))
    return train_mod.train(cfg)


def _state(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _same_weights(a, b) -> bool:
    a, b = _state(a)["state_dict"], _state(b)["state_dict"]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: {"cache", "run", "ckpt": run/checkpoints}."""
    cache, run = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("reference")
    _train(cache, run)
    return {"cache": cache, "run": run, "ckpt": run / "checkpoints"}


# --------------------------------------------------------------------------------------------- signals
def _named_checkpoint(out: str) -> Path:
    """The checkpoint a stopped run's message names ("resume with ckpt_path=<...>.ckpt"). The path ends at ".ckpt":
    the run's processes share the pipe, and another one's line can land between the message and its newline."""
    named = re.search(r"resume with ckpt_path=(\S+?\.ckpt)", out)
    assert named, out[-2000:]
    return Path(named.group(1))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_run_saves_the_step_exits_nonzero_and_resumes_exactly(reference, tmp_path, signum):
    """The signal arrives after the first checkpoint (step 2 here): the step in flight finishes, its checkpoint
    is written, the exit status is 128 + signal, and the resumed run ends bit for bit on the reference."""
    run = tmp_path / "signalled"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "train.py", *_overrides(reference["cache"], run, "ckpt_every=2")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    signal_once_exists(proc, run / "checkpoints" / "step0000002.ckpt", signum, timeout=120)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, out[-3000:]
    name = signal.Signals(signum).name
    assert f"stopped by {name} after step" in out and "resume with ckpt_path=" in out, out[-2000:]
    saved = _named_checkpoint(out)
    step = _state(saved)["global_step"]
    assert 2 <= step < STEPS and saved.name == f"step{step:07d}.ckpt"
    assert verify_checkpoint(saved) and _same_weights(saved, run / "checkpoints" / "last.ckpt")
    _train(reference["cache"], tmp_path / "resumed", f"ckpt_path={saved}")
    assert _same_weights(tmp_path / "resumed" / "checkpoints" / "last.ckpt", reference["ckpt"] / "last.ckpt")


def _sigterm_and_resume(cache, tmp_path, common, env, timeout):
    """`python train.py` with `common` three times: uninterrupted (tmp_path/full), sent SIGTERM (to the launching
    process) once its step-2 checkpoint exists (tmp_path/stopped: exit 143), and resumed from the checkpoint that
    run names (tmp_path/resumed). Returns that checkpoint and the first and last runs' metrics.json."""

    def launch(out, *extra, signal_after=None):
        cmd = [sys.executable, "train.py", *_overrides(cache, out, *common, *extra)]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if signal_after is not None:
            signal_once_exists(proc, signal_after, signal.SIGTERM, timeout)
        out_text, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out_text

    rc, out = launch(tmp_path / "full")
    assert rc == 0, out[-3000:]
    rc, out = launch(tmp_path / "stopped", signal_after=tmp_path / "stopped" / "checkpoints" / "step0000002.ckpt")
    assert rc == 143 and "stopped by SIGTERM after step" in out, out[-3000:]
    saved = _named_checkpoint(out)
    rc, out = launch(tmp_path / "resumed", f"ckpt_path={saved}")
    assert rc == 0, out[-3000:]
    metrics = [json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("full", "resumed")]
    return saved, *metrics


_one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL on a CUDA device: needs a GPU")


@pytest.mark.parametrize("backend, accelerator", [
    ("gloo", "cpu"), pytest.param("nccl", "cuda", marks=[pytest.mark.gpu, _one_gpu])])
def test_ranks_check_for_a_signal_once_per_optimizer_step_and_stop_together(monkeypatch, tmp_path, backend,
                                                                            accelerator):
    """StepBoundaryStop, the loop's SIGTERM check on several ranks: one all-reduce on the first micro-batch of
    each optimizer step and nothing on the others; a signal marked mid-step goes into the next step's all-reduce,
    and the step after that stops at its first micro-batch with Lightning's flag set (a 1-rank group stands in for
    the ranks: gloo on the CPU, and NCCL on a GPU, whose flag comes back through pinned memory behind an event)."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from recipe.preemption import StepBoundaryStop

    assert hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")  # the installed Lightning has what is replaced
    if accelerator == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        reduces = []
        real_all_reduce = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: reduces.append(t.clone()) or real_all_reduce(t, **kw))
        trainer = L.Trainer(accelerator=accelerator, devices=1, accumulate_grad_batches=4, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        signalled = []
        check = StepBoundaryStop(trainer, lambda: bool(signalled))
        for _ in range(9):  # micro-batches 0-8: optimizer steps start at 0, 4 and 8
            check()
        assert [int(t) for t in reduces] == [0, 0, 0]
        signalled.append(True)
        for _ in range(7):  # micro-batches 9-15: the step in flight, then the next, whose all-reduce carries it
            check()
        assert [int(t) for t in reduces] == [0, 0, 0, 1] and not trainer.received_sigterm
        with pytest.raises(SIGTERMException):
            check()  # micro-batch 16: the first of the step after
        assert len(reduces) == 4 and trainer.received_sigterm
        assert reduces[0].device.type == accelerator
        if accelerator == "cuda":
            assert check.flag.is_pinned() and check.flag.device.type == "cpu"
    finally:
        dist.destroy_process_group()


def test_sigterm_on_two_cpu_ranks_accumulating_stops_both_at_one_step_and_resumes(reference, tmp_path):
    """SIGTERM to the launching process of a 2-rank DDP run (gloo, CPU) with two micro-batches per rank and
    optimizer step: both ranks stop after the same step (recipe/preemption.py StepBoundaryStop; with Lightning's
    own handler this run hangs), the checkpoint of that step is written, the exit status is 143, and the resumed
    run ends on the uninterrupted run's loss."""
    common = ("trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.precision=32-true",
              "global_batch_tokens=512", "trainer.max_steps=12", "ckpt_every=2", "logger=csv")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    saved, full, resumed = _sigterm_and_resume(reference["cache"], tmp_path, common, env, timeout=300)
    assert 2 <= _state(saved)["global_step"] < 12 and verify_checkpoint(saved)
    assert full["global_step"] == resumed["global_step"] == 12
    assert resumed["train/loss"] == pytest.approx(full["train/loss"], rel=1e-5)


# -------------------------------------------------------------------------------- kill -9 during a save
_SAVE_AND_HANG = """
import os, sys, time, torch
import recipe.checkpoint_files as io
path, where = sys.argv[1], sys.argv[2]
io.atomic_save({"w": torch.full((4,), 1.0)}, path)
def hang(*args, **kwargs):
    print("hanging", flush=True)
    time.sleep(600)
if where == "write":      # inside torch.save's stream into the temporary file
    io._HashingWriter.write = lambda self, data: hang()
else:                     # after the checksum file, before the rename over the checkpoint
    real_replace = os.replace
    os.replace = lambda a, b: hang() if str(b) == path else real_replace(a, b)
io.atomic_save({"w": torch.full((1 << 20,), 2.0)}, path)
"""


@pytest.mark.parametrize("where", ["write", "rename"])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path, where):
    path = tmp_path / "last.ckpt"
    proc = subprocess.Popen([sys.executable, "-c", _SAVE_AND_HANG, str(path), where], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "hanging"
    proc.kill()
    proc.wait(timeout=30)
    assert verify_checkpoint(path)  # the previous file, matching its checksum file
    assert torch.equal(_state(path)["w"], torch.full((4,), 1.0))
    atomic_save({"w": torch.zeros(2)}, path)  # and the next save works over the leftovers
    assert verify_checkpoint(path) and _state(path)["w"].shape == (2,)


# ---------------------------------------------------------------------------------- bad checkpoints
def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 32] = b"\xff" * 32  # inside a tensor's storage
    path.write_bytes(bytes(data))


DAMAGES = {
    "32 bytes overwritten": _flip_bytes,
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
    "random bytes": lambda p: p.write_bytes(os.urandom(4096)),
    "random bytes, no checksum file": lambda p: (p.write_bytes(os.urandom(4096)), checksum_path(p).unlink()),
    "a directory": lambda p: (p.unlink(), p.mkdir()),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_bad_checkpoint_is_one_clear_error_and_the_good_last_ckpt_survives(reference, tmp_path, damage):
    """Resume from a damaged step-4 checkpoint INTO its own run directory: refused before any step, naming
    the file and pointing at a good one, and last.ckpt is not overwritten."""
    run = tmp_path / "run"
    shutil.copytree(reference["run"], run)
    bad, last = run / "checkpoints" / "step0000004.ckpt", run / "checkpoints" / "last.ckpt"
    last_bytes = last.read_bytes()
    DAMAGES[damage](bad)
    with pytest.raises(CheckpointError) as err:
        _train(reference["cache"], run, f"ckpt_path={bad}")
    message = str(err.value)
    assert f"ckpt_path={bad}" in message and "weights_only" not in message
    assert "resume from another checkpoint, e.g. ckpt_path=" in message
    assert last.read_bytes() == last_bytes and verify_checkpoint(last)


# ---------------------------------------------------------------------------------------- bad shards
def test_a_checkpoint_without_its_checksum_loads_with_a_warning_and_a_changed_one_not_at_all(tmp_path):
    """recipe/checkpoint_files.verify_or_warn, which every single-file load runs first (VerifiedCheckpointIO, and
    trainer=fsdp2's full checkpoints): a file written elsewhere passes with a warning naming the missing checksum
    file; one of ours passes silently; one changed after it was written is refused."""
    import warnings

    elsewhere, ours = tmp_path / "elsewhere.ckpt", tmp_path / "ours.ckpt"
    torch.save({"step": 1}, elsewhere)
    atomic_save({"step": 1}, ours)
    with pytest.warns(UserWarning, match="has no elsewhere.ckpt.sha256 beside it: loading it unverified"):
        verify_or_warn(elsewhere)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verify_or_warn(ours)
    ours.write_bytes(ours.read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match="its bytes do not match"):
        verify_or_warn(ours)


def test_damaged_shards_are_refused_or_rebuilt(reference, tmp_path):
    """A shard overwritten at its own size is refused before the first step, naming the file; a truncated
    one is rebuilt by the next run, which then trains."""
    cache = tmp_path / "cache"
    shutil.copytree(reference["cache"], cache)
    (shard,) = cache.glob("*/train.bin")
    good = shard.read_bytes()
    shard.write_bytes(b"\xff" * len(good))
    with pytest.raises(ValueError, match=rf"{shard}.*token id 65535"):
        _train(cache, tmp_path / "a", "trainer.max_steps=2")
    assert not (tmp_path / "a" / "checkpoints").exists()
    os.truncate(shard, len(good) // 3)
    _train(cache, tmp_path / "b", "trainer.max_steps=2")
    assert shard.read_bytes() == good and (tmp_path / "b" / "checkpoints" / "last.ckpt").is_file()


# --------------------------------------------------------------------------- NaN, then the advised resume
def test_nan_after_checkpoints_keeps_them_and_the_advised_resume_applies_a_lower_lr(reference, tmp_path, monkeypatch):
    real_loss = LitGPT._loss

    def poisoned(self, batch):
        loss = real_loss(self, batch)
        return loss * float("nan") if self.training and self.global_step >= 5 else loss

    monkeypatch.setattr(LitGPT, "_loss", poisoned)
    with pytest.raises(NonFiniteLossError, match="Lower optim.optimizer.lr") as err:
        _train(reference["cache"], tmp_path / "nan")
    good = tmp_path / "nan" / "checkpoints" / "last.ckpt"
    assert f"last good checkpoint is {good}" in str(err.value)
    assert _state(good)["global_step"] == 4 and verify_checkpoint(good)
    monkeypatch.setattr(LitGPT, "_loss", real_loss)
    # The advice works: the lower learning rate replaces the checkpoint's on resume.
    _train(reference["cache"], tmp_path / "resumed", f"ckpt_path={good}", "optim.optimizer.lr=1e-5")
    state = _state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert state["lr_schedulers"][0]["base_lrs"] == [1e-5, 1e-5]
    assert all(g["lr"] <= 1e-5 for g in state["optimizer_states"][0]["param_groups"])


# ----------------------------------------------------------------------------- resume with other settings
def test_resume_with_changed_settings_applies_or_refuses_by_name(reference, tmp_path):
    mid = reference["ckpt"] / "step0000004.ckpt"
    with pytest.raises(CheckpointModelMismatch, match=r"seq_len: 32 in the checkpoint, 64 in the config"):
        _train(reference["cache"], tmp_path / "a", f"ckpt_path={mid}", "seq_len=64")
    with pytest.raises(CheckpointModelMismatch, match=r"model.d_model: 32 in the checkpoint, 64 in the config"):
        _train(reference["cache"], tmp_path / "b", f"ckpt_path={mid}", "model.d_model=64")
    with pytest.raises(ResumeError, match=r"trainer.max_steps=4 but the checkpoint is at step 4"):
        _train(reference["cache"], tmp_path / "c", f"ckpt_path={mid}", "trainer.max_steps=4")
    assert not any((tmp_path / d / "checkpoints").exists() for d in "abc")
    # Applied: a longer schedule, another warmup and batch size. The run ends between two periodic saves
    # (ckpt_every=4): its end state is saved all the same.
    _train(reference["cache"], tmp_path / "d", f"ckpt_path={mid}", "trainer.max_steps=10", "optim.warmup_steps=50",
           "data.batch_size=8")
    state = _state(tmp_path / "d" / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 10 and state["hyper_parameters"]["warmup_steps"] == 50
    # warmup 50: the LR after step 10 is 11/50 of the peak, which the checkpoint's warmup (30) would not give
    assert state["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(3e-3 * 11 / 50)
    data_state = state["TokenDataModule"]
    assert data_state["batch_size"] == 8 and data_state["window_offset"] == 4 * 4 - 4 * 8


# ------------------------------------------------------------------------------- unwritable directories
def test_unwritable_run_directory_is_refused_before_the_first_step(reference, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"output_dir=/proc/x is not a writable directory"):
        _train(reference["cache"], "/proc/x")
    # hydra.run.dir: the Hydra callback that conf/train.yaml registers exits with one line before Hydra's mkdir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hydra.run.dir=/proc/x"], return_hydra_config=True)
    (check,) = [instantiate(c) for c in cfg.hydra.callbacks.values() if c._target_ == "recipe.preflight.RunDirCheck"]
    from hydra.core.hydra_config import HydraConfig

    try:
        with pytest.raises(SystemExit) as exit_:
            check.on_run_start(cfg)
    finally:
        HydraConfig.instance().cfg = None  # on_run_start set it, as Hydra does; later tests run without Hydra
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: hydra.run.dir=/proc/x is not a writable directory")


# ------------------------------------------------------------------------------------ config mistakes
@pytest.mark.parametrize("override, key", [("seq_len=abc", "seq_len"), ("data.batch_size=x", "data.batch_size"),
                                           ("optim.optimizer.lr=fast", "optim.optimizer.lr"),
                                           ("model.n_kv_head=two", "model.n_kv_head")])
def test_config_type_errors_name_the_key(reference, tmp_path, override, key):
    from recipe.schema import ConfigTypeError

    with pytest.raises(ConfigTypeError, match=rf"^config key {key}: Value '\w+' of type 'str' could not be converted"):
        _train(reference["cache"], tmp_path, override)
    assert not (tmp_path / "checkpoints").exists()


def test_a_gpu_sized_default_on_a_cpu_says_so_and_points_to_cpu_tiny():
    from recipe.preflight import cpu_default_hint

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        default, tiny = compose(config_name="train"), compose(config_name="train", overrides=["experiment=cpu_tiny"])
    hint = cpu_default_hint(default, cuda_available=False, model_choice="gpt3-125m")
    assert "model=gpt3-125m" in hint and "trainer.max_steps=2000" in hint and "experiment=cpu_tiny" in hint
    assert cpu_default_hint(default, cuda_available=True) is None and cpu_default_hint(tiny, cuda_available=False) is None


def test_a_gpu_run_that_cannot_run_the_gelu_epilogues_says_which_mlp_it_runs():
    """The GPT3-1.3B preset turns model.gelu_epilogue on; on a GPU whose extension lacks the epilogue matmuls the run
    says why and names the MLP it falls back to. A CPU run, a run without the option, or one that can run them: none."""
    from recipe.preflight import gelu_epilogue_hint

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        preset = compose(config_name="train", overrides=["model=gpt3-1.3b"])
        unfused = compose(config_name="train", overrides=["model=gpt3-1.3b", "model.fused_bias_gelu=false"])
        off = compose(config_name="train", overrides=["model=gpt3-1.3b", "model.gelu_epilogue=false"])
        cpu = compose(config_name="train", overrides=["model=gpt3-1.3b", "trainer.accelerator=cpu"])
    reason = "the flash_kernel extension is not built"
    hint = gelu_epilogue_hint(preset, cuda_available=True, reason=reason)
    assert hint.startswith("model.gelu_epilogue=true, but " + reason) and "fused_bias_gelu" in hint
    assert "the unfused GELU" in gelu_epilogue_hint(unfused, cuda_available=True, reason=reason)
    assert gelu_epilogue_hint(preset, cuda_available=True, reason=None) is None
    assert gelu_epilogue_hint(preset, cuda_available=False, reason=reason) is None
    assert gelu_epilogue_hint(cpu, cuda_available=True, reason=reason) is None
    assert gelu_epilogue_hint(off, cuda_available=True, reason=reason) is None


# ------------------------------------------------------------------------------------------ 2 GPUs, FSDP
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="FSDP checkpoints: needs 2 CUDA GPUs"
)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("trainer, state_dict_type", [("fsdp", "sharded"), ("fsdp", "full"), ("fsdp2", "sharded")])
def test_sigterm_under_fsdp_on_two_gpus(reference, tmp_path, trainer, state_dict_type):
    """SIGTERM to the launching process of a 2-GPU FSDP or FSDP2 run: both ranks stop after the same step, the
    checkpoint (a directory of shards, or one file) is written, the exit status is 143, and the resumed run
    reaches max_steps with the uninterrupted run's loss (up to the attention backward's atomics)."""
    steps = 40
    common = (f"trainer={trainer}", "trainer.devices=2", "attention=flash", "trainer.precision=bf16-mixed",
              f"trainer.strategy.state_dict_type={state_dict_type}", f"trainer.max_steps={steps}", "ckpt_every=2",
              "model.d_model=128", "model.n_head=2", "logger=csv")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    saved, full, resumed = _sigterm_and_resume(reference["cache"], tmp_path, common, env, timeout=600)
    assert saved.is_dir() if state_dict_type == "sharded" else saved.is_file()
    assert full["global_step"] == resumed["global_step"] == steps
    assert resumed["train/loss"] == pytest.approx(full["train/loss"], rel=2e-2)
