"""Shared test fixtures: `data_cache` for CPU training runs (tests/run_overrides.py writes their overrides);
`host_check` compiles one of the tests/*_check.cu programs with nvcc for the CPU (they include kernel headers, so no
GPU and no torch is needed) and runs it; `device_ptx` compiles a kernel file to PTX, `host_object` with its host
code."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CSRC = TESTS.parent / "flash_kernel" / "csrc"


def _nvcc(purpose: str) -> str:
    """nvcc's path; the test skips, naming `purpose`, where there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    if not candidate.is_file():
        pytest.skip(f"nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): it {purpose}")
    return str(candidate)


@pytest.fixture(scope="session")
def host_check(tmp_path_factory):
    """host_check("name_check.cu") -> the program's stdout lines, once it built and exited 0 (built and run once per
    pytest run: its output depends on the sources alone)."""
    nvcc = _nvcc("compiles the host check")
    outputs: dict[str, list[str]] = {}

    def run(source: str) -> list[str]:
        if source not in outputs:
            exe = tmp_path_factory.mktemp("host_check") / Path(source).stem
            build = subprocess.run([nvcc, "-std=c++17", "-O2", f"-I{CSRC}", str(TESTS / source), "-o", str(exe)],
                                   capture_output=True, text=True)
            assert build.returncode == 0, build.stderr
            result = subprocess.run([str(exe)], capture_output=True, text=True)
            assert result.returncode == 0, result.stdout
            outputs[source] = result.stdout.splitlines()
        return outputs[source]

    return run


def _compile_kernel_file(nvcc: str, mode: list[str], source: str, defines: list[str], out: Path) -> None:
    """nvcc `mode` (what to make) on a csrc file with the Hopper kernels and these -D defines; asserts it built."""
    build = subprocess.run([nvcc, *mode, "-std=c++17", "-DFLASH_KERNEL_SM90A", "--expt-relaxed-constexpr",
                            *(f"-D{d}" for d in defines), f"-I{CSRC}", str(CSRC / source), "-o", str(out)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]


@pytest.fixture(scope="session")
def device_ptx(tmp_path_factory):
    """device_ptx("flash_fwd_hdim128_bf16.cu", ["NAME=1"]) -> the PTX nvcc makes of that csrc file for sm_90a (with
    the Hopper kernels, no ptxas: seconds, not minutes), with these -D defines; compiled once per pytest run for each
    (file, defines), which many build-switch tests share (a file's default build above all)."""
    nvcc = _nvcc("compiles the kernels to PTX")
    root = tmp_path_factory.mktemp("device_ptx")
    made: dict[tuple[str, tuple[str, ...]], Path] = {}

    def run(source: str, defines: list[str]) -> str:
        key = (source, tuple(defines))
        if key not in made:
            ptx = root / f"{Path(source).stem}.{len(made)}.ptx"
            _compile_kernel_file(nvcc, ["-ptx", "-O3", "-arch=compute_90a"], source, defines, ptx)
            made[key] = ptx
        return made[key].read_text()

    return run


@pytest.fixture
def host_object(tmp_path):
    """host_object("flash_fwd_hdim96_bf16.cu") compiles that csrc file as the build does, host code included, for
    sm_90a's PTX (no ptxas), and fails with nvcc's errors: the host compiler parses templates the device pass took."""
    nvcc = _nvcc("compiles the kernel files' host code")

    def run(source: str) -> None:
        _compile_kernel_file(nvcc, ["-c", "-O0", "-gencode", "arch=compute_90a,code=compute_90a"], source, [],
                             tmp_path / f"{Path(source).stem}.o")

    return run


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One small prepared stdlib cache for the session's training runs (tiny vocab: BPE training in seconds)."""
    return tmp_path_factory.mktemp("data_cache")

