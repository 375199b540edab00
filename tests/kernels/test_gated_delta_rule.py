from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import gated_delta_rule as ref


def _inputs(rng, dtype, tokens, hk, hv, dk, dv, slots):
    # q, k, v as the layer passes them: strided head views of one conv output row.
    conv = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=rng).to(dtype).to(DEVICE)
    q = conv[:, : hk * dk].reshape(tokens, hk, dk)
    k = conv[:, hk * dk : 2 * hk * dk].reshape(tokens, hk, dk)
    v = conv[:, 2 * hk * dk :].reshape(tokens, hv, dv)
    g = (-F.softplus(torch.randn(tokens, hv, generator=rng)) * 0.5).to(DEVICE)  # float32, <= 0
    beta = torch.rand(tokens, hv, generator=rng).to(dtype).to(DEVICE)
    state = (torch.randn(slots, hv, dk, dv, generator=rng) * 0.3).to(DEVICE)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(
    "dtype,heads,dims,state_block_v",
    [
        (torch.float32, (2, 4), (12, 20), None),
        (torch.bfloat16, (1, 3), (16, 8), None),
        (torch.float32, (2, 2), (16, 16), None),
        # several value blocks in the state pass (16 of 40 columns) and in the outputs (32 of 72)
        (torch.float32, (1, 2), (8, 72), 16),
        (torch.bfloat16, (1, 1), (16, 40), 16),
    ],
)
def test_gated_delta_rule_prefill(rng, monkeypatch, dtype, heads, dims, state_block_v):
    from freetoken.kernels.triton import gated_delta_rule as triton_gdn
    from freetoken.kernels.triton.gated_delta_rule import gated_delta_rule_prefill

    if state_block_v is not None:  # narrower value blocks than the launch size would choose
        monkeypatch.setattr(triton_gdn, "state_pass_block_v", lambda *_: state_block_v)
        monkeypatch.setattr(triton_gdn, "OUTPUT_BLOCK_V", 32)

    lens = [70, 0, 5, 129]  # several chunks with a partial last one, empty, shorter than a chunk
    (hk, hv), (dk, dv), slots = heads, dims, 6
    q, k, v, g, beta, state = _inputs(rng, dtype, sum(lens), hk, hv, dk, dv, slots)
    cu = torch.tensor([0] + lens).cumsum(0).int().to(DEVICE)
    state_slots = torch.tensor([4, 1, 2, 5], dtype=torch.int32, device=DEVICE)
    want_state = state.clone()
    want = ref.gated_delta_rule_prefill_reference(q, k, v, g, beta, want_state, state_slots, cu)
    got = gated_delta_rule_prefill(q, k, v, g, beta, state, state_slots, cu)
    assert_close(got, want)
    assert_close(state, want_state, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_rule_decode(rng, dtype):
    from freetoken.kernels.triton.gated_delta_rule import gated_delta_rule_decode

    batch, hk, hv, dk, dv, slots = 5, 2, 6, 12, 40, 7
    q, k, v, g, beta, state = _inputs(rng, dtype, batch, hk, hv, dk, dv, slots)
    state_slots = torch.tensor([6, 0, 3, 2, 5], dtype=torch.int32, device=DEVICE)
    want_state = state.clone()
    want = ref.gated_delta_rule_decode_reference(q, k, v, g, beta, want_state, state_slots)
    got = gated_delta_rule_decode(q, k, v, g, beta, state, state_slots)
    assert_close(got, want)
    assert_close(state, want_state, dtype=torch.float32)


# Snapshots inside the requests' rows: on a chunk boundary, off it, in a partial last chunk, two
# in one request, in a request shorter than a chunk; the empty request has none.
SNAPSHOTS = [(0, 64, 7), (0, 69, 6), (2, 3, 8), (3, 1, 9), (3, 100, 10)]


@pytest.mark.parametrize("dtype,heads,dims", [(torch.float32, (2, 4), (12, 20)), (torch.bfloat16, (1, 3), (16, 8))])
def test_gated_delta_rule_prefill_snapshots(rng, dtype, heads, dims):
    """The states at the snapshot boundaries are stored in their rows, and the outputs and final
    states are those of the calls a cut at each boundary would have made; the kernel equals the
    reference."""
    from freetoken.kernels.prefill_snapshots import prefill_snapshots
    from freetoken.kernels.triton.gated_delta_rule import gated_delta_rule_prefill

    lens = [70, 0, 5, 129]
    (hk, hv), (dk, dv), slots = heads, dims, 11
    q, k, v, g, beta, state = _inputs(rng, dtype, sum(lens), hk, hv, dk, dv, slots)
    cu = torch.tensor([0] + lens).cumsum(0).int().to(DEVICE)
    state_slots = torch.tensor([4, 1, 2, 5], dtype=torch.int32, device=DEVICE)
    snapshots = prefill_snapshots(lens, SNAPSHOTS, 3, torch.device(DEVICE))

    cut_state = state.clone()  # the reference, one call per segment, as cut chunks would run
    cut_out = torch.empty_like(v)
    starts = cu.tolist()
    for b, slot in enumerate(state_slots.tolist()):
        pieces = [0] + [o for r, o, _ in SNAPSHOTS if r == b] + [lens[b]]
        for lo, hi in zip(pieces, pieces[1:]):
            rows = slice(starts[b] + lo, starts[b] + hi)
            one = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
            cut_out[rows] = ref.gated_delta_rule_prefill_reference(
                q[rows], k[rows], v[rows], g[rows], beta[rows], cut_state, state_slots[b : b + 1], one
            )
            if hi < lens[b]:
                (snapshot_slot,) = [s for r, o, s in SNAPSHOTS if r == b and o == hi]
                cut_state[snapshot_slot] = cut_state[slot]

    want_state = state.clone()
    want = ref.gated_delta_rule_prefill_reference(q, k, v, g, beta, want_state, state_slots, cu, snapshots)
    assert torch.equal(want, cut_out) and torch.equal(want_state, cut_state)
    got = gated_delta_rule_prefill(q, k, v, g, beta, state, state_slots, cu, snapshots)
    assert_close(got, want)
    assert_close(state, want_state, dtype=dtype)
