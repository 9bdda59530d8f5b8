"""The kernels' build switches (docs/kernel_design.md, "Build switches") compile, and compile to what they claim.

Each switch selects, with `if constexpr`, a schedule that the default build discards unchecked, so nothing else
compiles it until a GPU build does. Here nvcc compiles the affected Hopper instantiations to PTX (no ptxas, a few
seconds each) with and without the switch: with it, the source must compile, and a wgmma group must be waited for
while another is in flight (`wgmma.wait_group.sync.aligned 1`: S_j before the warpgroup's own P V in the forward,
dV and dQ_i before dK in the backward); without it, no such wait exists.
"""

import re

import pytest

SWITCHES = {  # switch -> an instantiation file whose schedule it changes
    "FLASH_FWD_INTRA_WG_OVERLAP": "flash_fwd_hdim128_bf16.cu",
    "FLASH_FWD_INTRA_WG_OVERLAP_HD64": "flash_fwd_hdim64_bf16.cu",
    "FLASH_BWD_DQ_BEFORE_DK": "flash_bwd_hdim128_bf16.cu",
}
WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned (\d+);")


def _waits(ptx: str) -> dict[int, int]:
    """{N: count} of `wgmma.wait_group N` in the PTX."""
    waits: dict[int, int] = {}
    for n in WAIT.findall(ptx):
        waits[int(n)] = waits.get(int(n), 0) + 1
    return waits


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_a_switch_compiles_and_waits_for_one_group_while_another_runs(switch, device_ptx):
    default = _waits(device_ptx(SWITCHES[switch], []))
    switched = _waits(device_ptx(SWITCHES[switch], [f"{switch}=1"]))
    assert default.get(0) and not default.get(1), default
    assert switched.get(0) and switched.get(1), switched
