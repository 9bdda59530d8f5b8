"""Shared test fixtures: `data_cache` for CPU training runs (tests/run_overrides.py writes their overrides);
`host_check` compiles one of the tests/*_check.cu programs with nvcc for the CPU (they include kernel headers, so no
GPU is needed) and runs it; `device_ptx` compiles a kernel file to PTX, `host_object` with its host code. Each nvcc
run takes the flags torch's extension build adds (`_extension_flags`)."""

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CSRC = TESTS.parent / "flash_kernel" / "csrc"


def pytest_xdist_auto_num_workers(config) -> int:
    """pytest-xdist's worker count for `-n auto` (make test): without a visible CUDA GPU one per core, up to 4, each
    running whole test files (--dist loadfile: a file's nvcc builds and data cache are made once); with one, none, so
    that the tests run in this process one after another: the GPU tests share the device and the two-GPU tests need
    both GPUs."""
    import torch

    cores = os.cpu_count() or 1
    return 0 if torch.cuda.is_available() or cores < 2 else min(cores, 4)


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
            build = subprocess.run([nvcc, "-std=c++17", "-O2", *_extension_flags(), f"-I{CSRC}", str(TESTS / source),
                                    "-o", str(exe)], capture_output=True, text=True)
            assert build.returncode == 0, build.stderr
            result = subprocess.run([str(exe)], capture_output=True, text=True)
            assert result.returncode == 0, result.stdout
            outputs[source] = result.stdout.splitlines()
        return outputs[source]

    return run


def _extension_flags() -> list[str]:
    """The flags torch's extension build gives every nvcc run (COMMON_NVCC_FLAGS): among them
    -D__CUDA_NO_HALF_CONVERSIONS__ and -D__CUDA_NO_BFLOAT16_CONVERSIONS__, which take away the implicit float <->
    half / bfloat16 conversions a bare nvcc run allows, so code that leans on them compiles here only if it would
    compile in `make build`."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return list(COMMON_NVCC_FLAGS)


def _compile_kernel_file(nvcc: str, mode: list[str], source: str, defines: list[str], out: Path) -> None:
    """nvcc `mode` (what to make) on a csrc file with the Hopper kernels, the extension's flags and these -D defines;
    asserts it built."""
    build = subprocess.run([nvcc, *mode, "-std=c++17", "-DFLASH_KERNEL_SM90A", *_extension_flags(),
                            *(f"-D{d}" for d in defines), f"-I{CSRC}", str(CSRC / source), "-o", str(out)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]


SWITCH_DEFAULT = re.compile(r"^#ifndef (FLASH_\w+)\n#define \1 (\S+)", re.M)


def switch_defaults() -> dict[str, str]:
    """{NAME: value} of the build switches the csrc headers default with `#ifndef NAME` / `#define NAME value`."""
    found: dict[str, set[str]] = {}
    for header in sorted([*CSRC.glob("*.h"), *CSRC.glob("*.cuh")]):
        for name, value in SWITCH_DEFAULT.findall(header.read_text()):
            found.setdefault(name, set()).add(value)
    return {name: values.pop() for name, values in found.items() if len(values) == 1}


class DevicePtx:
    """device_ptx("flash_fwd_hdim128_bf16.cu", ["NAME=1"]) -> the PTX nvcc makes of that csrc file for sm_90a (the
    Hopper kernels, no ptxas: seconds, not minutes) with these -D defines. Each build is made once per pytest run,
    keyed by the file and the defines that differ from the headers' defaults (a switch at its default builds what
    naming no switch builds), and many build-switch tests share one (a file's default build above all).
    device_ptx.each(source, defines_a, defines_b, ...) makes the builds not yet made side by side, one nvcc per core."""

    def __init__(self, nvcc: str, root: Path):
        self.nvcc, self.root = nvcc, root
        self.defaults = switch_defaults()
        self.made: dict[tuple[str, tuple[str, ...]], Path] = {}

    def key(self, source: str, defines: list[str]) -> tuple[str, tuple[str, ...]]:
        values = {}
        for define in defines:  # "NAME" alone is NAME=1, as for nvcc -D; a later NAME wins
            name, sep, value = define.partition("=")
            values[name] = value if sep else "1"
        return source, tuple(sorted(f"{n}={v}" for n, v in values.items() if v != self.defaults.get(n)))

    def _make(self, key: tuple[str, tuple[str, ...]]) -> Path:
        source, defines = key
        ptx = self.root / f"{Path(source).stem}.{'.'.join(defines) or 'default'}.ptx"
        _compile_kernel_file(self.nvcc, ["-ptx", "-O3", "-arch=compute_90a"], source, list(defines), ptx)
        return ptx

    def each(self, source: str, *defines: list[str]) -> list[str]:
        keys = [self.key(source, d) for d in defines]
        missing = [k for k in dict.fromkeys(keys) if k not in self.made]
        if missing:
            with ThreadPoolExecutor(max_workers=min(len(missing), os.cpu_count() or 1)) as pool:
                self.made.update(zip(missing, pool.map(self._make, missing)))
        return [self.made[k].read_text() for k in keys]

    def __call__(self, source: str, defines: list[str]) -> str:
        return self.each(source, defines)[0]


@pytest.fixture(scope="session")
def device_ptx(tmp_path_factory) -> DevicePtx:
    """The run's DevicePtx: compiles kernel files to PTX (nvcc's absence skips the test)."""
    return DevicePtx(_nvcc("compiles the kernels to PTX"), tmp_path_factory.mktemp("device_ptx"))


@pytest.fixture
def host_object(tmp_path):
    """host_object("flash_fwd_hdim96_bf16.cu") compiles that csrc file as the build does, host code included, for
    sm_90a's PTX (no ptxas), and fails with nvcc's errors: the host compiler parses templates the device pass took.
    The device pass runs without NVVM's optimizer (-Xcicc -O0: 4 s instead of 9 for the hd96 forward here); its
    front end instantiates every template either way, and device_ptx compiles the optimized PTX."""
    nvcc = _nvcc("compiles the kernel files' host code")

    def run(source: str) -> None:
        _compile_kernel_file(nvcc, ["-c", "-O0", "-Xcicc", "-O0", "-gencode", "arch=compute_90a,code=compute_90a"],
                             source, [], tmp_path / f"{Path(source).stem}.o")

    return run


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One small prepared stdlib cache for the session's training runs (tiny vocab: BPE training in seconds)."""
    return tmp_path_factory.mktemp("data_cache")

