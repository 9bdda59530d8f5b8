"""Which tile the Hopper forward runs in dense non-causal calls, checked on the host.

tests/fwd_tile_choice_check.cu prints, for hd128's config and for head dims up to 80, the lengths from 1 to 16384 keys
at which wider_blocks_pay (hopper_kernel_traits.h) runs the 192-key blocks rather than the 128-key ones. Here: those
are the lengths where bench/turn_model.py's turn-cost model says so, and the kernels' choice is the faster tile at
every length where the two differed by more than 3% on an H200 (bench/results/stage3_rounds/v47/tile_ratios.csv,
medians of five interleaved rounds; docs/results.md, sections 38 and 39).
"""

import math
from pathlib import Path

import pytest

from bench import turn_model

MAX_KEYS = 16384
MEASURED = Path(__file__).resolve().parents[1] / "bench" / "results" / "stage3_rounds" / "v47" / "tile_ratios.csv"


@pytest.fixture
def wider_lengths(host_check):
    """{head dim: the key lengths at which the 192-key blocks run}, from the host check."""
    out = {}
    for line in host_check("fwd_tile_choice_check.cu"):
        name, long_keys, short_keys, *ranges = line.split()
        assert (int(long_keys), int(short_keys)) == (turn_model.WIDE, turn_model.NARROW), line
        lengths = set()
        for r in ranges:
            first, last = map(int, r.split("-"))
            lengths.update(range(first, last + 1))
        out[{"hd128": 128, "hd80": 80}[name]] = lengths
    assert set(out) == {128, 80}
    return out


@pytest.mark.parametrize("head_dim", [128, 80])
def test_the_wider_blocks_run_where_their_turns_cost_less(wider_lengths, head_dim):
    expected = {t for t in range(1, MAX_KEYS + 1) if turn_model.wider_blocks_pay(t)}
    assert wider_lengths[head_dim] == expected
    assert set(range(2177, MAX_KEYS + 1)) <= expected  # from 2177 keys the wider blocks always run


def test_the_choice_is_the_faster_tile_where_timed(wider_lengths):
    clear = [r for r in turn_model.read_measured(MEASURED) if abs(math.log(r["t128_over_t192"])) > math.log(1.03)]
    assert {r["hd"] for r in clear} == {128, 80} and len(clear) >= 20
    for r in clear:
        chosen_wide = r["keys"] in wider_lengths[r["hd"]]
        assert chosen_wide == (r["t128_over_t192"] > 1), r
