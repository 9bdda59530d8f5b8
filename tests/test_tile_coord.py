"""The Hopper forward's tile arithmetic (flash_kernel/csrc/fast_div.h, fwd_tile_scheduler.h), checked on the host.

tests/tile_coord_check.cu compiles the headers the kernel uses for the CPU: FastDiv's multiply-and-shift equals
integer division over the divisors and dividends the kernel can meet, and every tile index maps to the
(query block, head, batch) of the causal and non-causal orders written out as plain loops.
"""


def test_fast_div_and_tile_order(host_check):
    assert host_check("tile_coord_check.cu") == ["ok fast_div", "ok tile order"]
