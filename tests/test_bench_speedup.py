"""bench/speedup.py on bench/kernel.py rows written here: rounds paired one to one, runs combined by their median,
the table's cells and geometric means, and the errors a wrong file or a wrong pair of methods gets."""

from __future__ import annotations

import json
import math

import pytest

from bench import speedup as sp


def row(method: str, ms_rounds: list[float], hd: int = 64, causal: bool = True, seqlen: int = 1024,
        status: str = "ok") -> dict:
    return {"device": "GPU", "inputs": "bthd", "dtype": "bf16", "mode": "bwd", "hd": hd, "causal": causal,
            "seqlen": seqlen, "batch": 16, "heads": 32, "method": method, "status": status,
            "ms": sorted(ms_rounds)[len(ms_rounds) // 2], "ms_rounds": ms_rounds}


def write(tmp_path, name: str, rows: list[dict]):
    path = tmp_path / name
    path.write_text(json.dumps({"environment": {}, "results": rows}))
    return path


def test_rounds_pair_one_to_one():
    # Round 1: old 2.0 / new 1.0 = 2.0; round 2: 2.0 / 2.0 = 1.0. Pairing by sorted times would give other values.
    speedups = sp.round_speedups([row("ours", [1.0, 2.0]), row("ours_candidate", [2.0, 2.0])], "ours", "ours_candidate")
    assert list(speedups.values()) == [[2.0, 1.0]]


def test_cells_without_both_methods_or_not_ok_are_left_out():
    rows = [row("ours", [1.0]), row("ours_candidate", [1.5]),
            row("ours", [1.0], seqlen=2048),  # no old method
            row("ours", [1.0], seqlen=4096), row("ours_candidate", [1.0], seqlen=4096, status="skipped")]
    speedups = sp.round_speedups(rows, "ours", "ours_candidate")
    assert [dict(zip(sp.CELL_KEYS, c))["seqlen"] for c in speedups] == [1024]
    assert speedups[next(iter(speedups))] == [1.5]


def test_unequal_round_counts_are_an_error():
    with pytest.raises(ValueError, match="ours has 2 rounds and ours_candidate 3"):
        sp.round_speedups([row("ours", [1.0, 1.0]), row("ours_candidate", [1.0, 1.0, 1.0])], "ours", "ours_candidate")


def test_runs_combine_by_median_and_keep_the_lowest_round():
    a = {("c",): [1.10, 1.00, 1.05]}  # median 1.05
    b = {("c",): [0.90, 1.20, 1.01]}  # median 1.01
    c = {("c",): [1.02, 1.03, 1.04], ("only here",): [2.0]}  # median 1.03
    out = sp.combine([a, b, c])
    assert set(out) == {("c",)}  # a cell missing from one run is left out
    assert out[("c",)]["runs"] == [1.05, 1.01, 1.03]
    assert out[("c",)]["speedup"] == 1.03
    assert out[("c",)]["lowest_round"] == 0.90


def test_table_cells_and_geometric_means():
    rows = []
    for seqlen, (causal_gain, plain_gain) in {1024: (1.1, 1.0), 2048: (1.2, 0.9)}.items():
        for causal, gain in ((True, causal_gain), (False, plain_gain)):
            rows += [row("ours", [1.0], causal=causal, seqlen=seqlen), row("ours_candidate", [gain], causal=causal,
                                                                            seqlen=seqlen)]
    text = sp.table(sp.combine([sp.round_speedups(rows, "ours", "ours_candidate")]))
    assert "| head dim | 1k | 2k | geometric mean |" in text
    mean = f"{math.sqrt(1.1 * 1.2):.3f} / {math.sqrt(1.0 * 0.9):.3f}"
    assert f"| 64 | 1.100 / 1.000 | 1.200 / 0.900 | {mean} |" in text


def test_main_prints_the_table_and_swaps_methods(tmp_path, capsys):
    path = write(tmp_path, "run.json", [row("ours", [1.0, 1.0]), row("ours_candidate", [1.25, 1.25])])
    assert sp.main([str(path), "--cells"]) == 0
    out = capsys.readouterr().out
    assert "| 64 | 1.250 / - | 1.250 / - |" in out
    assert "bwd hd64 causal 1024: 1.250 (runs 1.250; lowest round 1.250)" in out
    sp.main([str(path), "--new", "ours_candidate", "--old", "ours"])
    assert "| 64 | 0.800 / - | 0.800 / - |" in capsys.readouterr().out


def test_main_filters_head_dims(tmp_path, capsys):
    path = write(tmp_path, "run.json", [row("ours", [1.0]), row("ours_candidate", [1.0]),
                                        row("ours", [1.0], hd=128), row("ours_candidate", [2.0], hd=128)])
    sp.main([str(path), "--hdims", "128"])
    out = capsys.readouterr().out
    assert "| 128 | 2.000 / - |" in out and "| 64 |" not in out


def test_bad_inputs_name_the_problem(tmp_path):
    not_results = tmp_path / "notes.json"
    not_results.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a bench/kernel.py result file"):
        sp.main([str(not_results)])
    one_method = write(tmp_path, "one.json", [row("ours", [1.0])])
    with pytest.raises(SystemExit, match="no cell has both 'ours' and 'ours_candidate'"):
        sp.main([str(one_method)])
    uneven = write(tmp_path, "uneven.json", [row("ours", [1.0]), row("ours_candidate", [1.0, 1.0])])
    with pytest.raises(SystemExit, match="uneven.json: .*interleaved rounds pair one to one"):
        sp.main([str(uneven)])
    with pytest.raises(SystemExit):
        sp.main([str(one_method), "--new", "ours", "--old", "ours"])


def varlen_row(method: str, ms_rounds: list[float], grid: str, case: str, window: int = -1) -> dict:
    """A bench/kernel.py --varlen row: grid, case and window instead of inputs and seqlen."""
    return {"device": "GPU", "grid": grid, "case": case, "window": window, "method": method, "hd": 128, "heads": 16,
            "tokens": 16384, "dtype": "bf16", "causal": True, "mode": "bwd", "status": "ok",
            "ms": sorted(ms_rounds)[len(ms_rounds) // 2], "ms_rounds": ms_rounds}


def test_varlen_rows_keep_their_cases_apart(tmp_path, capsys):
    rows = [varlen_row("ours", [1.0, 1.0], "docs", "fixed1k"), varlen_row("ours_candidate", [1.1, 1.1], "docs", "fixed1k"),
            varlen_row("ours", [1.0, 1.0], "docs", "fixed2k"), varlen_row("ours_candidate", [0.9, 0.9], "docs", "fixed2k"),
            varlen_row("ours", [1.0, 1.0], "window", "T8192", 256),
            varlen_row("ours_candidate", [1.2, 1.2], "window", "T8192", 256)]
    path = write(tmp_path, "varlen.json", rows)
    assert sp.main([str(path), "--new", "ours_candidate", "--old", "ours", "--cells"]) == 0
    out = capsys.readouterr().out
    assert "| docs | fixed1k | -1 | 128 | 0.909 | 0.909 |" in out  # 1.0 ms / 1.1 ms, not merged with fixed2k
    assert "| docs | fixed2k | -1 | 128 | 1.111 | 1.111 |" in out
    assert "| window | T8192 | 256 | 128 | 0.833 | 0.833 |" in out
    assert f"geometric mean over 3 cells: {(1 / 1.1 / 0.9 / 1.2) ** (1 / 3):.3f}" in out
    assert "bwd hd128 causal docs fixed1k w-1: 0.909" in out and "head dim | 1k" not in out


def test_parts_of_one_run_combine_and_the_summary_counts_the_cells(tmp_path, capsys):
    # One run saved per head dim: as runs their cells do not overlap, as --parts they make one table.
    hd64 = write(tmp_path, "hd64.json", [row("ours", [1.0]), row("fa4", [1.1]),
                                         row("ours", [1.0], seqlen=2048), row("fa4", [1.0], seqlen=2048)])
    hd128 = write(tmp_path, "hd128.json", [row("ours", [1.0], hd=128), row("fa4", [0.9], hd=128)])
    with pytest.raises(SystemExit, match="no cell has both 'ours' and 'fa4' in every file"):
        sp.main([str(hd64), str(hd128), "--old", "fa4"])
    assert sp.main([str(hd64), str(hd128), "--old", "fa4", "--parts"]) == 0
    out = capsys.readouterr().out
    assert "| 64 | 1.100 / - | 1.000 / - |" in out and "| 128 | 0.900 / - | - / - |" in out
    assert f"2 of 3 cells at or above 1.00; geometric mean {(1.1 * 1.0 * 0.9) ** (1 / 3):.3f}" in out
    with pytest.raises(SystemExit, match="both time ours in cell .*leave out --parts"):
        sp.main([str(hd64), str(hd64), "--old", "fa4", "--parts"])
