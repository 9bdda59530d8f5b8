"""The sm80 kernels' shared-memory layouts (flash_kernel/csrc/smem_tile.h), checked on the host.

tests/smem_tile_check.cu includes the header the kernels use, compiled by nvcc for the CPU (no GPU needed):
each layout keeps every element inside its row, ldmatrix conflict free, the swizzled copies in whole 128-byte
lines, and SmemTile::step equal to index() over the kernels' ldmatrix walks.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK_SRC = ROOT / "tests" / "smem_tile_check.cu"
CSRC = ROOT / "flash_kernel" / "csrc"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() else None


NVCC = _nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): it compiles the host check")
def test_smem_tile_layouts(tmp_path):
    exe = tmp_path / "smem_tile_check"
    build = subprocess.run([NVCC, "-std=c++17", f"-I{CSRC}", str(CHECK_SRC), "-o", str(exe)], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    layouts = ["padded 32", "padded 96", "padded 64", "padded 128", "swizzled 64", "swizzled 128", "swizzled 256"]
    assert run.stdout.split("\n")[:-1] == [f"ok {name}" for name in layouts]
