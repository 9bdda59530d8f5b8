"""The sm80 kernels' shared-memory layouts (flash_kernel/csrc/smem_tile.h) and the Hopper backward's dQ tile rows
(dq_accum_layout.h), checked on the host.

tests/smem_tile_check.cu includes the header the kernels use, compiled by nvcc for the CPU (no GPU needed):
each layout keeps every element inside its row, ldmatrix conflict free, the swizzled copies in whole 128-byte
lines, and SmemTile::step equal to index() over the kernels' ldmatrix walks; and the backward's dQ staging tile
(DqStageTile) free of bank conflicts for its fragment stores and row reads; the Hopper backward's sdQ rows (which
dq_accum shares) free of bank conflicts for its float2 stores, per half-warp.
"""


def test_smem_tile_layouts(host_check):
    layouts = ["padded 32", "padded 96", "padded 64", "padded 128", "swizzled 64", "swizzled 128", "swizzled 256",
               "dq stage 32", "hopper dq 64", "hopper dq 80", "hopper dq 96", "hopper dq 128"]
    assert host_check("smem_tile_check.cu") == [f"ok {name}" for name in layouts]
