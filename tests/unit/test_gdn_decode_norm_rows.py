"""A Gated DeltaNet layer's decode step takes the output norm in the delta-rule launch
(``FUSED_DECODE_NORM``) up to ``DECODE_NORM_MAX_ROWS`` requests and the separate norm above, with
the same output and states either way."""

from __future__ import annotations

import pytest
import torch

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.layers import gated_deltanet
from freetoken.layers.gated_deltanet import DeltaNetSizes, GatedDeltaNet
from freetoken.layers.slot_state import SlotStates

SIZES = DeltaNetSizes(hidden_size=24, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4, eps=1e-6)


def _decode_batch(slots: list[int]) -> ForwardBatch:
    """The fields a Gated DeltaNet layer reads (decode rows only); the others are placeholders."""
    rows = len(slots)
    zeros = torch.zeros(rows, dtype=torch.int64)
    return ForwardBatch(
        input_ids=zeros, positions=zeros, cu_seqlens=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.ones(rows, dtype=torch.int32), page_table=torch.zeros(rows, 1, dtype=torch.int32),
        kv_locations=zeros, state_slots=torch.tensor(slots, dtype=torch.int32), logits_indices=zeros,
        num_decodes=rows, max_query_len=1, query_lens=[1] * rows, max_seq_len=8,
    )


@pytest.mark.parametrize("max_rows, fused_calls", [(3, 1), (2, 0)])
@torch.inference_mode()
def test_decode_step_takes_the_fused_norm_up_to_its_row_limit(monkeypatch, max_rows, fused_calls):
    torch.manual_seed(0)
    layer = GatedDeltaNet(SIZES)
    for param in layer.parameters():
        param.copy_(torch.randn_like(param) * 0.3)
    SlotStates([layer], 6, torch.float32, torch.device("cpu"))
    layer.conv_state.copy_(torch.randn_like(layer.conv_state))
    layer.recurrent_state.copy_(torch.randn_like(layer.recurrent_state) * 0.3)
    initial = layer.conv_state.clone(), layer.recurrent_state.clone()
    x, batch = torch.randn(3, SIZES.hidden_size), _decode_batch([4, 1, 2])

    monkeypatch.setattr(gated_deltanet, "FUSED_DECODE_NORM", False)
    want = layer(x, batch), layer.conv_state.clone(), layer.recurrent_state.clone()

    layer.conv_state.copy_(initial[0])
    layer.recurrent_state.copy_(initial[1])
    calls = []
    fused = kernels.gated_delta_rule_decode_gated_norm
    monkeypatch.setattr(kernels, "gated_delta_rule_decode_gated_norm", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(gated_deltanet, "FUSED_DECODE_NORM", True)
    monkeypatch.setattr(gated_deltanet, "DECODE_NORM_MAX_ROWS", max_rows)
    got = layer(x, batch), layer.conv_state, layer.recurrent_state

    assert len(calls) == fused_calls
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
