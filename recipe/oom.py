"""CUDA out of memory, explained: another process on the same GPU when there is one, else the setting to change."""

from __future__ import annotations

import os
import re

import torch
from omegaconf import DictConfig

GIB = 2**30
# CUDA's own context and allocator slack: memory the GPU reports used that torch's allocator does not count
CONTEXT_SLACK_BYTES = 1 * GIB


class TrainingOutOfMemory(RuntimeError):
    """CUDA ran out of memory; the message names the likely cause and the setting to change."""


def other_processes(device: torch.device) -> list[str]:
    """'pid N (X MiB)' for each process other than this one holding memory on `device`, as NVML reports them
    (torch.cuda.list_gpu_processes); empty where NVML cannot say."""
    try:
        report = torch.cuda.list_gpu_processes(device)
    except Exception:  # no NVML (pynvml / amdsmi missing), or a driver that refuses the query
        return []
    found = re.findall(r"process\s+(\d+)\s+uses\s+([\d.]+)\s*MB", report)
    return [f"pid {pid} ({float(mib):.0f} MiB)" for pid, mib in found if int(pid) != os.getpid()]


def memory_held_by_others(device: torch.device) -> float:
    """Bytes in use on `device` that this process's allocator does not hold (cudaMemGetInfo against torch's)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, (total - free) - torch.cuda.memory_reserved(device) - CONTEXT_SLACK_BYTES)


def _shared_gpu(device: torch.device | None) -> str | None:
    if device is None or device.type != "cuda":
        return None
    try:
        others, held = other_processes(device), memory_held_by_others(device)
    except RuntimeError:  # the CUDA context itself is unusable after the error
        return None
    if held < GIB:  # NVML's pids alone can mislead: inside a container this process may show a host pid
        return None
    who = ", ".join(others) if others else "another process"
    return (
        f"Another process holds memory on this GPU ({device}): {who}, {held / GIB:.1f} GiB not held by this run. "
        "Two runs (or two ranks of one launch) on one GPU is the likely cause: stop the other process, or give "
        "each run its own GPUs (CUDA_VISIBLE_DEVICES). "
    )


def explain_oom(cfg: DictConfig, err: torch.OutOfMemoryError, device: torch.device | None = None) -> str:
    B, T, n_head = cfg.data.batch_size, cfg.seq_len, cfg.model.n_head
    msg = (
        f"CUDA out of memory with model={cfg.model.n_layer}L/{cfg.model.d_model}d, seq_len={T}, "
        f"data.batch_size={B}, attention={cfg.attention.name}. "
    )
    shared = _shared_gpu(device)
    if shared:
        msg += shared
    elif cfg.attention.name == "naive":
        score_gib = B * n_head * T * T * 2 / GIB  # bf16 (B, H, T, T) per layer, kept for backward
        msg += (
            f"Naive attention materializes the (B, H, T, T) scores: {score_gib:.1f} GiB per layer in bf16. "
            "Use attention=flash or attention=sdpa, or lower data.batch_size / seq_len. "
        )
    else:
        msg += (
            "Lower data.batch_size and set global_batch_tokens to the tokens per step you want (gradient "
            "accumulation keeps the global batch), or set model.activation_checkpointing=true. "
        )
    return msg + f"({str(err).splitlines()[0]})"
