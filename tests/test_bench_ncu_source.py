"""bench/ncu_source.py on CPU: ncu's source page (CSV, plain or gzipped) parsed, the stall reasons' shares, the
hottest instructions with the barrier before each, the commands a profile runs, and the inputs it refuses; on a GPU
with ncu on PATH, one real profile of our forward."""

import gzip
import shutil
from types import SimpleNamespace

import pytest
import torch

from bench import ncu_source as ns
from bench.ncu_compare import KERNELS

# The shape of `ncu --import r.ncu-rep --page source --csv --print-source sass`: the kernel's name, a header (ncu
# 2025.3.1 has some 70 columns; these are the ones read, a few others, and a "(Not Issued)" twin), one row per SASS
# instruction. 100 samples in all: 60 on the instruction after the barrier, 25 on the HGMMA (20 of them of a reason
# the page has no column for), 10 + 5 on the others.
PAGE = '''"Kernel Name","void flash::flash_bwd_hopper_kernel<T, true, false>(flash::BwdParams)"
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples",\
"Instructions Executed","stall_barrier","stall_long_sb","stall_mio","stall_selected","stall_barrier (Not Issued)"
"0x7f00","      LDC R1, c[0x0][0x28]","5","5","5","1,024","0","0","0","5","0"
"0x7f10","      BAR.SYNC.DEFER_BLOCKING 0x0","0","0","0","1,024","0","0","0","0","0"
"0x7f20","      UMOV UR8, UR16","60","59","60","1,024","59","0","0","1","59"
"0x7f30","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT","25","25","25","1,024","0","0","5","0","0"
"0x7f40","      FENCE.VIEW.ASYNC.S","10","10","10","1,024","0","9","0","1","0"
'''.replace("\\\n", "")


def test_the_source_page_is_parsed_per_instruction():
    view = ns.parse_source_csv(PAGE, "v39")
    assert view.kernel.startswith("void flash::flash_bwd_hopper_kernel")
    assert [line.sass for line in view.lines][:2] == ["LDC R1, c[0x0][0x28]", "BAR.SYNC.DEFER_BLOCKING 0x0"]
    assert view.samples == 100 and view.lines[0].executed == 1024
    assert view.lines[2].reasons == {"barrier": 59, "long_sb": 0, "mio": 0, "selected": 1}  # no "(Not Issued)"


def test_reason_shares_count_the_samples_no_column_names():
    shares = ns.reason_shares(ns.parse_source_csv(PAGE))
    assert list(shares) == ["barrier", "no column", "long_sb", "selected", "mio"]
    assert shares["barrier"] == pytest.approx(59) and shares["no column"] == pytest.approx(20)
    assert sum(shares.values()) == pytest.approx(100)


def test_the_summary_ranks_instructions_and_names_the_barrier_before_each():
    view = ns.parse_source_csv(PAGE, "v39")
    assert [line.index for line in ns.hottest(view, 2)] == [2, 3]
    assert ns.wait_before(view, 2) == "1 back: BAR.SYNC.DEFER_BLOCKING 0x0"
    assert ns.wait_before(view, 1) == ""  # nothing before the barrier itself
    text = ns.summary(view, 3)
    rows = [line for line in text.splitlines() if line.startswith("| 2 ") or line.startswith("| 3 ")]
    assert rows[0] == ("| 2 | 60.00 | 1,024 | `UMOV UR8, UR16` | barrier 98, selected 2 | "
                       "`1 back: BAR.SYNC.DEFER_BLOCKING 0x0` |")
    assert "mio 20, no column 80" in rows[1]
    assert "barrier 59.0, no column 20.0" in text and "100 warp-stall samples" in text


def test_inputs_are_read_plain_or_gzipped_and_labelled(tmp_path):
    plain, packed = tmp_path / "ours.csv", tmp_path / "fa4_hd128.csv.gz"
    plain.write_text(PAGE)
    packed.write_bytes(gzip.compress(PAGE.encode()))
    a, b = ns.read_views([f"v39={plain}", str(packed)])
    assert (a.label, b.label) == ("v39", "fa4_hd128") and a.samples == b.samples == 100


def test_what_is_not_a_source_page_is_refused(tmp_path):
    raw = tmp_path / "raw.csv"
    raw.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"0","k","1"\n')
    with pytest.raises(SystemExit, match="not ncu's source page"):
        ns.read_views([str(raw)])
    with pytest.raises(SystemExit, match="no such file"):
        ns.read_views([str(tmp_path / "missing.csv")])
    header_only = PAGE.splitlines()[:2]
    with pytest.raises(SystemExit, match="no instruction rows"):
        ns.parse_source_csv("\n".join(header_only) + "\n")


# A page with the SourceCounters section's shared-memory columns: two HGMMAs of one kind (their operand reads), a
# predicated STS.64 whose bank conflicts take 16 wavefronts more than 32, an FMUL that touches no shared memory.
SMEM_PAGE = '''"Kernel Name","k"
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","L1 Wavefronts Shared",\
"L1 Wavefronts Shared Ideal","stall_mio"
"0x0","      HGMMA.64x64x16.F32.BF16 R152, gdesc[UR8], RZ, !UPT","30","8","256","256","10"
"0x10","      HGMMA.64x64x16.F32.BF16 R152, gdesc[UR10], R152","20","8","256","256","5"
"0x20","@!P4  STS.64 [R186], R172","10","16","48","32","10"
"0x30","      FMUL.FTZ R1, R2, R3","40","64","0","0","0"
'''.replace("\\\n", "")


def test_by_opcode_sums_each_kind_of_instruction_per_unit():
    assert ns.opcode("@!P4  STS.64 [R186], R172") == "STS.64" and ns.opcode("HGMMA.64x80x16.F32.BF16 R1") == \
        "HGMMA.64x80x16.F32.BF16"
    view = ns.parse_source_csv(SMEM_PAGE, "ours")
    assert (view.lines[2].wavefronts, view.lines[2].ideal) == (48, 32)
    text = ns.by_opcode(view, per=8)
    assert [line for line in text.splitlines() if line.startswith("| `")] == [
        "| `HGMMA.64x64x16.F32.BF16` | 2.0 | 64.0 | 0.0 | 50.0 |",
        "| `STS.64` | 2.0 | 6.0 | 2.0 | 10.0 |",
        "| `FMUL.FTZ` | 8.0 | 0.0 | 0.0 | 40.0 |",
    ]
    assert "| all 3 kinds | 12.0 | 70.0 | 2.0 | 100.0 |" in text and "(per 8)" in text
    assert all(line.wavefronts == line.ideal == 0 for line in ns.parse_source_csv(PAGE).lines)  # no such columns


def test_summary_prints_the_opcode_table_on_request_and_refuses_a_bad_unit(tmp_path, capsys):
    page = tmp_path / "ours.csv"
    page.write_text(SMEM_PAGE)
    ns.main(["summary", str(page), "--top", "2"])
    assert "by kind of instruction" not in capsys.readouterr().out
    ns.main(["summary", f"v58={page}", "--opcodes", "--per", "2"])
    assert "### v58: by kind of instruction (per 2)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a positive count"):
        ns.main(["summary", str(page), "--opcodes", "--per", "0"])


def test_a_profile_runs_ncu_case_under_ncu_then_exports_the_source_page(tmp_path):
    args = SimpleNamespace(hdim=128, seqlen=8192, causal=1, mode="bwd")
    run, export = ns.profile_commands("ncu", "ours", args, tmp_path / "ours")
    assert run[:3] == ["ncu", "--set", "full"] and ["--import-source", "yes"] == run[3:5]
    assert f"regex:{KERNELS[('ours', 'bwd')]}" in run and ["-s", "1", "-c", "1"] == run[7:11]
    assert run[run.index("-o") + 1] == str(tmp_path / "ours") and run[-2:] == ["--inputs", "bthd"]
    assert export == ["ncu", "--import", f"{tmp_path / 'ours'}.ncu-rep", "--page", "source", "--csv",
                      "--print-source", "sass"]
    assert ns.profile_commands("ncu", "sdpa_cudnn", args, tmp_path / "x", "cudnn")[0][6] == "regex:cudnn"
    with pytest.raises(SystemExit, match="no kernel pattern"):
        ns.profile_commands("ncu", "sdpa_cudnn", args, tmp_path / "x")
    assert ns.source_name("fa4", args) == "source_fa4_hd128_T8192_c1_bwd.csv.gz"


def test_the_committed_profiles_still_read():
    # results.md section 22 quotes these numbers from the v39 backward's source page.
    page = ns.REPO / "bench" / "results" / "stage3_rounds" / "v40" / "source_bwd_hd128_T8192_c1_v39.csv.gz"
    view = ns.read_views([f"v39={page}"])[0]
    top = ns.hottest(view, 1)[0]
    assert 100 * top.samples / view.samples == pytest.approx(11.59, abs=0.01)
    assert ns.wait_before(view, top.index).endswith("BAR.SYNC.DEFER_BLOCKING 0x0")


def test_the_committed_wavefront_counts_still_read():
    # results.md section 64 quotes these per 64 queries of a 128-key tile (262,144 of them in either kernel's call:
    # B = 2, 16 heads, 64 key blocks, 8192 queries).
    where = ns.REPO / "bench" / "results" / "stage3_rounds" / "v58" / "ncu_source_bwd_hd128_nc8k"
    ours, fa4 = ns.read_views([f"ours={where / 'source_ours_hd128_T8192_c0_bwd.csv.gz'}",
                               f"fa4={where / 'source_fa4_hd128_T8192_c0_bwd.csv.gz'}"])

    def waves(view, kind):
        return sum(line.wavefronts for line in view.lines if ns.opcode(line.sass) == kind) / 262144

    assert waves(ours, "HGMMA.64x64x16.F32.BF16") == pytest.approx(1536.0)
    assert waves(fa4, "HGMMA.64x80x16.F32.BF16") == pytest.approx(1390.5, abs=0.1)
    assert sum(line.wavefronts - line.ideal for line in ours.lines + fa4.lines) == 0  # no bank conflicts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="ncu profiles CUDA kernels: needs a CUDA GPU")
@pytest.mark.skipif(shutil.which("ncu") is None, reason="Nsight Compute's ncu is not on PATH")
def test_ncu_source_profiles_our_forward(tmp_path, capsys):
    import flash_kernel

    if not flash_kernel.is_available():
        pytest.skip(f"our kernel cannot run here: {flash_kernel.unavailable_reason(64)}")
    ns.main(["profile", "--methods", "ours", "--hdim", "64", "--seqlen", "1024", "--causal", "1", "--raw",
             str(tmp_path), "--top", "5"])
    (view,) = ns.read_views([str(tmp_path / "source_ours_hd64_T1024_c1_fwd.csv.gz")])
    assert "flash_fwd" in view.kernel and view.samples > 0 and any("HGMMA" in line.sass or "HMMA" in line.sass
                                                                    for line in view.lines)
    assert "| # | % of samples |" in capsys.readouterr().out
