"""The sm80 kernels' shared-memory layouts (flash_kernel/csrc/smem_tile.h), checked on the host.

tests/smem_tile_check.cu includes the header the kernels use, compiled by nvcc for the CPU (no GPU needed):
each layout keeps every element inside its row, ldmatrix conflict free, the swizzled copies in whole 128-byte
lines, and SmemTile::step equal to index() over the kernels' ldmatrix walks; and the backward's dQ staging tile
(DqStageTile) free of bank conflicts for its fragment stores and row reads.
"""


def test_smem_tile_layouts(host_check):
    layouts = ["padded 32", "padded 96", "padded 64", "padded 128", "swizzled 64", "swizzled 128", "swizzled 256",
               "dq stage 32"]
    assert host_check("smem_tile_check.cu") == [f"ok {name}" for name in layouts]
