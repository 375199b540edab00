"""A Gated DeltaNet layer's snapshots inside a prefill chunk (``ForwardBatch.snapshots``) are the
states a chunk cut at each boundary would have left in the slot: the conv window (also where the
boundary lies fewer than ``K - 1`` tokens into the chunk, so part of it is the window the slot held
before) and the recurrent state; the outputs and the slots' final states are the cut run's."""

from __future__ import annotations

import pytest
import torch

from freetoken.batch import ForwardBatch
from freetoken.kernels.prefill_snapshots import prefill_snapshots
from freetoken.layers.gated_deltanet import DeltaNetSizes, GatedDeltaNet
from freetoken.layers.slot_state import SlotStates

SIZES = DeltaNetSizes(hidden_size=24, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4, eps=1e-6)
NUM_SLOTS = 9


def _layer(seed: int) -> tuple[GatedDeltaNet, SlotStates]:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(SIZES)
    for param in layer.parameters():
        param.copy_(torch.randn_like(param) * 0.3)
    states = SlotStates([layer], NUM_SLOTS, torch.float32, torch.device("cpu"))
    layer.conv_state.copy_(torch.randn_like(layer.conv_state))  # the requests' earlier chunks
    layer.recurrent_state.copy_(torch.randn_like(layer.recurrent_state) * 0.3)
    return layer, states


def _prefill_batch(lens: list[int], slots: list[int], snapshots=None) -> ForwardBatch:
    """The fields a Gated DeltaNet layer reads (prefill rows only); the others are placeholders."""
    tokens = sum(lens)
    return ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64),
        cu_seqlens=torch.tensor([0, *lens]).cumsum(0).int(),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        page_table=torch.zeros(len(lens), 1, dtype=torch.int32),
        kv_locations=torch.zeros(tokens, dtype=torch.int64),
        state_slots=torch.tensor(slots, dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.int64),
        num_decodes=0,
        max_query_len=max(lens),
        query_lens=lens,
        max_seq_len=max(lens),
        snapshots=snapshots,
    )


@torch.inference_mode()
def test_snapshots_inside_the_chunk_equal_the_states_of_a_cut():
    lens, slots = [7, 70], [2, 5]
    # Request 0: 1 and 2 tokens in (windows partly from the slot), request 1: on a delta-rule chunk
    # boundary (64) and off it (66).
    snapshots = [(0, 1, 6), (0, 2, 7), (1, 64, 8), (1, 66, 3)]
    layer, states = _layer(0)
    x = torch.randn(sum(lens), SIZES.hidden_size)
    initial = layer.conv_state.clone(), layer.recurrent_state.clone()

    out = layer(x, _prefill_batch(lens, slots, prefill_snapshots(lens, snapshots, SIZES.conv_kernel - 1,
                                                                  torch.device("cpu"))))
    got = layer.conv_state.clone(), layer.recurrent_state.clone()

    layer.conv_state.copy_(initial[0])
    layer.recurrent_state.copy_(initial[1])
    want_out = torch.empty_like(out)
    starts = [0, lens[0]]
    for b, (length, slot) in enumerate(zip(lens, slots)):
        cuts = [(o, s) for r, o, s in snapshots if r == b]
        pieces = [0, *(o for o, _ in cuts), length]
        for lo, hi in zip(pieces, pieces[1:]):
            rows = slice(starts[b] + lo, starts[b] + hi)
            want_out[rows] = layer(x[rows], _prefill_batch([hi - lo], [slot]))
            for offset, snapshot_slot in cuts:
                if offset == hi:
                    states.copy(torch.tensor([slot]), torch.tensor([snapshot_slot]))
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for snapshot_slot in (*slots, *(s for _, _, s in snapshots)):
        # Close, not equal: the in_proj GEMM over a whole chunk and over a piece of it round differently.
        torch.testing.assert_close(got[0][snapshot_slot], layer.conv_state[snapshot_slot], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1][snapshot_slot], layer.recurrent_state[snapshot_slot], rtol=1e-5, atol=1e-5)
    for untouched in (0, 1, 4):
        assert torch.equal(got[0][untouched], initial[0][untouched])


def test_a_snapshot_must_lie_inside_its_request():
    cpu = torch.device("cpu")
    for bad in [(0, 0, 5), (0, 7, 5), (2, 1, 5), (1, 3, -1)]:
        with pytest.raises(ValueError, match="snapshot of request"):
            prefill_snapshots([7, 70], [bad], 3, cpu)
    with pytest.raises(ValueError, match="repeats"):
        prefill_snapshots([7, 70], [(1, 3, 5), (1, 3, 6)], 3, cpu)
    layout = prefill_snapshots([7, 0, 70], [(2, 64, 5), (0, 2, 6)], 3, cpu)
    assert layout.segment_cu.tolist() == [0, 2, 7, 7, 71, 77] and layout.chunk_segment.tolist() == [0, 1, 3, 4]
    assert layout.request_chunks.tolist() == [0, 2, 2, 4] and layout.chunk_rows.tolist() == [0, 2, 7, 71]
    assert layout.chunk_ends.tolist() == [2, 7, 71, 77] and layout.chunk_snapshot.tolist() == [6, -1, 5, -1]
