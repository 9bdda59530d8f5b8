"""The Hopper kernel files compile for the host too, where nvcc hands the host compiler (g++) the same templates.

tests/test_build_switches.py compiles the kernels to PTX, the device pass alone; g++ parses the launch code and the
traits it instantiates by rules of its own, and a construct the device pass accepts can fail there (a member variable
template in a template argument did). Here each Hopper head dim's forward and backward file is compiled as the build
compiles it (torch's extension flags among nvcc's), host code included, for sm_90a's PTX without ptxas.
"""

import pytest

# and one fp16 backward: its preprocess kernel instantiates store_ld_mma_row for __half
FILES = [*(f"flash_{p}_hdim{d}_bf16.cu" for d in (64, 96, 128) for p in ("fwd", "bwd")), "flash_bwd_hdim128_fp16.cu"]


@pytest.mark.parametrize("source", FILES)
def test_a_hopper_kernel_file_compiles_host_code_included(source, host_object):
    host_object(source)
