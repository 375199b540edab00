from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import norm as ref


def _triton():
    from freetoken.kernels.triton import norm

    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_strided_heads(rng, dtype, zero_centered):
    # q as the layer passes it: a [T, H, D] half of a [T, H, 2D] projection.
    t, h, d = 5, 3, 40
    packed = torch.randn(t, h, 2 * d, generator=rng).to(dtype).to(DEVICE)
    x = packed[..., :d]
    w = (torch.randn(d, generator=rng) * 0.3).to(dtype).to(DEVICE)
    got = _triton().rms_norm(x, w, 1e-6, zero_centered)
    assert_close(got, ref.rms_norm_reference(x, w, 1e-6, zero_centered))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(rng, dtype):
    t, d = 7, 72
    x = torch.randn(t, d, generator=rng).to(dtype).to(DEVICE)
    residual = torch.randn(t, d, generator=rng).to(dtype).to(DEVICE)
    w = (torch.randn(d, generator=rng) * 0.3).to(dtype).to(DEVICE)
    got, summed = _triton().add_rms_norm(x, residual, w, 1e-6, True)
    want, want_summed = ref.add_rms_norm_reference(x, residual, w, 1e-6, True)
    assert torch.equal(summed, want_summed)
    assert_close(got, want)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_strided_gate(rng, dtype, activation):
    # z as the Gated DeltaNet passes it: a slice of the packed in_proj output, viewed as heads.
    t, h, d = 6, 3, 20
    packed = torch.randn(t, h * d + 11, generator=rng).to(dtype).to(DEVICE)
    gate = packed[:, 5 : 5 + h * d].reshape(t, h, d)
    x = torch.randn(t, h, d, generator=rng).to(dtype).to(DEVICE)
    w = (1 + 0.2 * torch.randn(d, generator=rng)).to(dtype).to(DEVICE)
    got = _triton().gated_rms_norm(x, gate, w, 1e-6, activation)
    assert_close(got, ref.gated_rms_norm_reference(x, gate, w, 1e-6, activation))
