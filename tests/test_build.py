"""flash_kernel/build.py on CPU: which -gencode flags and defines an FLASH_KERNEL_ARCHS value gives, and how the
built extension is put in place (the package's, or --out's)."""

import mmap
import os
import sysconfig

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


def test_out_builds_a_second_extension_and_leaves_the_packages_alone(tmp_path, monkeypatch, capsys):
    """--out DIR: the compile's build directory and the installed file are DIR's, with the extra nvcc flags; the
    package's extension and build directory are not touched."""
    from torch.utils import cpp_extension

    compiles = []

    def compile_extension(**kw):
        compiles.append(kw)
        with open(os.path.join(kw["build_directory"], build.EXT_NAME + ".so"), "wb") as f:
            f.write(b"candidate")

    monkeypatch.setattr(cpp_extension, "load", compile_extension)
    monkeypatch.setattr(build, "_unavailable_reason", lambda: None)
    monkeypatch.setenv("FLASH_KERNEL_NVCC_EXTRA", "-DFLASH_FWD_INTRA_WG_OVERLAP=1")
    monkeypatch.setenv("MAX_JOBS", "1")
    package_so = os.path.join(build.PKG_DIR, build.EXT_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    before = os.path.exists(package_so) and os.stat(package_so).st_mtime_ns
    assert build.main(["--out", str(tmp_path / "candidate")]) == 0
    (kw,) = compiles
    assert kw["build_directory"] == str(tmp_path / "candidate" / "_build")
    assert "-DFLASH_FWD_INTRA_WG_OVERLAP=1" in kw["extra_cuda_cflags"]
    target = tmp_path / "candidate" / (build.EXT_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    assert target.read_bytes() == b"candidate"
    assert (os.path.exists(package_so) and os.stat(package_so).st_mtime_ns) == before
    assert f"FLASH_KERNEL_EXT={target}" in capsys.readouterr().out


def test_cublaslt_is_linked_where_the_toolkit_has_it(tmp_path):
    """csrc/gelu_gemm.cu calls cuBLASLt: -lcublasLt where CUDA_HOME has the library, and no flag (the symbols then
    resolve to the libcublasLt that torch loaded) where it does not, or where there is no toolkit."""
    assert build._cublaslt_flags(str(tmp_path)) == [] and build._cublaslt_flags(None) == []
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libcublasLt.so").write_bytes(b"")
    assert build._cublaslt_flags(str(tmp_path)) == ["-lcublasLt"]
