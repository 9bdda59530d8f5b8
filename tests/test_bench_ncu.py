"""bench/ncu_compare.py on CPU: ncu's raw CSV parsed, scaled and tabulated (each metric from the first of its names
the profile holds), the command each method gets, the kernel patterns, and --from-raw's rows and table from saved
CSVs; on a GPU with ncu on PATH, one real profile of our forward."""

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from bench import ncu_compare as nc

# The shape of `ncu --page raw --csv --print-units base` output: what the profiled program printed, ncu's notices,
# a header of metric names, their units, one row per kernel.
RAW = '''ours hd128 causal=0 T=8192 B=2 H=16 fwd (bthd inputs): 2 calls
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC",\
"gpu__time_duration.sum","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",\
"smsp__inst_executed.sum","lts__t_bytes.sum","launch__shared_mem_per_block_dynamic","launch__registers_per_thread",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","device__attribute_display_name"
"","","","","","","","","","","","nsecond","%","inst","byte","byte","register/thread","ratio","ratio",""
"0","4242","python3","gpu1","void flash::flash_fwd_hopper_kernel<T, false, false>(flash::FwdParams)","1","7",\
"(384, 1, 1)","(132, 1, 1)","0","9.0","1,250,000","71.5","52,000,000","300,000,000","230,400","168","0.25","1.5",\
"NVIDIA H200"
'''.replace("\\\n", "")

# The metric names and units ncu 2025.3.1 reports on an H200 (values from a profile of our hd64 T=16k forward):
# the tensor pipe, issue slots and XU pipe in %, L2 traffic in 32-byte sectors, DRAM bytes read and written apart.
RAW_H200 = '''ours hd64 causal=0 T=16384 B=1 H=32 fwd (bthd inputs): 2 calls
==PROF== Disconnected from process 4501
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC",\
"device__attribute_display_name","gpu__time_duration.sum",\
"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",\
"smsp__issue_active.avg.pct_of_peak_sustained_active",\
"sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","lts__t_sectors.sum","dram__bytes_read.sum",\
"dram__bytes_write.sum","launch__shared_mem_per_block_dynamic",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","","","","","","","","","","","ns","%","%","%","sector","byte","byte","byte/block","inst"
"0","4501","python3.12","127.0.0.1",\
"void flash_fwd_hopper_kernel<HopperFwdTraits<64, 128, 3, __nv_bfloat16, 64, 8, 3, 0, 64, 0>, 0, 0>(FwdParams)",\
"1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","NVIDIA H200","5,266,176","57.10","55.98","51.78","326,785,698",\
"202,849,792","61,877,760","124,056","1.14"
'''.replace("\\\n", "")


def _with_column(text: str, name: str, unit: str, value: str) -> str:
    """`text` (a raw CSV above) with one more metric: its name, unit and value appended to the three CSV rows."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    for i, cell in zip(range(start, start + 3), (name, unit, value)):
        lines[i] += f',"{cell}"'
    return "\n".join(lines) + "\n"


def test_the_raw_csv_parses_to_numbers_with_their_units():
    (kernel,) = nc.parse_raw_csv(RAW)
    assert kernel["kernel"].startswith("void flash::flash_fwd_hopper_kernel")
    assert kernel["values"]["gpu__time_duration.sum"] == 1_250_000  # thousands separators dropped
    assert kernel["units"]["lts__t_bytes.sum"] == "byte"
    assert "device__attribute_display_name" not in kernel["values"]  # text, not a number
    assert kernel["device"] == "NVIDIA H200"
    assert nc.parse_raw_csv(RAW.replace('"NVIDIA H200"', '""'))[0]["device"] is None
    with pytest.raises(ValueError, match="Kernel Name"):
        nc.parse_raw_csv("==PROF== no kernels were profiled\n")


def test_the_summary_scales_to_the_tables_units_and_sorts_the_stalls():
    s = nc.summary(nc.parse_raw_csv(RAW)[0])
    assert s["metrics"]["time (µs)"] == pytest.approx(1250.0)
    assert s["metrics"]["L2 traffic (MB)"] == pytest.approx(300.0)
    assert s["metrics"]["dynamic shared memory (KiB)"] == pytest.approx(225.0)
    assert s["metrics"]["instructions (M)"] == pytest.approx(52.0)
    assert "DRAM read (MB)" not in s["metrics"] and "DRAM written (MB)" not in s["metrics"]  # not in this profile
    assert list(s["stalls"].items()) == [("wait", 1.5), ("barrier", 0.25)]
    # ncu 2025.3.1 spells the units of time and of shared memory per block so
    units_2025_3 = RAW.replace('"nsecond","%","inst","byte","byte"', '"ns","%","inst","byte","byte/block"')
    assert nc.summary(nc.parse_raw_csv(units_2025_3)[0])["metrics"] == s["metrics"]
    scaled = nc.parse_raw_csv(RAW.replace('"nsecond"', '"usecond"'))[0]
    with pytest.raises(ValueError, match="usecond"):
        nc.summary(scaled)


def test_the_names_ncu_2025_3_reports_on_the_h200_are_read_and_scaled():
    m = nc.summary(nc.parse_raw_csv(RAW_H200)[0])["metrics"]
    assert m["time (µs)"] == pytest.approx(5266.176)
    assert m["tensor pipe active (%)"] == pytest.approx(57.10)
    assert m["issue slots busy (%)"] == pytest.approx(55.98)
    assert m["XU (MUFU) pipe use (% of peak)"] == pytest.approx(51.78)
    assert m["L2 traffic (MB)"] == pytest.approx(326_785_698 * 32 / 1e6)  # 32-byte sectors
    assert m["DRAM read (MB)"] == pytest.approx(202.849792)
    assert m["DRAM written (MB)"] == pytest.approx(61.87776)
    assert m["dynamic shared memory (KiB)"] == pytest.approx(124_056 / 1024)
    # where a profile holds both, the first name of a row wins over the names of other ncu versions
    both = _with_column(_with_column(RAW_H200, "lts__t_bytes.sum", "byte", "1,000,000"),
                        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "12.5")
    assert nc.summary(nc.parse_raw_csv(both)[0])["metrics"] == m


def test_a_rows_later_name_is_read_where_the_profile_lacks_the_first():
    m = nc.summary(nc.parse_raw_csv(RAW)[0])["metrics"]  # RAW holds the other ncu versions' names only
    assert m["tensor pipe active (%)"] == pytest.approx(71.5)  # sm__pipe_tensor_op_gmma_cycles_active
    assert m["L2 traffic (MB)"] == pytest.approx(300.0)  # lts__t_bytes.sum, in bytes, not sectors
    for old, unit, label in [("sm__inst_issued.avg.pct_of_peak_sustained_active", "%", "issue slots busy (%)"),
                             ("sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active", "%",
                              "XU (MUFU) pipe use (% of peak)")]:
        assert nc.summary(nc.parse_raw_csv(_with_column(RAW, old, unit, "33.5"))[0])["metrics"][label] == 33.5


@pytest.mark.parametrize("text, name, unit", [
    (RAW_H200, "lts__t_sectors.sum", "byte"),  # bytes read as sectors would be 32 times too many
    (RAW_H200, "dram__bytes_read.sum", "sector"),
    (RAW_H200, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "cycle"),
    (RAW_H200, "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "inst/cycle"),
    (RAW, "lts__t_bytes.sum", "sector"),  # a later name's unit is checked too
    (RAW, "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "cycle"),
])
def test_a_metric_in_a_unit_other_than_expected_is_refused(text, name, unit):
    units = nc.parse_raw_csv(text)[0]["units"]
    cells = ",".join(f'"{unit if n == name else u}"' for n, u in units.items())
    header = next(line for line in text.splitlines() if line.startswith('"ID"'))
    unit_row = text.splitlines()[text.splitlines().index(header) + 1]
    with pytest.raises(ValueError, match=f"{re.escape(name)} in '{re.escape(unit)}'"):
        nc.summary(nc.parse_raw_csv(text.replace(unit_row, cells))[0])


def test_every_name_of_a_row_that_scales_or_checks_its_unit_has_its_scale():
    for label, names in nc.METRICS:
        assert names and all(isinstance(n, str) for n in names), label
        scaled = [n in nc.SCALE for n in names]
        assert all(scaled) or not any(scaled), (label, names)


def test_the_table_puts_methods_side_by_side_with_the_first_ones_ratios():
    ours = {"method": "ours", "kernel": "flash_fwd_hopper_kernel", "metrics": {"time (µs)": 1100.0, "grid": 132.0},
            "stalls": {"wait": 1.0}}
    fa4 = {"method": "fa4", "kernel": "FlashAttentionForwardSm90", "metrics": {"time (µs)": 1000.0},
           "stalls": {"wait": 0.5, "barrier": 2.0}}
    text = nc.table([ours, fa4])
    assert text.splitlines()[0] == "| metric | ours | fa4 | ours / fa4 |"
    assert "| time (µs) | 1.1e+03 | 1e+03 | 1.100 |" in text
    assert "| grid | 132 | – | – |" in text
    lines = text.splitlines()
    assert lines.index("| stall: barrier (cycles per instruction) | – | 2 | – |") < lines.index(
        "| stall: wait (cycles per instruction) | 1 | 0.5 | 2.000 |")  # the largest stall first


def test_each_method_profiles_its_main_kernel_once_after_the_warm_up():
    cmd = nc.ncu_command("/usr/bin/ncu", "ours", 128, 8192, 0, "bwd")
    assert cmd[:3] == ["/usr/bin/ncu", "--set", "full"] and "--print-units" in cmd
    assert cmd[cmd.index("-k") + 1] == "regex:flash_bwd_(hopper|tiled)_kernel"
    assert cmd[cmd.index("-s") + 1] == "1" and cmd[cmd.index("-c") + 1] == "1"
    assert cmd[cmd.index("--mode") + 1] == "bwd" and cmd[cmd.index("--inputs") + 1] == "bthd"
    assert nc.ncu_command("ncu", "sdpa_cudnn", 64, 1024, 1, "fwd", regex="cudnn")[cmd.index("-k") + 1] == "regex:cudnn"
    with pytest.raises(SystemExit, match="--kernel-regex"):
        nc.ncu_command("ncu", "sdpa_cudnn", 64, 1024, 1, "fwd")


def _cute_dsl_name(module: str, cls: str) -> str:
    """A CuTe DSL kernel's name as nvidia-cutlass-dsl 4.8 makes it (base_dsl/dsl.py mangle_name): 'kernel_' + the
    prefix 'cutlass' + the function's name (FA4's kernels are methods named `kernel`) + each argument that is not an
    IR value or a tensor (the first is `self`, as str() prints it; those after it are left out here), without the
    characters '-![]#,.<>()":{}=%?@; and the address, spaces as underscores, cut at 180 characters; then the
    kernel's count."""
    this = f"<flash_attn.cute.{module}.{cls} object at 0x7f3a5c0d2e10>"
    mangled = f"cutlass_kernel_{this}".translate(str.maketrans("", "", "'-![]#,.<>()\":{}=%?@;"))
    mangled = re.sub(r"0x[a-fA-F0-9]{8,16}", "", mangled).replace(" ", "_")
    return f"kernel_{mangled[:180]}_0"


@pytest.mark.parametrize("mode, main, others", [
    ("fwd", _cute_dsl_name("flash_fwd_sm90", "FlashAttentionForwardSm90"), []),
    ("bwd", _cute_dsl_name("flash_bwd_sm90", "FlashAttentionBackwardSm90"),
     [_cute_dsl_name("flash_bwd_preprocess", "FlashAttentionBackwardPreprocess"),
      _cute_dsl_name("flash_bwd_postprocess", "FlashAttentionBackwardPostprocess")]),
])
def test_fa4_patterns_take_the_attention_kernel_and_not_its_pre_or_post_processing(mode, main, others):
    pattern = re.compile(nc.KERNELS[("fa4", mode)])
    assert pattern.search(main)
    assert not any(pattern.search(name) for name in others)


def test_without_ncu_the_reason_is_given(monkeypatch):
    monkeypatch.setattr(nc.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="not on PATH"):
        nc.main(["--ncu", "ncu"])
    with pytest.raises(SystemExit, match="METHOD=REGEX"):
        nc.main(["--kernel-regex", "fa4"])


def test_a_method_that_cannot_run_is_left_out_and_the_others_compared(monkeypatch, tmp_path, capsys):
    """main's flow with ncu and the GPU stood in for: FA4 not installed is a note, ours is profiled, its row kept."""
    from bench.kernel import BackendUnsupported

    def make_method(method, *args):
        if method == "fa4":
            raise BackendUnsupported("flash_attn.cute does not import")

    ran = []
    monkeypatch.setattr(nc.shutil, "which", lambda name: "/opt/ncu/ncu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU X")
    monkeypatch.setattr(nc, "make_method", make_method)
    monkeypatch.setattr(nc, "RAW", tmp_path / "raw")
    monkeypatch.setattr(nc.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or SimpleNamespace(
        returncode=0, stdout=RAW, stderr=""))
    out = tmp_path / "ncu.json"
    nc.main(["--methods", "ours", "fa4", "--hdim", "128", "--seqlen", "8192", "--out", str(out)])
    assert len(ran) == 1 and ran[0][0] == "/opt/ncu/ncu"
    (row,) = json.loads(out.read_text())
    assert (row["device"], row["method"], row["seqlen"]) == ("GPU X", "ours", 8192)
    assert row["metrics"]["time (µs)"] == pytest.approx(1250.0)
    text = capsys.readouterr().out
    assert "note: fa4 skipped: flash_attn.cute does not import" in text and "| time (µs) | 1.25e+03 |" in text
    assert (tmp_path / "raw" / "ours_hd128_T8192_c0_fwd.csv").read_text() == RAW


# FA4's forward on the same case, as a profiling run saves it beside ours'.
FA4_H200 = RAW_H200.replace(
    "void flash_fwd_hopper_kernel<HopperFwdTraits<64, 128, 3, __nv_bfloat16, 64, 8, 3, 0, 64, 0>, 0, 0>(FwdParams)",
    "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_0").replace(
    '"5,266,176","57.10","55.98","51.78","326,785,698"', '"4,758,656","63.23","52.87","65.22","319,265,502"')
CASE = ["--methods", "ours", "fa4", "--hdim", "64", "--seqlen", "16384", "--causal", "0", "--mode", "fwd"]


def _refuse(*args, **kwargs):
    raise AssertionError("--from-raw neither profiles nor asks the GPU")


def _without_gpu_or_ncu(monkeypatch):
    monkeypatch.setattr(nc.shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", _refuse)
    monkeypatch.setattr(nc, "make_method", _refuse)
    monkeypatch.setattr(nc.subprocess, "run", _refuse)


def test_from_raw_gives_the_rows_and_table_of_the_profiling_run_that_saved_the_csvs(monkeypatch, tmp_path, capsys):
    outputs = {"ours": RAW_H200, "fa4": FA4_H200}
    monkeypatch.setattr(nc, "RAW", tmp_path / "raw")
    with monkeypatch.context() as m:  # the profiling run, ncu and the GPU stood in for
        m.setattr(nc.shutil, "which", lambda name: "/opt/ncu/ncu")
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
        m.setattr(nc, "make_method", lambda *a: None)
        m.setattr(nc.subprocess, "run", lambda cmd, **kw: SimpleNamespace(
            returncode=0, stdout=outputs[cmd[cmd.index("--method") + 1]], stderr=""))
        nc.main(CASE + ["--out", str(tmp_path / "profiled.json")])
    profiled = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["fa4_hd64_T16384_c0_fwd.csv",
                                                                     "ours_hd64_T16384_c0_fwd.csv"]

    _without_gpu_or_ncu(monkeypatch)
    nc.main(CASE + ["--from-raw", "--out", str(tmp_path / "from_raw.json")])
    from_raw = capsys.readouterr().out
    rows = json.loads((tmp_path / "from_raw.json").read_text())
    assert rows == json.loads((tmp_path / "profiled.json").read_text())
    assert [(r["device"], r["method"], r["hdim"], r["seqlen"]) for r in rows] == [
        ("NVIDIA H200", "ours", 64, 16384), ("NVIDIA H200", "fa4", 64, 16384)]
    assert rows[1]["metrics"]["tensor pipe active (%)"] == pytest.approx(63.23)
    shown = from_raw[from_raw.index("NVIDIA H200: hd64 T=16384 causal=0 fwd"):]
    assert profiled.endswith(shown)  # the same table
    assert "| time (µs) | 5.27e+03 | 4.76e+03 | 1.107 |" in shown
    assert "| XU (MUFU) pipe use (% of peak) | 51.8 | 65.2 | 0.794 |" in shown
    assert "| L2 traffic (MB) | 1.05e+04 | 1.02e+04 | 1.024 |" in shown


def test_from_raw_keys_rows_by_the_gpu_and_date_of_the_saved_profile(monkeypatch, tmp_path):
    from datetime import datetime

    _without_gpu_or_ncu(monkeypatch)
    monkeypatch.setattr(nc, "RAW", tmp_path)
    when = datetime(2025, 3, 4, 12).timestamp()
    for name, text in [("ours_hd64_T16384_c0_fwd.csv", RAW_H200), ("fa4_hd64_T16384_c0_fwd.csv", FA4_H200)]:
        (tmp_path / name).write_text(text.replace("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
        os.utime(tmp_path / name, (when, when))
    out = tmp_path / "ncu.json"
    nc.main(CASE + ["--from-raw", "--out", str(out)])
    assert [(r["device"], r["date"], r["method"]) for r in json.loads(out.read_text())] == [
        ("NVIDIA H100 80GB HBM3", "2025-03-04", "ours"), ("NVIDIA H100 80GB HBM3", "2025-03-04", "fa4")]


def test_from_raw_refuses_a_missing_failed_anonymous_or_mixed_set_of_profiles(monkeypatch, tmp_path):
    _without_gpu_or_ncu(monkeypatch)
    monkeypatch.setattr(nc, "RAW", tmp_path)
    out = tmp_path / "ncu.json"
    fa4 = tmp_path / "fa4_hd64_T16384_c0_fwd.csv"
    (tmp_path / "ours_hd64_T16384_c0_fwd.csv").write_text(RAW_H200)
    with pytest.raises(SystemExit, match=f"{re.escape(str(fa4))} does not exist"):
        nc.main(CASE + ["--from-raw", "--out", str(out)])
    fa4.write_text("==ERROR== Failed to profile \"kernel\" in process 4242\n")  # what a failed profile leaves
    with pytest.raises(SystemExit, match=f"{re.escape(str(fa4))} holds no ncu raw CSV"):
        nc.main(CASE + ["--from-raw", "--out", str(out)])
    fa4.write_text(FA4_H200.replace('"NVIDIA H200"', '""'))
    with pytest.raises(SystemExit, match="does not name its GPU"):
        nc.main(CASE + ["--from-raw", "--out", str(out)])
    fa4.write_text(FA4_H200.replace("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    with pytest.raises(SystemExit, match="different GPUs"):
        nc.main(CASE + ["--from-raw", "--out", str(out)])
    assert not out.exists()  # nothing merged from a refused set
    nc.main(CASE + ["--methods", "ours", "--from-raw", "--out", str(out)])  # the profiles asked for, only
    assert [r["method"] for r in json.loads(out.read_text())] == ["ours"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="ncu profiles CUDA kernels: needs a CUDA GPU")
@pytest.mark.skipif(shutil.which("ncu") is None, reason="Nsight Compute's ncu is not on PATH")
def test_ncu_profiles_our_forward(tmp_path):
    import flash_kernel

    if not flash_kernel.is_available():
        pytest.skip(f"our kernel cannot run here: {flash_kernel.unavailable_reason(64)}")
    out = tmp_path / "ncu.json"
    nc.main(["--methods", "ours", "--hdim", "64", "--seqlen", "1024", "--causal", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert "flash_fwd" in row["kernel"] and row["metrics"]["time (µs)"] > 0 and row["stalls"]
