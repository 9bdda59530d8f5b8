"""GPU test setup for flash_kernel: skip (with the reason) when there is no CUDA device or flash_kernel._C is
not built; seed each test from its id (fresh inputs per parameter set, reproducible on rerun); keep the
float32 reference matmuls in true float32 (no TF32), since the reference is the accuracy yardstick."""

import zlib
from pathlib import Path

import pytest
import torch

import flash_kernel
from flash_kernel.interface import set_kernel_overrides

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    reason = flash_kernel.unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"flash_kernel GPU tests: {reason}")
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def overrides():
    """flash_kernel.interface.set_kernel_overrides for this test; the defaults are back after it, pass or fail."""
    yield set_kernel_overrides
    set_kernel_overrides()


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    # "highest" = IEEE float32 in cuBLAS (no TF32), so the fp32 reference is ~1e-6 accurate.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)
