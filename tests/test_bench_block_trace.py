"""bench/block_trace.py's accounting of the traced blocks, on rows made up here (no GPU)."""

import gzip
import json

import pytest

from bench import block_trace as bt


def _row(sm, start_ns, trips, fixed=1000, per_trip=200, ghz=2.0, loaded=300, stored=250):
    """A block on SM `sm` whose cycles are `fixed` outside the loop (the prologue `loaded`, a first S^T of 100, the
    stores `stored`, the rest waiting for the reduce) plus `per_trip` per loop trip."""
    loop_start = loaded + 100
    loop_end = loop_start + per_trip * trips
    stored_at = loop_end + stored
    exit_at = fixed + per_trip * trips
    assert exit_at > stored_at
    return dict(sm=sm, batch=0, head=0, block=0, trips=trips, start_ns=start_ns,
                exit_ns=start_ns + round(exit_at / ghz), loaded=loaded, loop_start=loop_start, loop_end=loop_end,
                stored=stored_at, exit=exit_at)


def test_fixed_cost_and_cycles_per_trip_are_recovered():
    rows = [_row(sm, 0, trips) for sm, trips in enumerate([2, 10, 30, 64])]
    s = bt.summarize(rows)
    assert s["cycles_per_trip"] == pytest.approx(200)
    assert s["fixed_cycles_per_block"] == pytest.approx(1000)
    assert s["fixed_in_trips"] == pytest.approx(5)
    assert s["fit"]["fixed_cycles"] == pytest.approx(1000)
    assert s["fit"]["cycles_per_trip"] == pytest.approx(200)
    assert s["sm_ghz"] == pytest.approx(2.0, rel=1e-3)
    total = sum(r["exit"] for r in rows)
    assert s["phase_share"][bt.PHASES[0][0]] == pytest.approx(4 * 300 / total)
    assert s["phase_share"][bt.PHASES[2][0]] == pytest.approx(200 * (2 + 10 + 30 + 64) / total)
    assert sum(s["phase_share"].values()) == pytest.approx(1)


def test_sm_time_between_blocks_and_after_the_last():
    # SM 0: a block of 1000 ns, a gap of 500 ns, a block of 1000 ns; SM 1: one block of 1000 ns, then idle 1500 ns
    rows = [_row(0, 0, 0, fixed=2000, per_trip=0, loaded=100, stored=100),
            _row(0, 1500, 0, fixed=2000, per_trip=0, loaded=100, stored=100),
            _row(1, 0, 0, fixed=2000, per_trip=0, loaded=100, stored=100)]
    for r in rows:
        r["trips"] = 1  # one trip of no cycles: the blocks count as working blocks
    s = bt.summarize(rows)
    assert s["fit"] is None  # every block one trip: no line to fit
    assert s["span_us"] == pytest.approx(2.5)
    share = s["sm_time_share"]
    assert share["blocks"] == pytest.approx(3000 / 5000)
    assert share["between blocks"] == pytest.approx(500 / 5000)
    assert share["after the last block"] == pytest.approx(1500 / 5000)
    assert share["before the first block"] == 0
    assert sum(share.values()) == pytest.approx(1)


def test_no_working_block_is_an_error():
    with pytest.raises(ValueError, match="no block ran a loop trip"):
        bt.summarize([_row(0, 0, 0)])


def _saved(path, rows, case="hd80 causal T=4096 B=4 H=25 backward"):
    """rows as --out saves them (gzipped where the name ends in .gz)."""
    text = json.dumps({"case": case, "device": None, "columns": bt.COLUMNS,
                       "rows": [[r[c] for c in bt.COLUMNS] for r in rows]})
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_a_saved_trace_is_reported_without_a_gpu(tmp_path, capsys, name):
    rows = [_row(sm, 0, trips) for sm, trips in enumerate([2, 10, 30, 64])]
    path = _saved(tmp_path / name, rows)
    again, figure = tmp_path / "again.json", tmp_path / "t.png"
    assert bt.main(["--from-json", str(path), "--out", str(again), "--plot", str(figure)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "## hd80 causal T=4096 B=4 H=25 backward" in out
    assert "cycles per loop trip 200; outside the loop 1000 per block = 5.00 trips" in out
    assert "1000 + 200 x trips (5.00 trips)" in out
    saved = json.loads(again.read_text())
    assert saved["rows"] == [[r[c] for c in bt.COLUMNS] for r in rows]
    assert saved["summary"]["fixed_in_trips"] == pytest.approx(5)


def test_a_grid_of_equal_blocks_reports_no_fit(tmp_path, capsys):
    path = _saved(tmp_path / "t.json", [_row(sm, 0, 8) for sm in range(4)], case="non-causal")
    assert bt.main(["--from-json", str(path)]) == 0
    assert "least squares over the blocks: none (every block runs the same trips)" in capsys.readouterr().out


def test_one_source_of_stamps(tmp_path):
    with pytest.raises(SystemExit):
        bt.main([])  # neither a build to trace nor a saved trace
    with pytest.raises(SystemExit):
        bt.main(["--ext", "x.so", "--from-json", str(tmp_path / "t.json")])


def test_the_persistent_replay_hides_what_each_schedule_loads_ahead():
    # Replayed onto 2 SMs in start order: A on SM 0 (1800 cycles), B on SM 1 (1000, its epilogue 600), then C on SM 1
    # after B, C's prologue 700 cycles of its 1900.
    a = _row(0, 0, 4)
    b = _row(1, 1, 0)
    c = _row(0, 2, 2, fixed=1500, loaded=700)
    assert (a["exit"], b["exit"] - b["loop_end"], c["exit"], c["loaded"]) == (1800, 600, 1900, 700)
    model = bt.persistent_model([c, b, a])  # the replay orders them by their start
    makespans = list(model["makespan_cycles"].values())
    assert [name for name, _ in bt.SCHEDULES] == list(model["makespan_cycles"])
    assert makespans == [
        1000 + 1900,  # as traced
        1000 + 1900 - 600,  # C's loads under B's epilogue: 600 of its 700 hidden
        1000 + 1900 - 700,  # C's loads landed before it starts
        1800,  # C's loop alone (400) ends before A does
    ]
    assert list(model["speedup"].values()) == pytest.approx([1, 2900 / 2300, 2900 / 2200, 2900 / 1800])


def test_the_report_shows_the_replay(tmp_path, capsys):
    # Two SMs, two blocks of 2600 cycles (1300 ns) each, back to back: the replay as traced fills the span.
    rows = [_row(sm, start, 8) for start in (0, 1300) for sm in (0, 1)]
    path = _saved(tmp_path / "t.json", rows, case="non-causal")
    assert bt.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "The replay of the blocks as traced takes 100.0% of the traced span" in out
    assert "| one block per tile, as traced | 5 | 1.000 |" in out  # two blocks of 2600 cycles per SM
    assert "| bound: the loop alone after each SM's first block | 4 | 1.238 |" in out  # 2600 + 1600
