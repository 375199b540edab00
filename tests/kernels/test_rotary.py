from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import rotary as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(24, 12), (16, 16)])
def test_apply_rotary_partial(rng, dtype, head_dim, rotary_dim):
    from freetoken.kernels.triton.rotary import apply_rotary

    t, hq, hk = 7, 5, 2
    cache = ref.build_rotary_cache(rotary_dim, 64, 10000.0, DEVICE)
    positions = torch.randint(0, 64, (t,), generator=rng).to(DEVICE)
    packed = torch.randn(t, hq, 2 * head_dim, generator=rng).to(dtype).to(DEVICE)
    q = packed[..., head_dim:]  # strided, as the layer's q-and-gate projection yields it
    k = torch.randn(t, hk, head_dim, generator=rng).to(dtype).to(DEVICE)
    q_out, k_out = apply_rotary(q, k, positions, cache, rotary_dim)
    q_ref, k_ref = ref.apply_rotary_reference(q, k, positions, cache, rotary_dim)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)
    if DEVICE.type == "cpu":
        # The same roundings in the same order: bitwise equal (on the GPU the compiler may fuse a
        # multiply-add into an FMA, which rounds once).
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
