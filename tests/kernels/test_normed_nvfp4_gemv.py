"""The NVFP4 GEMV with the residual add + RMSNorm in its prologue against its reference and against
the two launches it replaces (the Triton norm, then the Triton NVFP4 GEMV)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_as_launched, assert_close
from freetoken.kernels.normed_nvfp4_gemv import NORMED_NVFP4_MAX_ROWS, add_rms_norm_nvfp4_gemv_reference
from freetoken.kernels.nvfp4 import nvfp4_linear_reference

EPS = 1e-6


def _triton():
    from freetoken.kernels.triton import norm, normed_nvfp4_gemv, nvfp4_rows

    return norm, normed_nvfp4_gemv, nvfp4_rows


def operands(rng, rows: int, n_out: int, k_in: int, dtype: torch.dtype, residual: bool, zero_centered: bool):
    x = torch.randn(rows, k_in, generator=rng).to(dtype).to(DEVICE)
    res = torch.randn(rows, k_in, generator=rng).to(dtype).to(DEVICE) if residual else None
    nw = (torch.randn(k_in, generator=rng) * (0.2 if zero_centered else 1.0) + (0.0 if zero_centered else 1.0))
    packed = torch.randint(0, 256, (n_out, k_in // 2), generator=rng, dtype=torch.uint8).to(DEVICE)
    scales = torch.randint(0, 0x7F, (n_out, k_in // 16), generator=rng, dtype=torch.uint8).view(torch.float8_e4m3fn)
    row_scales = torch.rand(n_out, generator=rng) * 2**-6 * k_in**-0.5 + 1e-4
    return x, res, nw.to(dtype).to(DEVICE), (packed, scales.to(DEVICE), row_scales.to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first"])
@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero_centered", "plain"])
# Widths that are one GEMV step, ragged, and past one 2048-weight step; rows past one program's block.
@pytest.mark.parametrize("rows,n_out,k_in", [(1, 37, 48), (3, 70, 272), (NORMED_NVFP4_MAX_ROWS, 9, 4112)])
def test_normed_nvfp4_gemv_matches_the_two_launches(rng, dtype, residual, zero_centered, rows, n_out, k_in):
    norm, fused, gemv = _triton()
    x, res, nw, w = operands(rng, rows, n_out, k_in, dtype, residual, zero_centered)
    out, normed, summed = fused.add_rms_norm_nvfp4_gemv(x, res, nw, EPS, zero_centered, *w, True)
    if res is None:
        want_normed, want_summed = norm.rms_norm(x, nw, EPS, zero_centered), x
    else:
        want_normed, want_summed = norm.add_rms_norm(x, res, nw, EPS, zero_centered)
    want_out = torch.empty(rows, n_out, dtype=dtype, device=DEVICE)
    gemv.nvfp4_gemv(normed, w[0], w[1].view(torch.uint8), w[2], want_out)  # the GEMV launch on the same rows
    assert out.dtype == dtype and out.shape == (rows, n_out)
    assert torch.equal(summed, want_summed)
    assert_as_launched(normed, want_normed)  # compiled, the row's sum of squares follows each kernel's tile
    assert_as_launched(out, want_out)
    ref_out, ref_normed, ref_summed = add_rms_norm_nvfp4_gemv_reference(x, res, nw, EPS, zero_centered, *w, True)
    assert torch.equal(summed, ref_summed)
    assert_close(normed.float(), ref_normed.float(), dtype=dtype)
    # Against the float32 reference on the rounded normalized rows (the kernel scales the float32
    # accumulator by the row scale; the bf16 reference rounds every dequantized weight first).
    want = nvfp4_linear_reference(normed.float(), *w)
    assert_close(out.float(), ref_out.float() if dtype == torch.float32 else want, dtype=dtype)


def test_normed_nvfp4_gemv_keeps_leading_dims_and_skips_the_normed_rows(rng):
    _, fused, _ = _triton()
    x, res, nw, w = operands(rng, 2, 24, 32, torch.float32, True, True)
    out, normed, summed = fused.add_rms_norm_nvfp4_gemv(x.view(1, 2, 32), res.view(1, 2, 32), nw, EPS, True, *w)
    assert out.shape == (1, 2, 24) and normed is None and summed.shape == (1, 2, 32)
    assert_close(out, add_rms_norm_nvfp4_gemv_reference(x, res, nw, EPS, True, *w)[0].view(1, 2, 24))


def test_normed_nvfp4_gemv_rejects_bad_operands(rng):
    _, fused, _ = _triton()
    x, res, nw, w = operands(rng, NORMED_NVFP4_MAX_ROWS + 1, 8, 32, torch.float32, True, True)
    with pytest.raises(ValueError, match="rows"):
        fused.add_rms_norm_nvfp4_gemv(x, res, nw, EPS, True, *w)
    with pytest.raises(ValueError, match="NVFP4 weight"):
        fused.add_rms_norm_nvfp4_gemv(x[:1, :16], None, nw[:16], EPS, True, *w)
    with pytest.raises(ValueError, match="residual"):
        fused.add_rms_norm_nvfp4_gemv(x[:1], res[:2], nw, EPS, True, *w)
