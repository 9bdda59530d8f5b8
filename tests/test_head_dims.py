"""One definition of the supported head dims, checked on the host.

tests/head_dims_check.cu compiles kernel_traits.h and static_switch.h for the CPU: the runtime switch runs every
multiple of 8 on round_head_dim's choice. Here: that list has one forward and one backward .cu file per dtype
and nothing else, and flash_kernel/interface.py's range (which model/attention.py imports) ends where it does.
"""

import re
from pathlib import Path

from flash_kernel.interface import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM

CSRC = Path(__file__).resolve().parents[1] / "flash_kernel" / "csrc"


def test_head_dims_are_defined_once(host_check):
    lines = host_check("head_dims_check.cu")
    assert len(lines) == 2 and lines[0].startswith("head dims ") and lines[1].startswith("max ")
    head_dims = [int(x) for x in lines[0].split()[2:]]
    assert head_dims and int(lines[1].split()[1]) == head_dims[-1] == MAX_HEAD_DIM
    assert all(d % HEAD_DIM_MULTIPLE == 0 for d in head_dims)
    files = {p.name for p in CSRC.glob("flash_*_hdim*.cu")}
    assert files == {f"flash_{p}_hdim{d}_{t}.cu" for p in ("fwd", "bwd") for d in head_dims for t in ("bf16", "fp16")}
    for name in files:  # each instantiates its own head dim and dtype
        text = (CSRC / name).read_text()
        d, dtype = re.fullmatch(r"flash_\w+_hdim(\d+)_(\w+)\.cu", name).groups()
        element = {"bf16": "__nv_bfloat16", "fp16": "__half"}[dtype]
        assert f"<{element}, {d}>" in text, name
