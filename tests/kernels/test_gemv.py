from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import gemv_configs
from freetoken.kernels.gemv import gemv_reference
from freetoken.kernels.gemv_configs import GemvConfig

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _triton():
    from freetoken.kernels.triton import gemv

    return gemv


def operands(rng: torch.Generator, rows: int, n_out: int, k_in: int, dtype: torch.dtype):
    x = torch.randn(rows, k_in, generator=rng).to(dtype).to(DEVICE)
    w = (torch.randn(n_out, k_in, generator=rng) * k_in**-0.5).to(dtype).to(DEVICE)
    return x, w


def want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 product of the operands as given: what one rounding of a float32 sum is held to."""
    return gemv_reference(x.float(), w.float())


@pytest.mark.parametrize("dtype", DTYPES)
# Odd N, K not a multiple of the step (the interpreter's step: 256 2-byte columns), every row count
# of one program and past it (two row chunks, the second partial).
@pytest.mark.parametrize("rows,n_out,k_in", [(1, 37, 100), (2, 65, 300), (3, 9, 48), (5, 130, 257), (8, 33, 16),
                                             (11, 7, 72)])
def test_gemv(rng, dtype, rows, n_out, k_in):
    x, w = operands(rng, rows, n_out, k_in, dtype)
    got = _triton().gemv(x, w)
    assert got.dtype == dtype
    assert_close(got.float(), want(x, w), dtype=dtype)


# Each launch-shape path at K = 300 (steps of 256 2-byte / 128 float32 columns a chunk, the last
# partial): one row a warp, two rows a warp, several chunks a step, more rows a program than N,
# more warps than rows (the step split over warps); the tensor-core variant (float32: the FMA kernel).
@pytest.mark.parametrize("config", [GemvConfig(1, 256, 1), GemvConfig(4, 256, 2, pdl=False), GemvConfig(8, 512, 4, 2),
                                    GemvConfig(64, 512, 4), GemvConfig(2, 256, 4), GemvConfig(16, 64, 4, 2, dot=True),
                                    GemvConfig(32, 128, 4, 3, pdl=False, dot=True)], ids=lambda c: c.label())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_gemv_tiles(rng, config, dtype, rows):
    x, w = operands(rng, rows, 13, 300, dtype)
    assert_close(_triton().gemv_tiled(x, w, config).float(), want(x, w), dtype=dtype)


def test_gemv_keeps_leading_dims_and_strided_rows(rng):
    x, w = operands(rng, 6, 24, 40, torch.float32)
    got = _triton().gemv(x.reshape(2, 3, 40), w)
    assert got.shape == (2, 3, 24)
    assert_close(got, want(x, w).reshape(2, 3, 24))
    wide = torch.randn(3, 80, generator=rng).to(DEVICE)
    assert_close(_triton().gemv(wide[:, ::2], w), want(wide[:, ::2], w))


def test_gemv_without_rows():
    x, w = torch.empty(0, 16, device=DEVICE), torch.ones(5, 16, device=DEVICE)
    assert _triton().gemv(x, w).shape == (0, 5)


def test_gemv_rejects_mismatched_operands():
    w = torch.ones(5, 16, device=DEVICE)
    with pytest.raises(ValueError, match="disagree"):
        _triton().gemv(torch.ones(2, 15, device=DEVICE), w)
    with pytest.raises(ValueError, match="the same"):
        _triton().gemv(torch.ones(2, 16, device=DEVICE, dtype=torch.bfloat16), w)


def test_gemv_configs_are_checked():
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(3, 256, 4)
    with pytest.raises(ValueError, match="num_stages"):
        GemvConfig(4, 256, 4, 0)
    with pytest.raises(ValueError, match="dot"):
        GemvConfig(8, 256, 4, dot=True)


def test_prefers_gemv_follows_the_table(monkeypatch):
    cfg = GemvConfig(4, 2048, 8)
    monkeypatch.setattr(gemv_configs, "TUNED", {(2048, 4096): ((2, cfg), (4, None), (8, cfg))})
    assert gemv_configs.prefers_gemv(1, 2048, 4096) and gemv_configs.gemv_config(2, 2048, 4096) == cfg
    assert not gemv_configs.prefers_gemv(3, 2048, 4096)  # cuBLAS measured faster there
    assert gemv_configs.gemv_config(3, 2048, 4096) == gemv_configs.default_config(2048, 4096)
    assert gemv_configs.prefers_gemv(8, 2048, 4096)
    assert not gemv_configs.prefers_gemv(9, 2048, 4096)  # past GEMV_MAX_ROWS
    assert not gemv_configs.prefers_gemv(0, 2048, 4096)
    # Shapes not measured: the GEMV for projections at a few rows, cuBLAS for an lm_head-sized weight.
    assert gemv_configs.prefers_gemv(gemv_configs.UNTUNED_MAX_ROWS, 9216, 2048)
    assert not gemv_configs.prefers_gemv(gemv_configs.UNTUNED_MAX_ROWS + 1, 9216, 2048)
    assert not gemv_configs.prefers_gemv(1, 248320, 2048)


def test_default_config_fills_the_sms():
    assert gemv_configs.default_config(12352, 2048) == GemvConfig(8, 2048, 8)
    assert gemv_configs.default_config(257, 2048) == GemvConfig(1, 2048, 1)
    assert gemv_configs.default_config(9, 100).block_k == 128
