from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import gdn_decode as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_gated_delta_rule_decode_gated(rng, dtype, batch):
    from freetoken.kernels.triton.gdn_decode import gated_delta_rule_decode_gated

    hk, hv, dk, dv, slots_total = 2, 4, 24, 40, 7

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


def _deltanet_inputs(rng, dtype, batch, hk, hv, dk, dv, width, slots_total):
    """The fused decode's inputs as the layer passes them: mixed_qkv, z, b and a are strided
    slices of one packed projection output."""

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(dtype).to(DEVICE)

    channels = 2 * hk * dk + hv * dv
    packed = randn(batch, channels + hv * dv + 2 * hv)
    mixed_qkv = packed[:, :channels]
    z = packed[:, channels : channels + hv * dv].reshape(batch, hv, dv)
    b, a = packed[:, channels + hv * dv :].split([hv, hv], dim=-1)
    a[0, 0] = 25.0  # a + dt_bias on softplus's linear branch too
    conv_weight = randn(channels, width, scale=0.5)
    A_log, dt_bias = randn(hv, scale=0.5), randn(hv)
    norm_weight = (1 + 0.2 * torch.randn(dv, generator=rng)).to(dtype).to(DEVICE)
    conv_state = randn(slots_total, channels, width - 1)
    recurrent_state = (torch.randn(slots_total, hv, dk, dv, generator=rng) * 0.1).to(DEVICE)
    return mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "hk", "hv", "dk", "dv", "width"),
    [(3, 2, 4, 24, 40, 4), (2, 1, 3, 12, 20, 3), (1, 3, 3, 16, 8, 4), (2, 1, 4, 8, 16, 4)],  # ratios 2, 3, 1, 4
)
def test_gated_deltanet_decode(rng, dtype, activation, batch, hk, hv, dk, dv, width):
    from freetoken.kernels.triton.gdn_decode import gated_deltanet_decode

    slots_total = 7
    inputs = _deltanet_inputs(rng, dtype, batch, hk, hv, dk, dv, width, slots_total)
    mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state = inputs
    slots = torch.randperm(slots_total, generator=rng)[:batch].int().to(DEVICE)
    want_conv, want_rec = conv_state.clone(), recurrent_state.clone()
    want = ref.gated_deltanet_decode_reference(
        mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, 1e-6, want_conv, want_rec, slots, activation
    )
    got = gated_deltanet_decode(
        mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, 1e-6, conv_state, recurrent_state, slots, activation
    )
    assert_close(got, want)
    assert torch.equal(conv_state, want_conv)  # the moved windows are copies of inputs: exact
    assert_close(recurrent_state, want_rec, dtype=dtype)


def test_gated_deltanet_decode_states_smaller_than_the_threads(rng, monkeypatch):
    """8 warps on 4 x 8 states: every element held by several threads (the barrier path)."""
    from freetoken.kernels.triton import gdn_decode

    monkeypatch.setattr(gdn_decode, "NUM_WARPS", 8)
    inputs = _deltanet_inputs(rng, torch.float32, 2, 1, 2, 4, 8, 4, 5)
    mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state = inputs
    slots = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    want_conv, want_rec = conv_state.clone(), recurrent_state.clone()
    args = (mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, 1e-6)
    want = ref.gated_deltanet_decode_reference(*args, want_conv, want_rec, slots)
    got = gdn_decode.gated_deltanet_decode(*args, conv_state, recurrent_state, slots)
    assert_close(got, want)
    assert torch.equal(conv_state, want_conv)
    assert_close(recurrent_state, want_rec)


def test_gated_deltanet_decode_rejects_mismatched_shapes():
    from freetoken.kernels.triton.gdn_decode import gated_deltanet_decode

    hk, hv, dk, dv, width = 1, 2, 8, 8, 4
    channels = 2 * hk * dk + hv * dv
    mixed_qkv, z = torch.zeros(2, channels), torch.zeros(2, hv, dv)
    ab, heads = torch.zeros(2, hv), torch.zeros(hv)
    conv_state, rec = torch.zeros(3, channels, width - 1), torch.zeros(3, hv, dk, dv)
    slots = torch.arange(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="norm_weight"):
        gated_deltanet_decode(mixed_qkv, z, ab, ab, torch.zeros(channels, width), heads, heads, torch.zeros(dv + 1),
                              1e-6, conv_state, rec, slots)
    with pytest.raises(ValueError, match="gate activation"):
        gated_deltanet_decode(mixed_qkv, z, ab, ab, torch.zeros(channels, width), heads, heads, torch.zeros(dv),
                              1e-6, conv_state, rec, slots, "relu")


def test_gated_deltanet_decode_padding_rows_touch_only_the_scratch_slot(rng):
    """Padded graph rows all name the scratch slot 0: the real rows' outputs and states are those
    of a batch without them, and every other slot is left as it was."""
    from freetoken.kernels.triton.gdn_decode import gated_deltanet_decode

    real, padded = 2, 3
    inputs = _deltanet_inputs(rng, torch.float32, real + padded, 2, 4, 16, 24, 4, 6)
    mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state = inputs
    slots = torch.tensor([3, 5] + [0] * padded, dtype=torch.int32, device=DEVICE)
    want_conv, want_rec = conv_state.clone(), recurrent_state.clone()
    weights = (conv_weight, A_log, dt_bias, norm_weight, 1e-6)
    want = ref.gated_deltanet_decode_reference(
        mixed_qkv[:real], z[:real], a[:real], b[:real], *weights, want_conv, want_rec, slots[:real]
    )
    got = gated_deltanet_decode(mixed_qkv, z, a, b, *weights, conv_state, recurrent_state, slots)
    assert_close(got[:real], want)
    assert torch.equal(conv_state[1:], want_conv[1:])
    assert_close(recurrent_state[1:], want_rec[1:])
