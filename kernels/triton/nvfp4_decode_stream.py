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

``SHARED_FIRST``: a token's gate/up tiles start with the shared expert's, and the programs whose
first tile is one of them issue its loads before the wait for the previous launch and before the
routing (the shared expert's weights depend on neither), so that ~1 MB a layer is in flight while
the routing is read.

Tiles: gate/up tile ``i`` of a token is pair ``j = i // NB`` (choice ``j``, the shared expert at
``j = TOP_K``; ``SHARED_FIRST``: ``j = (i // NB + TOP_K) % (TOP_K + 1)``), intermediate columns ``(i % NB) · BLOCK_N`` on, the whole hidden dim in one load;
down tile ``i`` is hidden columns ``i · BLOCK_N`` on, all choices and the shared expert, the whole
intermediate dim in one load. The packed codes are loaded and carried as int32 words and reduced by
``nvfp4_rows._word_dots`` (``_row_dots`` a word at a time: a byte tensor carried across the loop
would sit one byte a register and be repacked before every decode); the rounding is that of
``nvfp4_decode``'s kernels, so every variant gives the reference's result.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, device_function, round_as
from freetoken.kernels.triton.nvfp4_rows import _word_dots


@device_function
def _choices(topw_ptr, topi_ptr, map_ptr, fill_ptr, t, TOP_K: tl.constexpr, BLOCK_C: tl.constexpr,
             OFFLOAD: tl.constexpr, FILL: tl.constexpr):
    """Token ``t``'s routing weights (float32), expert ids, slots and fill slots (int32), ``[BLOCK_C]``
    with choice ``c`` in lane ``c``: the routing launch's output, read from L2 (``.cg``: L1 may hold
    an earlier layer's at the same address).

    Resident experts: the slot is the expert id (its index in the layer's weights). ``OFFLOAD``: the
    routing launch wrote ``e`` for a hit and ``-1 - e`` for a miss (``moe_decode_offload``); a hit's
    slot comes from the layer's slot map, a miss has slot -1 (read from host memory). ``FILL``: the
    slot a miss claimed for the read-through fill, else -1."""
    c = tl.arange(0, BLOCK_C)
    c_ok = c < TOP_K
    weights = tl.load(topw_ptr + t * TOP_K + c, mask=c_ok, other=0.0, cache_modifier=".cg")
    codes = tl.load(topi_ptr + t * TOP_K + c, mask=c_ok, other=0, cache_modifier=".cg")
    fills = tl.full([BLOCK_C], -1, tl.int32)
    if OFFLOAD:
        experts = tl.where(codes >= 0, codes, -1 - codes)
        slots = tl.load(map_ptr + experts, mask=c_ok & (codes >= 0), other=-1, cache_modifier=".cg")
        if FILL:
            fills = tl.load(fill_ptr + t * TOP_K + c, mask=c_ok, other=-1, cache_modifier=".cg")
    else:
        experts = codes
        slots = codes
    return weights, experts, slots, fills


@device_function
def _expert_base(ptr, host_ptr, slot, expert, stride, OFFLOAD: tl.constexpr):
    """Where a routed expert's part starts: in its slot (resident experts: the slot is the expert),
    or (``OFFLOAD``, slot -1: a miss) in host memory; both sides have the part's expert ``stride``."""
    if OFFLOAD:
        return tl.where(slot >= 0, ptr + slot.to(tl.int64) * stride, host_ptr + expert.to(tl.int64) * stride)
    else:
        return ptr + slot.to(tl.int64) * stride


@device_function
def _word_columns(rows_ptr, word, ok):
    """Activations ``rows_ptr[..., 8 · word + m]`` as float32, one tensor for each column ``m`` of
    ``nvfp4_rows.WORD_COLUMNS`` (0, 2, 4, 6, 1, 3, 5, 7), the operands of ``_word_dots``."""
    base = rows_ptr + 8 * word
    return (tl.load(base, mask=ok, other=0.0).to(tl.float32), tl.load(base + 2, mask=ok, other=0.0).to(tl.float32),
            tl.load(base + 4, mask=ok, other=0.0).to(tl.float32), tl.load(base + 6, mask=ok, other=0.0).to(tl.float32),
            tl.load(base + 1, mask=ok, other=0.0).to(tl.float32), tl.load(base + 3, mask=ok, other=0.0).to(tl.float32),
            tl.load(base + 5, mask=ok, other=0.0).to(tl.float32), tl.load(base + 7, mask=ok, other=0.0).to(tl.float32))


@device_function
def _pair(tile, TOP_K: tl.constexpr, NB: tl.constexpr, SHARED_FIRST: tl.constexpr):
    """The pair of gate/up tile ``tile``: choice ``j`` or the shared expert at ``j = TOP_K``, in that
    order, or (``SHARED_FIRST``) the shared expert's ``NB`` tiles first, then the choices'."""
    if SHARED_FIRST:
        return (tile // NB + TOP_K) % (TOP_K + 1)
    else:
        return tile // NB


@device_function
def _select(lanes, j, TOP_K: tl.constexpr, other):
    """Lane ``j`` of an int32 ``[BLOCK_C]`` vector, ``other`` at ``j = TOP_K`` (the shared expert)."""
    picked = tl.sum(tl.where(tl.arange(0, lanes.shape[0]) == j, lanes, 0), 0)
    return tl.where(j < TOP_K, picked, other)


@device_function
def _gate_up_rows(tile, num_tiles, inter, shared_inter, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                  SHARED_FIRST: tl.constexpr):
    """Tile ``tile``'s pair ``j``, its row count ``limit`` (the gate rows of its expert), its first
    row and the rows in range ``[1, BLOCK_N]`` (none past ``num_tiles``)."""
    j = _pair(tile, TOP_K, NB, SHARED_FIRST)
    limit = tl.where(j < TOP_K, inter, shared_inter)
    first_row = (tile % NB) * BLOCK_N
    n_ok = (tl.arange(0, BLOCK_N) < tl.where(tile < num_tiles, limit - first_row, 0))[None, :]
    return j, limit, first_row, n_ok


@device_function
def _gate_up_tile(w13_ptr, w13_s_ptr, w13_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r,
                  sw_ptr, sw_s_ptr, sw_r_ptr, experts, slots, tile, num_tiles, w_row, s_row,
                  w_offs, s_offs, w_k_ok, s_k_ok, inter, shared_inter, TOP_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, NB: tl.constexpr, SHARED_FIRST: tl.constexpr, OFFLOAD: tl.constexpr):
    """Tile ``tile``'s packed gate and up rows as int32 words ``[1, BLOCK_N, BLOCK_K / 8]``, their scale bytes
    ``[1, BLOCK_N, BLOCK_K / 16]`` and row scales ``[1, BLOCK_N]`` (zeros past ``num_tiles``), read
    where ``_expert_base`` says (``es_*``: the parts' expert strides in words, bytes and floats).
    The element offsets within a tile (``w_offs``, ``s_offs``) are the program's, so a tile costs
    one 64-bit add and one mask a vector."""
    j, limit, first_row, n_ok = _gate_up_rows(tile, num_tiles, inter, shared_inter, TOP_K, BLOCK_N, NB, SHARED_FIRST)
    routed = j < TOP_K
    expert, slot = _select(experts, j, TOP_K, 0), _select(slots, j, TOP_K, 0)
    gate_w_ptr = tl.where(routed, _expert_base(w13_ptr, host_w_ptr, slot, expert, es_w, OFFLOAD), sw_ptr) + first_row * w_row
    gate_s_ptr = tl.where(routed, _expert_base(w13_s_ptr, host_s_ptr, slot, expert, es_s, OFFLOAD), sw_s_ptr) + first_row * s_row
    gate_r_ptr = tl.where(routed, _expert_base(w13_r_ptr, host_r_ptr, slot, expert, es_r, OFFLOAD), sw_r_ptr) + first_row
    gate_w = tl.load(gate_w_ptr + w_offs, mask=n_ok[:, :, None] & w_k_ok, other=0)
    up_w = tl.load(gate_w_ptr + limit * w_row + w_offs, mask=n_ok[:, :, None] & w_k_ok, other=0)
    gate_s = tl.load(gate_s_ptr + s_offs, mask=n_ok[:, :, None] & s_k_ok, other=0)
    up_s = tl.load(gate_s_ptr + limit * s_row + s_offs, mask=n_ok[:, :, None] & s_k_ok, other=0)
    n = tl.arange(0, BLOCK_N)[None, :]
    gate_r = tl.load(gate_r_ptr + n, mask=n_ok, other=0.0)
    up_r = tl.load(gate_r_ptr + limit + n, mask=n_ok, other=0.0)
    return gate_w, up_w, gate_s, up_s, gate_r, up_r


@device_function
def _fill_gate_up_tile(w13_ptr, w13_s_ptr, w13_r_ptr, es_w, es_s, es_r, fills, tile, num_tiles, w_row, s_row,
                       w_offs, s_offs, w_k_ok, s_k_ok, inter, shared_inter, gate_w, up_w, gate_s, up_s, gate_r, up_r,
                       TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SHARED_FIRST: tl.constexpr):
    """The read-through fill of a gate/up tile: its rows, as ``_gate_up_tile`` loaded them from host
    memory, stored into the slot its miss claimed (nothing for a hit, the shared expert or a miss
    that claimed none)."""
    fill = _select(fills, _pair(tile, TOP_K, NB, SHARED_FIRST), TOP_K, -1)
    # No rows where the pair claimed no slot: as if past the last tile.
    j, limit, first_row, n_ok = _gate_up_rows(tile, tl.where(fill >= 0, num_tiles, 0), inter, shared_inter, TOP_K,
                                              BLOCK_N, NB, SHARED_FIRST)
    slot = tl.maximum(fill, 0).to(tl.int64)
    w_ptr = w13_ptr + slot * es_w + first_row * w_row
    s_ptr = w13_s_ptr + slot * es_s + first_row * s_row
    r_ptr = w13_r_ptr + slot * es_r + first_row
    tl.store(w_ptr + w_offs, gate_w, mask=n_ok[:, :, None] & w_k_ok)
    tl.store(w_ptr + limit * w_row + w_offs, up_w, mask=n_ok[:, :, None] & w_k_ok)
    tl.store(s_ptr + s_offs, gate_s, mask=n_ok[:, :, None] & s_k_ok)
    tl.store(s_ptr + limit * s_row + s_offs, up_s, mask=n_ok[:, :, None] & s_k_ok)
    n = tl.arange(0, BLOCK_N)[None, :]
    tl.store(r_ptr + n, gate_r, mask=n_ok)
    tl.store(r_ptr + limit + n, up_r, mask=n_ok)


@triton.jit
def _gate_up_stream_kernel(
    x_ptr, x_st, w13_ptr, w13_s_ptr, w13_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r, map_ptr,
    fill_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, topw_ptr, topi_ptr,
    h_ptr, h_width, hidden, w_row, s_row, inter, shared_inter,
    TOP_K: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, NB: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    SHARED_FIRST: tl.constexpr, PDL: tl.constexpr, OFFLOAD: tl.constexpr, FILL: tl.constexpr,
):
    # NB: column blocks a pair (cdiv(h_width, BLOCK_N)), a constant so that a tile's pair is a shift.
    # w_row, s_row: hidden / 8 and hidden / 16, the row strides in int32 words of packed codes and in
    # scale bytes, as arguments so that Triton sees them divisible by 16 where they are (wide loads).
    # es_w, es_s, es_r: the routed experts' strides (words, bytes, floats), in the slots and on the host.
    # SHARED_FIRST: the programs whose first tile is the shared expert's (the first NB) issue its loads
    # before the wait and the routing, which it needs neither of; the others load theirs after.
    t = tl.program_id(0)
    num_tiles = (TOP_K + 1) * NB
    word = tl.arange(0, BLOCK_K // 8)
    group = tl.arange(0, BLOCK_K // 16)
    rows = tl.arange(0, BLOCK_N)[None, :, None]
    w_offs, s_offs = rows * w_row + word[None, None, :], rows * s_row + group[None, None, :]
    w_k_ok, s_k_ok = (word < w_row)[None, None, :], (group < s_row)[None, None, :]
    step = tl.num_programs(1)
    first = tl.program_id(1)
    early = first < 0
    if SHARED_FIRST:
        early = first < NB
    if SHARED_FIRST:  # past num_tiles (every lane masked, zeros) where the first tile is a choice's
        none = tl.zeros([BLOCK_C], tl.int32)
        shared_tile = _gate_up_tile(
            w13_ptr, w13_s_ptr, w13_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r, sw_ptr, sw_s_ptr,
            sw_r_ptr, none, none, tl.where(early, first, num_tiles), num_tiles, w_row, s_row, w_offs, s_offs, w_k_ok,
            s_k_ok, inter, shared_inter, TOP_K, BLOCK_N, NB, SHARED_FIRST, OFFLOAD)
    if PDL:  # the routing is the previous launch's output; the down programs may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _, experts, slots, fills = _choices(topw_ptr, topi_ptr, map_ptr, fill_ptr, t, TOP_K, BLOCK_C, OFFLOAD, FILL)
    x0, x1, x2, x3, x4, x5, x6, x7 = _word_columns(x_ptr + t * x_st + word[None, None, :] * 0, word[None, None, :],
                                                   (word < w_row)[None, None, :])
    dtype = h_ptr.dtype.element_ty
    gate_w, up_w, gate_s, up_s, gate_r, up_r = _gate_up_tile(
        w13_ptr, w13_s_ptr, w13_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r, sw_ptr, sw_s_ptr,
        sw_r_ptr, experts, slots, tl.where(early, num_tiles, first), num_tiles, w_row, s_row, w_offs, s_offs, w_k_ok,
        s_k_ok, inter, shared_inter, TOP_K, BLOCK_N, NB, SHARED_FIRST, OFFLOAD)
    if SHARED_FIRST:  # one of the two loads is all zeros
        gate_w, up_w = gate_w | shared_tile[0], up_w | shared_tile[1]
        gate_s, up_s = gate_s | shared_tile[2], up_s | shared_tile[3]
        gate_r, up_r = gate_r + shared_tile[4], up_r + shared_tile[5]
    for tile in range(first, num_tiles, step):
        if PREFETCH:  # the next tile's loads in flight during this tile's decode
            next_tile = _gate_up_tile(
                w13_ptr, w13_s_ptr, w13_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r, sw_ptr,
                sw_s_ptr, sw_r_ptr, experts, slots, tile + step, num_tiles, w_row, s_row, w_offs, s_offs, w_k_ok,
                s_k_ok, inter, shared_inter, TOP_K, BLOCK_N, NB, SHARED_FIRST, OFFLOAD)
        if FILL:  # this tile's rows, read from host memory for a miss that claimed a slot, into that slot
            _fill_gate_up_tile(w13_ptr, w13_s_ptr, w13_r_ptr, es_w, es_s, es_r, fills, tile, num_tiles, w_row, s_row,
                               w_offs, s_offs, w_k_ok, s_k_ok, inter, shared_inter, gate_w, up_w, gate_s, up_s,
                               gate_r, up_r, TOP_K, BLOCK_N, NB, SHARED_FIRST)
        j = _pair(tile, TOP_K, NB, SHARED_FIRST)
        n = (tile % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < tl.where(j < TOP_K, inter, shared_inter)
        gate = _word_dots(gate_w, gate_s, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, BLOCK_K // 8)
        up = _word_dots(up_w, up_s, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, BLOCK_K // 8)
        gate, up = round_as(gate * gate_r, dtype), round_as(up * up_r, dtype)
        h = round_as(gate * tl.sigmoid(gate), dtype) * up
        q = t.to(tl.int64) * (TOP_K + 1) + j
        tl.store(h_ptr + q * h_width + n[None, :], cast(h, dtype), mask=n_ok[None, :])
        if PREFETCH:
            gate_w, up_w, gate_s, up_s, gate_r, up_r = next_tile
        else:
            gate_w, up_w, gate_s, up_s, gate_r, up_r = _gate_up_tile(
                w13_ptr, w13_s_ptr, w13_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r, sw_ptr,
                sw_s_ptr, sw_r_ptr, experts, slots, tile + step, num_tiles, w_row, s_row, w_offs, s_offs, w_k_ok,
                s_k_ok, inter, shared_inter, TOP_K, BLOCK_N, NB, SHARED_FIRST, OFFLOAD)


@device_function
def _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r,
               sd_ptr, sd_s_ptr, sd_r_ptr, experts, slots, tile, num_tiles, hidden, w_row, s_row,
               sw_row, ss_row, w_offs, s_offs, ws_offs, ss_offs, w_k_ok, s_k_ok, ws_k_ok, ss_k_ok,
               TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, OFFLOAD: tl.constexpr):
    """Tile ``tile``'s packed down rows (int32 words) of every choice ``[BLOCK_C, BLOCK_N, BLOCK_K / 8]``
    and of the shared expert ``[1, BLOCK_N, BLOCK_K / 8]``, their scale bytes and row scales (zeros past
    ``num_tiles``), each choice's read where ``_expert_base`` says; the element offsets within a tile
    are the program's, as in ``_gate_up_tile``."""
    n0 = tile * BLOCK_N
    n_ok = (tl.arange(0, BLOCK_N) < tl.where(tile < num_tiles, hidden - n0, 0))[None, :]
    rows_ok = (tl.arange(0, BLOCK_C) < TOP_K)[:, None] & n_ok
    w_base = _expert_base(w2_ptr, host_w_ptr, slots, experts, es_w, OFFLOAD) + n0.to(tl.int64) * w_row
    s_base = _expert_base(w2_s_ptr, host_s_ptr, slots, experts, es_s, OFFLOAD) + n0.to(tl.int64) * s_row
    r_base = _expert_base(w2_r_ptr, host_r_ptr, slots, experts, es_r, OFFLOAD) + n0
    w = tl.load(w_base[:, None, None] + w_offs, mask=rows_ok[:, :, None] & w_k_ok, other=0)
    s = tl.load(s_base[:, None, None] + s_offs, mask=rows_ok[:, :, None] & s_k_ok, other=0)
    r = tl.load(r_base[:, None] + tl.arange(0, BLOCK_N)[None, :], mask=rows_ok, other=0.0)
    ws = tl.load(sd_ptr + n0.to(tl.int64) * sw_row + ws_offs, mask=n_ok[:, :, None] & ws_k_ok, other=0)
    ss = tl.load(sd_s_ptr + n0.to(tl.int64) * ss_row + ss_offs, mask=n_ok[:, :, None] & ss_k_ok, other=0)
    rs = tl.load(sd_r_ptr + n0 + tl.arange(0, BLOCK_N)[None, :], mask=n_ok, other=0.0)
    return w, s, r, ws, ss, rs


@device_function
def _fill_down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, es_w, es_s, es_r, fills, tile, num_tiles, hidden, w_row, s_row,
                    w_offs, s_offs, w_k_ok, s_k_ok, w, s, r, BLOCK_N: tl.constexpr):
    """The read-through fill of a down tile: each choice's rows that claimed a slot (``fills`` >= 0),
    as ``_down_tile`` loaded them from host memory, stored into that slot."""
    n0 = tile * BLOCK_N
    n_ok = (tl.arange(0, BLOCK_N) < tl.where(tile < num_tiles, hidden - n0, 0))[None, :]
    rows_ok = (fills >= 0)[:, None] & n_ok
    slot = tl.maximum(fills, 0).to(tl.int64)
    w_base = w2_ptr + (slot * es_w + n0 * w_row)  # the tile's offset within an expert fits int32
    s_base = w2_s_ptr + (slot * es_s + n0 * s_row)
    r_base = w2_r_ptr + (slot * es_r + n0)
    tl.store(w_base[:, None, None] + w_offs, w, mask=rows_ok[:, :, None] & w_k_ok)
    tl.store(s_base[:, None, None] + s_offs, s, mask=rows_ok[:, :, None] & s_k_ok)
    tl.store(r_base[:, None] + tl.arange(0, BLOCK_N)[None, :], r, mask=rows_ok)


@triton.jit
def _down_stream_kernel(
    h_ptr, h_width, w2_ptr, w2_s_ptr, w2_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r, map_ptr,
    fill_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, topw_ptr, topi_ptr,
    logits_ptr, l_st, out_ptr, hidden, inter, shared_inter, w_row, s_row, sw_row, ss_row, num_experts,
    TOP_K: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    OFFLOAD: tl.constexpr, FILL: tl.constexpr,
):
    # w_row, s_row (sw_row, ss_row): the routed (shared) down rows' strides in words and scale bytes,
    # inter / 8 and inter / 16, as arguments for their divisibility (see _gate_up_stream_kernel).
    # Under PDL this starts while the gate/up launch runs: the routing and the first tile's weights
    # are loaded before the wait, ``h`` (the gate/up output) after it. The routing launch ran two
    # launches back: it finished before the gate/up programs' wait returned, which precedes this
    # launch (as ``moe_decode._down_kernel`` reads the routing); an offloaded layer's routing launch
    # (slots, claims) likewise.
    t = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    weight, experts, slots, fills = _choices(topw_ptr, topi_ptr, map_ptr, fill_ptr, t, TOP_K, BLOCK_C, OFFLOAD, FILL)
    weight = cast(weight, dtype).to(tl.float32)  # as the reference holds them: rounded to the activations' dtype
    num_tiles = tl.cdiv(hidden, BLOCK_N)
    word = tl.arange(0, BLOCK_K // 8)[None, None, :]
    group = tl.arange(0, BLOCK_K // 16)[None, None, :]
    rows = tl.arange(0, BLOCK_N)[None, :, None]
    w_offs, s_offs, ws_offs, ss_offs = rows * w_row + word, rows * s_row + group, rows * sw_row + word, rows * ss_row + group
    w_k_ok, s_k_ok, ws_k_ok, ss_k_ok = word < w_row, group < s_row, word < sw_row, group < ss_row
    step = tl.num_programs(1)
    first = tl.program_id(1)
    w, s, r, ws, ss, rs = _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r,
                                     sd_ptr, sd_s_ptr, sd_r_ptr, experts, slots, first, num_tiles, hidden, w_row,
                                     s_row, sw_row, ss_row, w_offs, s_offs, ws_offs, ss_offs, w_k_ok, s_k_ok, ws_k_ok,
                                     ss_k_ok, TOP_K, BLOCK_C, BLOCK_N, OFFLOAD)
    if PDL:
        tl.extra.cuda.gdc_wait()
    c = tl.arange(0, BLOCK_C)
    h_rows = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + c) * h_width
    h0, h1, h2, h3, h4, h5, h6, h7 = _word_columns(h_rows[:, None, None], word, (c < TOP_K)[:, None, None] & w_k_ok)
    h_shared = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + TOP_K) * h_width
    s0, s1, s2, s3, s4, s5, s6, s7 = _word_columns(h_shared + word * 0, word, ws_k_ok)
    gate = round_as(tl.sigmoid(tl.load(logits_ptr + t * l_st + num_experts).to(tl.float32)), dtype)
    for tile in range(first, num_tiles, step):
        if PREFETCH:
            next_tile = _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w, es_s, es_r,
                                   sd_ptr, sd_s_ptr, sd_r_ptr, experts, slots, tile + step, num_tiles, hidden, w_row,
                                   s_row, sw_row, ss_row, w_offs, s_offs, ws_offs, ss_offs, w_k_ok, s_k_ok, ws_k_ok,
                                   ss_k_ok, TOP_K, BLOCK_C, BLOCK_N, OFFLOAD)
        if FILL:  # the choices' rows read from host memory for misses that claimed a slot, into those slots
            _fill_down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, es_w, es_s, es_r, fills, tile, num_tiles, hidden, w_row, s_row,
                            w_offs, s_offs, w_k_ok, s_k_ok, w, s, r, BLOCK_N)
        acc = _word_dots(w, s, h0, h1, h2, h3, h4, h5, h6, h7, BLOCK_N, BLOCK_K // 8) * r
        shared = tl.sum(_word_dots(ws, ss, s0, s1, s2, s3, s4, s5, s6, s7, BLOCK_N, BLOCK_K // 8) * rs, 0)
        scaled = round_as(round_as(acc, dtype) * weight[:, None], dtype)
        # One float32 sum over the choices in a fixed (tree) order, as moe_decode's.
        out = round_as(tl.sum(scaled, 0), dtype) + round_as(gate * round_as(shared, dtype), dtype)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + t * hidden + n, cast(out, dtype), mask=n < hidden)
        if PREFETCH:
            w, s, r, ws, ss, rs = next_tile
        else:
            w, s, r, ws, ss, rs = _down_tile(w2_ptr, w2_s_ptr, w2_r_ptr, host_w_ptr, host_s_ptr, host_r_ptr, es_w,
                                             es_s, es_r, sd_ptr, sd_s_ptr, sd_r_ptr, experts, slots, tile + step,
                                             num_tiles, hidden, w_row, s_row, sw_row, ss_row, w_offs, s_offs, ws_offs,
                                             ss_offs, w_k_ok, s_k_ok, ws_k_ok, ss_k_ok, TOP_K, BLOCK_C, BLOCK_N,
                                             OFFLOAD)
