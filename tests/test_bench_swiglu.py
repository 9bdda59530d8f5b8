"""bench/swiglu.py off the GPU: what its bandwidth counts, its table, and its refusals."""

import pytest
import torch

from bench import swiglu


def test_the_bandwidth_counts_the_bytes_each_pass_must_move():
    # forward: gate and up read, the output written; backward: gate, up and the incoming gradient read, dh written
    assert swiglu.min_bytes(16384, 8192, 2) == (3 * 16384 * 8192 * 2, 5 * 16384 * 8192 * 2)


def test_the_table_has_a_row_per_method():
    rows = [{"device": "GPU", "torch": "2.11", "n": 8, "ffn": 4, "dtype": "bf16", "method": m, "fwd_ms": 1.0,
             "bwd_ms": b, "fwd_tb_s": 0.5, "bwd_tb_s": None if b <= 0 else 2.0}
            for m, b in (("triton", 2.0), ("plain", 0.0))]
    lines = swiglu.table(rows).splitlines()
    assert len(lines) == 4 and "| triton | 1.000 | 2.000 | 0.50 | 2.00 |" in lines[2] and lines[3].endswith("| – |")


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(SystemExit, match="must be at least 1"):
        swiglu.main(["--rounds", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            swiglu.main([])


def test_launch_shapes_are_parsed_and_bad_ones_refused():
    assert swiglu.parse_config("2048x8") == (2048, 8)
    for bad in ("2048", "1000x4", "8x4", "1024x64", "axb"):
        with pytest.raises(SystemExit, match="--triton-configs"):
            swiglu.parse_config(bad)
