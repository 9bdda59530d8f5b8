"""bench/layout_rates.cu: it builds for sm_90a without spills (which would time the local memory, not the layouts),
and on a Hopper GPU it prints a rate for every case of both tables."""

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "bench" / "layout_rates.cu"
WGMMA_ROWS, TMA_ROWS = 36, 12  # 18 wgmma kernels at 2 and 3 warpgroups; 12 TMA cases of 9 kernels
KERNELS = WGMMA_ROWS // 2 + 9


def _build(tmp_path: Path) -> tuple[Path, str]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: it builds bench/layout_rates.cu")
    exe = tmp_path / "layout_rates"
    build = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                            f"-I{ROOT / 'flash_kernel' / 'csrc'}", str(SOURCE), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    return exe, build.stderr


def _table(lines: list[str], header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header line starts with `header`."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_it_builds_without_spills(tmp_path):
    _, ptxas = _build(tmp_path)
    usage = [line for line in ptxas.splitlines() if "spill stores" in line]
    assert len(usage) == KERNELS  # ptxas reports each kernel once
    assert all("0 bytes spill stores, 0 bytes spill loads" in line for line in usage), usage


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="layout_rates runs wgmma and TMA: needs a CUDA GPU")
def test_it_reports_every_case_on_hopper(tmp_path):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"its kernels are sm_90a's; this GPU is {torch.cuda.get_device_name()}")
    exe, _ = _build(tmp_path)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    wgmma = _table(lines, "| B | layout |")
    tma = _table(lines, "| d | boxes |")
    assert len(wgmma) == WGMMA_ROWS and len(tma) == TMA_ROWS
    for row in wgmma:
        assert row[0] in ("K-major", "N-major") and row[1] in ("SW128", "SW64", "SW32"), row
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in row[5:]), row
    for row in tma:
        cycles, tensor_rate, written_rate, gbs = map(float, row[2:])
        assert cycles > 0 and 0 < tensor_rate <= written_rate and gbs > 0, row
