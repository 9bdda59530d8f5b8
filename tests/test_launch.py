"""The launch (issue: the everyday line uses the node's GPUs under any launcher): launcher detection, the config
that follows it, the refusals, and real launches on CPU processes (gloo): plain python, torchrun, SLURM's
environment; on two GPUs, the plain launch, torchrun and trainer=fsdp at the same per-GPU throughput."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train  # noqa: F401  (registers the resolvers)
from run_overrides import compose_train, tiny_run_overrides
from signal_run import signal_once_exists
from two_ranks import free_port
from recipe import oom
from recipe.checks import ConfigError, validate_trainer
from recipe.launch import Launcher, detect_launcher, release_process_group, run_name, shared_launch_id

REPO = Path(__file__).resolve().parents[1]
LAUNCH_KEYS = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "SLURM_NTASKS",
               "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_NAME", "SLURM_JOB_ID", "SLURM_STEP_ID",
               "SLURM_LOCALID", "SLURM_PROCID", "SLURM_NODEID", "SLURM_JOB_NUM_NODES")
TORCHRUN_2 = {"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1"}
SRUN_2x4 = {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_LOCALID": "3",
            "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train"}


@pytest.fixture
def launch_env(monkeypatch):
    """Set a launcher's environment (after clearing every launcher variable of the test process)."""
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)

    def set_env(env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return set_env


@pytest.mark.parametrize(
    "env, expected",
    [({}, Launcher("python", 1, 1, 1, 0)),
     (TORCHRUN_2, Launcher("torchrun", 2, 2, 1, 1)),
     ({**TORCHRUN_2, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, Launcher("torchrun", 8, 4, 2, 1)),
     (SRUN_2x4, Launcher("srun", 8, 4, 2, 3)),
     ({**SRUN_2x4, "SLURM_JOB_NAME": "interactive"}, Launcher("python", 1, 1, 1, 0)),  # Lightning's rule too
     ({"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"}, Launcher("srun", 1, 1, 1, 0)),
     ({**SRUN_2x4, **TORCHRUN_2}, Launcher("torchrun", 2, 2, 1, 1)),  # torchrun inside a SLURM job
     ({"WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1"}, Launcher("WORLD_SIZE/RANK launcher", 2, 2, 1, 1)),
     ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, Launcher("python", 1, 1, 1, 0))],  # a rank Lightning started
)
def test_launcher_is_detected_from_the_environment(env, expected):
    assert detect_launcher(env) == expected



@pytest.mark.parametrize(
    "env, overrides, devices, nodes",
    [({}, (), "auto", 1), (TORCHRUN_2, (), 2, 1), (SRUN_2x4, (), 4, 2), (SRUN_2x4, ("trainer=ddp",), 4, 2),
     (SRUN_2x4, ("trainer=fsdp",), 4, 2), ({}, ("trainer=gpu",), 1, 1), (TORCHRUN_2, ("trainer.devices=1",), 1, 1)],
)
def test_trainer_devices_follow_the_launch(launch_env, env, overrides, devices, nodes):
    launch_env(env)
    cfg = compose_train(*overrides)
    assert (cfg.trainer.devices, cfg.trainer.num_nodes) == (devices, nodes)


def _fake_gpus(monkeypatch, count, nccl=True):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)


@pytest.mark.parametrize(
    "env, gpus, overrides, match",
    [(TORCHRUN_2, 2, ("trainer.devices=1",), "ranks would share a GPU: torchrun started 2 rank"),
     (TORCHRUN_2, 2, ("trainer=gpu",), "ranks would share a GPU"),
     ({}, 2, ("trainer.devices=[1,1]",), r"ranks would share a GPU: trainer.devices=\[1, 1\]"),
     ({**TORCHRUN_2, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, 2, (), "more ranks than GPUs: torchrun started 4"),
     ({}, 2, ("trainer.devices=4",), "more ranks than GPUs: trainer.devices=4 asks for 4 GPUs per node"),
     (SRUN_2x4, 4, ("trainer.num_nodes=1",), r"world does not match.*4 × 1 = 4.*trainer.num_nodes=2"),
     (TORCHRUN_2, 8, ("trainer.devices=auto",), r"world does not match.*8 × 1 = 8"),
     ({}, 8, ("trainer.strategy=ddpp",), "'ddpp' is not a strategy name.*ddp_spawn"),
     ({}, 0, ("trainer=ddp",), "no CUDA GPU is visible"),
     ({}, 2, ("trainer=fsdp", "trainer.devices=[0,1,2]"), "asks for 3 GPUs"),
     ({}, 2, ("trainer=fsdp", "+nccl=false"), "needs NCCL"),
     ({}, 2, ("trainer=ddp", "+nccl=false"), r"model.distributed.data_parallel\) on GPUs needs NCCL"),
     ({}, 2, ("+nccl=false",), "needs NCCL")],
)
def test_a_launch_that_cannot_work_is_refused_by_name(launch_env, monkeypatch, env, gpus, overrides, match):
    launch_env(env)
    _fake_gpus(monkeypatch, gpus, nccl="+nccl=false" not in overrides)
    overrides = [o for o in overrides if o != "+nccl=false"]
    cfg = compose_train("trainer.accelerator=gpu", *overrides)
    with pytest.raises(ConfigError, match=match):
        validate_trainer(cfg.trainer, detect_launcher())


@pytest.mark.parametrize("env, gpus", [({}, 2), ({}, 8), (TORCHRUN_2, 8), (SRUN_2x4, 4)])
def test_the_default_trainer_passes_under_every_launcher(launch_env, monkeypatch, env, gpus):
    launch_env(env)
    _fake_gpus(monkeypatch, gpus)
    for trainer in ("default", "ddp", "fsdp", "fsdp2"):
        validate_trainer(compose_train(f"trainer={trainer}").trainer, detect_launcher())


def test_one_gpu_needs_no_nccl(launch_env, monkeypatch):
    """The default strategy is DDP only on several ranks: one GPU starts no process group."""
    launch_env({})
    _fake_gpus(monkeypatch, 2, nccl=False)
    for overrides in (("trainer.devices=1",), ("trainer=gpu",)):
        validate_trainer(compose_train("trainer.accelerator=gpu", *overrides).trainer, detect_launcher())


@pytest.mark.parametrize(
    "overrides",
    [("trainer=ddp", "trainer.devices=8", "trainer.num_nodes=4"), ("trainer=fsdp", "trainer.devices=2"),
     ("trainer=ddp", "+trainer.strategy.process_group_backend=gloo"), ("trainer.strategy=ddp_spawn",)],
)
def test_explicit_multi_gpu_settings_pass(launch_env, monkeypatch, overrides):
    launch_env({})
    _fake_gpus(monkeypatch, 8, nccl="process_group_backend=gloo" not in overrides[-1])
    validate_trainer(compose_train(*overrides).trainer, detect_launcher())


@pytest.mark.parametrize(
    "env, expected",
    [({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_STEP_ID": "2"}, "slurm-77.2"),
     ({"TORCHELASTIC_RUN_ID": "0123456789abcdef"}, "torchrun-01234567"),
     ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"}, None),  # one task in a SLURM job: a plain run
     ({"TORCHELASTIC_RUN_ID": "none"}, None)],
)
def test_ranks_of_one_launch_name_one_run_directory(env, expected):
    assert shared_launch_id(env) == expected


def test_run_directory_is_named_after_what_ran():
    assert run_name("cpu_tiny", "gpt-tiny", "sdpa") == "cpu_tiny_sdpa"
    assert run_name(None, "gpt3-125m", "flash") == "gpt3-125m_flash"


def test_out_of_memory_names_another_process_on_the_same_gpu(monkeypatch):
    monkeypatch.setattr(oom, "other_processes", lambda device: ["pid 4242 (30000 MiB)"])
    monkeypatch.setattr(oom, "memory_held_by_others", lambda device: 30e9)
    cfg = compose_train("experiment=cpu_tiny")
    msg = oom.explain_oom(cfg, torch.OutOfMemoryError("CUDA out of memory."), torch.device("cuda", 1))
    assert "Another process holds memory on this GPU (cuda:1): pid 4242 (30000 MiB)" in msg
    assert "Lower data.batch_size" not in msg  # not the wrong advice
    monkeypatch.setattr(oom, "memory_held_by_others", lambda device: 0.0)
    assert "Lower data.batch_size" in oom.explain_oom(cfg, torch.OutOfMemoryError("x"), torch.device("cuda", 1))


# --- real launches on CPU processes (gloo) ------------------------------------------------------------------
CPU_ENV = {**{k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def _shared_dir_overrides(data_cache, out, *extra):
    """tiny_run_overrides without output_dir / hydra.run.dir: the ranks must agree on the run directory."""
    return [o for o in tiny_run_overrides(data_cache, out, *extra) if not o.startswith(("output_dir=", "hydra.run.dir="))]


def test_a_run_releases_its_process_group_and_a_run_without_one_is_unaffected():
    """release_process_group, which train() calls last, destroys gloo's group (Lightning leaves it to the
    interpreter's teardown, which now and then aborted a two-rank CPU run at exit); without a group it does
    nothing."""
    release_process_group()  # no group: a no-op
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert torch.distributed.is_initialized()
        release_process_group()
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


DISTRIBUTED_THREADS = ("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl")  # name prefixes of torch.distributed's threads
linux_threads = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads from Linux's /proc")


def _threads_after_train(data_cache, out, *extra, signal_after=None):
    """tests/threads_after_train.py on 2 CPU ranks (Lightning starts rank 1; rank 0 hosts the rendezvous store), sent
    SIGTERM once `signal_after` exists when given; returns its exit status, its output and each rank's threads."""
    cmd = [sys.executable, "tests/threads_after_train.py",
           *tiny_run_overrides(data_cache, out, "logger=none", "trainer.accelerator=cpu", "trainer.precision=32-true",
                               "trainer.devices=2", *extra)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=CPU_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if signal_after is not None:
        signal_once_exists(proc, signal_after, signal.SIGTERM, timeout=300)
    text, _ = proc.communicate(timeout=300)
    return proc.returncode, text, [json.loads(p.read_text()) for p in sorted((out / "threads").glob("*.json"))]


def _assert_no_distributed_threads(ranks):
    assert len(ranks) == 2
    for names in ranks:
        assert "python" in names  # the listing works: the main thread is there
        assert not [n for n in names if n.startswith(DISTRIBUTED_THREADS)], names


@pytest.mark.slow
@linux_threads
@pytest.mark.parametrize("trainer", ["ddp", "fsdp2"])
def test_a_two_rank_run_ends_every_thread_of_torch_distributed(data_cache, tmp_path, trainer):
    """When train() returns, neither rank of a two-rank CPU launch runs a thread of torch.distributed: gloo's
    workers (pt_gloo_runloop) and transport loops (gloo_tcp_loop), the store's server (pt_tcpstore_uv). The FSDP2
    run writes a sharded checkpoint, whose DTensor caches keep the device mesh. Two-rank runs that left these
    threads to the interpreter's teardown now and then aborted there (status -6)."""
    rc, out, ranks = _threads_after_train(data_cache, tmp_path, f"trainer={trainer}", "trainer.max_steps=2",
                                          "ckpt_every=2")
    assert rc == 0, out[-3000:]
    _assert_no_distributed_threads(ranks)
    if trainer == "fsdp2":
        assert (tmp_path / "checkpoints" / "step0000002.ckpt").is_dir()


@pytest.mark.slow
@linux_threads
def test_a_two_rank_run_stopped_by_sigterm_ends_every_thread_of_torch_distributed(data_cache, tmp_path):
    """The same when SIGTERM stops a two-rank DDP run (recipe/preemption.py): train() raises Preempted with no
    torch.distributed thread left in either rank, and the exit status is 143, not an abort's."""
    rc, out, ranks = _threads_after_train(data_cache, tmp_path, "trainer=ddp", "trainer.max_steps=1000",
                                          "ckpt_every=2", signal_after=tmp_path / "checkpoints" / "step0000002.ckpt")
    assert rc == 143 and "stopped by SIGTERM after step" in out, out[-3000:]
    _assert_no_distributed_threads(ranks)


@pytest.mark.slow
def test_plain_launch_on_two_cpu_processes(data_cache, tmp_path):
    """`python train.py trainer.accelerator=cpu trainer.devices=2`: the default trainer, Lightning starts rank 1."""
    cmd = [sys.executable, "train.py", *tiny_run_overrides(data_cache, tmp_path, "logger=csv", "trainer.accelerator=cpu",
                                                           "trainer.devices=2", "trainer.max_steps=4")]
    proc = subprocess.run(cmd, cwd=REPO, env=CPU_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launch: 2 CPU processes, DDP, ranks started by Lightning" in proc.stderr
    assert "global batch: 512 tokens per optimizer step = data.batch_size 4 × seq_len 64 × 2 ranks" in proc.stderr
    assert len(list((tmp_path / "csv").rglob("metrics.csv"))) == 1  # logged from rank 0 only
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    summary = json.loads((tmp_path / "metrics.json").read_text())  # what bench/e2e.py --gpus N reads
    assert summary["world_size"] == 2 and summary["global_step"] == 4
    assert summary["perf/tokens_per_s_total"] == pytest.approx(2 * summary["perf/tokens_per_s"])


def _torchrun(data_cache, cwd, *args, launcher_args=("--standalone",)):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *launcher_args, str(REPO / "train.py"),
           *_shared_dir_overrides(data_cache, cwd, "logger=csv", "trainer.accelerator=cpu", "trainer.max_steps=4", *args)]
    return subprocess.run(cmd, cwd=cwd, env=CPU_ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_torchrun_world_is_the_launch_and_ranks_share_one_run_directory(data_cache, tmp_path):
    proc = _torchrun(data_cache, tmp_path)  # no trainer.devices: it follows torchrun's world
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launch: 2 CPU processes, DDP, ranks started by torchrun" in proc.stderr
    (run_dir,) = (tmp_path / "outputs").glob("*/*")  # not one per rank, though the ranks start apart
    assert run_dir.name.startswith("torchrun-") and run_dir.name.endswith("_cpu_tiny_sdpa")
    assert json.loads((run_dir / "metrics.json").read_text())["world_size"] == 2
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_torchrun_ranks_that_would_share_a_device_are_refused_before_any_work(data_cache, tmp_path):
    proc = _torchrun(data_cache, tmp_path, "trainer.devices=1")
    assert proc.returncode != 0  # torchrun exits 1 when a rank fails; the ranks print the reason
    assert "error: ranks would share a CPU device: torchrun started 2 rank(s) per node" in proc.stderr
    assert not list(tmp_path.rglob("checkpoints")) and not list(tmp_path.rglob("metrics.csv"))


@pytest.mark.slow
def test_torchrun_without_a_shared_id_is_refused_with_the_fix(data_cache, tmp_path):
    proc = _torchrun(data_cache, tmp_path, launcher_args=("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29533",
                                                          "--nnodes=1"))
    assert proc.returncode != 0
    assert "error: torchrun without --standalone or --rdzv-id" in proc.stderr and "output_dir=" in proc.stderr
    assert not list(tmp_path.rglob("checkpoints"))  # refused before any work


@pytest.mark.slow
def test_srun_environment_sets_the_world(data_cache, tmp_path):
    """Two tasks as `srun --ntasks-per-node=2 python train.py` starts them: SLURM's variables only."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
             "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "127.0.0.1",
             "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, str(REPO / "train.py"),
           *_shared_dir_overrides(data_cache, tmp_path, "logger=csv", "trainer.accelerator=cpu", "trainer.max_steps=4")]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env={**CPU_ENV, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert "launch: 2 CPU processes, DDP, ranks started by srun" in outs[0][1]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert run_dir.name == "slurm-4242_cpu_tiny_sdpa"
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 4


# --- two GPUs: the three launches at the same per-GPU throughput ----------------------------------------------
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="multi-GPU launch: needs 2 CUDA GPUs"
)


def _gpu_overrides(data_cache, out, *extra):
    import flash_kernel

    attention = "flash" if flash_kernel.is_available() else "sdpa"
    return ["model=gpt3-350m", f"attention={attention}", "seq_len=2048", "data.batch_size=8", "data.num_workers=2",
            "data.vocab_size=512", "data.max_documents=200", f"data.cache_dir={data_cache}", "data.val_batches=2",
            "trainer.max_steps=60", "trainer.log_every_n_steps=20", "trainer.val_check_interval=60",
            "trainer.enable_model_summary=false", "trainer.enable_progress_bar=false", "~callbacks.progress_bar",
            "~callbacks.checkpoint", "+trainer.enable_checkpointing=false", "logger=csv",
            f"output_dir={out}", f"hydra.run.dir={out}", *extra]


@pytest.mark.gpu
@two_gpus
def test_plain_torchrun_and_fsdp_launches_train_on_both_gpus(data_cache, tmp_path):
    """Each launch trains 60 steps of GPT3-350M at 16k tokens per GPU step with both GPUs busy (one rank per GPU:
    each rank records its device). The per-GPU tokens/s it prints are a measurement, not a test: docs/results.md
    holds them; speed targets live in benchmarks."""
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}, "PYTHONUNBUFFERED": "1"}
    launches = {
        "python": [sys.executable, "train.py"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"],
        "fsdp": [sys.executable, "train.py", "trainer=fsdp"],
    }
    rates = {}
    for name, cmd in launches.items():
        out = tmp_path / name
        proc = subprocess.run([*cmd, *_gpu_overrides(data_cache, out)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "metrics.json").read_text())
        assert summary["world_size"] == 2 and summary["global_step"] == 60
        devices = {json.loads(p.read_text())["device"] for p in (out / "ranks").glob("*.json")}
        assert devices == {"cuda:0", "cuda:1"}, f"{name}: ranks ran on {devices}"
        assert summary["perf/tokens_per_s"] > 0
        rates[name] = summary["perf/tokens_per_s"]
    print("per-GPU tokens/s:", {k: round(v) for k, v in rates.items()})
