"""Build the FlashAttention-2 CUDA extension in place: `python -m flash_kernel.build [--require] [--out DIR]`.

Compiles flash_kernel/csrc/*.cu + flash_api.cpp with torch.utils.cpp_extension (ninja, MAX_JOBS
defaulting to the core count) into flash_kernel/_build/, then copies the shared object next to the
package as flash_kernel/_C<ext suffix> so `import flash_kernel._C` works. The kernels follow FA2 (Dao, 2023)
Algorithms 1 and 2; see csrc/flash_fwd_kernel.cuh (and its Hopper form, csrc/flash_fwd_hopper_kernel.cuh) and
csrc/flash_bwd_common.cuh.

With --out DIR it builds in DIR/_build and puts the extension at DIR/_C<ext suffix> instead, leaving the package's
own build alone: a second build (other nvcc flags, say) that FLASH_KERNEL_EXT or `bench/kernel.py --candidate` runs
beside it (flash_kernel/interface.py).

Environment:
  FLASH_KERNEL_ARCHS   semicolon-separated SM versions, default "80;90a" (one -gencode each). "90a" (Hopper's
                       arch-specific target, needed by wgmma) also compiles the Hopper forward and makes H100/H200
                       run it; "90" instead builds the sm80 kernels only, for sm_90. Not both.
  MAX_JOBS             parallel compile jobs, default: all cores
  FLASH_KERNEL_NVCC_EXTRA  extra nvcc flags, shell-split and appended (default none), e.g.
                       "-Xptxas -v" for the kernels' registers and spills; only the .cu files recompile when it
                       changes
Without CUDA (CPU-only torch, no CUDA device, or no CUDA_HOME) it prints why and exits 0, or 1 with --require.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import sys
import sysconfig
import time

PKG_DIR = os.path.dirname(os.path.abspath(__file__))
CSRC_DIR = os.path.join(PKG_DIR, "csrc")
BUILD_DIR = os.path.join(PKG_DIR, "_build")
EXT_NAME = "_C"
DEFAULT_ARCHS = "80;90a"
SM90A_DEFINE = "-DFLASH_KERNEL_SM90A"  # hopper_kernel_traits.h: the wgmma forward is compiled in


def _unavailable_reason() -> str | None:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - torch is a hard dependency
        return f"torch is not importable ({e})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (no CUDA)"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no CUDA device or driver)"
    if cpp_extension.CUDA_HOME is None:
        return "CUDA_HOME is not set and nvcc was not found"
    return None


def _arch_flags(archs: str) -> list[str]:
    names = [a.strip().replace(".", "") for a in archs.replace(",", ";").split(";") if a.strip()]
    if not names:
        raise SystemExit(f"FLASH_KERNEL_ARCHS={archs!r} names no architecture")
    if "90" in names and "90a" in names:
        # An sm_90 GPU would load one of the two cubins; only the 90a one has the Hopper forward.
        raise SystemExit(f"FLASH_KERNEL_ARCHS={archs!r}: name 90a (with the Hopper forward) or 90, not both")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in names]
    return flags + ([SM90A_DEFINE] if "90a" in names else [])


def _cublaslt_flags(cuda_home: str | None) -> list[str]:
    """The linker flag for cuBLASLt (csrc/gelu_gemm.cu calls it) where the toolkit has the library; without it the
    extension's cuBLASLt symbols resolve, when it loads, to the libcublasLt that `import torch` has loaded."""
    found = cuda_home and any(os.path.exists(os.path.join(cuda_home, d, "libcublasLt.so")) for d in ("lib64", "lib"))
    return ["-lcublasLt"] if found else []


def install(built: str, target: str) -> None:
    """Put the built extension at `target` as a new file renamed into place. A process that imported the old one
    (a training run while `make test` rebuilds) keeps running it: copying over it in place would rewrite the pages
    that process has mapped, and it would crash."""
    partial = f"{target}.{os.getpid()}.partial"
    shutil.copy2(built, partial)
    os.replace(partial, target)


def build(verbose: bool = False, out: str | None = None) -> str:
    """Compile and copy the extension (into the package, or into `out`); returns the path of the loadable .so."""
    from torch.utils import cpp_extension

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    archs = os.environ.get("FLASH_KERNEL_ARCHS", DEFAULT_ARCHS)
    sources = sorted(glob.glob(os.path.join(CSRC_DIR, "*.cu"))) + [os.path.join(CSRC_DIR, "flash_api.cpp")]
    build_dir = os.path.join(out, "_build") if out else BUILD_DIR
    os.makedirs(build_dir, exist_ok=True)
    extra = os.environ.get("FLASH_KERNEL_NVCC_EXTRA", "")
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "-lineinfo",  # source lines in compute-sanitizer / ncu reports; no effect on code
        "--ptxas-options=-warn-spills",
        *_arch_flags(archs),
        *shlex.split(extra),
    ]
    print(f"flash_kernel: building {len(sources)} sources for sm {archs} with MAX_JOBS={os.environ['MAX_JOBS']}"
          + (f", extra nvcc flags {extra!r}" if extra else ""), flush=True)
    t0 = time.perf_counter()
    cpp_extension.load(
        name=EXT_NAME,
        sources=sources,
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=nvcc_flags,
        extra_ldflags=_cublaslt_flags(cpp_extension.CUDA_HOME),
        extra_include_paths=[CSRC_DIR],
        build_directory=build_dir,
        verbose=verbose,
        is_python_module=True,
    )
    built = os.path.join(build_dir, EXT_NAME + ".so")
    target = os.path.join(out or PKG_DIR, EXT_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    install(built, target)
    print(f"flash_kernel: built {target} in {time.perf_counter() - t0:.1f} s", flush=True)
    if out:
        print(f"flash_kernel: run it with FLASH_KERNEL_EXT={target}, or time it beside the package's build with "
              f"`python bench/kernel.py --candidate {target} --methods ours ours_candidate ...`", flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require", action="store_true", help="fail (exit 1) instead of skipping without CUDA")
    parser.add_argument("--verbose", action="store_true", help="show the ninja/nvcc command lines")
    parser.add_argument("--out", metavar="DIR", help="build in DIR and put the extension there, not in the package")
    args = parser.parse_args(argv)
    reason = _unavailable_reason()
    if reason is not None:
        print(f"flash_kernel: not building the CUDA extension: {reason}", flush=True)
        return 1 if args.require else 0
    build(verbose=args.verbose, out=os.path.abspath(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
