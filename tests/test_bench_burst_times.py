"""bench/burst_times.py: the doubling windows, their medians, the table, the arguments; one case on a GPU."""

import json

import pytest
import torch

from bench import burst_times as bt


@pytest.mark.parametrize("calls, spans", [
    (1, [(0, 1)]),
    (2, [(0, 1), (1, 2)]),
    (5, [(0, 1), (1, 2), (2, 4), (4, 5)]),
    (16, [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16)]),
])
def test_windows_double_and_cover_every_call_once(calls, spans):
    assert bt.windows(calls) == spans


def test_window_medians_take_each_burst_then_the_bursts():
    bursts = [[10.0, 4.0, 2.0, 8.0], [12.0, 6.0, 3.0, 1.0], [11.0, 5.0, 100.0, 100.0]]
    # window (2, 4): per burst 5.0, 2.0, 100.0 -> 5.0; the outlier burst moves nothing
    assert bt.window_medians(bursts, [(0, 1), (1, 2), (2, 4)]) == [11.0, 5.0, 5.0]


def test_table_has_a_row_per_window_and_the_first_methods_speed_over_the_others():
    calls = {"ours": [[2.0, 1.0, 1.0, 1.0]], "fa4": [[2.0, 1.1, 1.2, 1.2]]}
    starts = [[0.0, 2.5, 4.0, 5.5]]
    table = bt.format_table("hd=128", calls, starts)
    lines = table.splitlines()
    assert lines[2] == "| calls | ms into the burst (ours) | ours (µs) | fa4 (µs) | ours / fa4 speed |"
    assert lines[4:] == ["| 1 | 0.0 | 2000.0 | 2000.0 | 1.000 |",
                         "| 2 | 2.5 | 1000.0 | 1100.0 | 1.100 |",
                         "| 3-4 | 4.0 | 1000.0 | 1200.0 | 1.200 |"]


def test_arguments_default_to_ours_and_fa4_on_hd128_causal_backward_calls_flushed():
    args = bt.parse_args([])
    assert (args.methods, args.hdim, args.causal, args.seqlen, args.mode) == (["ours", "fa4"], 128, 1, 8192, "bwd")
    assert args.flush_l2 and args.bursts == 5 and args.calls == 256 and args.gap_ms == 1000
    assert not bt.parse_args(["--no-flush"]).flush_l2


@pytest.mark.parametrize("bad", [["--bursts", "0"], ["--calls", "0"], ["--gap-ms", "-1"]])
def test_bad_counts_stop_at_the_arguments(bad, capsys):
    with pytest.raises(SystemExit):
        bt.parse_args(bad)
    assert "--bursts and --calls must be >= 1" in capsys.readouterr().err


def test_refuses_to_run_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bt.main(["--results", str(tmp_path / "bursts.json")])
    assert not (tmp_path / "bursts.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times attention calls: needs a CUDA GPU")
def test_bursts_time_every_call_on_the_gpu(tmp_path):
    import flash_kernel

    if not flash_kernel.is_available():
        pytest.skip(f"flash_kernel unavailable: {flash_kernel.unavailable_reason()}")
    path = tmp_path / "bursts.json"
    assert bt.main(["--methods", "ours", "sdpa_flash", "--hdim", "64", "--seqlen", "1024", "--bursts", "2",
                    "--calls", "6", "--gap-ms", "20", "--results", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert sorted((r["method"], r["burst"]) for r in rows) == [("ours", 0), ("ours", 1), ("sdpa_flash", 0),
                                                               ("sdpa_flash", 1)]
    for r in rows:
        assert len(r["call_ms"]) == len(r["start_ms"]) == 6 and all(ms > 0 for ms in r["call_ms"])
        # one stream: each call starts after the one before it has ended
        assert r["start_ms"][0] == 0
        assert all(later >= start + ms * (1 - 1e-3) for start, ms, later in
                   zip(r["start_ms"], r["call_ms"], r["start_ms"][1:]))
