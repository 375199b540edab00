"""The grouped MoE path's routing at the real sizes (256 experts, top-8, bf16 logits of row stride
264 as the layer passes them): the one-warp top-k kernel at each tile, with and without
programmatic dependent launch, against the multi-warp kernel and the reference, eager and replayed
from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import assert_close
from freetoken.kernels import moe as ref_moe

pytestmark = pytest.mark.gpu

EXPERTS, TOP_K, ROUTER_ROWS = 256, 8, 264
CUDA = torch.device("cuda")


def _moe():
    from freetoken.kernels.triton import moe

    return moe


@pytest.mark.parametrize("tokens", [1, 64, 255, 1000])
@pytest.mark.parametrize("warp_tokens", [1, 2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_one_warp_topk_and_sort(rng, monkeypatch, tokens, warp_tokens, pdl):
    """Random bf16 logits (ties included): ids equal to the multi-warp kernel's (the same selection
    and tie order), weights within a rounding of the reference; the sort after it equal to the
    reference's; a graph replay equal to the eager run."""
    moe = _moe()
    logits = torch.randn(tokens, ROUTER_ROWS, generator=rng, device=CUDA).to(torch.bfloat16)[:, :EXPERTS]
    monkeypatch.setattr(moe, "TOPK_WARP_MAX_TOKENS", 0)
    old_w, old_ids = moe.moe_topk_softmax(logits, TOP_K, True)
    monkeypatch.setattr(moe, "TOPK_WARP_MAX_TOKENS", 1 << 31)
    monkeypatch.setattr(moe, "TOPK_WARP_TOKENS", warp_tokens)
    monkeypatch.setattr(moe, "ROUTE_PDL", pdl)
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    order, offsets = moe.moe_sort_tokens(ids, EXPERTS)
    assert torch.equal(ids, old_ids)
    want_w, _ = ref_moe.moe_topk_softmax_reference(logits, TOP_K, True)
    assert_close(weights, want_w)
    assert_close(weights, old_w)
    want_order, want_offsets = ref_moe.moe_sort_tokens_reference(ids, EXPERTS)
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed_w, replayed_ids = moe.moe_topk_softmax(logits, TOP_K, True)
        replayed = moe.moe_sort_tokens(replayed_ids, EXPERTS)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed_w, weights) and torch.equal(replayed_ids, ids)
    assert torch.equal(replayed[0], order) and torch.equal(replayed[1], offsets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_warp_topk_distinct_logits(rng, dtype):
    """Distinct logits in every row (exact in bf16): the reference's ids exactly."""
    moe = _moe()
    distinct = torch.stack([torch.randperm(EXPERTS, generator=rng, device=CUDA) for _ in range(300)])
    packed = torch.cat([(distinct - 128) / 32.0, torch.zeros(300, ROUTER_ROWS - EXPERTS, device=CUDA)], 1)
    logits = packed.to(dtype)[:, :EXPERTS]
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    want_w, want_ids = ref_moe.moe_topk_softmax_reference(logits, TOP_K, True)
    assert torch.equal(ids, want_ids)
    assert_close(weights, want_w)
