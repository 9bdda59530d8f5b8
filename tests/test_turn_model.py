"""bench/turn_model.py: the turn-cost model of the forward's tile choice, its report against measured rows, and the
committed measurements' agreement with it."""

from pathlib import Path

import pytest

from bench import turn_model as m

MEASURED = Path(__file__).resolve().parents[1] / "bench" / "results" / "stage3_rounds" / "v47" / "tile_ratios.csv"


def test_turns_cost_counts_a_partial_block_as_whole():
    assert m.turns_cost(1536, 192) == 8 * 216 and m.turns_cost(1537, 192) == 9 * 216
    assert m.turns_cost(1792, 128) == 14 * 152
    assert m.predicted_ratio(1536) == pytest.approx(12 * 152 / (8 * 216))


@pytest.mark.parametrize("keys,wide", [(128, False), (129, True), (512, False), (576, True), (1024, False),
                                       (1152, True), (1792, False), (1920, True), (2176, False), (2177, True)])
def test_wider_blocks_pay(keys, wide):
    assert m.wider_blocks_pay(keys) is wide


@pytest.mark.parametrize("keys,wide", [(1024, False), (1152, True), (1536, False), (2048, False), (3000, True),
                                       (4096, False), (4608, True), (5376, False), (8192, True), (16384, True)])
def test_hd96s_144_key_blocks_pay_where_their_turns_cost_less(keys, wide):
    # the lengths results.md section 58 timed: 144-key blocks at 8k and 16k, not at 1k, 2k or 4k
    assert m.wider_blocks_pay(keys, wide=m.WIDE_HD96) is wide
    assert (m.predicted_ratio(keys, wide=m.WIDE_HD96) > 1) is wide


def test_a_large_turn_runs_the_wider_blocks_wherever_they_take_fewer_turns():
    wide = [t for t in range(1, 4097) if m.wider_blocks_pay(t, turn_keys=100000)]
    assert wide == list(range(129, 193)) + list(range(257, 4097))


def test_choice_loss_is_the_slower_tiles_excess():
    assert m.choice_loss({"keys": 1792, "t128_over_t192": 0.98}) == 0.0  # model: 128, and 128 is faster
    assert m.choice_loss({"keys": 1792, "t128_over_t192": 1.05}) == pytest.approx(0.05)
    assert m.choice_loss({"keys": 1536, "t128_over_t192": 0.8}) == pytest.approx(0.25)


def test_read_measured_names_a_missing_column(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("hd,keys,ratio\n128,1024,0.93\n")
    with pytest.raises(ValueError, match="t128_over_t192"):
        m.read_measured(path)


def test_the_committed_measurements_agree_with_the_model():
    rows = m.read_measured(MEASURED)
    assert len(rows) >= 60 and {r["hd"] for r in rows} == {128, 80}
    assert max(m.choice_loss(r) for r in rows) < 0.015
    assert "by at most 1.4%" in m.report(rows).splitlines()[-1]


def test_main_prints_the_table_and_draws_the_figure(tmp_path, capsys):
    assert m.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["keys", "tile", "model", "128/192"] and len(out) == 1 + (4096 - 128) // 64 + 1
    assert m.main(["--wide", "144"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["keys", "tile", "model", "128/144"]
    assert {line.split()[1] for line in out[1:]} == {"128", "144"}
    with pytest.raises(SystemExit):
        m.main(["--wide", "144", "--causal"])
    assert m.main(["--measured", str(MEASURED)]) == 0
    assert "rows: the model's tile the slower one in" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    png = tmp_path / "fig.png"
    assert m.main(["--measured", str(MEASURED), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_plot_needs_measured_rows():
    with pytest.raises(SystemExit):
        m.main(["--plot", "fig.png"])


def test_the_causal_count_crosses_over_near_klongkeys():
    # hd128's causal calls switch to the 192-key blocks at 2048 keys (kLongKeys); summed over a causal grid's query
    # tiles the count favours the 128-key blocks up to 2048 keys and the 192-key ones from 2304.
    assert all(m.causal_predicted_ratio(t) < 1 for t in range(128, 2049, 128))
    assert all(m.causal_predicted_ratio(t) > 1 for t in range(2304, 16385, 256))
    # one tile of 128 rows: the dense count
    assert m.causal_predicted_ratio(100) == pytest.approx(m.predicted_ratio(100))


def test_main_prints_the_causal_count_and_refuses_it_with_measured_rows(capsys):
    assert m.main(["--causal"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "keys" and ["2048", "0.997"] in [line.split() for line in lines]
    with pytest.raises(SystemExit):
        m.main(["--causal", "--measured", str(MEASURED)])


def test_plot_without_matplotlib_is_refused_before_anything_runs(monkeypatch, tmp_path):
    find_spec = m.importlib.util.find_spec
    monkeypatch.setattr(m.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else find_spec(name))
    with pytest.raises(SystemExit):
        m.main(["--measured", str(MEASURED), "--plot", str(tmp_path / "fig.png")])
    assert not (tmp_path / "fig.png").exists()
