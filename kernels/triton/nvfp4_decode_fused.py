"""The NVFP4 MoE decode block's gate/up and down passes in one persistent launch
(``NVFP4DecodeTiles.fused_per_sm``; ``nvfp4_decode.py`` launches it).

Why: at one token the block is latency-bound (~13.8 us a layer against a 3.8 us floor as two
stream launches after the routing launch): every launch boundary costs a drain and a ramp. Here a
grid sized to the GPU (programs an SM x SMs) runs every tile of both passes, and a down tile starts
as soon as its token's gate/up tiles are stored, not when the whole gate/up launch has retired.

Work is handed out by tickets, two int32 counters claimed with ``atomic_add``: first the gate/up
counter, whose tickets are (``FUSE_ROUTE``) one routing task a token (done by the program that
draws it, before it draws a tile), then every token's shared expert tiles, then the routed tiles;
a program that draws a gate/up ticket past the last one moves on to the down counter. So every
gate/up tile has been claimed by a running program before any program waits for one, and a
waiting program never holds up the work it waits for: no deadlock, whatever the residency, and
under the interpreter (whose programs run one after another) the first program does all the work.
With ``PREFETCH`` a program takes two tiles an iteration: it draws the second ticket and issues
that tile's loads before it decodes the first, so the claim's round trip and the second tile's
DRAM loads overlap the first tile.

Completion is counted per token: a gate/up tile stores its ``h`` columns, then (all the program's
threads past a barrier) adds one to its token's counter with release semantics; a down tile loads
its weights first (they need only the routing), then waits with acquire semantics until its
token's counter reaches the token's gate/up tile count and reads ``h`` from L2 (``.cg``). A routing
task stores the token's top-k and raises the token's flag the same way; a routed gate/up tile and a
down tile wait for that flag before reading the expert ids. The last program to exit resets every
counter to zero (``_counters``: one zeroed buffer a device for the process, so launches on a device
must run in stream order, as the engine's do; the previous launch's reset is visible once the
programmatic-dependent-launch wait returns).

Tiles are those of ``nvfp4_decode_stream``: gate/up ``BLOCK_N`` intermediate columns of one pair
(the shared expert's first), the whole hidden dim in one load; down ``BLOCK_N`` hidden columns of
all choices and the shared expert, the whole intermediate dim in one load; the rounding is that of
``nvfp4_decode``'s kernels, so the result is the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, device_function, pow2, round_as
from freetoken.kernels.triton.nvfp4_decode_stream import _down_tile, _gate_up_tile, _route_token, _word_columns
from freetoken.kernels.triton.nvfp4_rows import _word_dots

# Counter layout: [0] gate/up tickets, [1] down tickets, [2] exits, then one completion counter a
# token and one routing flag a token.
MAX_TOKENS = 64
_DONE = tl.constexpr(3)
_ROUTED = tl.constexpr(3 + MAX_TOKENS)
_SIZE = tl.constexpr(pow2(3 + 2 * MAX_TOKENS))
_counter_buffers: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters of ``device`` (every launch leaves them zero again), allocated once:
    a captured graph keeps using the buffer it was captured with."""
    if device not in _counter_buffers:
        _counter_buffers[device] = torch.zeros(_SIZE.value, dtype=torch.int32, device=device)
    return _counter_buffers[device]


@device_function
def _claim(counter):
    return tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")


@device_function
def _wait_for(counter, target):
    """Spin until ``counter >= target`` (acquire: the producers' stores before their release are
    visible after it)."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


@device_function
def _release(counter):
    """Add one to ``counter`` after every thread's stores (the barrier, then a release)."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")


@device_function
def _experts_of(topi_ptr, count_ptr, t, need, experts, experts_t, TOP_K: tl.constexpr, BLOCK_C: tl.constexpr,
                FUSE_ROUTE: tl.constexpr):
    """Token ``t``'s expert ids where ``need`` and they are not those held (``experts_t``): read from
    L2 after (``FUSE_ROUTE``) the token's routing flag is raised."""
    if need & (t != experts_t):
        if FUSE_ROUTE:
            _wait_for(count_ptr + _ROUTED + t, 1)
        c = tl.arange(0, BLOCK_C)
        experts = tl.load(topi_ptr + t * TOP_K + c, mask=c < TOP_K, other=0, cache_modifier=".cg")
        experts_t = t
    return experts, experts_t


@device_function
def _gate_up_ticket(ticket, routes, num_tokens, TOP_K: tl.constexpr, NB: tl.constexpr):
    """(token, tile within the token in ``SHARED_FIRST`` order, is a tile, needs the routing) of
    gate/up ticket ``ticket``: ``routes`` routing tasks (token ``ticket``), then every token's ``NB``
    shared tiles, then the routed ones; the token is clamped in range past the last ticket."""
    a = ticket - routes
    shared = a < num_tokens * NB
    b = a - num_tokens * NB
    t = tl.where(a < 0, ticket, tl.where(shared, a // NB, b // (TOP_K * NB)))
    tile = tl.where(shared, a % NB, NB + b % (TOP_K * NB))
    is_tile = (a >= 0) & (t < num_tokens)
    return tl.minimum(t, num_tokens - 1), tile, is_tile, is_tile & (tile >= NB)


@device_function
def _x_of(x_ptr, x_st, t, x_t, x0, x1, x2, x3, x4, x5, x6, x7, word, ok):
    """Token ``t``'s activations as ``_word_dots`` operands, loaded where they are not those held."""
    if t != x_t:
        x0, x1, x2, x3, x4, x5, x6, x7 = _word_columns(x_ptr + t * x_st + word * 0, word, ok)
        x_t = t
    return x0, x1, x2, x3, x4, x5, x6, x7, x_t


@device_function
def _gate_up_store(h_ptr, h_width, count_ptr, t, tile, gate_w, up_w, gate_s, up_s, gate_r, up_r,
                   x0, x1, x2, x3, x4, x5, x6, x7, inter, shared_inter, TOP_K: tl.constexpr, GU_N: tl.constexpr,
                   NB: tl.constexpr, GU_K: tl.constexpr):
    """One gate/up tile's ``silu(gate) · up`` stored, then counted in its token's completion counter."""
    dtype = h_ptr.dtype.element_ty
    j = (tile // NB + TOP_K) % (TOP_K + 1)
    n = (tile % NB) * GU_N + tl.arange(0, GU_N)
    n_ok = n < tl.where(j < TOP_K, inter, shared_inter)
    gate = _word_dots(gate_w, gate_s, x0, x1, x2, x3, x4, x5, x6, x7, GU_N, GU_K // 8)
    up = _word_dots(up_w, up_s, x0, x1, x2, x3, x4, x5, x6, x7, GU_N, GU_K // 8)
    gate, up = round_as(gate * gate_r, dtype), round_as(up * up_r, dtype)
    h = round_as(gate * tl.sigmoid(gate), dtype) * up
    q = t.to(tl.int64) * (TOP_K + 1) + j
    tl.store(h_ptr + q * h_width + n[None, :], cast(h, dtype), mask=n_ok[None, :])
    _release(count_ptr + _DONE + t)


@device_function
def _h_of(h_ptr, h_width, topw_ptr, logits_ptr, l_st, count_ptr, t, h_t, h0, h1, h2, h3, h4, h5, h6, h7,
          s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, word, h_ok, s_ok, per_token, num_experts,
          TOP_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Token ``t``'s down-pass operands (its choices' and shared expert's ``h`` columns, routing
    weights, shared gate) where they are not those held: after its gate/up tiles are all stored."""
    if t != h_t:
        dtype = h_ptr.dtype.element_ty
        _wait_for(count_ptr + _DONE + t, per_token)
        c = tl.arange(0, BLOCK_C)
        h_rows = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + c) * h_width
        h0, h1, h2, h3, h4, h5, h6, h7 = _h_columns(h_rows[:, None, None], word, (c < TOP_K)[:, None, None] & h_ok)
        h_shared = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + TOP_K) * h_width
        s0, s1, s2, s3, s4, s5, s6, s7 = _h_columns(h_shared + word * 0, word, s_ok)
        weight = tl.load(topw_ptr + t * TOP_K + c, mask=c < TOP_K, other=0.0, cache_modifier=".cg")
        weight = cast(weight, dtype).to(tl.float32)  # as the reference holds them
        gate = round_as(tl.sigmoid(tl.load(logits_ptr + t * l_st + num_experts).to(tl.float32)), dtype)
        h_t = t
    return h0, h1, h2, h3, h4, h5, h6, h7, s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, h_t


@device_function
def _down_store(out_ptr, hidden, t, tile, w, s, r, ws, ss, rs, h0, h1, h2, h3, h4, h5, h6, h7,
                s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, DN_N: tl.constexpr, DN_K: tl.constexpr):
    """One down tile: each choice's rows rounded and weighted, summed in a fixed order, plus the
    gated shared expert's, stored (the rounding of ``nvfp4_decode._down_kernel``)."""
    dtype = out_ptr.dtype.element_ty
    acc = _word_dots(w, s, h0, h1, h2, h3, h4, h5, h6, h7, DN_N, DN_K // 8) * r
    shared = tl.sum(_word_dots(ws, ss, s0, s1, s2, s3, s4, s5, s6, s7, DN_N, DN_K // 8) * rs, 0)
    scaled = round_as(round_as(acc, dtype) * weight[:, None], dtype)
    out = round_as(tl.sum(scaled, 0), dtype) + round_as(gate * round_as(shared, dtype), dtype)
    n = tile * DN_N + tl.arange(0, DN_N)
    tl.store(out_ptr + t * hidden + n, cast(out, dtype), mask=n < hidden)


@triton.jit
def _fused_block_kernel(
    x_ptr, x_st, w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr,
    w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, topw_ptr, topi_ptr, logits_ptr, l_st,
    h_ptr, h_width, out_ptr, count_ptr, num_tokens, hidden, inter, shared_inter, num_experts,
    gu_w_row, gu_s_row, dn_w_row, dn_s_row, dn_sw_row, dn_ss_row,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    GU_N: tl.constexpr, NB: tl.constexpr, GU_K: tl.constexpr, DN_N: tl.constexpr, DN_K: tl.constexpr,
    FUSE_ROUTE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    # gu_w_row, gu_s_row: hidden / 8 and / 16; dn_*: inter / 8, / 16, shared_inter / 8, / 16 (row strides in
    # int32 words and scale bytes, as arguments for their divisibility; see nvfp4_decode_stream).
    # PREFETCH: two tiles an iteration, the second one's ticket drawn and its loads issued before the
    # first one's decode (tiles carried across iterations made Triton 3.6's layout pass fail).
    if PDL:  # the counters, the routing or logits and x are earlier launches' work; the next launch may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    routes = num_tokens if FUSE_ROUTE else num_tokens * 0
    per_token = (TOP_K + 1) * NB
    tiles_a = routes + num_tokens * per_token

    # Gate/up: routing tasks, shared tiles, routed tiles.
    word = tl.arange(0, GU_K // 8)
    group = tl.arange(0, GU_K // 16)
    rows = tl.arange(0, GU_N)[None, :, None]
    w_offs, s_offs = rows * gu_w_row + word[None, None, :], rows * gu_s_row + group[None, None, :]
    w_k_ok, s_k_ok = (word < gu_w_row)[None, None, :], (group < gu_s_row)[None, None, :]
    xw = word[None, None, :]
    experts = tl.zeros([BLOCK_C], tl.int32)
    experts_t = num_tokens * 0 - 1
    ticket = _claim(count_ptr)
    if FUSE_ROUTE:  # the routing tasks first, before any tile: a program that waits for a token's routing
        while ticket < routes:  # never holds that routing's task
            _route_token(logits_ptr, l_st, topw_ptr, topi_ptr, ticket, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
            _release(count_ptr + _ROUTED + ticket)
            ticket = _claim(count_ptr)
    x0, x1, x2, x3, x4, x5, x6, x7 = _word_columns(x_ptr + xw * 0, xw, w_k_ok)
    x_t = num_tokens * 0
    while ticket < tiles_a:  # every ticket here is a tile
        t, tile, _, routed = _gate_up_ticket(ticket, routes, num_tokens, TOP_K, NB)
        experts, experts_t = _experts_of(topi_ptr, count_ptr, t, routed, experts, experts_t, TOP_K, BLOCK_C, FUSE_ROUTE)
        gate_w, up_w, gate_s, up_s, gate_r, up_r = _gate_up_tile(
            w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, experts, tile, per_token, gu_w_row, gu_s_row,
            w_offs, s_offs, w_k_ok, s_k_ok, inter, shared_inter, TOP_K, BLOCK_C, GU_N, NB, True)
        if PREFETCH:
            second = _claim(count_ptr)
            t2, tile2, is_tile2, routed2 = _gate_up_ticket(second, routes, num_tokens, TOP_K, NB)
            experts, experts_t = _experts_of(topi_ptr, count_ptr, t2, routed2, experts, experts_t, TOP_K, BLOCK_C,
                                             FUSE_ROUTE)
            gate_w2, up_w2, gate_s2, up_s2, gate_r2, up_r2 = _gate_up_tile(
                w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, experts,
                tl.where(is_tile2, tile2, per_token), per_token, gu_w_row, gu_s_row, w_offs, s_offs, w_k_ok, s_k_ok,
                inter, shared_inter, TOP_K, BLOCK_C, GU_N, NB, True)
        x0, x1, x2, x3, x4, x5, x6, x7, x_t = _x_of(x_ptr, x_st, t, x_t, x0, x1, x2, x3, x4, x5, x6, x7, xw, w_k_ok)
        _gate_up_store(h_ptr, h_width, count_ptr, t, tile, gate_w, up_w, gate_s, up_s, gate_r, up_r,
                       x0, x1, x2, x3, x4, x5, x6, x7, inter, shared_inter, TOP_K, GU_N, NB, GU_K)
        if PREFETCH:
            if is_tile2:
                x0, x1, x2, x3, x4, x5, x6, x7, x_t = _x_of(x_ptr, x_st, t2, x_t, x0, x1, x2, x3, x4, x5, x6, x7, xw,
                                                           w_k_ok)
                _gate_up_store(h_ptr, h_width, count_ptr, t2, tile2, gate_w2, up_w2, gate_s2, up_s2, gate_r2, up_r2,
                               x0, x1, x2, x3, x4, x5, x6, x7, inter, shared_inter, TOP_K, GU_N, NB, GU_K)
        ticket = _claim(count_ptr)

    # Down: every gate/up ticket has been claimed by a running program, so the waits below end.
    nd = tl.cdiv(hidden, DN_N)
    tiles_b = num_tokens * nd
    dword = tl.arange(0, DN_K // 8)[None, None, :]
    dgroup = tl.arange(0, DN_K // 16)[None, None, :]
    drows = tl.arange(0, DN_N)[None, :, None]
    dw_offs, ds_offs = drows * dn_w_row + dword, drows * dn_s_row + dgroup
    dws_offs, dss_offs = drows * dn_sw_row + dword, drows * dn_ss_row + dgroup
    dw_k_ok, ds_k_ok, dws_k_ok, dss_k_ok = dword < dn_w_row, dgroup < dn_s_row, dword < dn_sw_row, dgroup < dn_ss_row
    h0 = tl.zeros([BLOCK_C, 1, DN_K // 8], tl.float32)
    h1, h2, h3, h4, h5, h6, h7 = h0, h0, h0, h0, h0, h0, h0
    s0 = tl.zeros([1, 1, DN_K // 8], tl.float32)
    s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
    weight = tl.zeros([BLOCK_C], tl.float32)
    gate = tl.sum(weight, 0)
    h_t = num_tokens * 0 - 1
    ticket = _claim(count_ptr + 1)
    while ticket < tiles_b:
        t = ticket // nd
        experts, experts_t = _experts_of(topi_ptr, count_ptr, t, t >= 0, experts, experts_t, TOP_K, BLOCK_C,
                                         FUSE_ROUTE)
        w, s, r, ws, ss, rs = _down_tile(
            w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, experts, ticket % nd, nd, hidden, dn_w_row,
            dn_s_row, dn_sw_row, dn_ss_row, dw_offs, ds_offs, dws_offs, dss_offs, dw_k_ok, ds_k_ok, dws_k_ok, dss_k_ok,
            TOP_K, BLOCK_C, DN_N)
        if PREFETCH:
            second = _claim(count_ptr + 1)
            t2 = tl.minimum(second // nd, num_tokens - 1)
            experts, experts_t = _experts_of(topi_ptr, count_ptr, t2, second < tiles_b, experts, experts_t, TOP_K,
                                             BLOCK_C, FUSE_ROUTE)
            w_b, s_b, r_b, ws_b, ss_b, rs_b = _down_tile(
                w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, experts,
                tl.where(second < tiles_b, second % nd, nd), nd, hidden, dn_w_row, dn_s_row, dn_sw_row, dn_ss_row,
                dw_offs, ds_offs, dws_offs, dss_offs, dw_k_ok, ds_k_ok, dws_k_ok, dss_k_ok, TOP_K, BLOCK_C, DN_N)
        h0, h1, h2, h3, h4, h5, h6, h7, s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, h_t = _h_of(
            h_ptr, h_width, topw_ptr, logits_ptr, l_st, count_ptr, t, h_t, h0, h1, h2, h3, h4, h5, h6, h7,
            s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, dword, dw_k_ok, dws_k_ok, per_token, num_experts,
            TOP_K, BLOCK_C)
        _down_store(out_ptr, hidden, t, ticket % nd, w, s, r, ws, ss, rs, h0, h1, h2, h3, h4, h5, h6, h7,
                    s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, DN_N, DN_K)
        if PREFETCH:
            if second < tiles_b:
                h0, h1, h2, h3, h4, h5, h6, h7, s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, h_t = _h_of(
                    h_ptr, h_width, topw_ptr, logits_ptr, l_st, count_ptr, t2, h_t, h0, h1, h2, h3, h4, h5, h6, h7,
                    s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, dword, dw_k_ok, dws_k_ok, per_token, num_experts,
                    TOP_K, BLOCK_C)
                _down_store(out_ptr, hidden, t2, second % nd, w_b, s_b, r_b, ws_b, ss_b, rs_b, h0, h1, h2, h3, h4, h5, h6,
                            h7, s0, s1, s2, s3, s4, s5, s6, s7, weight, gate, DN_N, DN_K)
        ticket = _claim(count_ptr + 1)

    # The last program out resets the counters for the next launch (every other one has exited).
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(count_ptr + tl.arange(0, _SIZE), tl.zeros([_SIZE], tl.int32))


@device_function
def _h_columns(rows_ptr, word, ok):
    """``nvfp4_decode_stream._word_columns`` read from L2 (``.cg``): the rows were stored by other
    programs of this launch, after the acquire that made them visible."""
    base = rows_ptr + 8 * word
    return (tl.load(base, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32),
            tl.load(base + 2, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32),
            tl.load(base + 4, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32),
            tl.load(base + 6, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32),
            tl.load(base + 1, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32),
            tl.load(base + 3, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32),
            tl.load(base + 5, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32),
            tl.load(base + 7, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32))
