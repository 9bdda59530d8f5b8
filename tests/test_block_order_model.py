"""bench/block_order_model.py, the greedy-schedule model that flash_kernel/csrc/causal_order.h quotes: its costs follow
the causal passes' shapes, and its numbers are the ones the header and docs/CHANGELOG.md state."""

import pytest

from bench import block_order_model as m


def test_block_costs_follow_the_causal_diagonal():
    # forward: query block i sees i + 1 key blocks of 128; backward at hd128 (64-row query blocks, 128-key blocks):
    # key block j is visited by 2 fewer query blocks than key block j - 1
    assert m.block_costs("fwd", 512, 128, 128, 0) == [1, 2, 3, 4]
    assert m.block_costs("bwd", 512, 64, 128, 0) == [8, 6, 4, 2]  # 8 query blocks of 64, two fewer per key block
    assert m.block_costs("bwd", 512, 64, 128, 1.5) == [9.5, 7.5, 5.5, 3.5]


def test_orders():
    costs = [3.0, 2.0, 1.0]
    assert m.launch_order(costs, 2, None) == [3, 2, 1, 3, 2, 1]  # the grid's: each pair's blocks in turn
    assert m.launch_order(costs, 3, 2) == [3, 3, 2, 2, 1, 1, 3, 2, 1]  # groups of 2 pairs, the last one short
    assert m.makespan_ratio([1.0] * 264, 132) == pytest.approx(1.0)
    assert m.makespan_ratio([2.0] + [1.0] * 131, 132) == pytest.approx(2.0 / (133 / 132))


def test_a_short_last_group_takes_in_the_one_before():
    assert m.group_sizes(100, 11, 32, None) == [11] * 9 + [1]  # the pairs left over, a group of their own
    assert m.group_sizes(100, 11, 32, 132) == [11] * 8 + [12]  # 1 pair x 32 blocks < 132 SMs: merged
    assert m.group_sizes(84, 10, 32, 132) == [10] * 7 + [14]
    assert m.group_sizes(64, 8, 32, 132) == [8] * 8  # 8 x 32 blocks: a wave, kept
    assert m.group_sizes(5, 5, 2, 132) == [5]  # one group: nothing to merge into
    assert m.launch_order([2.0, 1.0], 3, 2, sms=8) == [2, 2, 2, 1, 1, 1]  # 1 pair x 2 blocks < 8: one group of 3


def test_the_numbers_causal_order_h_quotes():
    for t in (1024, 2048, 4096, 8192):
        assert 1.05 < m.model("bwd", 128, t, None) < 1.08  # hd128 backward, grid order: 5.8-7.1% above ideal
        assert 1.02 < m.model("bwd", 64, t, None) < 1.04  # hd64: 2.8-3.5%
        assert 1.06 < m.model("fwd", 128, t, None) < 1.08  # the forward, grid order (shortest first per head): 3-8%
        assert 1.03 < m.model("fwd", 64, t, None) < 1.04
        assert m.model("fwd", 128, t, 16) < 1.021  # longest-first in groups: within 2%
    # the backward at hd80, 4k keys, 100 pairs in groups of 11, 2.4 tiles' fixed cost per block: 1.059 -> 1.010
    assert m.model("bwd", 80, 4096, 11, overhead=2.4, merge=False) == pytest.approx(1.059, abs=5e-4)
    assert m.model("bwd", 80, 4096, 11, overhead=2.4) == pytest.approx(1.010, abs=5e-4)
    # the causal forward at hd96, 8k keys, groups of 5 (results.md section 41): 1.082 -> 1.011
    assert m.model("fwd", 96, 8192, 5, merge=False) == pytest.approx(1.082, abs=5e-4)
    assert m.model("fwd", 96, 8192, 5) == pytest.approx(1.011, abs=5e-4)
    pairs_8k = (16384 // 8192) * 16
    assert m.model("bwd", 128, 8192, 4) < 1.002 and m.model("bwd", 128, 8192, pairs_8k) < 1.003  # the groups at 8k


def test_main_prints_the_table(capsys):
    assert m.main(["--pass", "bwd", "--hdims", "128", "--seqlens", "8192", "--groups", "4"]) == 0
    out = capsys.readouterr().out
    assert "| bwd | 128 | 8192 | 32 | 1.058 | 1.001 |" in out
    with pytest.raises(SystemExit):
        m.main(["--groups", "0"])
