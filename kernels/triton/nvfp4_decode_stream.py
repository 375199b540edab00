"""The NVFP4 MoE decode block's gate/up and down passes as streams: a fixed number of programs per
token, each looping over row tiles and loading the next tile's packed rows while it decodes the
current one (``NVFP4DecodeTiles.gate_up_per_sm`` / ``down_per_sm`` pick them; ``nvfp4_decode.py``
launches them).

Why: at one token a layer's block reads ~16 MB, ~120 KB an SM, and the one-program-per-tile
kernels (``nvfp4_decode._gate_up_kernel``: 576 programs at one token, two resident an SM) run it
as ~2.2 waves of "load every byte, then decode": each wave waits a full DRAM latency with nothing
to decode and then decodes with nothing in flight, and the last wave leaves most SMs idle. Here
the grid is sized to the GPU (programs an SM x SMs, split over the tokens), so there is one wave,
and each program's loads of tile i + 1 are issued before tile i's decode (``PREFETCH``), so that
DRAM and the decode overlap within every program. A program handles one token: its activations
(``x`` for gate/up, the token's ``h`` rows for down) are loaded and widened once, not per tile.

``FUSE_ROUTE``: the programs compute the token's top-k themselves (``moe_decode._top_k_of``, the
routing launch's own selection) instead of reading the routing launch's output, so the block is
two launches. The down programs read the logits from L2 (``.cg``) before waiting for the gate/up
launch: they were written two launches back, before the gate/up programs' wait returned, which
precedes this launch (as ``moe_decode._down_kernel`` reads the routing).

Tiles: gate/up tile ``i`` of a token is pair ``j = i // NB`` (choice ``j``, the shared expert at
``j = TOP_K``), intermediate columns ``(i % NB) · BLOCK_N`` on, the whole hidden dim in one load;
down tile ``i`` is hidden columns ``i · BLOCK_N`` on, all choices and the shared expert, the whole
intermediate dim in one load. Numerics are those of ``nvfp4_decode``'s kernels (``_row_dots``, the
same rounding), so every variant gives the reference's result.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, device_function, round_as
from freetoken.kernels.triton.moe_decode import _top_k_of
from freetoken.kernels.triton.nvfp4_rows import _row_dots


@device_function
def _choices(logits_ptr, l_st, topw_ptr, topi_ptr, t, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
             BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, FUSE_ROUTE: tl.constexpr):
    """Token ``t``'s routing weights (float32) and expert ids (int32), ``[BLOCK_C]`` with choice ``c``
    in lane ``c``: computed from its logits (``FUSE_ROUTE``) or read from the routing launch's output,
    both from L2 (``.cg``: L1 may hold an earlier layer's at the same address)."""
    c = tl.arange(0, BLOCK_C)
    c_ok = c < TOP_K
    if FUSE_ROUTE:
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + t * l_st + e, mask=e < num_experts, other=0.0, cache_modifier=".cg")
        weights_e, experts_e = _top_k_of(logits, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
        pick = e[None, :] == c[:, None]
        weights = tl.sum(tl.where(pick, weights_e[None, :], 0.0), 1)
        experts = tl.sum(tl.where(pick, experts_e[None, :], 0), 1)
    else:
        weights = tl.load(topw_ptr + t * TOP_K + c, mask=c_ok, other=0.0, cache_modifier=".cg")
        experts = tl.load(topi_ptr + t * TOP_K + c, mask=c_ok, other=0, cache_modifier=".cg")
    return weights, experts


@device_function
def _gate_up_tile(w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, experts, tile, num_tiles, nb,
                  hidden, inter, shared_inter, TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Tile ``tile``'s packed gate and up rows ``[1, BLOCK_N, BLOCK_K / 2]``, their scale bytes
    ``[1, BLOCK_N, BLOCK_K / 16]`` and row scales ``[1, BLOCK_N]`` (all zeros past ``num_tiles``)."""
    j = tile // nb
    routed = j < TOP_K
    expert = tl.sum(tl.where(tl.arange(0, BLOCK_C) == j, experts, 0), 0).to(tl.int64)
    limit = tl.where(routed, inter, shared_inter)
    first = tl.where(routed, expert * 2 * inter, 0)  # the pair's first row
    n = (tile % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < tl.where(tile < num_tiles, limit, 0)  # (one compare: the interpreter's bool & bool scalar gives int32)
    gate_n = n[None, :].to(tl.int64) + first
    up_n = gate_n + limit
    half = tl.arange(0, BLOCK_K // 2)
    group = tl.arange(0, BLOCK_K // 16)
    half_ok = n_ok[None, :, None] & (half < hidden // 2)[None, None, :]
    group_ok = n_ok[None, :, None] & (group < hidden // 16)[None, None, :]
    packed = tl.where(routed, w13_ptr, sw_ptr)
    scales = tl.where(routed, w13_s_ptr, sw_s_ptr)
    row_scales = tl.where(routed, w13_r_ptr, sw_r_ptr)
    gate_w = tl.load(packed + gate_n[:, :, None] * (hidden // 2) + half[None, None, :], mask=half_ok, other=0)
    up_w = tl.load(packed + up_n[:, :, None] * (hidden // 2) + half[None, None, :], mask=half_ok, other=0)
    gate_s = tl.load(scales + gate_n[:, :, None] * (hidden // 16) + group[None, None, :], mask=group_ok, other=0)
    up_s = tl.load(scales + up_n[:, :, None] * (hidden // 16) + group[None, None, :], mask=group_ok, other=0)
    gate_r = tl.load(row_scales + gate_n, mask=n_ok[None, :], other=0.0)
    up_r = tl.load(row_scales + up_n, mask=n_ok[None, :], other=0.0)
    return gate_w, up_w, gate_s, up_s, gate_r, up_r


@triton.jit
def _gate_up_stream_kernel(
    x_ptr, x_st, w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, topw_ptr, topi_ptr, logits_ptr, l_st,
    h_ptr, h_width, hidden, inter, shared_inter, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSE_ROUTE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the routing (or the router logits) is the previous launch's output; the down programs may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    _, experts = _choices(logits_ptr, l_st, topw_ptr, topi_ptr, t, num_experts, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_C,
                          FUSE_ROUTE)
    nb = tl.cdiv(h_width, BLOCK_N)
    num_tiles = (TOP_K + 1) * nb
    k = tl.arange(0, BLOCK_K)
    xv = tl.load(x_ptr + t * x_st + k[None, :], mask=(k < hidden)[None, :], other=0.0).to(tl.float32)[:, None, :]
    dtype = h_ptr.dtype.element_ty
    step = tl.num_programs(1)
    first = tl.program_id(1)
    gate_w, up_w, gate_s, up_s, gate_r, up_r = _gate_up_tile(
        w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, experts, first, num_tiles, nb,
        hidden, inter, shared_inter, TOP_K, BLOCK_C, BLOCK_N, BLOCK_K)
    for tile in range(first, num_tiles, step):
        if PREFETCH:  # the next tile's loads in flight during this tile's decode
            next_tile = _gate_up_tile(
                w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, experts, tile + step, num_tiles, nb,
                hidden, inter, shared_inter, TOP_K, BLOCK_C, BLOCK_N, BLOCK_K)
        j = tile // nb
        n = (tile % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < tl.where(j < TOP_K, inter, shared_inter)
        gate = round_as(_row_dots(gate_w, gate_s, xv, BLOCK_N, BLOCK_K) * gate_r, dtype)
        up = round_as(_row_dots(up_w, up_s, xv, BLOCK_N, BLOCK_K) * up_r, dtype)
        h = round_as(gate * tl.sigmoid(gate), dtype) * up
        q = t.to(tl.int64) * (TOP_K + 1) + j
        tl.store(h_ptr + q * h_width + n[None, :], cast(h, dtype), mask=n_ok[None, :])
        if PREFETCH:
            gate_w, up_w, gate_s, up_s, gate_r, up_r = next_tile
        else:
            gate_w, up_w, gate_s, up_s, gate_r, up_r = _gate_up_tile(
                w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, experts, tile + step, num_tiles, nb,
                hidden, inter, shared_inter, TOP_K, BLOCK_C, BLOCK_N, BLOCK_K)


@device_function
def _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, experts, tile, num_tiles, hidden, inter,
               shared_inter, TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile ``tile``'s packed down rows of every choice ``[BLOCK_C, BLOCK_N, BLOCK_K / 2]`` and of the
    shared expert ``[1, BLOCK_N, BLOCK_K / 2]``, their scale bytes and row scales (zeros past
    ``num_tiles``)."""
    c = tl.arange(0, BLOCK_C)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < tl.where(tile < num_tiles, hidden, 0)
    rows = experts.to(tl.int64)[:, None] * hidden + n[None, :]  # rows of the flattened [E · H, I] weight
    rows_ok = (c < TOP_K)[:, None] & n_ok[None, :]
    half = tl.arange(0, BLOCK_K // 2)
    group = tl.arange(0, BLOCK_K // 16)
    w = tl.load(w2_ptr + rows[:, :, None] * (inter // 2) + half[None, None, :],
                mask=rows_ok[:, :, None] & (half < inter // 2)[None, None, :], other=0)
    s = tl.load(w2_s_ptr + rows[:, :, None] * (inter // 16) + group[None, None, :],
                mask=rows_ok[:, :, None] & (group < inter // 16)[None, None, :], other=0)
    r = tl.load(w2_r_ptr + rows, mask=rows_ok, other=0.0)
    shared_rows = n[None, :].to(tl.int64)
    ws = tl.load(sd_ptr + shared_rows[:, :, None] * (shared_inter // 2) + half[None, None, :],
                 mask=n_ok[None, :, None] & (half < shared_inter // 2)[None, None, :], other=0)
    ss = tl.load(sd_s_ptr + shared_rows[:, :, None] * (shared_inter // 16) + group[None, None, :],
                 mask=n_ok[None, :, None] & (group < shared_inter // 16)[None, None, :], other=0)
    rs = tl.load(sd_r_ptr + shared_rows, mask=n_ok[None, :], other=0.0)
    return w, s, r, ws, ss, rs


@triton.jit
def _down_stream_kernel(
    h_ptr, h_width, w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, topw_ptr, topi_ptr,
    logits_ptr, l_st, out_ptr, hidden, inter, shared_inter, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSE_ROUTE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    # Under PDL this starts while the gate/up launch runs: the routing and the first tile's weights
    # are loaded before the wait, ``h`` (the gate/up output) after it.
    t = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    weight, experts = _choices(logits_ptr, l_st, topw_ptr, topi_ptr, t, num_experts, TOP_K, RENORMALIZE, BLOCK_E,
                               BLOCK_C, FUSE_ROUTE)
    weight = cast(weight, dtype).to(tl.float32)  # as the reference holds them: rounded to the activations' dtype
    num_tiles = tl.cdiv(hidden, BLOCK_N)
    step = tl.num_programs(1)
    first = tl.program_id(1)
    w, s, r, ws, ss, rs = _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, experts, first, num_tiles,
                                     hidden, inter, shared_inter, TOP_K, BLOCK_C, BLOCK_N, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    c = tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + c) * h_width
    hv = tl.load(h_rows[:, None] + k[None, :], mask=(c < TOP_K)[:, None] & (k < inter)[None, :], other=0.0)
    hv = hv.to(tl.float32)[:, None, :]
    h_shared = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + TOP_K) * h_width
    hs = tl.load(h_shared + k[None, :], mask=(k < shared_inter)[None, :], other=0.0).to(tl.float32)[:, None, :]
    gate = round_as(tl.sigmoid(tl.load(logits_ptr + t * l_st + num_experts).to(tl.float32)), dtype)
    for tile in range(first, num_tiles, step):
        if PREFETCH:
            next_tile = _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, experts, tile + step,
                                   num_tiles, hidden, inter, shared_inter, TOP_K, BLOCK_C, BLOCK_N, BLOCK_K)
        acc = _row_dots(w, s, hv, BLOCK_N, BLOCK_K) * r
        shared = tl.sum(_row_dots(ws, ss, hs, BLOCK_N, BLOCK_K) * rs, 0)
        scaled = round_as(round_as(acc, dtype) * weight[:, None], dtype)
        # One float32 sum over the choices in a fixed (tree) order, as moe_decode's.
        out = round_as(tl.sum(scaled, 0), dtype) + round_as(gate * round_as(shared, dtype), dtype)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + t * hidden + n, cast(out, dtype), mask=n < hidden)
        if PREFETCH:
            w, s, r, ws, ss, rs = next_tile
        else:
            w, s, r, ws, ss, rs = _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, experts,
                                             tile + step, num_tiles, hidden, inter, shared_inter, TOP_K, BLOCK_C,
                                             BLOCK_N, BLOCK_K)
