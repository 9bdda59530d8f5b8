"""bench/gpu_clocks.py and bench/kernel.py --clocks on the CPU: parsing nvidia-smi's lines, the medians, the GPU
index lookup, and the recorder against a fake nvidia-smi (a script on PATH that prints samples every -lms ms)."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_clocks as gc
from bench import kernel as bench

REPO = Path(__file__).resolve().parents[1]
DEVICE = "NVIDIA Fake GPU"
LISTING = ("0, GPU-aaaa0000-0000-0000-0000-000000000000, 00000000:1B:00.0\n"
           "1, GPU-bbbb1111-1111-1111-1111-111111111111, 00000000:9A:00.0")
ONE_SAMPLE = {"sm_clock_mhz": 1755.0, "power_w": 652.4}

# FAKE_SMI_MODE: ok (samples), count (samples whose clock counts up from 1001), fail (every call exits 1),
# sample_fail (one-shot queries work, sampling exits 1), no_devices (sampling says so on stdout, exits 6), na_only
# (sampling prints lines without numbers), silent (sampling prints nothing). Sampling prints "100, 50.0" first (before
# any span), then per period a sample ("1755, 652.4") and a line without numbers; after FAKE_SMI_DIE_AFTER seconds it
# exits with 1 and a message on stderr. Each call's arguments go to FAKE_SMI_LOG.
FAKE_SMI = '''#!{python}
import os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_SMI_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
mode = os.environ.get("FAKE_SMI_MODE", "ok")
if mode == "fail":
    sys.exit("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
query = next(a for a in args if a.startswith("--query-gpu=")).split("=", 1)[1]
if "-lms" not in args:
    print(os.environ["FAKE_SMI_LISTING"] if query == "index,uuid,pci.bus_id" else os.environ["FAKE_SMI_INSTANT"])
    sys.exit(0)
if mode == "sample_fail":
    sys.exit("Field \\"clocks.sm\\" is not a valid field to query.")
if mode == "no_devices":
    print("No devices were found", flush=True)
    sys.exit(6)
while mode == "na_only":
    print("[N/A], [N/A]", flush=True)
    time.sleep(0.05)
if mode == "silent":
    time.sleep(60)
period = int(args[args.index("-lms") + 1]) / 1000
time.sleep(float(os.environ.get("FAKE_SMI_DELAY", "0")))
print("100, 50.0", flush=True)
die = time.monotonic() + float(os.environ.get("FAKE_SMI_DIE_AFTER", "inf"))
count = 1000
while time.monotonic() < die:
    count += 1
    print(f"{{count if mode == 'count' else 1755}}, 652.4", flush=True)
    print("[N/A], [N/A]", flush=True)
    time.sleep(period)
sys.exit("Unable to determine the device handle for GPU0000:1B:00.0: GPU is lost")
'''


def _sampling(calls):
    """The calls of fake_smi's log that sampled (started an nvidia-smi -lms)."""
    return [c for c in calls if "-lms" in c]


def _gone(process) -> bool:
    return process.poll() is not None


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """A fake nvidia-smi first on PATH; returns a function reading the argument lines of its calls so far."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(FAKE_SMI.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_LOG", str(log))
    monkeypatch.setenv("FAKE_SMI_LISTING", LISTING.split("\n")[0])  # one GPU unless a test lists more
    monkeypatch.setenv("FAKE_SMI_INSTANT", "612.0")
    return lambda: log.read_text().splitlines() if log.exists() else []


# ------------------------------------------------------------------------------------------------ parsing
def test_parse_lines_skip_na_and_blank_values():
    assert gc.parse_line("1980, 512.34") == {"sm_clock_mhz": 1980.0, "power_w": 512.34}
    assert gc.parse_line("[N/A], 300.5") == {"power_w": 300.5}
    assert gc.parse_line("1755, [Not Supported]\n") == {"sm_clock_mhz": 1755.0}
    assert gc.parse_line("1755, ") == {"sm_clock_mhz": 1755.0}
    for nothing in ("", "  \n", "[N/A], [N/A]", ", "):
        assert gc.parse_line(nothing) is None


def test_summarize_takes_medians_of_the_values_there_are():
    samples = [{"sm_clock_mhz": 1980.0, "power_w": 500.0}, {"sm_clock_mhz": 1700.0}, {"sm_clock_mhz": 1800.0},
               {"sm_clock_mhz": 1900.0, "power_w": 700.0}]
    assert gc.summarize(samples) == {"sm_clock_mhz": 1850.0, "power_w": 600.0, "clock_samples": 4}
    assert gc.summarize([{"sm_clock_mhz": 1755.0}]) == {"sm_clock_mhz": 1755.0, "clock_samples": 1}
    assert gc.summarize([]) == {"clock_samples": 0}


def test_clock_fields_pool_the_rounds():
    rounds = [[{"sm_clock_mhz": 1000.0, "power_w": 400.0}], [{"sm_clock_mhz": 2000.0}, {"sm_clock_mhz": 1900.0}], []]
    fields = bench.clock_fields(rounds)
    assert fields == {"sm_clock_mhz": 1900.0, "power_w": 400.0, "clock_samples": 3,
                      "sm_clock_mhz_rounds": [1000.0, 1950.0, None]}
    assert bench.clock_fields([[{"sm_clock_mhz": 1755.0}]]) == {"sm_clock_mhz": 1755.0, "clock_samples": 1}
    assert bench.clock_fields([]) == {}  # no round sampled: the row stays as without --clocks


# ---------------------------------------------------------------------------------------- which GPU
def test_bus_ids_and_listing_parse():
    assert gc.parse_bus_id("00000000:1B:00.0") == (0, 0x1B, 0)
    assert gc.parse_bus_id("00000001:9a:1f.3") == (1, 0x9A, 0x1F)
    assert gc.parse_bus_id("[N/A]") is None
    gpus = gc.parse_gpu_listing(LISTING.splitlines() + ["", "No devices were found"])
    assert gpus == [gc.SmiGpu(0, "GPU-aaaa0000-0000-0000-0000-000000000000", (0, 0x1B, 0)),
                    gc.SmiGpu(1, "GPU-bbbb1111-1111-1111-1111-111111111111", (0, 0x9A, 0))]


def test_smi_index_follows_the_device_not_torch_numbering():
    gpus = gc.parse_gpu_listing(LISTING.splitlines())
    # CUDA_VISIBLE_DEVICES=1: torch's cuda:0 is nvidia-smi's GPU 1, found by UUID (torch spells it without "GPU-")
    assert gc.smi_index(gpus, "bbbb1111-1111-1111-1111-111111111111", None) == 1
    assert gc.smi_index(gpus, "GPU-BBBB1111-1111-1111-1111-111111111111", None) == 1
    assert gc.smi_index(gpus, None, (0, 0x9A, 0)) == 1  # by PCI bus where there is no UUID
    assert gc.smi_index(gpus, "MIG-cccc", (0, 0x1B, 0)) == 0  # a UUID nvidia-smi does not list: the bus decides
    assert gc.smi_index(gpus, None, None) is None  # two GPUs and nothing to tell them apart
    assert gc.smi_index(gpus, "dddd", (0, 0x33, 0)) is None
    assert gc.smi_index(gpus[1:], None, None) == 1  # one GPU listed: that one
    assert gc.smi_index([], None, None) is None


def test_recorder_samples_the_mapped_gpu(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_LISTING", LISTING)
    monkeypatch.setattr(gc, "torch_identity", lambda device: ("bbbb1111-1111-1111-1111-111111111111", None))
    said = []
    with gc.ClockRecorder.for_torch_device(0, period_ms=10, say=said.append) as clocks:
        assert clocks.active and clocks.index == 1 and clocks.power == "power.draw.instant" and not said
        assert clocks.description == "nvidia-smi -i 1 clocks.sm,power.draw.instant every 10 ms"
        with clocks.span() as samples:
            time.sleep(0.1)
    assert samples and all(s == ONE_SAMPLE for s in samples)
    query = "--query-gpu=clocks.sm,power.draw.instant --format=csv,noheader,nounits -i 1 -lms 10"
    assert _sampling(fake_smi()) == [query] and _gone(clocks.process)


def test_power_falls_back_to_power_draw(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_INSTANT", "[N/A]")
    monkeypatch.setattr(gc, "torch_identity", lambda device: (None, None))
    with gc.ClockRecorder.for_torch_device(0, say=print) as clocks:
        assert clocks.index == 0 and clocks.power == "power.draw"


# ------------------------------------------------------------------------------------------------ sampling
def test_one_nvidia_smi_serves_every_span(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_MODE", "count")  # sample n has clock 1000 + n: where each span's samples came from
    with gc.ClockRecorder(3, period_ms=10) as clocks:
        process = clocks.process
        spans = []
        for _ in range(3):
            time.sleep(0.15)  # between spans: samples no span takes
            with clocks.span() as samples:
                assert not _gone(process)
                time.sleep(0.15)
            spans.append([s["sm_clock_mhz"] for s in samples])
            assert all(stamp > time.monotonic() - 0.05 for stamp, _ in clocks._samples)  # older ones dropped
        assert clocks.process is process and not _gone(process)
    assert process.returncode == -signal.SIGTERM  # ended by close()
    assert not clocks.active and clocks.description == "off: closed"
    assert fake_smi() == ["--query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -i 3 -lms 10"]
    for before, clocks_mhz in zip([1000.0] + [span[-1] for span in spans], spans):
        assert 5 <= len(clocks_mhz) <= 25  # ~15 samples in 150 ms
        assert clocks_mhz == [float(n) for n in range(int(clocks_mhz[0]), int(clocks_mhz[-1]) + 1)]  # all of them
        assert clocks_mhz[0] - before >= 5  # none of the ~15 between the spans (nor "100, 50.0", before any)
    with clocks.span() as samples:
        pass
    assert samples is None


def test_the_buffer_keeps_the_latest_samples(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_MODE", "count")
    monkeypatch.setattr(gc, "MAX_SAMPLES", 5)
    with gc.ClockRecorder(0, period_ms=10) as clocks:
        time.sleep(0.2)  # ~20 samples, no span
        assert len(clocks._samples) == 5
        with clocks.span() as samples:
            time.sleep(0.03)
        assert samples and samples[0]["sm_clock_mhz"] > 1010.0


def test_the_recorder_waits_for_nvidia_smi_to_start_once(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_DELAY", "0.4")  # NVML's start-up
    began = time.monotonic()
    with gc.ClockRecorder(0, period_ms=10) as clocks:
        assert time.monotonic() - began >= 0.4
        for _ in range(2):
            began = time.monotonic()
            with clocks.span() as samples:
                assert time.monotonic() - began < 0.05  # the span's work starts at once
                time.sleep(0.1)
            assert samples and all(s == ONE_SAMPLE for s in samples)


def test_silent_or_failing_nvidia_smi_notes_why(fake_smi, monkeypatch):
    cases = {"silent": "printed no sample within 0.3 s$",
             "na_only": r"no sample within 0.3 s \(it printed '\[N/A\], \[N/A\]'\)",
             "sample_fail": r"exited with 1: Field \"clocks.sm\" is not a valid field",
             "no_devices": "exited with 6: No devices were found"}
    for mode, why in cases.items():
        monkeypatch.setenv("FAKE_SMI_MODE", mode)
        said = []
        clocks = gc.ClockRecorder(0, say=said.append, ready_timeout_s=0.3)
        assert not clocks.active and _gone(clocks.process)
        assert len(said) == 1 and re.search(why, said[0]) and re.search(why, clocks.description)
        with clocks.span() as samples:
            pass
        assert samples is None and len(said) == 1
        clocks.close()  # again: nothing
        assert len(said) == 1 and re.search(why, clocks.description)


def test_nvidia_smi_exiting_mid_run_notes_once_and_spans_go_on_without(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_DIE_AFTER", "0.3")
    said = []
    with gc.ClockRecorder(0, period_ms=10, say=said.append) as clocks:
        with clocks.span() as first:
            time.sleep(0.1)
        with clocks.span() as dying:  # nvidia-smi exits in this span: the span keeps the samples it had
            time.sleep(0.4)
        assert first and dying and all(s == ONE_SAMPLE for s in first + dying) and _gone(clocks.process)
        assert said == ["note: --clocks: no SM clock / power fields from here on: nvidia-smi exited with 1: "
                        "Unable to determine the device handle for GPU0000:1B:00.0: GPU is lost"]
        for _ in range(2):
            with clocks.span() as samples:
                time.sleep(0.02)
            assert samples is None
    assert len(said) == 1 and len(_sampling(fake_smi())) == 1  # one note; no nvidia-smi started again


def test_nvidia_smi_exiting_between_spans_is_noted_at_the_next(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_DIE_AFTER", "0.1")
    said = []
    with gc.ClockRecorder(0, period_ms=10, say=said.append) as clocks:
        time.sleep(0.4)
        with clocks.span() as samples:
            pass
        assert samples is None and len(said) == 1 and "GPU is lost" in said[0]


def test_an_exception_or_ctrl_c_in_the_run_ends_nvidia_smi(fake_smi):
    with pytest.raises(KeyboardInterrupt):
        with gc.ClockRecorder(0) as clocks:
            with clocks.span():
                raise KeyboardInterrupt
    assert clocks.process.returncode == -signal.SIGTERM


def test_nvidia_smi_ends_when_the_benchmark_is_killed(fake_smi):
    """Killed, the benchmark cannot close() the recorder: nvidia-smi ends at its next line, on the closed pipe."""
    script = ("import os, signal\nfrom bench import gpu_clocks\nclocks = gpu_clocks.ClockRecorder(0)\n"
              "print(clocks.process.pid, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    pid = int(killed.stdout)

    def running() -> bool:  # an orphan that has exited may stay a zombie where nothing reaps it
        with contextlib.suppress(FileNotFoundError):
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
        return False

    deadline = time.monotonic() + 5
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if running():
        os.kill(pid, signal.SIGKILL)
        pytest.fail("nvidia-smi outlived the killed benchmark")


def test_missing_nvidia_smi_leaves_the_fields_off(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    said = []
    clocks = gc.ClockRecorder.for_torch_device(0, say=said.append)
    assert not clocks.active and said == ["note: --clocks: no SM clock / power fields from here on: "
                                          "nvidia-smi not found on PATH"]
    with clocks.span() as samples:
        pass
    assert samples is None and len(said) == 1
    assert clocks.description == "off: nvidia-smi not found on PATH"
    clocks.close()


def test_failing_nvidia_smi_notes_once_and_the_run_goes_on(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_MODE", "fail")
    said = []
    clocks = gc.ClockRecorder.for_torch_device(0, say=said.append)
    assert not clocks.active and len(said) == 1 and "couldn't communicate with the NVIDIA driver" in said[0]
    monkeypatch.setenv("FAKE_SMI_MODE", "sample_fail")  # the listing works, sampling does not
    said.clear()
    with gc.ClockRecorder.for_torch_device(0, say=said.append) as clocks:
        for _ in range(2):
            with clocks.span() as samples:
                pass
            assert samples is None
    assert len(said) == 1 and "not a valid field" in said[0]  # one note, at the start
    assert len(_sampling(fake_smi())) == 1


# -------------------------------------------------------------------------------------------- kernel.py
def _fake_timing(monkeypatch, seconds=0.1):
    """bench/kernel.py's methods and run_mode faked: ours takes 2 ms, sdpa_cudnn 4 ms; each timing lasts `seconds`."""

    def fake_make_method(method, *shape_and_dtype):
        return tuple(torch.zeros(1) for _ in range(4)), method, bench.contextlib.nullcontext

    def fake_run_mode(mode, tensors, fn, warmup_ms, rep_ms):
        time.sleep(seconds)
        return {"ours": 2.0, "sdpa_cudnn": 4.0}[fn], 0.5

    monkeypatch.setattr(bench, "make_method", fake_make_method)
    monkeypatch.setattr(bench, "run_mode", fake_run_mode)
    monkeypatch.setattr(bench, "kernel_names", lambda hd: {})
    monkeypatch.setattr(bench, "_free", lambda: None)


def _args(rounds, *extra):
    return bench.parse_args(["--methods", "ours", "sdpa_cudnn", "--hdims", "128", "--causal", "1", "--seqlens",
                             "2048", "--modes", "fwd", "--rounds", str(rounds), *extra])


def test_clocks_put_fields_on_rows_and_tables(fake_smi, monkeypatch):
    _fake_timing(monkeypatch)
    assert not _args(2).clocks and _args(2, "--clocks").clocks
    plain = bench.benchmark(_args(2), DEVICE)
    with gc.ClockRecorder.for_torch_device(0, period_ms=10) as clocks:
        rows = bench.benchmark(_args(2, "--clocks"), DEVICE, clocks=clocks)
    assert len(_sampling(fake_smi())) == 1 and _gone(clocks.process)  # one nvidia-smi, 4 spans (methods x rounds)
    for row, before in zip(rows, plain):
        assert row["sm_clock_mhz"] == 1755.0 and row["power_w"] == 652.4 and row["clock_samples"] >= 4
        assert row["sm_clock_mhz_rounds"] == [1755.0, 1755.0]
        clock_keys = {"sm_clock_mhz", "power_w", "clock_samples", "sm_clock_mhz_rounds"}
        assert {k: v for k, v in row.items() if k not in clock_keys} == before  # the other fields as without
        assert not clock_keys & set(before)
    table = bench.format_table(rows, DEVICE)
    assert table.startswith(bench.format_table(plain, DEVICE))  # the TFLOP/s table as without --clocks
    clock_table = table[len(bench.format_table(plain, DEVICE)):]
    assert "SM clock (MHz) / power (W)" in clock_table
    assert "| 2048 | 1755 / 652 | 1755 / 652 |" in clock_table.splitlines()
    assert "SM clock" not in bench.format_table(plain, DEVICE)
    assert "1755 / 652 MHz / W" in bench._shown(rows[0])


def test_clocks_time_each_measurement_for_a_second_unless_told():
    # nvidia-smi's readings trail the load by ~100 ms: over do_bench's default 100 ms they read the idle GPU before
    assert _args(1).rep_ms == bench.REP_MS == 100.0
    assert _args(1, "--clocks").rep_ms == bench.CLOCKS_REP_MS == 1000.0
    assert _args(1, "--clocks", "--rep-ms", "30").rep_ms == _args(1, "--rep-ms", "30").rep_ms == 30.0


def test_clock_cells_show_what_rows_have():
    assert bench._clock_cell(None) == "-" and bench._clock_cell({"ms": 1.0}) == "-"
    assert bench._clock_cell({"sm_clock_mhz": 1755.4, "clock_samples": 3}) == "1755 / -"
    assert bench._clock_cell({"power_w": 650.0, "clock_samples": 3}) == "- / 650"


def test_clocks_off_or_failing_keep_rows_as_they_are(tmp_path, monkeypatch):
    _fake_timing(monkeypatch, seconds=0.0)
    monkeypatch.setenv("PATH", str(tmp_path))
    clocks = gc.ClockRecorder.for_torch_device(0, say=lambda note: None)
    rows = bench.benchmark(_args(1, "--clocks"), DEVICE, clocks=clocks)
    assert [r["status"] for r in rows] == ["ok", "ok"] and not any("clock_samples" in r for r in rows)
