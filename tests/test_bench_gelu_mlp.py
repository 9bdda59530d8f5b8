"""bench/gelu_mlp.py off the GPU: its methods compute the same MLP, its table, and its refusals."""

import pytest
import torch

from bench import gelu_mlp


def test_the_unfused_methods_compute_the_same_mlp():
    g = torch.Generator().manual_seed(0)
    x, w1, b1, w2, b2 = (torch.randn(*s, generator=g) for s in ((3, 8), (32, 8), (32,), (8, 32), (8,)))
    torch.testing.assert_close(gelu_mlp.fused_bias_gelu(x, w1, b1, w2, b2), gelu_mlp.unfused(x, w1, b1, w2, b2))


def test_the_table_has_a_row_per_method():
    rows = [{"device": "GPU", "m": 16, "c": 8, "d_ff": 32, "method": m, "fwd_ms": 1.0, "bwd_ms": 2.0,
             "fwd_bwd_ms": 3.0, "fwd_tflops": 500.0, "fwd_bwd_tflops": 510.0} for m in ("unfused", "epilogues")]
    lines = gelu_mlp.table(rows).splitlines()
    assert len(lines) == 4 and "| epilogues | 1.000 | 2.000 | 3.000 | 500 | 510 |" in lines[3]


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(SystemExit, match="must be at least 1"):
        gelu_mlp.main(["--rounds", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            gelu_mlp.main([])
