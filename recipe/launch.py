"""The launch: which launcher started this process, the world it gives, and the run directory's name.

    python train.py ...                               one process; on N > 1 GPUs Lightning starts the other ranks
    torchrun --standalone --nproc_per_node=N train.py ...   N ranks, the world from torchrun's environment
    srun --ntasks-per-node=N python train.py ...      N ranks per node, the world from SLURM's environment

Lightning reads the same environment (TorchElasticEnvironment, SLURMEnvironment, LightningEnvironment for
any launcher that sets WORLD_SIZE / LOCAL_RANK / RANK). This module reads it before the Trainer exists, so
that conf/trainer/default.yaml can follow the launch (devices: ${launch_devices:}, num_nodes:
${launch_nodes:}) and recipe/checks.py can refuse a launch that cannot work before any work.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Mapping

import torch


@dataclass(frozen=True)
class Launcher:
    name: str  # "torchrun", "srun", "WORLD_SIZE/RANK launcher", or "python" (Lightning starts any other ranks)
    world_size: int  # ranks in the whole launch; 1 for "python"
    ranks_per_node: int
    num_nodes: int
    local_rank: int

    @property
    def external(self) -> bool:
        """True when a launcher outside Lightning started the ranks (their world is fixed by it)."""
        return self.name != "python"


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    match = re.match(r"\d+", env.get(key, ""))  # SLURM writes counts such as "8(x2)"
    return int(match.group()) if match else default


def _srun(env: Mapping[str, str]) -> bool:
    # Lightning's SLURMEnvironment.detect: srun's tasks, unless the job is named for an interactive shell
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def _world_size_launcher(name: str, env: Mapping[str, str]) -> Launcher:
    """A launcher that describes the world in torch.distributed's variables (torchrun and its kind)."""
    world = _int(env, "WORLD_SIZE", 1)
    per_node = _int(env, "LOCAL_WORLD_SIZE", world)
    return Launcher(name, world, per_node, max(1, world // per_node), _int(env, "LOCAL_RANK", 0))


def detect_launcher(env: Mapping[str, str] | None = None) -> Launcher:
    """The launcher of this process, checked in Lightning's order (torchrun first: it also runs inside SLURM)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        return _world_size_launcher("torchrun", env)
    if _srun(env):
        world = _int(env, "SLURM_NTASKS", 1)
        nodes = _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
        per_node = _int(env, "SLURM_NTASKS_PER_NODE", max(1, world // nodes))
        return Launcher("srun", world, per_node, nodes, _int(env, "SLURM_LOCALID", 0))
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:
        return _world_size_launcher("WORLD_SIZE/RANK launcher", env)
    # one process (or a rank Lightning started: its LOCAL_RANK / WORLD_SIZE follow the same config)
    return Launcher("python", 1, 1, 1, 0)


def launch_devices() -> int | str:
    """trainer.devices by default: the launcher's ranks per node, or "auto" (every GPU of the node)."""
    launcher = detect_launcher()
    return launcher.ranks_per_node if launcher.external else "auto"


def launch_nodes() -> int:
    """trainer.num_nodes by default: the launcher's node count, else 1."""
    return detect_launcher().num_nodes


def shared_launch_id(env: Mapping[str, str] | None = None) -> str | None:
    """An id that every rank of one torchrun / srun launch sees alike (None when there is none)."""
    env = os.environ if env is None else env
    # a multi-task srun; a lone `python train.py` inside a SLURM job keeps time-of-day names, so that
    # consecutive runs of one job do not share a directory
    if env.get("SLURM_JOB_ID") and _int(env, "SLURM_NTASKS", 1) > 1:
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":  # torchrun --standalone (a fresh uuid) or --rdzv-id
        return f"torchrun-{run_id[:8]}"
    return None


_FIRST_LAUNCH_ID: list[str] = []


def launch_id() -> str:
    """The run directory's name stem: the time of day for a plain launch; under torchrun or srun the launch's
    own id, since the ranks start at different seconds and must share one run directory. The first value of
    the process is kept: Hydra resolves hydra.run.dir again on each read (Lightning reads it to give the ranks
    it starts the same directory), and a clock that moved on would name another."""
    if not _FIRST_LAUNCH_ID:
        _FIRST_LAUNCH_ID.append(shared_launch_id() or datetime.now().strftime("%H-%M-%S"))
    return _FIRST_LAUNCH_ID[0]


def run_name(experiment: str | None, model: str, attention: str) -> str:
    """What ran, for the run directory: the experiment (else the model preset) and the attention."""
    return f"{experiment if experiment not in (None, 'None', '') else model}_{attention}"


def needs_shared_run_dir(env: Mapping[str, str] | None = None) -> bool:
    """True for a torchrun launch whose ranks have no common id to name one run directory by."""
    env = os.environ if env is None else env
    return _int(env, "WORLD_SIZE", 1) > 1 and "TORCHELASTIC_RUN_ID" in env and shared_launch_id(env) is None


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def output_dir(cfg) -> str:
    """The run directory: output_dir when set, else Hydra's run dir (one for all ranks of a launch)."""
    from hydra.core.hydra_config import HydraConfig

    from recipe.checks import ConfigError

    if cfg.get("output_dir"):
        return str(cfg.output_dir)
    if needs_shared_run_dir():
        raise ConfigError(
            "torchrun without --standalone or --rdzv-id gives the ranks nothing in common to name one run "
            "directory by; add --standalone (one node) or --rdzv-id=<job id>, or pass output_dir=<shared path>"
        )
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.output_dir
    return os.getcwd()


def release_process_group() -> None:
    """Destroy torch.distributed's process groups at the end of a run and end their threads while the interpreter
    still runs: gloo's workers and transport loops, and the rendezvous store's server on the rank that hosts it.
    Two-rank CPU runs that left them to the interpreter's teardown now and then aborted there, after finishing and
    writing everything ("terminate called without an active exception", exit status -6).

    A group's threads end with its last reference. destroy_process_group drops torch.distributed's own; the others:
      - DDP's reducer and FSDP2's parameter groups, in the trainer's and the model's reference cycles: the caller
        lets go of them, and the collection here frees them;
      - FSDP2's device meshes, which DTensor's sharding and redistribution caches keep for the life of the
        process: each mesh still alive lets go of its groups (`_pg_registry`, where this torch has one).
    tests/test_launch.py checks that no thread of torch.distributed is left in either rank of a DDP and an FSDP2
    run."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.destroy_process_group()
    if "torch.distributed.device_mesh" in sys.modules:
        from torch.distributed.device_mesh import DeviceMesh

        for mesh in (obj for obj in gc.get_objects() if type(obj) is DeviceMesh):  # isinstance warns on some objects
            groups = getattr(mesh, "_pg_registry", None)
            if isinstance(groups, dict):
                groups.clear()
    gc.collect()


def describe_launch(trainer, launcher: Launcher) -> str:
    """One line: the ranks, the devices they run on, the nodes, the strategy and what started the ranks."""
    device = trainer.strategy.root_device
    world, nodes = trainer.world_size, trainer.num_nodes
    unit = ("GPU", "GPUs") if device.type == "cuda" else ("CPU process", "CPU processes")
    line = f"launch: {world} {unit[world > 1]}"
    if nodes > 1:
        line += f" = {nodes} nodes × {trainer.num_devices}"
    if device.type == "cuda":
        line += f" ({torch.cuda.get_device_name(device)})"
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    from model.fsdp2 import FSDP2Strategy

    kinds = ((FSDPStrategy, "FSDP"), (FSDP2Strategy, "FSDP2"), (DDPStrategy, "DDP"),
             (SingleDeviceStrategy, "one device"))  # subclasses too
    strategy = next((label for cls, label in kinds if isinstance(trainer.strategy, cls)), type(trainer.strategy).__name__)
    line += f", {strategy}"
    if world > 1:
        line += f", ranks started by {launcher.name if launcher.external else 'Lightning'}"
    unused = visible_gpus() - trainer.num_devices
    if unused > 0:
        how = (
            "start one rank per GPU: torchrun --nproc_per_node, srun --ntasks-per-node"
            if launcher.external
            else "the default trainer.devices=auto takes them all"
        )
        if device.type != "cuda":
            how = "trainer.accelerator=cpu"
        line += f"; {unused} more visible GPU(s) unused ({how})"
    return line
