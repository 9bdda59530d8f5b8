"""The Hopper kernels' tile arithmetic (flash_kernel/csrc/fast_div.h, fwd_tile_scheduler.h, hopper_seqlen.h), checked on
the host.

tests/tile_coord_check.cu compiles the headers the kernel uses for the CPU: FastDiv's multiply-and-shift equals
integer division over the divisors and dividends the kernel can meet, and every tile index maps to the
(query block, head, batch) of the causal and non-causal orders written out as plain loops.
tests/seqlen_bounds_check.cu checks the varlen / sliding-window bounds (the key blocks a forward tile visits, the
rows it leaves to the post-pass, the query blocks a backward key block visits) against the visibility rule per
(query, key) pair, over lengths 0-700, windows and causal.
"""


def test_fast_div_and_tile_order(host_check):
    assert host_check("tile_coord_check.cu") == ["ok fast_div", "ok tile order"]


def test_varlen_window_bounds(host_check):
    assert host_check("seqlen_bounds_check.cu") == ["ok seqlen bounds"]
