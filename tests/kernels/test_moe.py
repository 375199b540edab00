from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import moe as ref


def _triton():
    from freetoken.kernels.triton import moe

    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_topk_softmax(rng, dtype, renormalize):
    t, e, k = 9, 13, 3
    # Distinct logits in every row (exact in bf16): torch.topk leaves the order of ties unspecified.
    distinct = torch.stack([torch.randperm(e + 1, generator=rng) for _ in range(t)]) * 0.25 - 1.5
    packed = distinct.to(dtype).to(DEVICE)
    logits = packed[:, :e]  # the router half of the router + shared-gate GEMM, as the layer passes it
    weights, ids = _triton().moe_topk_softmax(logits, k, renormalize)
    want_w, want_ids = ref.moe_topk_softmax_reference(logits, k, renormalize)
    assert torch.equal(ids, want_ids)
    assert_close(weights, want_w)


def test_topk_ties_take_the_lowest_id():
    """Equal logits give equal probabilities: the choice among them is the lowest expert id."""
    logits = torch.tensor([[0.5, 2.0, 2.0, 0.5, 2.0, 0.5, 0.5], [1.0] * 7, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    got = _triton().moe_topk_softmax(logits.to(DEVICE), 4, True)[1]
    assert got.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [6, 0, 1, 2]]


# the last: 66 blocks of pairs, experts split over several prefix programs
@pytest.mark.parametrize("tokens,top_k,experts,one_program", [
    (11, 3, 7, True), (11, 3, 7, False), (1, 1, 5, True), (1, 1, 5, False), (300, 4, 6, True), (300, 4, 6, False),
    (2100, 8, 300, False),
])
def test_moe_sort_tokens(rng, monkeypatch, tokens, top_k, experts, one_program):
    """The one-program sort (``SORT_ONE_PROGRAM_PAIRS`` raised to the size here) and the
    three-launch sort (it lowered to 0): the reference's stable order and offsets."""
    moe = _triton()
    monkeypatch.setattr(moe, "SORT_ONE_PROGRAM_PAIRS", tokens * top_k if one_program else 0)
    ids = torch.stack([torch.randperm(experts, generator=rng)[:top_k] for _ in range(tokens)]).int().to(DEVICE)
    order, offsets = moe.moe_sort_tokens(ids, experts)
    want_order, want_offsets = ref.moe_sort_tokens_reference(ids, experts)
    assert torch.equal(offsets, want_offsets)
    assert torch.equal(order, want_order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_experts(rng, dtype, tokens):
    e, k, hidden, inter = 7, 3, 72, 40
    x = torch.randn(tokens, hidden, generator=rng).to(dtype).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=rng) * hidden**-0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=rng) * inter**-0.5).to(dtype).to(DEVICE)
    logits = torch.randn(tokens, e, generator=rng).to(dtype).to(DEVICE)
    weights, ids = ref.moe_topk_softmax_reference(logits, k, True)
    got = _triton().fused_experts(x, w13, w2, weights, ids)
    assert_close(got, ref.fused_experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("hidden,block_k", [(72, 32), (64, 32)])  # a partial and no partial column tile
def test_fused_experts_grouped_tiles(rng, monkeypatch, hidden, block_k):
    """Row tiles grouped 3 at a time over the column blocks (the last group partial), as the tuned
    prefill configurations run them."""
    from freetoken.kernels.triton.moe_configs import GemmConfig

    moe = _triton()
    config = GemmConfig(block_m=16, block_n=32, block_k=block_k, group_m=3, num_warps=4, num_stages=1)
    monkeypatch.setattr(moe, "moe_gemm_config", lambda *args: config)
    e, k, tokens, inter = 5, 2, 45, 48
    x = torch.randn(tokens, hidden, generator=rng).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=rng) * hidden**-0.5).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=rng) * inter**-0.5).to(DEVICE)
    weights, ids = ref.moe_topk_softmax_reference(torch.randn(tokens, e, generator=rng).to(DEVICE), k, True)
    assert_close(moe.fused_experts(x, w13, w2, weights, ids), ref.fused_experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(rng, dtype):
    x = torch.randn(5, 2 * 37, generator=rng).to(dtype).to(DEVICE)
    assert_close(_triton().silu_and_mul(x), ref.silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_expert_combine(rng, dtype):
    t, hidden = 6, 50
    routed = torch.randn(t, hidden, generator=rng).to(dtype).to(DEVICE)
    shared = torch.randn(t, hidden, generator=rng).to(dtype).to(DEVICE)
    gate_logit = torch.randn(t, 9, generator=rng).to(dtype).to(DEVICE)[:, 8:]  # a strided column
    got = _triton().shared_expert_combine(routed, shared, gate_logit)
    assert_close(got, ref.shared_expert_combine_reference(routed, shared, gate_logit))
