from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import conv1d as ref


def _inputs(rng, dtype, tokens: int, channels: int, width: int, slots: int):
    packed = torch.randn(tokens, channels + 9, generator=rng).to(dtype).to(DEVICE)
    x = packed[:, 4 : 4 + channels]  # a strided slice of the packed projection, as the layer passes it
    weight = (torch.randn(channels, width, generator=rng) * 0.5).to(dtype).to(DEVICE)
    state = torch.randn(slots, channels, width - 1, generator=rng).to(dtype).to(DEVICE)
    return x, weight, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [4, 3, 2])
@pytest.mark.parametrize("tiles", [None, (4, 16, 4), (8, 32, 2)], ids=["default", "4x16", "8x32"])
def test_causal_conv1d_prefill(rng, monkeypatch, dtype, width, tiles):
    from freetoken.kernels.triton import conv1d

    if tiles is not None:  # short runs: runs start inside requests, 1..3 rows after their starts
        fixed = conv1d.PrefillTiles(rows=tiles[0], channels=tiles[1], warps=1, unroll=tiles[2])
        monkeypatch.setattr(conv1d, "prefill_tiles", lambda *_: fixed)
    # Empty first and last, shorter than the window, several runs, one token.
    lens = [0, 2, 0, 19, 1, 7, 0]
    channels, slots = 37, 8
    x, weight, state = _inputs(rng, dtype, sum(lens), channels, width, slots)
    cu = torch.tensor([0] + lens).cumsum(0).int().to(DEVICE)
    state_slots = torch.tensor([0, 3, 7, 1, 6, 2, 5], dtype=torch.int32, device=DEVICE)
    causal_conv1d_prefill = conv1d.causal_conv1d_prefill
    want_state = state.clone()
    want = ref.causal_conv1d_prefill_reference(x, weight, want_state, state_slots, cu)
    got = causal_conv1d_prefill(x, weight, state, state_slots, cu)
    assert_close(got, want)
    assert torch.equal(state, want_state)  # the new windows are copies of inputs: exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_decode(rng, dtype):
    from freetoken.kernels.triton.conv1d import causal_conv1d_decode

    batch, channels, width, slots = 5, 45, 4, 9
    x, weight, state = _inputs(rng, dtype, batch, channels, width, slots)
    state_slots = torch.tensor([8, 2, 4, 1, 7], dtype=torch.int32, device=DEVICE)
    want_state = state.clone()
    want = ref.causal_conv1d_decode_reference(x, weight, want_state, state_slots)
    got = causal_conv1d_decode(x, weight, state, state_slots)
    assert_close(got, want)
    assert torch.equal(state, want_state)
