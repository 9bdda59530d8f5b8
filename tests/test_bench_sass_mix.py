"""bench/sass_mix.py on SASS listings written here: which loop is the main one, how instructions are classed, the
table, and the inputs it refuses; where the CUDA toolkit is on PATH, a PTX file through ptxas and cuobjdump, and PTX
of a newer ISA than that ptxas reads."""

from __future__ import annotations

import re

import pytest

from bench import sass_mix as sm

# Two functions as `cuobjdump -sass` prints them: a kernel whose main loop (0x0040-0x0100) holds two HGMMAs, a
# short loop without any, and an out-of-line spin wait past EXIT that jumps back into the main loop; then a kernel
# without a loop.
LISTING = """
\tcode for sm_90a
\t\tFunction : _ZN5flash6kernelILi128EEEvv
\t.headerflags\t@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   IADD3 R2, R0, 0x1, RZ ;                /* 0x0000000100027810 */
        /*0030*/              @!P0 BRA 0x20 ;                             /* 0x0000000000000947 */
        /*0040*/                   UMOV UR9, 0x40000040 ;                 /* 0x4000004000097882 */
        /*0050*/                   UIADD3 UR10, UR15, 0x2, URZ ;          /* 0x00000002000a7890 */
        /*0060*/                   HGMMA.64x64x16.F32.BF16 R152, gdesc[UR8], R152 ; /* 0x00e00000089879f0 */
        /*0070*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+UR5+0x8000], R2 ;
        /*0080*/              @!P0 BRA 0x180 ;                            /* 0x0000000000000947 */
        /*0090*/                   MUFU.EX2 R4, R4 ;                      /* 0x0000000400047308 */
        /*00a0*/                   FFMA.FTZ R4, R4, R5, -R6 ;             /* 0x0000000504047223 */
        /*00b0*/                   F2FP.BF16.F32.PACK_AB R7, R4, R4 ;     /* 0x000000040407723e */
        /*00c0*/                   STSM.16.M88.4 [R4+0x20000], R216 ;     /* 0x0000000004007844 */
        /*00d0*/                   HGMMA.64x128x16.F32.BF16 R24, R208, gdesc[UR8].tnspB, R24, gsb0 ;
        /*00e0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*00f0*/                   LDS.64 R216, [R228] ;                  /* 0x00000000e4d87984 */
        /*0100*/               @P1 BRA 0x40 ;                             /* 0x0000000000000947 */
        /*0110*/                   STG.E.128 desc[UR10][R24.64], R8 ;     /* 0x0000000818007986 */
        /*0120*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0180*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+UR5+0x8000], R2 ;
        /*0190*/              @!P0 BRA 0x180 ;                            /* 0x0000000000000947 */
        /*01a0*/                   BRA 0x90 ;                             /* 0x0000000000000947 */
        /*01b0*/                   BRA 0x1b0;
\t\t..........

\t\tFunction : _ZN5flash7convertEv
        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0010*/                   FMUL.FTZ R2, R2, 0.5 ;
        /*0020*/                   EXIT ;
"""


def test_the_main_loop_is_the_backward_branch_over_the_most_tensor_core_instructions():
    kernel, convert = sm.parse_sass(LISTING)
    assert kernel.name == "_ZN5flash6kernelILi128EEEvv" and convert.name == "_ZN5flash7convertEv"
    assert (0x90, "MUFU.EX2 R4, R4") in kernel.code and (0x30, "BRA 0x20") in kernel.code  # predicates stripped
    # 0x20-0x30 (no HGMMA), 0x40-0x100 (two), the spin wait on itself; not 0x90-0x1a0 (it holds the EXIT)
    assert sm.loops(kernel) == [(0x20, 0x30), (0x40, 0x100), (0x180, 0x190)]
    assert sm.main_loop(kernel) == (0x40, 0x100)
    assert sm.main_loop(convert) is None


# A persistent kernel as cuobjdump prints it: a loop over tiles (0x10-0x90) holds each tile's first and last HGMMAs
# and the main loop (0x20-0x60), which holds an inline spin wait (0x30-0x40) without any.
PERSISTENT = """
\tcode for sm_90a
\t\tFunction : _ZN5flash10persistentEv
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+UR5+0x8000], R2 ;
        /*0040*/              @!P0 BRA 0x30 ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, R208, gdesc[UR8].tnspB, R24, gsb0 ;
        /*0060*/               @P1 BRA 0x20 ;
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0080*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0090*/               @P2 BRA 0x10 ;
        /*00a0*/                   EXIT ;
"""


def test_the_main_loop_of_a_persistent_kernel_is_inside_its_loop_over_tiles():
    (kernel,) = sm.parse_sass(PERSISTENT)
    assert sm.loops(kernel) == [(0x30, 0x40), (0x20, 0x60), (0x10, 0x90)]
    assert sm.main_loop(kernel) == (0x20, 0x60)  # two HGMMAs, where the tile loop has five


def test_instructions_are_classed_by_opcode():
    assert sm.class_of("HGMMA.64x64x16.F32.BF16") == sm.class_of("WARPGROUP.ARRIVE") == "tensor core"
    assert sm.class_of("UMOV") == sm.class_of("UIADD3") == sm.class_of("R2UR") == "uniform datapath"
    assert sm.class_of("UTMALDG.4D") == sm.class_of("UBLKRED.G.S.ADD.F32.RN") == "global / TMA"
    assert sm.class_of("LDGSTS.E") == sm.class_of("STG.E.128") == "global / TMA"
    assert sm.class_of("LDS.64") == sm.class_of("STSM.16.M88.4") == "shared memory"
    assert sm.class_of("MUFU.EX2") == "special function (MUFU)"
    assert sm.class_of("LDL.LU.64") == sm.class_of("STL") == "local memory (spills)"
    assert sm.class_of("FFMA.FTZ") == sm.class_of("FSEL") == "fp32 math"
    assert sm.class_of("F2FP.BF16.F32.PACK_AB") == "conversion, packing"
    assert sm.class_of("SYNCS.PHASECHK.TRANS64.TRYWAIT") == sm.class_of("BAR.SYNC.DEFER_BLOCKING") == \
        "barriers, fences"
    assert sm.class_of("BRA") == sm.class_of("BSSY") == "branches"
    assert sm.class_of("IMAD.WIDE.U32") == sm.class_of("ISETP.GT.OR") == "integer, predicates"
    assert sm.class_of("HYPOTHETICAL") == "other"


def test_the_mix_counts_the_main_loop_and_the_table_shows_it(tmp_path):
    listing = tmp_path / "kernels.sass"
    listing.write_text(LISTING)
    mixes = sm.read_inputs([f"ours={listing}", str(listing)], r"kernelILi128")
    assert [m.label for m in mixes] == ["ours", "kernels.sass"]
    m = mixes[0]
    assert m.loop == (0x40, 0x100) and m.total == 13
    assert m.classes["tensor core"] == 2 and m.classes["uniform datapath"] == 2
    assert m.classes["special function (MUFU)"] == 1 and m.classes["shared memory"] == 2
    assert m.classes["barriers, fences"] == 2 and m.classes["branches"] == 2
    assert sum(m.classes.values()) == m.total
    assert m.opcodes["HGMMA.64x64x16.F32.BF16"] == 1 and m.opcodes["BRA"] == 2
    text = sm.table(mixes, top=3)
    assert "| loop (addresses) | 0x40-0x100 | 0x40-0x100 |" in text
    assert "| instructions | 13 | 13 |" in text
    assert "| tensor core | 2 (15%) | 2 (15%) |" in text
    assert "| global / TMA |" not in text  # a class no input has is left out
    opcode_rows = text.split("| opcode |")[1].splitlines()[2:]
    assert len(opcode_rows) == 3 and all(row.startswith("| ") for row in opcode_rows)  # --top 3
    convert = sm.read_inputs([str(listing)], r"convert")[0]
    assert convert.loop is None and convert.total == 3  # no loop: the whole kernel
    assert "no loop: the whole kernel" in sm.table([convert], top=2)


def test_each_input_may_have_its_own_kernel_pattern(tmp_path):
    assert sm.kernel_patterns([]) == (".", {})
    assert sm.kernel_patterns(["bwd", "fa4=Backward", "ours=hopper<.*128"]) == \
        ("bwd", {"fa4": "Backward", "ours": "hopper<.*128"})
    assert sm.kernel_patterns(["(?i)x=y"]) == ("(?i)x=y", {})  # not a label before the '=': a pattern of its own
    listing = tmp_path / "kernels.sass"
    listing.write_text(LISTING)
    mixes = sm.read_inputs([f"a={listing}", f"b={listing}"], "kernelILi128", {"b": "convert"})
    assert [(m.label, m.loop) for m in mixes] == [("a", (0x40, 0x100)), ("b", None)]


def test_names_demangle_where_cxxfilt_is(monkeypatch):
    assert sm.demangle([]) == []
    monkeypatch.setattr(sm.shutil, "which", lambda name: None)
    assert sm.demangle(["_ZN5flash7convertEv"]) == ["_ZN5flash7convertEv"]


def test_a_demangled_name_loses_its_parameter_list_only():
    """The parameter list is the parenthesized group at the end; `(anonymous namespace)` before it is a scope (a
    standalone .cu file's kernels live there), which cutting at the first parenthesis would leave as an empty name."""
    assert sm.without_parameters("void (anonymous namespace)::tma_loop<64, 1, 32, 1>((anonymous namespace)::TileMaps, "
                                 "long long*, int)") == "(anonymous namespace)::tma_loop<64, 1, 32, 1>"
    assert sm.without_parameters("void flash::kernel<128>(flash::Params, int)") == "flash::kernel<128>"
    assert sm.without_parameters("flash::other()") == "flash::other"
    assert sm.without_parameters("flash::plain") == "flash::plain"


def test_a_ptx_file_names_its_arch():
    assert sm.ptx_arch(".version 8.7\n.target sm_90a\n.address_size 64\n") == "sm_90a"
    assert sm.ptx_arch(".version 8.0\n  .target sm_80\n") == "sm_80"
    assert sm.ptx_arch("// no target line\n") == "sm_90a"


def test_inputs_it_cannot_read_are_refused_with_the_reason(tmp_path):
    listing = tmp_path / "kernels.sass"
    listing.write_text(LISTING)
    with pytest.raises(SystemExit, match="no such file"):
        sm.read_inputs([str(tmp_path / "missing.cubin")], ".")
    with pytest.raises(SystemExit, match="no kernel of .* matches 'attention'"):
        sm.read_inputs([str(listing)], "attention")
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(b"\x7fELF")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sm.shutil, "which", lambda name: None)
        with pytest.raises(SystemExit, match="cuobjdump is not on PATH"):
            sm.read_inputs([str(cubin)], ".")


LOOP_KERNEL = r"""
extern "C" __global__ void scale_rows(float* x, int n, int steps) {
    float v = x[threadIdx.x];
    for (int i = 0; i < steps; ++i) v = __expf(v) * 0.5f + x[i % n];
    x[threadIdx.x] = v;
}
"""


@pytest.fixture
def loop_ptx(tmp_path):
    """LOOP_KERNEL as PTX from nvcc (this toolkit's PTX ISA); the CUDA toolkit's tools turn it into SASS."""
    missing = [tool for tool in ("nvcc", "ptxas", "cuobjdump", "nvdisasm") if sm.shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not on PATH: the CUDA toolkit turns the PTX into SASS")
    source, ptx = tmp_path / "loop.cu", tmp_path / "loop.ptx"
    source.write_text(LOOP_KERNEL)
    sm._run(["nvcc", "-ptx", "-O3", "-arch=compute_90a", str(source), "-o", str(ptx)])
    return ptx


def test_a_ptx_file_goes_through_ptxas_and_cuobjdump(loop_ptx):
    (m,) = sm.read_inputs([f"loop={loop_ptx}"], "scale_rows")
    assert m.kernel == "scale_rows" and m.loop is not None
    assert m.classes["special function (MUFU)"] >= 1 and m.classes["branches"] >= 1
    assert sum(m.classes.values()) == m.total


def test_a_newer_ptx_version_is_recognized_and_rewritten():
    # FA4's CuTe DSL writes PTX of its own toolkit's ISA (9.4 from CUTLASS DSL 4.8), which an older ptxas refuses.
    assert sm.ptx_at_version("//\n.version 9.4\n.target sm_90a\n", "9.0") == "//\n.version 9.0\n.target sm_90a\n"
    said = sm.NEWER_PTX.search("ptxas x.ptx, line 9; fatal   : Unsupported .version 9.4; current version is '9.0'")
    assert said.groups() == ("9.4", "9.0")


def test_ptx_of_a_newer_isa_is_assembled_at_this_ptxas_version(loop_ptx, tmp_path, capsys):
    own = re.search(r"^\.version (\S+)", loop_ptx.read_text(), re.MULTILINE).group(1)
    major, minor = own.split(".")
    newer = tmp_path / "newer.ptx"
    newer.write_text(sm.ptx_at_version(loop_ptx.read_text(), f"{major}.{int(minor) + 1}"))
    (m,) = sm.read_inputs([f"newer={newer}"], "scale_rows")
    assert m.kernel == "scale_rows" and m.loop is not None
    assert f"assembled as {own}" in capsys.readouterr().err
