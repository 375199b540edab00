"""``linear_padded_rows``: the GEMM of ``linear`` written into 16-byte-aligned output rows (the MoE
router + shared-gate GEMM: 257 columns): ``F.linear``'s values (bit for bit on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.layers.linear import linear_padded_rows

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_equal_linear(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g).to(device, dtype)
    w = torch.randn(257, 64, generator=g).to(device, dtype)
    got = linear_padded_rows(x, w)
    assert got.shape == (37, 257)
    assert got.stride() == (264 if dtype == torch.bfloat16 else 260, 1)  # rows of a multiple of 16 bytes
    if device == "cpu":
        assert torch.equal(got, F.linear(x, w))
    else:  # cuBLAS picks another (aligned) kernel: another summation order
        torch.testing.assert_close(got, F.linear(x, w))


def test_aligned_rows_stay_dense():
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    got = linear_padded_rows(x, w)
    assert got.is_contiguous() and torch.equal(got, F.linear(x, w))
