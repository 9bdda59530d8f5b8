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


def test_fwd_bwd_times_interleaves_the_methods_and_takes_medians(monkeypatch):
    """bench.common.fwd_bwd_times (bench/swiglu.py's and bench/gelu_mlp.py's timing): each round times every
    method's forward then forward + backward, and each time is the median over the rounds."""
    import sys
    import types

    from bench.common import fwd_bwd_times

    order, clock = [], iter([1.0, 3.0, 10.0, 30.0, 2.0, 5.0, 20.0, 50.0, 3.0, 4.0, 30.0, 40.0])
    fake = types.ModuleType("triton.testing")
    fake.do_bench_cudagraph = lambda fn, return_mode: (order.append(fn()), next(clock))[1]
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.testing", fake)
    runs = {m: (lambda m=m: f"{m} fwd", lambda m=m: f"{m} fwd_bwd") for m in ("a", "b")}
    times = fwd_bwd_times(runs, rounds=3)
    assert order == ["a fwd", "a fwd_bwd", "b fwd", "b fwd_bwd"] * 3
    assert times["a"] == {"fwd_ms": 2.0, "fwd_bwd_ms": 4.0, "bwd_ms": 2.0,
                          "rounds": [(1.0, 3.0), (2.0, 5.0), (3.0, 4.0)]}
    assert times["b"]["fwd_ms"] == 20.0 and times["b"]["fwd_bwd_ms"] == 40.0 and times["b"]["bwd_ms"] == 20.0
