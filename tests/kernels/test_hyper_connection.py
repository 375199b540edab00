from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import hyper_connection as ref

TOKENS, STREAMS, HIDDEN = 7, 3, 20


def _randn(rng, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=rng).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_norm(rng, dtype):
    from freetoken.kernels.triton.hyper_connection import hc_norm

    x = _randn(rng, TOKENS, STREAMS * HIDDEN + 5, dtype=dtype)[:, 5:]  # a strided view
    weight = _randn(rng, STREAMS * HIDDEN) * 0.3
    assert_close(hc_norm(x, weight, 1e-6, STREAMS), ref.hc_norm_reference(x, weight, 1e-6, STREAMS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mix(rng, dtype):
    from freetoken.kernels.triton.hyper_connection import hc_mix

    logits = _randn(rng, TOKENS, STREAMS * HIDDEN + 3, dtype=dtype)[:, 3:]
    normed = _randn(rng, TOKENS, STREAMS * HIDDEN, dtype=dtype)
    assert_close(hc_mix(logits, normed, STREAMS), ref.hc_mix_reference(logits, normed, STREAMS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_combine(rng, dtype):
    from freetoken.kernels.triton.hyper_connection import hc_combine

    hyper = _randn(rng, TOKENS, STREAMS * HIDDEN, dtype=dtype)
    block_out = _randn(rng, TOKENS, HIDDEN, dtype=dtype)
    inject = _randn(rng, TOKENS, 8 + STREAMS, dtype=dtype)[:, 8:]  # the inject columns of the packed GEMM
    got = hc_combine(hyper, block_out, inject, STREAMS)
    assert_close(got, ref.hc_combine_reference(hyper, block_out, inject, STREAMS))


def test_hc_shapes_are_checked(rng):
    from freetoken.kernels.triton.hyper_connection import hc_combine, hc_norm

    with pytest.raises(ValueError, match="hc_norm"):
        hc_norm(_randn(rng, 2, 10), _randn(rng, 10), 1e-6, 3)
    with pytest.raises(ValueError, match="hc_combine"):
        hc_combine(_randn(rng, 2, 12), _randn(rng, 2, 4), _randn(rng, 2, 2), 3)
