"""bench/ncu_compare.py on CPU: ncu's raw CSV parsed, scaled and tabulated, the command each method gets, and the
kernel patterns; on a GPU with ncu on PATH, one real profile of our forward."""

import json
import re
import shutil

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


def test_the_raw_csv_parses_to_numbers_with_their_units():
    (kernel,) = nc.parse_raw_csv(RAW)
    assert kernel["kernel"].startswith("void flash::flash_fwd_hopper_kernel")
    assert kernel["values"]["gpu__time_duration.sum"] == 1_250_000  # thousands separators dropped
    assert kernel["units"]["lts__t_bytes.sum"] == "byte"
    assert "device__attribute_display_name" not in kernel["values"]  # text, not a number
    with pytest.raises(ValueError, match="Kernel Name"):
        nc.parse_raw_csv("==PROF== no kernels were profiled\n")


def test_the_summary_scales_to_the_tables_units_and_sorts_the_stalls():
    s = nc.summary(nc.parse_raw_csv(RAW)[0])
    assert s["metrics"]["time (µs)"] == pytest.approx(1250.0)
    assert s["metrics"]["L2 traffic (MB)"] == pytest.approx(300.0)
    assert s["metrics"]["dynamic shared memory (KiB)"] == pytest.approx(225.0)
    assert s["metrics"]["instructions (M)"] == pytest.approx(52.0)
    assert "DRAM traffic (MB)" not in s["metrics"]  # not in this profile
    assert list(s["stalls"].items()) == [("wait", 1.5), ("barrier", 0.25)]
    # ncu 2025.3.1 spells the units of time and of shared memory per block so
    units_2025_3 = RAW.replace('"nsecond","%","inst","byte","byte"', '"ns","%","inst","byte","byte/block"')
    assert nc.summary(nc.parse_raw_csv(units_2025_3)[0])["metrics"] == s["metrics"]
    scaled = nc.parse_raw_csv(RAW.replace('"nsecond"', '"usecond"'))[0]
    with pytest.raises(ValueError, match="usecond"):
        nc.summary(scaled)


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
    from types import SimpleNamespace

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
