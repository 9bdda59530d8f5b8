"""flash_kernel/build.py on CPU: which -gencode flags and defines an FLASH_KERNEL_ARCHS value gives, and how the
built extension is put in place."""

import mmap

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


def test_install_leaves_a_loaded_extension_intact(tmp_path):
    """A rebuild while a process has the extension mapped (a training run during `make test`): that process must
    keep reading the bytes it loaded. An in-place copy rewrites the mapped pages (the process crashed with SIGSEGV)."""
    target, built = tmp_path / "_C.so", tmp_path / "built.so"
    target.write_bytes(b"old kernel " * 4096)
    built.write_bytes(b"new kernel " * 4096)
    with open(target, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as loaded:
        build.install(str(built), str(target))
        assert loaded[:11] == b"old kernel "  # what the running process sees
    assert target.read_bytes() == built.read_bytes()  # what the next import loads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_C.so", "built.so"]  # no partial file left
