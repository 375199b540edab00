from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import moe as ref


def _triton():
    from freetoken.kernels.triton import moe

    return moe


def _distinct_logits(rng, tokens, experts, dtype):
    """Distinct logits in every row (exact in bf16; torch.topk leaves the order of ties unspecified),
    the router half of a router + shared-gate GEMM's output as the layer passes it (row stride e + 1)."""
    distinct = torch.stack([torch.randperm(experts + 1, generator=rng) for _ in range(tokens)]) * 0.25 - 1.5
    return distinct.to(dtype).to(DEVICE)[:, :experts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("one_warp", [True, False])
def test_moe_topk_softmax(rng, monkeypatch, dtype, renormalize, one_warp):
    """The one-warp kernel and (``TOPK_WARP_MAX_TOKENS`` lowered to 0) the multi-warp one."""
    moe = _triton()
    monkeypatch.setattr(moe, "TOPK_WARP_MAX_TOKENS", moe.TOPK_WARP_MAX_TOKENS if one_warp else 0)
    logits = _distinct_logits(rng, 9, 13, dtype)
    weights, ids = moe.moe_topk_softmax(logits, 3, renormalize)
    want_w, want_ids = ref.moe_topk_softmax_reference(logits, 3, renormalize)
    assert torch.equal(ids, want_ids)
    assert_close(weights, want_w)


@pytest.mark.parametrize("tokens_per_program", [1, 2, 4])
def test_topk_softmax_warp_tiles(rng, tokens_per_program):
    """The one-warp kernel at each tile the sweep offers (9 tokens: the last program partial)."""
    moe = _triton()
    logits = _distinct_logits(rng, 9, 21, torch.bfloat16)
    weights = torch.full((9, 5), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    ids = torch.full((9, 5), -1, dtype=torch.int32, device=DEVICE)
    moe.topk_softmax_warp(logits, weights, ids, 5, True, tokens_per_program)
    want_w, want_ids = ref.moe_topk_softmax_reference(logits, 5, True)
    assert torch.equal(ids, want_ids)
    assert_close(weights, want_w)


def test_route_with_pdl_setting(rng, monkeypatch):
    """``ROUTE_PDL`` on: the top-k kernel and the one-program sort as without it (programmatic
    dependent launch only where the GPU has it; the compile check builds those variants)."""
    moe = _triton()
    monkeypatch.setattr(moe, "ROUTE_PDL", True)
    logits = _distinct_logits(rng, 7, 11, torch.bfloat16)
    weights, ids = moe.moe_topk_softmax(logits, 3, True)
    want_w, want_ids = ref.moe_topk_softmax_reference(logits, 3, True)
    assert torch.equal(ids, want_ids)
    assert_close(weights, want_w)
    order, offsets = moe.moe_sort_tokens(ids, 11)
    want_order, want_offsets = ref.moe_sort_tokens_reference(ids, 11)
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)


@pytest.mark.parametrize("one_warp", [True, False])
def test_topk_ties_take_the_lowest_id(monkeypatch, one_warp):
    """Equal logits give equal probabilities: the choice among them is the lowest expert id."""
    moe = _triton()
    monkeypatch.setattr(moe, "TOPK_WARP_MAX_TOKENS", moe.TOPK_WARP_MAX_TOKENS if one_warp else 0)
    logits = torch.tensor([[0.5, 2.0, 2.0, 0.5, 2.0, 0.5, 0.5], [1.0] * 7, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    got = moe.moe_topk_softmax(logits.to(DEVICE), 4, True)[1]
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


# one program per tile; 3 programs looping over the tiles (with a register cap or not), the
# operands through pointers or TMA (the down GEMM's both, the gate/up GEMM's weight rows)
@pytest.mark.parametrize("persistent,tma,max_registers", [(0, False, 0), (3, False, 0), (3, True, 0), (3, True, 128)])
@pytest.mark.parametrize("hidden,block_k", [(72, 32), (64, 32)])  # a partial and no partial column tile
def test_fused_experts_grouped_tiles(rng, monkeypatch, hidden, block_k, persistent, tma, max_registers):
    """Row tiles grouped 3 at a time over the column blocks (the last group partial), as the tuned
    prefill configurations run them."""
    from freetoken.kernels.triton.moe_configs import GemmConfig

    moe = _triton()
    config = GemmConfig(block_m=16, block_n=32, block_k=block_k, group_m=3, num_warps=4, num_stages=1,
                        persistent=persistent, tma=tma, max_registers=max_registers)
    monkeypatch.setattr(moe, "moe_gemm_config", lambda *args: config)
    e, k, tokens, inter = 5, 2, 45, 48
    x = torch.randn(tokens, hidden, generator=rng).to(DEVICE)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=rng) * hidden**-0.5).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=rng) * inter**-0.5).to(DEVICE)
    weights, ids = ref.moe_topk_softmax_reference(torch.randn(tokens, e, generator=rng).to(DEVICE), k, True)
    assert_close(moe.fused_experts(x, w13, w2, weights, ids), ref.fused_experts_reference(x, w13, w2, weights, ids))


# one program per tile; a persistent launch through pointers; through TMA descriptors, the row
# tiles scanned or from the map
@pytest.mark.parametrize("persistent,tma,tile_map", [(0, False, False), (3, False, False), (3, True, False),
                                                     (3, True, True)])
@pytest.mark.parametrize("rows", [11, 4])  # an expert cache larger and smaller than the layer's experts
def test_fused_experts_expert_slots(rng, monkeypatch, persistent, tma, tile_map, rows):
    """``expert_slots``: each expert's weights at its slot of tensors of ``rows`` experts (the
    expert cache's), other slots holding other weights; experts no token routes have slot -1."""
    from freetoken.kernels.triton.moe_configs import GemmConfig

    moe = _triton()
    config = GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1,
                        persistent=persistent, tma=tma, tile_map=tile_map)
    monkeypatch.setattr(moe, "moe_gemm_config", lambda *args: config)
    e, k, tokens, hidden, inter = 7, 2, 29, 64, 48
    routed = min(rows, 4)  # the experts the tokens route to
    x = torch.randn(tokens, hidden, generator=rng).to(DEVICE)
    w13 = (torch.randn(rows, 2 * inter, hidden, generator=rng) * hidden**-0.5).to(DEVICE)
    w2 = (torch.randn(rows, hidden, inter, generator=rng) * inter**-0.5).to(DEVICE)
    experts = torch.randperm(e, generator=rng)[:routed]
    slots = torch.full((e,), -1, dtype=torch.int32)
    slots[experts] = torch.randperm(rows, generator=rng)[:routed].int()
    logits = torch.randn(tokens, routed, generator=rng).to(DEVICE)
    weights, local = ref.moe_topk_softmax_reference(logits, k, True)
    ids = experts.to(DEVICE)[local.long()].int()
    slots = slots.to(DEVICE)
    want = ref.fused_experts_reference(x, w13[slots.long()[experts]], w2[slots.long()[experts]], weights, local)
    assert_close(ref.fused_experts_reference(x, w13, w2, weights, ids, slots), want)
    assert_close(moe.fused_experts(x, w13, w2, weights, ids, slots), want)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("tile_map", [False, True])
def test_fused_experts_half_tail(rng, monkeypatch, tma, tile_map):
    """``GemmConfig.half_tail`` at 32-row tiles: experts of 0, 16 (a half tile), 17 (a full one),
    33 and 34 pairs (a full tile, then a half tile of 1 and 2 pairs), 50 tokens in shuffled order;
    the row tiles scanned by each tile or read from ``tile_map``."""
    from freetoken.kernels.triton.moe_configs import GemmConfig

    moe = _triton()
    config = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=3, num_warps=4, num_stages=1,
                        persistent=3, tma=tma, half_tail=True, tile_map=tile_map)
    monkeypatch.setattr(moe, "moe_gemm_config", lambda *args: config)
    e, k, tokens, hidden, inter = 5, 2, 50, 72, 48
    flat = torch.tensor([1] * 16 + [2] * 17 + [3] * 33 + [4] * 34, dtype=torch.int32)
    ids = torch.stack([flat[:tokens], flat[tokens:]], 1)[torch.randperm(tokens, generator=rng)].to(DEVICE)
    x = torch.randn(tokens, hidden, generator=rng).to(DEVICE)
    w13, w2 = _experts(rng, torch.float32, e, hidden, inter)
    weights = torch.softmax(torch.randn(tokens, k, generator=rng), -1).to(DEVICE)
    got = moe.fused_experts_pairs(x, w13, w2, weights, ids)
    assert_close(got, ref.fused_experts_pairs_reference(x, w13, w2, weights, ids))


def test_gemm_config_half_tail_needs_32_rows():
    from freetoken.kernels.triton.moe_configs import GemmConfig

    with pytest.raises(ValueError, match="block_m >= 32"):
        GemmConfig(16, 64, 64, 8, 4, 3, persistent=2, half_tail=True)


def test_gemm_config_tile_map_needs_persistent():
    from freetoken.kernels.triton.moe_configs import GemmConfig

    with pytest.raises(ValueError, match="tile_map need persistent"):
        GemmConfig(64, 64, 64, 8, 4, 3, tile_map=True)


def test_tile_map_lists_every_row_tile_and_their_count():
    """``tile_map``: each real row tile's (expert, first pair, end) as ``_tile_of`` finds them, the
    tiles past them on ``num_experts``, and their count last."""
    moe = _triton()
    counts = torch.tensor([0, 5, 16, 17, 0, 40])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int().to(DEVICE)
    got, tiles = moe.tile_map(offsets, int(counts.sum()), 16)
    want = [(1, 0, 5), (2, 5, 21), (3, 21, 38), (3, 37, 38), (5, 38, 78), (5, 54, 78), (5, 70, 78)]
    assert tiles == -(-78 // 16) + 6
    got = got.cpu()
    expert, first, end = got[:tiles], got[tiles : 2 * tiles], got[2 * tiles : 3 * tiles]
    assert list(zip(expert[: len(want)].tolist(), first[: len(want)].tolist(), end[: len(want)].tolist())) == want
    assert (expert[len(want):] == 6).all()
    assert int(got[3 * tiles]) == len(want)


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


def _experts(rng, dtype, e, hidden, inter):
    w13 = (torch.randn(e, 2 * inter, hidden, generator=rng) * hidden**-0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(e, hidden, inter, generator=rng) * inter**-0.5).to(dtype).to(DEVICE)
    return w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_experts_pairs(rng, dtype, tokens):
    """The pairs' outputs unsummed ``[T, k, H]``; their float32 sum is ``fused_experts``."""
    e, k, hidden, inter = 7, 3, 72, 40
    x = torch.randn(tokens, hidden, generator=rng).to(dtype).to(DEVICE)
    w13, w2 = _experts(rng, dtype, e, hidden, inter)
    weights, ids = ref.moe_topk_softmax_reference(torch.randn(tokens, e, generator=rng).to(dtype).to(DEVICE), k, True)
    got = _triton().fused_experts_pairs(x, w13, w2, weights, ids)
    assert_close(got, ref.fused_experts_pairs_reference(x, w13, w2, weights, ids))
    assert_close(got.float().sum(1).to(dtype), ref.fused_experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,block_m,persistent,tma",
    [(1, 16, 0, False), (37, 16, 0, False), (21, 8, 0, False), (21, 8, 2, False), (21, 8, 2, True)],
)
def test_fused_experts_shared_pairs(rng, monkeypatch, dtype, tokens, block_m, persistent, tma):
    """The shared expert as the grouped GEMMs' first row tiles: the same pairs, and its gated output
    (gate logits a strided column of the router GEMM's output, as the layer passes them); one
    partial shared tile, several, and several in the persistent loop (the operands through
    pointers or TMA: the shared weights by descriptors of their own)."""
    from freetoken.kernels.triton.moe_configs import GemmConfig

    moe = _triton()
    if block_m != 16:
        config = GemmConfig(block_m=block_m, block_n=32, block_k=32, group_m=3, num_warps=4, num_stages=1,
                            persistent=persistent, tma=tma)
        monkeypatch.setattr(moe, "moe_gemm_config", lambda *args: config)
    e, k, hidden, inter = 7, 3, 72, 40
    x = torch.randn(tokens, hidden, generator=rng).to(dtype).to(DEVICE)
    w13, w2 = _experts(rng, dtype, e, hidden, inter)
    shared_w13, shared_w2 = (w[0] for w in _experts(rng, dtype, 1, hidden, inter))
    logits = torch.randn(tokens, e + 1, generator=rng).to(dtype).to(DEVICE)
    weights, ids = ref.moe_topk_softmax_reference(logits[:, :e], k, True)
    args = (x, w13, w2, weights, ids, shared_w13, shared_w2, logits[:, e:])
    pairs, gated = moe.fused_experts_shared_pairs(*args)
    want_pairs, want_gated = ref.fused_experts_shared_pairs_reference(*args)
    assert_close(pairs, want_pairs)
    assert_close(gated, want_gated)


def test_fused_experts_shared_pairs_rejects_another_intermediate(rng):
    e, k, hidden, inter = 5, 2, 32, 16
    x = torch.randn(3, hidden, generator=rng).to(DEVICE)
    w13, w2 = _experts(rng, torch.float32, e, hidden, inter)
    shared_w13, shared_w2 = (w[0] for w in _experts(rng, torch.float32, 1, hidden, 2 * inter))
    weights, ids = ref.moe_topk_softmax_reference(torch.randn(3, e, generator=rng).to(DEVICE), k, True)
    with pytest.raises(ValueError, match="shared_gate_up"):
        _triton().fused_experts_shared_pairs(x, w13, w2, weights, ids, shared_w13, shared_w2, torch.zeros(3, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated,zero_centered,selected", [(True, True, False), (False, True, True), (True, False, True)])
def test_moe_combine_add_rms_norm(rng, dtype, gated, zero_centered, selected):
    """The MoE output's sum, shared term, residual add and norm in one launch: as the three-launch
    chain (``sum_choices``, ``shared_expert_combine``, ``add_rms_norm``); ``rows``: a subset, out of order."""
    t, k, hidden = 9, 3, 50
    pairs = torch.randn(t, k, hidden, generator=rng).to(dtype).to(DEVICE)
    shared = torch.randn(t, hidden, generator=rng).to(dtype).to(DEVICE)
    gate = torch.randn(t, 7, generator=rng).to(dtype).to(DEVICE)[:, 6:] if gated else None
    residual = torch.randn(t, hidden, generator=rng).to(dtype).to(DEVICE)
    weight = (torch.randn(hidden, generator=rng) * 0.1).to(dtype).to(DEVICE)
    rows = torch.tensor([7, 2, 8], device=DEVICE) if selected else None
    args = (pairs, shared, gate, residual, weight, 1e-6, zero_centered, rows)
    normed, summed = _triton().moe_combine_add_rms_norm(*args)
    want_normed, want_summed = ref.moe_combine_add_rms_norm_reference(*args)
    assert_close(normed, want_normed)
    assert_close(summed, want_summed)
    from freetoken.kernels.norm import add_rms_norm_reference

    picked = rows if rows is not None else torch.arange(t, device=DEVICE)
    moe = pairs.float().sum(1).to(dtype)
    moe = ref.shared_expert_combine_reference(moe, shared, gate) if gated else moe + shared
    chain = add_rms_norm_reference(moe[picked], residual[picked], weight, 1e-6, zero_centered)
    assert torch.equal(want_normed, chain[0]) and torch.equal(want_summed, chain[1])


def test_gemm_config_tma_needs_persistent():
    from freetoken.kernels.triton.moe_configs import GemmConfig

    with pytest.raises(ValueError, match="need persistent"):
        GemmConfig(128, 128, 64, 8, 8, 3, persistent=0, tma=True)
