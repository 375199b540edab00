from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import moe_decode as ref


def _inputs(rng, dtype, tokens, experts, hidden, inter, shared_inter):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(dtype).to(DEVICE)

    x = randn(tokens, hidden)
    # Distinct router logits in every row (exact in bf16): torch.topk leaves the order of ties unspecified.
    router = torch.stack([torch.randperm(experts, generator=rng) for _ in range(tokens)]) * 0.25 - 1.5
    gate_logits = torch.cat([router, torch.randn(tokens, 1, generator=rng)], dim=1).to(dtype).to(DEVICE)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    shared_gate_up = randn(2 * shared_inter, hidden, scale=hidden**-0.5)
    shared_down = randn(hidden, shared_inter, scale=shared_inter**-0.5)
    return x, gate_logits, w13, w2, shared_gate_up, shared_down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,renormalize,shared_inter", [(1, True, 24), (5, False, 40), (3, True, 56)])
def test_sparse_moe_decode(rng, dtype, tokens, renormalize, shared_inter):
    from freetoken.kernels.triton.moe_decode import sparse_moe_decode

    experts, top_k, hidden, inter = 7, 3, 72, 40
    args = _inputs(rng, dtype, tokens, experts, hidden, inter, shared_inter)
    got = sparse_moe_decode(*args, top_k, renormalize)
    assert_close(got, ref.sparse_moe_decode_reference(*args, top_k, renormalize))


# Launch shapes the tuner may pick, at sizes that leave ragged edges: pairs per gate/up program not
# dividing the 9 pairs, row blocks not dividing the rows, reduction steps below, at and above the
# reduced dimension (one load covering it); programmatic dependent launch on and off (it applies only
# compiled for sm_90 on: scripts/compile_check.sh builds both).
TILE_CASES = [
    dict(gate_up_block_n=8, gate_up_block_k=32, gate_up_warps=2, down_block_n=16, down_block_k=16, down_warps=2),
    dict(gate_up_block_n=4, gate_up_block_k=64, gate_up_pairs=2, down_block_n=8, down_block_k=64),
    dict(gate_up_block_n=16, gate_up_block_k=16, gate_up_pairs=4, gate_up_warps=4, down_block_n=4, down_block_k=32,
         pdl=False),
    dict(gate_up_block_n=2, gate_up_block_k=4096, gate_up_pairs=16, down_block_n=2, down_block_k=4096, down_warps=1),
    # the shared expert's gate/up as pairs of the gate/up launch, and in the routing launch in row
    # blocks not dividing its 40 rows
    dict(gate_up_pairs=2, shared_in_route=False),
    dict(gate_up_pairs=2, shared_block_n=16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILE_CASES, ids=lambda t: "-".join(f"{v}" for v in t.values()))
def test_sparse_moe_decode_tiles(rng, dtype, tiles):
    """Every launch shape gives the reference's result; shared_inter above inter, so the shared
    expert's rows run past the routed ones' in both passes."""
    from freetoken.kernels.triton import moe_decode

    experts, top_k, hidden, inter, shared_inter = 6, 2, 40, 24, 40
    args = _inputs(rng, dtype, 3, experts, hidden, inter, shared_inter)
    got = moe_decode.sparse_moe_decode_tiled(*args, top_k, True, moe_decode.DecodeTiles(**tiles))
    assert_close(got, ref.sparse_moe_decode_reference(*args, top_k, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_rows_in_the_routing_launch_step_over_the_hidden_size(rng, dtype, monkeypatch):
    """The routing launch's shared-expert programs loop over the hidden size in steps where it is
    wider than one load (a ragged last step here); the shared expert wider than the routed ones."""
    from freetoken.kernels.triton import moe_decode

    monkeypatch.setattr(moe_decode, "SHARED_MAX_K", 16)
    experts, top_k, hidden, inter, shared_inter = 5, 2, 40, 8, 24
    args = _inputs(rng, dtype, 2, experts, hidden, inter, shared_inter)
    got = moe_decode.sparse_moe_decode_tiled(*args, top_k, True, moe_decode.DecodeTiles(shared_block_n=2))
    assert_close(got, ref.sparse_moe_decode_reference(*args, top_k, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_topk_softmax(rng, dtype, renormalize):
    """The routing launch picks the reference router's experts in its order, with its float32
    weights before they are rounded to the activations' dtype (the shared gate's logit, last, takes
    no part). Its softmax sums in another order: equal to float32 rounding, not bitwise."""
    from freetoken.kernels.moe import moe_topk_softmax_reference
    from freetoken.kernels.triton.moe_decode import route

    experts, top_k = 13, 5
    gate_logits = _inputs(rng, dtype, 4, experts, 8, 8, 8)[1]
    want_w, want_i = moe_topk_softmax_reference(gate_logits[:, :experts].float(), top_k, renormalize)
    got_w, got_i = route(gate_logits, experts, top_k, renormalize)
    assert got_w.dtype == torch.float32 and got_i.dtype == torch.int32
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


def test_route_takes_the_lowest_index_among_ties(rng):
    """Equal probabilities go to the lower expert index first, as the general routing kernel."""
    from freetoken.kernels.triton.moe_decode import route

    experts, top_k = 11, 6
    gate_logits = torch.randint(0, 3, (5, experts + 1), generator=rng).float().to(DEVICE)
    order = torch.sort(gate_logits[:, :experts], dim=1, descending=True, stable=True).indices
    assert torch.equal(route(gate_logits, experts, top_k, False)[1].long(), order[:, :top_k])


def test_decode_tiles_rejects_a_block_not_a_power_of_two():
    from freetoken.kernels.triton.moe_decode import DecodeTiles

    with pytest.raises(ValueError, match="down_block_n"):
        DecodeTiles(down_block_n=12)


def test_sparse_moe_decode_rejects_mismatched_shapes(rng):
    from freetoken.kernels.triton.moe_decode import sparse_moe_decode

    x, gate_logits, w13, w2, sgu, sd = _inputs(rng, torch.float32, 2, 5, 16, 8, 8)
    with pytest.raises(ValueError, match="gate_logits"):
        sparse_moe_decode(x, gate_logits[:, :-1], w13, w2, sgu, sd, 2, True)
