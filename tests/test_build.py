"""flash_kernel/build.py on CPU: which -gencode flags and defines an FLASH_KERNEL_ARCHS value gives."""

import pytest

from flash_kernel import build


def test_default_builds_sm80_and_the_hopper_forward():
    flags = build._arch_flags(build.DEFAULT_ARCHS)
    assert "-gencode=arch=compute_80,code=sm_80" in flags
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert build.SM90A_DEFINE in flags  # hopper_kernel_traits.h compiles the wgmma forward only with it


def test_plain_sm90_builds_no_hopper_forward():
    flags = build._arch_flags("80;90")
    assert "-gencode=arch=compute_90,code=sm_90" in flags and build.SM90A_DEFINE not in flags


@pytest.mark.parametrize("archs,match", [("90;90a", "not both"), (" ; ", "names no architecture")])
def test_bad_arch_lists_are_refused_with_the_reason(archs, match):
    with pytest.raises(SystemExit, match=match):
        build._arch_flags(archs)
