from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import ple as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ple_gate(rng, dtype):
    from freetoken.kernels.triton.ple import ple_gate

    tokens, streams, hidden = 6, 3, 20
    key = torch.randn(tokens, streams * hidden, generator=rng).to(dtype).to(DEVICE)
    query = torch.randn(tokens, streams * hidden, generator=rng).to(dtype).to(DEVICE)
    value = torch.randn(tokens, hidden + 4, generator=rng).to(dtype).to(DEVICE)[:, 4:]
    query[0] = 0  # a zero gate: sign 0, clamped magnitude
    assert_close(ple_gate(key, query, value, streams), ref.ple_gate_reference(key, query, value, streams))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 2, 13, 5], [23]], ids=["decode", "mixed", "prefill"])
def test_ple_short_conv(rng, dtype, query_lens):
    """Chunks shorter and longer than the state (9 inputs): taps read both the state and the chunk."""
    from freetoken.kernels.triton.ple import ple_short_conv

    channels, width, dilation, num_slots = 37, 4, 3, 6
    state_len = (width - 1) * dilation
    num_tokens = sum(query_lens)
    x = torch.randn(num_tokens, channels, generator=rng).to(dtype).to(DEVICE)
    weight = torch.randn(channels, width, generator=rng).to(dtype).to(DEVICE)
    state = torch.randn(num_slots, state_len, channels, generator=rng).to(dtype).to(DEVICE)
    slots = (torch.randperm(num_slots - 1, generator=rng)[: len(query_lens)] + 1).int().to(DEVICE)
    cu = torch.tensor([0] + query_lens).cumsum(0).int().to(DEVICE)
    requests = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens)).to(DEVICE)
    want_state = state.clone()
    want = ref.ple_short_conv_reference(x, weight, want_state, slots, requests, cu, dilation)
    got = ple_short_conv(x, weight, state, slots, requests, cu, dilation)
    assert_close(got, want)
    assert torch.equal(state, want_state)
