"""Triton MoE: softmax top-k routing, grouping (token, choice) pairs by expert, and the expert GEMMs.

``fused_experts`` runs, with no device->host sync:

0. ``moe_topk_softmax`` (called by the layer before): softmax and top-k of each token's router
   logits in one warp (``_topk_softmax_warp_kernel``), or past ``TOPK_WARP_MAX_TOKENS`` tokens in
   multi-warp row tiles (``_topk_softmax_kernel``).
1. ``moe_sort_tokens``: a stable sort of the flat expert ids, one program at decode sizes, else a
   counting sort parallel over blocks of pairs (``order``: pair indices grouped by expert, ``offsets``: each expert's range).
2. ``_gate_up_kernel``: a grouped GEMM over tiles of ``BLOCK_M`` pairs of one expert. A program finds
   its (expert, tile) from ``offsets`` itself; tiles past the real count exit, so the grid is an upper
   bound (``ceil(pairs / BLOCK_M) + experts`` row tiles, in groups of ``GROUP_M`` over all column
   blocks). Tile sizes, warps and stages come from ``moe_configs`` (a table tuned per shape). Each program computes a gate block and the matching up
   block of ``w13`` and writes ``silu(gate) · up`` (SiLU-and-mul fused) in sorted pair order.
3. ``_down_kernel``: the same tiling over ``w2``, scaled by the routing weight, written per pair.
4. ``_sum_choices_kernel``: each token's ``top_k`` pair outputs summed in float32 (deterministic, no atomics).

Rounding follows the reference (the projections, SiLU and products rounded to the activations' dtype).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from freetoken.kernels.triton._common import (
    INTERPRETED,
    cast,
    device_function,
    dot,
    dot_precision,
    new_empty,
    pow2,
    round_as,
    rows_per_program,
)
from freetoken.kernels.triton.moe_configs import GemmConfig, moe_gemm_config
from freetoken.kernels.triton.moe_decode import _pdl_available, _top_k_rows


@device_function
def _softmax_topk(logits, e, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Rows of float32 ``logits [R, BLOCK_E]`` (``e``: the column index ``[1, BLOCK_E]``): softmax,
    the ``TOP_K`` largest probabilities in decreasing order, the lowest expert id first among ties,
    optionally renormalised; ``(weights [R, BLOCK_K] float32, ids [R, BLOCK_K] int32)``.

    Each choice is one max over an int64 key: the probability's float32 bits (order-preserving for
    the non-negative probabilities) above ``BLOCK_E - 1 - e`` (so among equal probabilities the
    lowest id is largest), instead of a max over the values and a min over the ids that tie."""
    logits = tl.where(e < num_experts, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(e < num_experts, p, -1.0)  # padding: below every probability
    rank = (BLOCK_E - 1) - e  # int32
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | rank.to(tl.int64)
    j = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros([logits.shape[0], BLOCK_K], tl.float32)
    top_i = tl.zeros([logits.shape[0], BLOCK_K], tl.int32)
    for choice in tl.static_range(TOP_K):
        best = tl.max(key, 1)[:, None]
        top_w = tl.where(j == choice, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top_w)
        top_i = tl.where(j == choice, (BLOCK_E - 1) - (best & 0xFFFFFFFF).to(tl.int32), top_i)
        key = tl.where(key == best, -(1 << 62), key)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(j < TOP_K, top_w, 0.0), 1)[:, None]
    return top_w, top_i


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, l_st, weights_ptr, ids_ptr, num_tokens, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    t_ok = t < num_tokens
    e = tl.arange(0, BLOCK_E)[None, :]
    logits = tl.load(logits_ptr + t * l_st + e, mask=t_ok & (e < num_experts), other=0.0).to(tl.float32)
    top_w, top_i = _softmax_topk(logits, e, num_experts, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    j = tl.arange(0, BLOCK_K)[None, :]
    mask = t_ok & (j < TOP_K)
    tl.store(weights_ptr + t * TOP_K + j, cast(top_w, weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + t * TOP_K + j, top_i, mask=mask)


# The one-warp top-k kernel (``_topk_softmax_warp_kernel``) routes up to this many tokens,
# ``TOPK_WARP_TOKENS`` per program; past it the multi-warp kernel. Set both from
# ``benchmarks/moe_route_sweep.py`` (its ``topk`` part times each tile against the old kernel).
TOPK_WARP_MAX_TOKENS = 1 << 31
TOPK_WARP_TOKENS = 1
# Programmatic dependent launch (sm_90 on) for the one-warp top-k kernel and the one-program sort:
# each starts while the launch before it (the router GEMM; the shared expert's down GEMM) drains
# and waits (``griddepcontrol.wait``) before its first load. The sweep times it on and off.
ROUTE_PDL = False


@triton.jit
def _topk_softmax_warp_kernel(
    logits_ptr, l_st, weights_ptr, ids_ptr, num_tokens, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, TOKENS: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    """``TOKENS`` tokens in one warp (launched with ``num_warps=1``): every reduction over a row's
    ``BLOCK_E`` logits stays in the warp whatever layout Triton picks (the multi-warp kernel's rows
    span its warps when the row stride is not a multiple of 16: each of its ten reductions is then a
    round trip through shared memory between barriers). The choices are ``moe_decode._top_k_rows``'s,
    the decode block's routing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS))[:, None]
    t_ok = t < num_tokens
    e = tl.arange(0, BLOCK_E)[None, :]
    logits = tl.load(logits_ptr + t * l_st + e, mask=t_ok & (e < num_experts), other=0.0).to(tl.float32)
    weights, experts = _top_k_rows(logits, e, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
    mask = t_ok & (e < TOP_K)
    tl.store(weights_ptr + t * TOP_K + e, cast(weights, weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + t * TOP_K + e, experts, mask=mask)


def topk_softmax_warp(
    router_logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, top_k: int, renormalize: bool, tokens: int
) -> None:
    """The one-warp top-k kernel over unit-column-stride ``router_logits``, ``tokens`` per program."""
    num_tokens, num_experts = router_logits.shape
    pdl = ROUTE_PDL and _pdl_available()
    _topk_softmax_warp_kernel[(triton.cdiv(num_tokens, tokens),)](
        router_logits, router_logits.stride(0), weights, ids, num_tokens, num_experts,
        TOP_K=top_k, RENORMALIZE=renormalize, TOKENS=tokens, BLOCK_E=pow2(num_experts), PDL=pdl, num_warps=1,
        launch_pdl=pdl,
    )


def moe_topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``TOPK_WARP_MAX_TOKENS`` tokens the one-warp kernel, past it the multi-warp one. Under
    the interpreter, whose cost is per program, the one-warp kernel takes a row tile's worth of
    tokens per program (the same results: tokens are independent)."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = new_empty((num_tokens, top_k), router_logits.dtype, router_logits.device)
    ids = new_empty((num_tokens, top_k), torch.int32, router_logits.device)
    if not num_tokens:
        return weights, ids
    block_e = pow2(num_experts)
    block_t = rows_per_program(num_tokens, block_e)
    if num_tokens <= TOPK_WARP_MAX_TOKENS:
        tokens = max(TOPK_WARP_TOKENS, block_t) if INTERPRETED else TOPK_WARP_TOKENS
        topk_softmax_warp(router_logits, weights, ids, top_k, renormalize, tokens)
    else:
        _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
            router_logits, router_logits.stride(0), weights, ids, num_tokens, num_experts,
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=pow2(top_k),
        )
    return weights, ids


@triton.jit
def _block_counts_kernel(ids_ptr, partial_ptr, num_pairs, num_experts,
                         BLOCK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pairs per expert in block ``b`` of ``BLOCK`` consecutive pairs: ``partial[b, e]``."""
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for sub in tl.static_range(BLOCK // SUB):
        i = b * BLOCK + sub * SUB + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
    tl.store(partial_ptr + b * num_experts + e, counts, mask=e < num_experts)


@triton.jit
def _block_prefix_kernel(partial_ptr, totals_ptr, num_blocks, num_experts,
                         BLOCKS: tl.constexpr, GROUP_E: tl.constexpr):
    """For ``GROUP_E`` experts: ``partial[b, e]`` becomes the pairs of ``e`` in the blocks before
    ``b`` (exclusive prefix over blocks), ``totals[e]`` the expert's pairs."""
    e = (tl.program_id(0) * GROUP_E + tl.arange(0, GROUP_E))[None, :]
    blocks = tl.arange(0, BLOCKS)[:, None]
    mask = (blocks < num_blocks) & (e < num_experts)
    counts = tl.load(partial_ptr + blocks * num_experts + e, mask=mask, other=0)
    before = tl.cumsum(counts, 0) - counts
    tl.store(partial_ptr + blocks * num_experts + e, before, mask=mask)
    tl.store(totals_ptr + e, tl.sum(counts, 0)[None, :], mask=e < num_experts)


@triton.jit
def _place_kernel(ids_ptr, partial_ptr, totals_ptr, order_ptr, offsets_ptr, num_pairs, num_experts,
                  BLOCK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    """Block ``b``'s pairs to their sorted places: the expert's start, plus its pairs in earlier
    blocks, plus the pair's rank among the block's earlier pairs of that expert (stable)."""
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    totals = tl.load(totals_ptr + e, mask=e_ok, other=0)
    starts = tl.cumsum(totals, 0) - totals
    if b == 0:
        tl.store(offsets_ptr + e, starts, mask=e_ok)
        tl.store(offsets_ptr + num_experts, tl.sum(totals, 0))
    next_place = starts + tl.load(partial_ptr + b * num_experts + e, mask=e_ok, other=0)
    for sub in tl.static_range(BLOCK // SUB):
        i = b * BLOCK + sub * SUB + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
        match = (ids[:, None] == e[None, :]).to(tl.int32)
        place = tl.sum(tl.where(match > 0, next_place[None, :] + tl.cumsum(match, 0) - 1, 0), 1)
        tl.store(order_ptr + place, i, mask=i < num_pairs)
        next_place += tl.sum(match, 0)


# Up to this many (token, choice) pairs ``moe_sort_tokens`` sorts them in one program (256 tokens
# of top-8: the keys stay in registers; 26.2 us per layer on the H200 with the top-k kernel before
# it, against 26.7 for the three-launch sort: ``benchmarks/moe_route_sweep.py``); past it, prefill
# sizes, the three launches, parallel over blocks of pairs.
SORT_ONE_PROGRAM_PAIRS = 2048
SORT_ONE_PROGRAM_WARPS = 8  # 4 warps: 35.4 us at 256 tokens, 8: 26.2


@triton.jit
def _sort_program_kernel(ids_ptr, order_ptr, offsets_ptr, num_pairs, num_experts, BLOCK_E: tl.constexpr,
                         BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """The sort by expert in one program, over all ``num_pairs`` pairs: the per-expert counts (a
    histogram), their prefix (``offsets``) and the stable order (a bitonic sort of
    ``id · BLOCK_P + pair``: unique keys, so the pairs of an expert keep their order)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pair = tl.arange(0, BLOCK_P)
    pair_ok = pair < num_pairs
    ids = tl.load(ids_ptr + pair, mask=pair_ok, other=0)
    # Padding pairs count as expert 0 (the histogram takes no mask in every Triton): taken back.
    counts = tl.histogram(ids, BLOCK_E)
    counts -= tl.where(tl.arange(0, BLOCK_E) == 0, BLOCK_P - num_pairs, 0)
    expert = tl.arange(0, BLOCK_E)
    tl.store(offsets_ptr + expert, tl.cumsum(counts, 0) - counts, mask=expert < num_experts)
    tl.store(offsets_ptr + num_experts, num_pairs)
    keys = tl.where(pair_ok, ids, BLOCK_E) * BLOCK_P + pair  # padding sorts last
    order = tl.sort(keys) & (BLOCK_P - 1)
    tl.store(order_ptr + pair, order, mask=pair_ok)


def moe_sort_tokens(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``SORT_ONE_PROGRAM_PAIRS`` pairs one program; past it three small launches, parallel
    over blocks of pairs (round 1 scanned every pair once per expert: 113 µs at T=8192 on the
    H200): per-block expert counts, their prefix over blocks per expert, and the stable placement."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.shape[0]
    device = topk_ids.device
    order = new_empty((num_pairs,), torch.int32, device)
    offsets = new_empty((num_experts + 1,), torch.int32, device)
    if 0 < num_pairs <= SORT_ONE_PROGRAM_PAIRS:
        pdl = ROUTE_PDL and _pdl_available()
        _sort_program_kernel[(1,)](
            flat, order, offsets, num_pairs, num_experts, BLOCK_E=pow2(num_experts), BLOCK_P=pow2(num_pairs, 16),
            PDL=pdl, num_warps=SORT_ONE_PROGRAM_WARPS, launch_pdl=pdl,
        )
        return order, offsets
    block = max(256, pow2(triton.cdiv(num_pairs, 512)))  # at most 512 blocks: one prefix tile
    num_blocks = max(triton.cdiv(num_pairs, block), 1)
    partial = new_empty((num_blocks, num_experts), torch.int32, device)
    totals = new_empty((num_experts,), torch.int32, device)
    block_e, sub = pow2(num_experts), 32
    _block_counts_kernel[(num_blocks,)](flat, partial, num_pairs, num_experts, BLOCK=block, SUB=sub, BLOCK_E=block_e)
    group_e = max(1, min(block_e, 2048 // pow2(num_blocks)))  # tiles of 2K counts: no spills
    _block_prefix_kernel[(triton.cdiv(num_experts, group_e),)](
        partial, totals, num_blocks, num_experts, BLOCKS=pow2(num_blocks), GROUP_E=group_e
    )
    _place_kernel[(num_blocks,)](
        flat, partial, totals, order, offsets, num_pairs, num_experts, BLOCK=block, SUB=sub, BLOCK_E=block_e
    )
    return order, offsets


@device_function
def _tile_of(pid, offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first sorted pair, end of the expert's pairs) of grouped-GEMM tile ``pid``; the
    expert is ``num_experts`` for tiles past the last one."""
    starts, ends, tiles_end, _ = _expert_tiles(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    return _tile_in(pid, starts, ends, tiles_end, BLOCK_M, BLOCK_E)


@device_function
def _expert_tiles(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Each expert's first and end sorted pair and the row tiles of the experts up to it
    (``[BLOCK_E]`` each), and the count of real row tiles."""
    e = tl.arange(0, BLOCK_E)
    starts = tl.load(offsets_ptr + e, mask=e < num_experts, other=0)
    ends = tl.load(offsets_ptr + e + 1, mask=e < num_experts, other=0)
    tiles_end = tl.cumsum((ends - starts + BLOCK_M - 1) // BLOCK_M, 0)  # tiles of experts <= e
    return starts, ends, tiles_end, tl.max(tiles_end, 0)


@device_function
def _tile_in(pid, starts, ends, tiles_end, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``_tile_of`` from ``_expert_tiles``' vectors."""
    e = tl.arange(0, BLOCK_E)
    expert = tl.sum((tiles_end <= pid).to(tl.int32), 0)
    tiles_before = tl.sum(tl.where(e == expert - 1, tiles_end, 0), 0)
    first = tl.sum(tl.where(e == expert, starts, 0), 0) + (pid - tiles_before) * BLOCK_M
    end = tl.sum(tl.where(e == expert, ends, 0), 0)
    return expert, first, end


@triton.jit
def _tile_map_kernel(offsets_ptr, tiles_ptr, num_experts, num_row_tiles, BLOCK_M: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """``tiles [3 · num_row_tiles + 1]``: each row tile's expert (``num_experts`` past the last
    tile), first sorted pair and its expert's end, for ``BLOCK_T`` tiles a program (``_tile_of``
    for many tiles at once), then the count of real row tiles. Every grouped-GEMM tile then loads
    its three numbers instead of scanning all experts' offsets itself: a down tile runs only four
    to eight K steps, and that scan, with its reductions across the warps, was a large part of it."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    starts, ends, tiles_end, real_tiles = _expert_tiles(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    tiles_end = tl.where(e < num_experts, tiles_end, 1 << 30)
    expert = tl.sum((tiles_end[None, :] <= t[:, None]).to(tl.int32), 1)
    mine = e[None, :] == expert[:, None]
    tiles_before = tl.sum(tl.where(e[None, :] == expert[:, None] - 1, tiles_end[None, :], 0), 1)
    first = tl.sum(tl.where(mine, starts[None, :], 0), 1) + (t - tiles_before) * BLOCK_M
    end = tl.sum(tl.where(mine, ends[None, :], 0), 1)
    ok = t < num_row_tiles
    tl.store(tiles_ptr + t, expert, mask=ok)
    tl.store(tiles_ptr + num_row_tiles + t, first, mask=ok)
    tl.store(tiles_ptr + 2 * num_row_tiles + t, end, mask=ok)
    if tl.program_id(0) == 0:
        tl.store(tiles_ptr + 3 * num_row_tiles, real_tiles)


def tile_map(offsets: torch.Tensor, num_pairs: int, block_m: int) -> tuple[torch.Tensor, int]:
    """(``_tile_map_kernel``'s ``[3 · tiles + 1]``, tiles) for row tiles of ``block_m`` sorted
    pairs, ``tiles`` the host's upper bound (``_row_tiles``)."""
    num_experts = offsets.shape[0] - 1
    tiles = _row_tiles(num_pairs, num_experts, block_m)
    out = new_empty((3 * tiles + 1,), torch.int32, offsets.device)
    block_e = pow2(num_experts)
    block_t = max(1, min(pow2(tiles), 8192 // block_e))
    _tile_map_kernel[(triton.cdiv(tiles, block_t),)](offsets, out, num_experts, tiles, BLOCK_M=block_m,
                                                     BLOCK_E=block_e, BLOCK_T=block_t)
    return out, tiles


@device_function
def _persistent_tiles(offsets_ptr, map_ptr, map_tiles, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                      TILE_MAP: tl.constexpr):
    """A persistent program's view of the row tiles: ``_expert_tiles``' vectors and real tile count,
    or with ``TILE_MAP`` the count ``tile_map`` wrote (the vectors unused: zeros)."""
    if TILE_MAP:
        routed = tl.load(map_ptr + 3 * map_tiles)
        zeros = tl.zeros([BLOCK_E], tl.int32)
        starts, ends, tiles_end = zeros, zeros, zeros
    else:
        starts, ends, tiles_end, routed = _expert_tiles(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    return starts, ends, tiles_end, routed


@device_function
def _persistent_tile(tile, starts, ends, tiles_end, map_ptr, map_tiles, BLOCK_M: tl.constexpr,
                     BLOCK_E: tl.constexpr, TILE_MAP: tl.constexpr):
    """(expert, first pair, end) of real row tile ``tile``: three loads from the map, or ``_tile_in``."""
    if TILE_MAP:
        expert = tl.load(map_ptr + tile)
        first = tl.load(map_ptr + map_tiles + tile)
        end = tl.load(map_ptr + 2 * map_tiles + tile)
    else:
        expert, first, end = _tile_in(tile, starts, ends, tiles_end, BLOCK_M, BLOCK_E)
    return expert, first, end


@device_function
def _grouped_tile(num_row_tiles, num_col_blocks, GROUP_M: tl.constexpr):
    """(row tile, column block) of this program in a 1-D grid: ``GROUP_M`` row tiles (mostly of one
    expert) run over all column blocks before the next group, so their weight blocks and gathered
    rows are reused from L2."""
    return _group_index(tl.program_id(0), num_row_tiles, num_col_blocks, GROUP_M)


@device_function
def _group_index(pid, num_row_tiles, num_col_blocks, GROUP_M: tl.constexpr):
    """``_grouped_tile`` of work item ``pid``."""
    per_group = GROUP_M * num_col_blocks
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_row_tiles - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@device_function
def _gate_up_block(
    x_ptr, x_st, token, row_ok, w_base, w_sn, h_ptr, h_rows, col_block, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``h[h_rows] = silu(x[token] w_gateᵀ) · (x[token] w_upᵀ)`` for one column block of the weight
    at ``w_base`` (gate rows, then up rows, ``inter`` each)."""
    n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < hidden) | EVEN_K  # constant true when the tiles divide the dim: no column mask
        a = tl.load(x_ptr + token[:, None] * x_st + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(w_base + n[:, None] * w_sn + k[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (inter + n)[:, None] * w_sn + k[None, :], mask=w_mask, other=0.0)
        acc_gate += dot(a, tl.trans(w_gate), PRECISION)
        acc_up += dot(a, tl.trans(w_up), PRECISION)
    _gate_up_store(acc_gate, acc_up, h_ptr, h_rows, row_ok, n, inter)


@device_function
def _gate_up_store(acc_gate, acc_up, h_ptr, h_rows, row_ok, n, inter):
    """``h[h_rows, n] = silu(gate) · up``, rounded as the reference rounds."""
    dtype = h_ptr.dtype.element_ty
    gate = round_as(acc_gate, dtype)
    h = round_as(gate * tl.sigmoid(gate), dtype) * round_as(acc_up, dtype)
    tl.store(h_ptr + h_rows[:, None] * inter + n[None, :], cast(h, dtype), mask=row_ok[:, None] & (n < inter)[None, :])


@device_function
def _gate_up_block_tma(
    x_ptr, x_st, token, row_ok, w_desc, w_row, h_ptr, h_rows, col_block, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``_gate_up_block`` with the weight rows read by TMA (``GemmConfig.tma``): gate rows from
    ``w_row``, up rows from ``w_row + inter`` of a 2-D descriptor over ``[experts · 2I, H]``. Rows
    past the block's own (the up rows, the next expert's gate rows) are read and never stored; past
    the tensor's end and past ``hidden`` the descriptor reads zeros. ``x`` rows are gathered by
    token through pointers (Hopper's TMA has no row gather)."""
    n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < hidden) | EVEN_K
        a = tl.load(x_ptr + token[:, None] * x_st + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_gate = w_desc.load([w_row, k0])
        w_up = w_desc.load([w_row + inter, k0])
        acc_gate += dot(a, tl.trans(w_gate), PRECISION)
        acc_up += dot(a, tl.trans(w_up), PRECISION)
    _gate_up_store(acc_gate, acc_up, h_ptr, h_rows, row_ok, n, inter)


@device_function
def _slot_of(expert, slots_ptr, HAS_SLOTS: tl.constexpr):
    """The weight tensors' row of ``expert``: its expert-cache slot ``slots[expert]`` (``HAS_SLOTS``),
    else the expert itself."""
    slot = expert
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + expert)
    return slot


@device_function
def _gate_up_routed(
    tile, col_block, x_ptr, x_st, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, h_ptr, hidden, inter,
    num_experts, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    expert, first, end = _tile_of(tile, offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        _gate_up_rows(_slot_of(expert, slots_ptr, HAS_SLOTS), first, end, col_block, x_ptr, x_st, w_ptr, w_se, w_sn, None, order_ptr, h_ptr, hidden,
                      inter, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, False)


@device_function
def _gate_up_rows(
    expert, first, end, col_block, x_ptr, x_st, w_ptr, w_se, w_sn, w_desc, order_ptr, h_ptr, hidden, inter,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """The routed tile of ``expert``'s sorted pairs ``[first, min(first + BLOCK_M, end))`` (``expert``:
    its weights' row, ``_slot_of``); ``TMA``: its weight rows through ``w_desc`` (``_gate_up_block_tma``)."""
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    token = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
    if TMA:
        _gate_up_block_tma(x_ptr, x_st, token, row_ok, w_desc, expert * (2 * inter) + col_block * BLOCK_N, h_ptr,
                           rows, col_block, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    else:
        _gate_up_block(x_ptr, x_st, token, row_ok, w_ptr + expert.to(tl.int64) * w_se, w_sn, h_ptr, rows, col_block,
                       hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)


@triton.jit
def _gate_up_kernel(
    x_ptr, x_st, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, h_ptr,
    hidden, inter, num_experts, num_row_tiles,
    ws_ptr, ws_sn, num_tokens, num_pairs, shared_tiles,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    SHARED: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    """``SHARED``: the first ``shared_tiles`` row tiles are the shared expert's (weight ``ws``,
    every token in order, ``h`` rows from ``num_pairs``), the rest the routed pairs' tiles."""
    tile, col_block = _grouped_tile(num_row_tiles + shared_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if SHARED:
        if tile < shared_tiles:
            tokens = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            _gate_up_block(x_ptr, x_st, tokens, tokens < num_tokens, ws_ptr, ws_sn, h_ptr, num_pairs + tokens,
                           col_block, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        else:
            _gate_up_routed(tile - shared_tiles, col_block, x_ptr, x_st, w_ptr, w_se, w_sn, order_ptr, offsets_ptr,
                            slots_ptr, h_ptr, hidden, inter, num_experts, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E,
                            EVEN_K, PRECISION, HAS_SLOTS)
    else:
        _gate_up_routed(tile, col_block, x_ptr, x_st, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, h_ptr,
                        hidden, inter, num_experts, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, EVEN_K, PRECISION,
                        HAS_SLOTS)


@device_function
def _down_block(
    h_ptr, rows, row_ok, w_base, w_sn, weight, y_ptr, y_rows, col_block, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``y[y_rows] = weight · (h[rows] w_downᵀ)`` for one column block of the weight at ``w_base``;
    ``weight`` float32 ``[BLOCK_M]``."""
    n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < inter) | EVEN_K
        a = tl.load(h_ptr + rows[:, None] * inter + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[:, None] * w_sn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += dot(a, tl.trans(w), PRECISION)
    _down_store(acc, weight, y_ptr, y_rows, row_ok, n, hidden)


@device_function
def _down_store(acc, weight, y_ptr, y_rows, row_ok, n, hidden):
    """``y[y_rows, n] = weight · acc``, rounded as the reference rounds."""
    dtype = y_ptr.dtype.element_ty
    y = round_as(acc, dtype) * weight[:, None]
    tl.store(y_ptr + y_rows.to(tl.int64)[:, None] * hidden + n[None, :], cast(y, dtype),
             mask=row_ok[:, None] & (n < hidden)[None, :])


@device_function
def _down_block_tma(
    h_desc, h_row, w_desc, w_row, row_ok, weight, y_ptr, y_rows, col_block, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """``_down_block`` with both operands read by TMA (``GemmConfig.tma``): ``h`` rows from
    ``h_row`` and weight rows from ``w_row`` of 2-D descriptors. Rows past the tile's own (the next
    expert's pairs, the next expert's weight rows) are read and never stored; past the tensors' ends
    and past ``inter`` the descriptors read zeros, so no masks and no pointer tensors (registers)."""
    n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a = h_desc.load([h_row, k0])
        w = w_desc.load([w_row, k0])
        acc += dot(a, tl.trans(w), PRECISION)
    _down_store(acc, weight, y_ptr, y_rows, row_ok, n, hidden)


@device_function
def _down_routed(
    tile, col_block, h_ptr, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, topk_w_ptr, y_ptr, hidden, inter,
    num_experts, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    expert, first, end = _tile_of(tile, offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        _down_rows(_slot_of(expert, slots_ptr, HAS_SLOTS), first, end, col_block, h_ptr, w_ptr, w_se, w_sn, order_ptr, topk_w_ptr, y_ptr, hidden, inter,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)


@device_function
def _down_rows(
    expert, first, end, col_block, h_ptr, w_ptr, w_se, w_sn, order_ptr, topk_w_ptr, y_ptr, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The routed tile of ``expert``'s sorted pairs ``[first, min(first + BLOCK_M, end))`` (``expert``:
    its weights' row, ``_slot_of``)."""
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    _down_block(h_ptr, rows, row_ok, w_ptr + expert.to(tl.int64) * w_se, w_sn, weight, y_ptr, pair, col_block,
                hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, topk_w_ptr, y_ptr,
    hidden, inter, num_experts, num_row_tiles,
    ws_ptr, ws_sn, gate_ptr, g_st, num_tokens, num_pairs, shared_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    SHARED: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    """``SHARED``: the first ``shared_tiles`` row tiles are the shared expert's (weight ``ws``, ``h``
    and ``y`` rows from ``num_pairs``), scaled by ``sigmoid(gate)`` rounded to the activations' dtype."""
    tile, col_block = _grouped_tile(num_row_tiles + shared_tiles, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if SHARED:
        if tile < shared_tiles:
            tokens = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            t_ok = tokens < num_tokens
            logit = tl.load(gate_ptr + tokens * g_st, mask=t_ok, other=0.0).to(tl.float32)
            weight = round_as(tl.sigmoid(logit), y_ptr.dtype.element_ty)
            _down_block(h_ptr, num_pairs + tokens, t_ok, ws_ptr, ws_sn, weight, y_ptr, num_pairs + tokens, col_block,
                        hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        else:
            _down_routed(tile - shared_tiles, col_block, h_ptr, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr,
                         topk_w_ptr, y_ptr, hidden, inter, num_experts, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, EVEN_K,
                         PRECISION, HAS_SLOTS)
    else:
        _down_routed(tile, col_block, h_ptr, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, topk_w_ptr, y_ptr,
                     hidden, inter, num_experts, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, EVEN_K, PRECISION, HAS_SLOTS)


@triton.jit
def _gate_up_persistent_kernel(
    x_ptr, x_st, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, h_ptr,
    hidden, inter, num_experts,
    ws_ptr, ws_sn, num_tokens, num_pairs, shared_tiles, w_desc, ws_desc, map_ptr, map_tiles,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    SHARED: tl.constexpr, TMA: tl.constexpr, HALF_TAIL: tl.constexpr, TILE_MAP: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    """``_gate_up_kernel``'s tiles, a program looping over every ``num_programs``-th (GemmConfig.persistent);
    ``TMA``: the weight rows through the descriptors; ``HALF_TAIL``: a routed tile of at most
    ``BLOCK_M // 2`` pairs (an expert's last) as a ``BLOCK_M // 2``-row tile; ``TILE_MAP``: the row
    tiles from ``tile_map``'s ``map_ptr``."""
    starts, ends, tiles_end, routed = _persistent_tiles(offsets_ptr, map_ptr, map_tiles, num_experts, BLOCK_M,
                                                        BLOCK_E, TILE_MAP)
    row_tiles = routed + shared_tiles
    col_blocks = tl.cdiv(inter, BLOCK_N)
    for work in tl.range(tl.program_id(0), row_tiles * col_blocks, tl.num_programs(0)):
        tile, col_block = _group_index(work, row_tiles, col_blocks, GROUP_M)
        if SHARED and tile < shared_tiles:
            tokens = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            if TMA:
                _gate_up_block_tma(x_ptr, x_st, tokens, tokens < num_tokens, ws_desc, col_block * BLOCK_N, h_ptr,
                                   num_pairs + tokens, col_block, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                   PRECISION)
            else:
                _gate_up_block(x_ptr, x_st, tokens, tokens < num_tokens, ws_ptr, ws_sn, h_ptr, num_pairs + tokens,
                               col_block, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        else:
            expert, first, end = _persistent_tile(tile - shared_tiles, starts, ends, tiles_end, map_ptr, map_tiles,
                                                  BLOCK_M, BLOCK_E, TILE_MAP)
            expert = _slot_of(expert, slots_ptr, HAS_SLOTS)
            if HALF_TAIL and end - first <= BLOCK_M // 2:
                _gate_up_rows(expert, first, end, col_block, x_ptr, x_st, w_ptr, w_se, w_sn, w_desc, order_ptr, h_ptr,
                              hidden, inter, TOP_K, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
            else:
                _gate_up_rows(expert, first, end, col_block, x_ptr, x_st, w_ptr, w_se, w_sn, w_desc, order_ptr, h_ptr,
                              hidden, inter, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)


@triton.jit
def _down_persistent_kernel(
    h_ptr, w_ptr, w_se, w_sn, order_ptr, offsets_ptr, slots_ptr, topk_w_ptr, y_ptr,
    hidden, inter, num_experts,
    ws_ptr, ws_sn, gate_ptr, g_st, num_tokens, num_pairs, shared_tiles, h_desc, w_desc, ws_desc, h_half_desc,
    map_ptr, map_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    SHARED: tl.constexpr, TMA: tl.constexpr, HALF_TAIL: tl.constexpr, TILE_MAP: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    """``_down_kernel``'s tiles, a program looping over every ``num_programs``-th (GemmConfig.persistent);
    ``TMA``: the operands through the descriptors (``_down_block_tma``; ``h_half_desc``: ``h``'s of
    ``BLOCK_M // 2`` rows), else through pointers; ``HALF_TAIL``: a routed tile of at most
    ``BLOCK_M // 2`` pairs (an expert's last) as a ``BLOCK_M // 2``-row tile; ``TILE_MAP``: the row
    tiles from ``tile_map``'s ``map_ptr``."""
    starts, ends, tiles_end, routed = _persistent_tiles(offsets_ptr, map_ptr, map_tiles, num_experts, BLOCK_M,
                                                        BLOCK_E, TILE_MAP)
    row_tiles = routed + shared_tiles
    col_blocks = tl.cdiv(hidden, BLOCK_N)
    for work in tl.range(tl.program_id(0), row_tiles * col_blocks, tl.num_programs(0)):
        tile, col_block = _group_index(work, row_tiles, col_blocks, GROUP_M)
        if SHARED and tile < shared_tiles:
            tokens = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            t_ok = tokens < num_tokens
            logit = tl.load(gate_ptr + tokens * g_st, mask=t_ok, other=0.0).to(tl.float32)
            weight = round_as(tl.sigmoid(logit), y_ptr.dtype.element_ty)
            if TMA:
                _down_block_tma(h_desc, num_pairs + tile * BLOCK_M, ws_desc, col_block * BLOCK_N, t_ok, weight, y_ptr,
                                num_pairs + tokens, col_block, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            else:
                _down_block(h_ptr, num_pairs + tokens, t_ok, ws_ptr, ws_sn, weight, y_ptr, num_pairs + tokens,
                            col_block, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        else:
            expert, first, end = _persistent_tile(tile - shared_tiles, starts, ends, tiles_end, map_ptr, map_tiles,
                                                  BLOCK_M, BLOCK_E, TILE_MAP)
            expert = _slot_of(expert, slots_ptr, HAS_SLOTS)
            if HALF_TAIL and end - first <= BLOCK_M // 2:
                _down_routed_tile(expert, first, end, col_block, h_ptr, h_half_desc, w_ptr, w_se, w_sn, w_desc,
                                  order_ptr, topk_w_ptr, y_ptr, hidden, inter, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K,
                                  PRECISION, TMA)
            else:
                _down_routed_tile(expert, first, end, col_block, h_ptr, h_desc, w_ptr, w_se, w_sn, w_desc, order_ptr,
                                  topk_w_ptr, y_ptr, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)


@device_function
def _down_routed_tile(
    expert, first, end, col_block, h_ptr, h_desc, w_ptr, w_se, w_sn, w_desc, order_ptr, topk_w_ptr, y_ptr, hidden,
    inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """The persistent down GEMM's routed tile of ``expert``'s sorted pairs ``[first, min(first +
    BLOCK_M, end))``: through the descriptors (``h_desc``'s block ``BLOCK_M`` rows) or pointers."""
    if TMA:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
        weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        _down_block_tma(h_desc, first, w_desc, expert * hidden + col_block * BLOCK_N, row_ok, weight, y_ptr,
                        pair, col_block, hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:
        _down_rows(expert, first, end, col_block, h_ptr, w_ptr, w_se, w_sn, order_ptr, topk_w_ptr, y_ptr,
                   hidden, inter, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)


@triton.jit
def _sum_choices_kernel(y_ptr, out_ptr, num_tokens, hidden, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    ok = (t < num_tokens) & (cols < hidden)
    acc = tl.zeros([BLOCK_T, BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, cast(acc, out_ptr.dtype.element_ty), mask=ok)


def sum_choices(y: torch.Tensor, out: torch.Tensor, top_k: int) -> None:
    """``out[t] = Σ_j y[t·top_k + j]`` (``y [T·k, H]`` the pairs' weighted outputs in pair order),
    in float32 (deterministic, no atomics)."""
    num_tokens, hidden = out.shape
    block = min(pow2(hidden), 1024)
    block_t = rows_per_program(num_tokens, block)
    _sum_choices_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block))](
        y, out, num_tokens, hidden, TOP_K=top_k, BLOCK_T=block_t, BLOCK=block
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _tma_rows(t: torch.Tensor, row_len: int) -> bool:
    """Whether rows of ``row_len`` elements of ``t``'s dtype meet TMA's 16-byte stride alignment
    (the weights and ``h`` are contiguous, from aligned allocations)."""
    return (row_len * t.element_size()) % 16 == 0


def _persistent_programs(config: GemmConfig, work: int, device: torch.device) -> int:
    """Programs of a persistent launch: ``config.persistent`` per SM, at most one per work item
    (``work``: the row-tile upper bound times the column blocks)."""
    return max(1, min(work, config.persistent * _num_sms(device)))


def _row_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the grouped GEMM's row tiles: every expert may end in a partial tile."""
    return triton.cdiv(num_pairs, block_m) + num_experts


def _map_args(config: GemmConfig, offsets: torch.Tensor, num_pairs: int) -> tuple[torch.Tensor, int]:
    """A persistent launch's ``(map_ptr, map_tiles)``: ``tile_map``'s with ``config.tile_map``, else
    an unread stand-in."""
    return tile_map(offsets, num_pairs, config.block_m) if config.tile_map else (offsets, 0)


@dataclass(frozen=True)
class SharedTiles:
    """The shared expert run as the first row tiles of the grouped GEMMs (``fused_experts_shared_pairs``):
    its ``gate_up [2I, H]`` and ``down [H, I]`` (the routed experts' ``I``), and its gate logits ``[T, 1]``.
    Its ``h`` and ``y`` rows follow the pairs' rows."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_logit: torch.Tensor

    def tiles(self, num_tokens: int, block_m: int) -> int:
        return triton.cdiv(num_tokens, block_m)


def gate_up(
    x: torch.Tensor, w13: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor, top_k: int,
    config: GemmConfig, shared: SharedTiles | None = None, expert_slots: torch.Tensor | None = None,
) -> None:
    """``h[sorted pair] = silu(x w_gateᵀ) · (x w_upᵀ)`` of the pair's expert (the tuner launches it
    too); with ``shared``, ``h[pairs + t]`` the shared expert's of token ``t``; with ``expert_slots``
    (``fused_experts``), expert ``e``'s weights are ``w13[expert_slots[e]]``."""
    _, two_inter, hidden = w13.shape
    num_experts = expert_slots.shape[0] if expert_slots is not None else w13.shape[0]
    inter = two_inter // 2
    slots = expert_slots if expert_slots is not None else offsets
    num_pairs = order.shape[0]
    tiles = _row_tiles(num_pairs, num_experts, config.block_m)
    shared_tiles = shared.tiles(x.shape[0], config.block_m) if shared is not None else 0
    ws = shared.gate_up if shared is not None else w13
    work = (tiles + shared_tiles) * triton.cdiv(inter, config.block_n)
    if config.persistent:
        tma = config.tma and _tma_rows(w13, hidden)
        descs = (
            TensorDescriptor.from_tensor(w13.view(-1, hidden), [config.block_n, config.block_k]),
            TensorDescriptor.from_tensor(ws.reshape(-1, hidden), [config.block_n, config.block_k]),
        ) if tma else (None, None)
        _gate_up_persistent_kernel[(_persistent_programs(config, work, x.device),)](
            x, x.stride(0), w13, w13.stride(0), w13.stride(1), order, offsets, slots, h,
            hidden, inter, num_experts,
            ws, ws.stride(-2), x.shape[0], num_pairs, shared_tiles, *descs, *_map_args(config, offsets, num_pairs),
            TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, BLOCK_E=pow2(num_experts), EVEN_K=hidden % config.block_k == 0,
            PRECISION=dot_precision(x.dtype), SHARED=shared is not None, TMA=tma, HALF_TAIL=config.half_tail,
            TILE_MAP=config.tile_map, HAS_SLOTS=expert_slots is not None,
            num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.max_registers or None,
        )
        return
    _gate_up_kernel[(work,)](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), order, offsets, slots, h,
        hidden, inter, num_experts, tiles,
        ws, ws.stride(-2), x.shape[0], num_pairs, shared_tiles,
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, BLOCK_E=pow2(num_experts), EVEN_K=hidden % config.block_k == 0,
        PRECISION=dot_precision(x.dtype), SHARED=shared is not None, HAS_SLOTS=expert_slots is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def down(
    h: torch.Tensor, w2: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, topk_weights: torch.Tensor,
    y: torch.Tensor, config: GemmConfig, shared: SharedTiles | None = None, expert_slots: torch.Tensor | None = None,
) -> None:
    """``y[pair] = weight · (h w_downᵀ)`` of the pair's expert, in pair order (the tuner launches it
    too); with ``shared``, ``y[pairs + t] = sigmoid(gate_t) · (h[pairs + t] w_sharedᵀ)``; with
    ``expert_slots``, expert ``e``'s weights are ``w2[expert_slots[e]]``."""
    _, hidden, inter = w2.shape
    num_experts = expert_slots.shape[0] if expert_slots is not None else w2.shape[0]
    slots = expert_slots if expert_slots is not None else offsets
    num_pairs = order.shape[0]
    tiles = _row_tiles(num_pairs, num_experts, config.block_m)
    num_tokens = h.shape[0] - num_pairs
    shared_tiles = shared.tiles(num_tokens, config.block_m) if shared is not None else 0
    ws = shared.down if shared is not None else w2
    gate = shared.gate_logit if shared is not None else topk_weights
    work = (tiles + shared_tiles) * triton.cdiv(hidden, config.block_n)
    if config.persistent:
        tma = config.tma and _tma_rows(h, inter)
        descs = (
            TensorDescriptor.from_tensor(h, [config.block_m, config.block_k]),
            TensorDescriptor.from_tensor(w2.view(-1, inter), [config.block_n, config.block_k]),
            TensorDescriptor.from_tensor(ws.reshape(-1, inter), [config.block_n, config.block_k]),
            TensorDescriptor.from_tensor(h, [config.block_m // 2, config.block_k]) if config.half_tail else None,
        ) if tma else (None, None, None, None)
        _down_persistent_kernel[(_persistent_programs(config, work, h.device),)](
            h, w2, w2.stride(0), w2.stride(1), order, offsets, slots, topk_weights, y,
            hidden, inter, num_experts,
            ws, ws.stride(-2), gate, gate.stride(0), num_tokens, num_pairs, shared_tiles, *descs,
            *_map_args(config, offsets, num_pairs),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, BLOCK_E=pow2(num_experts), EVEN_K=inter % config.block_k == 0,
            PRECISION=dot_precision(h.dtype), SHARED=shared is not None, TMA=tma, HALF_TAIL=config.half_tail,
            TILE_MAP=config.tile_map, HAS_SLOTS=expert_slots is not None,
            num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.max_registers or None,
        )
        return
    _down_kernel[(work,)](
        h, w2, w2.stride(0), w2.stride(1), order, offsets, slots, topk_weights, y,
        hidden, inter, num_experts, tiles,
        ws, ws.stride(-2), gate, gate.stride(0), num_tokens, num_pairs, shared_tiles,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, BLOCK_E=pow2(num_experts), EVEN_K=inter % config.block_k == 0,
        PRECISION=dot_precision(h.dtype), SHARED=shared is not None, HAS_SLOTS=expert_slots is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _check_experts(name: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, num_pairs: int) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_inter // 2) or num_pairs % max(x.shape[0], 1):
        raise ValueError(
            f"{name}: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, {num_pairs} pairs disagree"
        )


def _pair_outputs(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor,
    offsets: torch.Tensor, shared: SharedTiles | None = None, expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [T·k, H]``: each pair's weighted expert output, in pair order (gate/up, then down); with
    ``shared``, ``y [T·k + T, H]``: then each token's gated shared expert output. ``expert_slots``:
    as ``fused_experts``'; the tiles are those of its ``E`` experts."""
    num_tokens, hidden = x.shape
    two_inter = w13.shape[1]
    num_experts = offsets.shape[0] - 1
    inter = two_inter // 2
    top_k = topk_weights.shape[1]
    num_pairs = num_tokens * top_k
    rows = num_pairs + (num_tokens if shared is not None else 0)
    h = new_empty((rows, inter), x.dtype, x.device)
    config = moe_gemm_config("gate_up", x.dtype, num_pairs, num_experts, hidden, inter)
    gate_up(x, w13, order, offsets, h, top_k, config, shared, expert_slots)
    y = new_empty((rows, hidden), x.dtype, x.device)
    config = moe_gemm_config("down", x.dtype, num_pairs, num_experts, hidden, inter)
    down(h, w2, order, offsets, topk_weights, y, config, shared, expert_slots)
    return y


def _routed_inputs(
    name: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checked, unit-stride inputs of the grouped path and the pairs sorted by expert (of
    ``num_experts``, default ``w13``'s): ``(x, w13, w2, topk_weights, order, offsets)``."""
    _check_experts(name, x, w13, w2, topk_ids.numel())
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{name}: weights {tuple(topk_weights.shape)}, ids {tuple(topk_ids.shape)} disagree")
    x = x if x.stride(-1) == 1 else x.contiguous()
    order, offsets = moe_sort_tokens(topk_ids, w13.shape[0] if num_experts is None else num_experts)
    return x, w13.contiguous(), w2.contiguous(), topk_weights.contiguous(), order, offsets


def checked_slots(name: str, expert_slots: torch.Tensor | None) -> torch.Tensor | None:
    """``expert_slots`` (an expert's row of the weight tensors: ``fused_experts``) checked to be a
    1-D int32 tensor, unit-stride for the kernels; None stays None."""
    if expert_slots is None:
        return None
    if expert_slots.dim() != 1 or expert_slots.dtype != torch.int32:
        raise ValueError(f"{name}: expert_slots must be a 1-D int32 tensor, got {expert_slots.dtype} "
                         f"{tuple(expert_slots.shape)}")
    return expert_slots.contiguous()


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_experts("fused_experts", x, w13, w2, topk_ids.numel())
    out = new_empty(x.shape, x.dtype, x.device)
    if x.shape[0] == 0:
        return out
    expert_slots = checked_slots("fused_experts", expert_slots)
    num_experts = None if expert_slots is None else expert_slots.shape[0]
    inputs = _routed_inputs("fused_experts", x, w13, w2, topk_weights, topk_ids, num_experts)
    y = _pair_outputs(*inputs, expert_slots=expert_slots)
    sum_choices(y, out, topk_ids.shape[1])
    return out


def fused_experts_pairs(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        _check_experts("fused_experts_pairs", x, w13, w2, 0)
        return new_empty((0, top_k, x.shape[1]), x.dtype, x.device)
    y = _pair_outputs(*_routed_inputs("fused_experts_pairs", x, w13, w2, topk_weights, topk_ids))
    return y.view(num_tokens, top_k, x.shape[1])


def fused_experts_shared_pairs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    shared_gate_logit: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, top_k = topk_ids.shape
    two_inter, hidden = w13.shape[1:]
    if shared_gate_up.shape != (two_inter, hidden) or shared_down.shape != (hidden, two_inter // 2) \
            or shared_gate_logit.shape != (num_tokens, 1):
        raise ValueError(
            f"fused_experts_shared_pairs: shared_gate_up {tuple(shared_gate_up.shape)}, shared_down "
            f"{tuple(shared_down.shape)}, shared_gate_logit {tuple(shared_gate_logit.shape)} do not match the routed "
            f"experts' w13 {tuple(w13.shape)} and {num_tokens} tokens"
        )
    if num_tokens == 0:
        _check_experts("fused_experts_shared_pairs", x, w13, w2, 0)
        return new_empty((0, top_k, hidden), x.dtype, x.device), new_empty((0, hidden), x.dtype, x.device)
    shared = SharedTiles(shared_gate_up.contiguous(), shared_down.contiguous(), shared_gate_logit)
    inputs = _routed_inputs("fused_experts_shared_pairs", x, w13, w2, topk_weights, topk_ids)
    y = _pair_outputs(*inputs, shared=shared)
    num_pairs = num_tokens * top_k
    return y[:num_pairs].view(num_tokens, top_k, hidden), y[num_pairs:]


# Programmatic dependent launch for ``_combine_add_norm_kernel`` (sm_90 on), as the RMSNorm launch it
# replaces had.
COMBINE_PDL = True


@triton.jit
def _combine_add_norm_kernel(
    pairs_ptr, p_st, p_sk, shared_ptr, s_st, gate_ptr, g_st, res_ptr, r_st, rows_ptr, w_ptr,
    out_ptr, sum_ptr, num_rows, dim, eps,
    TOP_K: tl.constexpr, HAS_GATE: tl.constexpr, HAS_ROWS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Rows of the MoE output, summed from its parts, added to the residual and normalized; rounded
    where ``sum_choices``, ``shared_expert_combine`` and ``add_rms_norm`` round. ``PDL`` as the
    RMSNorm it replaces: every input is an earlier launch's output, so wait before any load."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    if HAS_ROWS:
        src = tl.load(rows_ptr + r, mask=r_ok, other=0).to(tl.int64)[:, None]
    else:
        src = r.to(tl.int64)[:, None]
    r2 = r[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = r_ok[:, None] & (cols < dim)
    dtype = sum_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + src * p_st + j * p_sk + cols, mask=mask, other=0.0).to(tl.float32)
    shared = tl.load(shared_ptr + src * s_st + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        logit = tl.load(gate_ptr + src * g_st, mask=r_ok[:, None], other=0.0).to(tl.float32)
        shared = round_as(round_as(tl.sigmoid(logit), dtype) * shared, dtype)
    moe = round_as(round_as(acc, dtype) + shared, dtype)
    xf = round_as(moe + tl.load(res_ptr + src * r_st + cols, mask=mask, other=0.0).to(tl.float32), dtype)
    tl.store(sum_ptr + r2 * dim + cols, cast(xf, dtype), mask=mask)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / dim + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    if ZERO_CENTERED:
        y = normed * (1.0 + w)
    else:
        y = round_as(w * round_as(normed, dtype), out_dtype)
    tl.store(out_ptr + r2 * dim + cols, cast(y, out_dtype), mask=mask)


def moe_combine_add_rms_norm(
    pairs: torch.Tensor,
    shared: torch.Tensor,
    shared_gate_logit: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for what ``sum_choices``, ``shared_expert_combine`` and the next norm's
    ``add_rms_norm`` did in three (each a pass over the rows)."""
    num_tokens, top_k, dim = pairs.shape
    if shared.shape != (num_tokens, dim) or residual.shape != (num_tokens, dim) or weight.shape != (dim,) \
            or (shared_gate_logit is not None and shared_gate_logit.shape != (num_tokens, 1)):
        raise ValueError(
            f"moe_combine_add_rms_norm: pairs {tuple(pairs.shape)}, shared {tuple(shared.shape)}, residual "
            f"{tuple(residual.shape)}, weight {tuple(weight.shape)}, gate "
            f"{None if shared_gate_logit is None else tuple(shared_gate_logit.shape)} disagree"
        )
    pairs = pairs if pairs.stride(-1) == 1 else pairs.contiguous()
    shared = shared if shared.stride(-1) == 1 else shared.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    num_rows = num_tokens if rows is None else rows.shape[0]
    out_dtype = pairs.dtype if zero_centered else torch.promote_types(pairs.dtype, weight.dtype)
    out = new_empty((num_rows, dim), out_dtype, pairs.device)
    summed = new_empty((num_rows, dim), pairs.dtype, pairs.device)
    if num_rows:
        block_d = pow2(dim)
        block_r = rows_per_program(num_rows, block_d)
        gate = shared_gate_logit if shared_gate_logit is not None else shared
        _combine_add_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            pairs, pairs.stride(0), pairs.stride(1), shared, shared.stride(0), gate, gate.stride(0),
            residual, residual.stride(0), rows if rows is not None else out, weight.contiguous(),
            out, summed, num_rows, dim, eps,
            TOP_K=top_k, HAS_GATE=shared_gate_logit is not None, HAS_ROWS=rows is not None,
            ZERO_CENTERED=zero_centered, BLOCK_R=block_r, BLOCK_D=block_d, PDL=COMBINE_PDL and _pdl_available(),
            num_warps=4 if block_r * block_d <= 1024 else 8, launch_pdl=COMBINE_PDL and _pdl_available(),
        )
    return out, summed


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_st, out_ptr, num_rows, inter, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    ok = (t < num_rows) & (cols < inter)
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * x_st + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * x_st + inter + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, cast(round_as(gate * tl.sigmoid(gate), dtype) * up, dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = new_empty((*x.shape[:-1], inter), x.dtype, x.device)
    num_rows = rows.shape[0]
    if num_rows:
        block = min(pow2(inter), 1024)
        block_t = rows_per_program(num_rows, block)
        _silu_and_mul_kernel[(triton.cdiv(num_rows, block_t), triton.cdiv(inter, block))](
            rows, rows.stride(0), out, num_rows, inter, BLOCK_T=block_t, BLOCK=block
        )
    return out


@triton.jit
def _shared_combine_kernel(routed_ptr, shared_ptr, gate_ptr, g_st, out_ptr, num_tokens, hidden,
                           BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    t_ok = t < num_tokens
    ok = t_ok & (cols < hidden)
    dtype = out_ptr.dtype.element_ty
    gate = round_as(tl.sigmoid(tl.load(gate_ptr + t * g_st, mask=t_ok, other=0.0).to(tl.float32)), dtype)
    shared = tl.load(shared_ptr + t * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    routed = tl.load(routed_ptr + t * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, cast(routed + round_as(gate * shared, dtype), dtype), mask=ok)


def shared_expert_combine(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    num_tokens, hidden = routed.shape
    if shared.shape != routed.shape or gate_logit.shape != (num_tokens, 1):
        raise ValueError(
            f"shared_expert_combine: routed {tuple(routed.shape)}, shared {tuple(shared.shape)}, "
            f"gate_logit {tuple(gate_logit.shape)} disagree"
        )
    routed, shared = routed.contiguous(), shared.contiguous()
    out = new_empty((num_tokens, hidden), routed.dtype, routed.device)
    if num_tokens:
        block = min(pow2(hidden), 1024)
        block_t = rows_per_program(num_tokens, block)
        _shared_combine_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block))](
            routed, shared, gate_logit, gate_logit.stride(0), out, num_tokens, hidden, BLOCK_T=block_t, BLOCK=block
        )
    return out
