"""The Hopper kernels' tile layout in shared memory (TileLayout, hopper_utils.cuh), checked on the host.

tests/tile_layout_check.cu includes the header the kernels use, compiled by nvcc for the CPU (no GPU needed): in
every tile, the hd65-80 tiles of 64 columns in SW128 and 16 in SW32 included, each 16-byte chunk has its own place,
in its column block, where the hardware's swizzle (the one TMA writes and wgmma reads) puts it; tiles of whole
column blocks map as before.
"""


def test_tile_layouts(host_check):
    layouts = ["64 x 80 sw128 + sw32", "128 x 80 sw128 + sw32", "144 x 80 sw128 + sw32", "192 x 80 sw128 + sw32",
               "64 x 96 sw128 + sw64", "128 x 128 sw128", "128 x 96 sw64", "64 x 64 sw128"]
    assert host_check("tile_layout_check.cu") == [f"ok {name}" for name in layouts]
