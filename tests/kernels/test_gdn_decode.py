from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_as_launched, assert_close
from freetoken.kernels import gdn_decode as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("wide", [False, True])
def test_gated_delta_rule_decode_gated(rng, monkeypatch, dtype, batch, wide):
    """Both tile widths (``WIDE_BATCH`` lowered here for the wide one): 80 value columns are three
    blocks of 32 or two of 64, the last one partial."""
    from freetoken.kernels.triton import gdn_decode

    monkeypatch.setattr(gdn_decode, "WIDE_BATCH", 1 if wide else 1 << 30)
    assert gdn_decode.decode_tiles(batch, 80) == (64 if wide else 32)
    gated_delta_rule_decode_gated = gdn_decode.gated_delta_rule_decode_gated
    hk, hv, dk, dv, slots_total = 2, 4, 24, 80, 7

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(dtype).to(DEVICE)

    # q, k, v strided views of one conv output, as the layer passes them.
    conv = randn(batch, 2 * hk * dk + hv * dv)
    q = conv[:, : hk * dk].reshape(batch, hk, dk)
    k = conv[:, hk * dk : 2 * hk * dk].reshape(batch, hk, dk)
    v = conv[:, 2 * hk * dk :].reshape(batch, hv, dv)
    # a, b: columns of the in_proj output; a + dt_bias spans softplus's linear branch (> 20) too.
    ab = randn(batch, 2 * hv + 3, scale=3.0)
    b, a = ab[:, :hv], ab[:, hv : 2 * hv]
    a[0, 0] = 25.0
    A_log, dt_bias = randn(hv, scale=0.5), randn(hv)
    state = (torch.randn(slots_total, hv, dk, dv, generator=rng) * 0.1).to(DEVICE)
    slots = torch.randperm(slots_total, generator=rng)[:batch].int().to(DEVICE)
    want_state = state.clone()
    want = ref.gated_delta_rule_decode_gated_reference(q, k, v, a, b, A_log, dt_bias, want_state, slots)
    got = gated_delta_rule_decode_gated(q, k, v, a, b, A_log, dt_bias, state, slots)
    assert_close(got, want)
    assert_close(state, want_state, dtype=dtype)


def test_gated_delta_rule_decode_gated_rejects_mismatched_shapes():
    from freetoken.kernels.triton.gdn_decode import gated_delta_rule_decode_gated

    q = k = torch.zeros(2, 1, 8, device=DEVICE)
    v = torch.zeros(2, 2, 8, device=DEVICE)
    state = torch.zeros(3, 2, 8, 8, device=DEVICE)
    slots = torch.arange(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="A_log"):
        gated_delta_rule_decode_gated(q, k, v, torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(3), torch.zeros(2), state, slots)


@pytest.mark.parametrize(
    "dtype, batch, activation, weight_dtype",
    [
        (torch.float32, 1, "silu", None),
        (torch.bfloat16, 3, "silu", None),
        (torch.bfloat16, 2, "sigmoid", None),
        (torch.bfloat16, 2, "silu", torch.float32),  # a wider norm weight: ``w · x̂`` not rounded
        (torch.float32, 16, "silu", None),  # the wide tiles: 64 value columns a program
    ],
)
def test_gated_delta_rule_decode_gated_norm(rng, dtype, batch, activation, weight_dtype):
    """The step with the gated output norm in its epilogue: the unfused Triton chain (the step, then
    ``gated_rms_norm``; bit for bit under the interpreter, to the rounding of the row's sum compiled)
    and its state, and the composed references within the dtype's bound. 80 value columns in three 32-column programs a head (two 64-column ones at 16 requests),
    the last partly masked: the head's last program to arrive normalizes the whole row."""
    from freetoken.kernels.triton import gdn_decode, norm

    hk, hv, dk, dv, slots_total, eps = 2, 4, 24, 80, batch + 4, 1e-6

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=rng) * scale).to(dt).to(DEVICE)

    # q|k|v strided views of one conv output, z a strided view of the in_proj output, as the layer passes them.
    conv = randn(batch, 2 * hk * dk + hv * dv)
    q = conv[:, : hk * dk].reshape(batch, hk, dk)
    k = conv[:, hk * dk : 2 * hk * dk].reshape(batch, hk, dk)
    v = conv[:, 2 * hk * dk :].reshape(batch, hv, dv)
    projected = randn(batch, hv * dv + 2 * hv + 5, scale=2.0)
    z = projected[:, : hv * dv].reshape(batch, hv, dv)
    b, a = projected[:, hv * dv : hv * dv + hv], projected[:, hv * dv + hv : hv * dv + 2 * hv]
    A_log, dt_bias = randn(hv, scale=0.5), randn(hv)
    norm_w = randn(dv, scale=0.3, dt=weight_dtype or dtype) + 1
    state = (torch.randn(slots_total, hv, dk, dv, generator=rng) * 0.1).to(DEVICE)
    slots = torch.randperm(slots_total, generator=rng)[:batch].int().to(DEVICE)
    args = (q, k, v, a, b, A_log, dt_bias)

    chain_state, ref_state = state.clone(), state.clone()
    got = gdn_decode.gated_delta_rule_decode_gated_norm(*args, state, slots, z, norm_w, eps, activation)
    core = gdn_decode.gated_delta_rule_decode_gated(*args, chain_state, slots)
    chain = norm.gated_rms_norm(core, z, norm_w, eps, activation)
    want = ref.gated_delta_rule_decode_gated_norm_reference(*args, ref_state, slots, z, norm_w, eps, activation)
    if weight_dtype is None:  # the unfused Triton norm rounds ``w · x̂`` to the activations' dtype whatever w's is
        assert_as_launched(got, chain)  # a compiled row sum's order follows its tile, not the norm kernel's
    assert torch.equal(state, chain_state)
    assert got.dtype == dtype and got.shape == (batch, hv, dv)
    assert_close(got, want)
    assert_close(state, ref_state, dtype=dtype)


def test_gated_delta_rule_decode_gated_norm_rejects_bad_inputs():
    from freetoken.kernels.triton.gdn_decode import gated_delta_rule_decode_gated_norm

    q = k = torch.zeros(2, 1, 8, device=DEVICE)
    v = torch.zeros(2, 2, 8, device=DEVICE)
    a = b = torch.zeros(2, 2, device=DEVICE)
    A_log = dt_bias = torch.zeros(2, device=DEVICE)
    state = torch.zeros(3, 2, 8, 8, device=DEVICE)
    slots = torch.arange(2, dtype=torch.int32, device=DEVICE)
    args = (q, k, v, a, b, A_log, dt_bias, state, slots)
    with pytest.raises(ValueError, match="z"):
        gated_delta_rule_decode_gated_norm(*args, torch.zeros(2, 2, 4, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="gate activation"):
        gated_delta_rule_decode_gated_norm(*args, torch.zeros_like(v), torch.zeros(8, device=DEVICE), 1e-6, "relu")
