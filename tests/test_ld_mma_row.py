"""The rows of BwdParams::ld_mma (store_ld_mma_row, flash_bwd_common.cuh), checked on the host: the dense Hopper
backward adds -L_i / scale to S^T and -D_i to dP^T as three bf16 values per row summed by a matmul, so their sum must
give the float back, and an infinite L (a row that sees no key) must give -inf, not inf - inf.

tests/ld_mma_row_check.cu includes the header the preprocess kernel uses, compiled by nvcc for the CPU.
"""


def test_ld_mma_rows_sum_to_the_float_they_split(host_check):
    assert host_check("ld_mma_row_check.cu") == ["ok ld_mma_row", "worst relative error 0"]
