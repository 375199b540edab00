"""Triton depthwise causal conv1d + SiLU with per-request state slots (Gated DeltaNet's short conv).

Prefill runs two launches: the convolution, then the state update, which must read the old state
only after every program of the convolution has. A convolution program owns a block of channels
over a run of rows of the flat token dimension and walks the run row by row, keeping the ``K - 1``
previous rows in registers: each input row is read once, as channel-contiguous vectors, and a
group of rows is loaded ahead of its use to keep loads in flight (the kernel is memory-bound).
The previous rows of a run's first row, and of a request's first row, come from the chunk or the
request's slot window; programs find their requests by comparing with ``cu_seqlens`` (no host
sync). Decode runs one program per (request, channel block). ``x`` may be a strided slice of the
packed projection (unit stride along channels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import _INTERPRETED, cast, device_function, new_empty, pow2, round_as
from freetoken.kernels.triton.moe_decode import _pdl_available

MAX_PREFILL_WIDTH = 4  # the prefill kernel holds the K - 1 previous rows in three registers


@device_function
def _cols(c, cond, channels):
    """The mask of channels ``c`` where the scalar ``cond`` holds: ``c < (channels or 0)``. A
    comparison with a scalar, so the compiler still sees masks constant over 16 channels and
    vectorizes; ``vector & scalar`` also miscomputes under Triton 3.9's interpreter."""
    return c < tl.where(cond, channels, 0)


@device_function
def _request_of(cu_ptr, num_requests, t, BLOCK_R: tl.constexpr):
    """The request row ``t`` belongs to: how many requests after the first start at or before it
    (an empty request shares its start with the next one, which then counts too)."""
    request = t * 0
    for i in range(1, num_requests, BLOCK_R):
        idx = i + tl.arange(0, BLOCK_R)
        starts = tl.load(cu_ptr + idx, mask=idx < num_requests, other=0)
        request += tl.sum(((starts <= t) & (idx < num_requests)).to(tl.int32), 0)
    return request


@device_function
def _prev_row(x_c, x_st, window, st_sk, c, channels, src, start, WIDTH: tl.constexpr):
    """Input row ``src`` of the request that starts at row ``start``, as float32: from the chunk,
    or for ``src < start`` from column ``src - start + K - 1`` of the slot's window."""
    xv = tl.load(x_c + src.to(tl.int64) * x_st, mask=_cols(c, src >= start, channels), other=0.0)
    sv = tl.load(window + (src - start + WIDTH - 1) * st_sk, mask=_cols(c, src < start, channels), other=0.0)
    return tl.where(src >= start, xv.to(tl.float32), sv.to(tl.float32))


@device_function
def _enter_request(x_c, x_st, state_c, st_ss, st_sk, slot_ptr, cu_ptr, num_requests, c, channels, t, p2, p3,
                   WIDTH: tl.constexpr, BLOCK_R: tl.constexpr):
    """At row ``t``, of the request holding it: where that request ends and the previous rows
    (lags 1, 2, 3) of row ``t``. Lags at or past the width keep ``p2``/``p3``."""
    request = _request_of(cu_ptr, num_requests, t, BLOCK_R)
    start = tl.load(cu_ptr + request)
    end = tl.load(cu_ptr + request + 1)
    window = state_c + tl.load(slot_ptr + request).to(tl.int64) * st_ss
    p1 = _prev_row(x_c, x_st, window, st_sk, c, channels, t - 1, start, WIDTH)
    if WIDTH >= 3:
        p2 = _prev_row(x_c, x_st, window, st_sk, c, channels, t - 2, start, WIDTH)
    if WIDTH >= 4:
        p3 = _prev_row(x_c, x_st, window, st_sk, c, channels, t - 3, start, WIDTH)
    return end, p1, p2, p3


@device_function
def _lag_weight(w_ptr, c, channels, lag: tl.constexpr, WIDTH: tl.constexpr):
    """The weights of the input ``lag`` rows back (tap ``K - 1 - lag``), float32; zero past the width."""
    if lag < WIDTH:
        return tl.load(w_ptr + c * WIDTH + (WIDTH - 1 - lag), mask=c < channels, other=0.0).to(tl.float32)
    else:
        return tl.zeros(c.shape, tl.float32)


@device_function
def _taps(x, p1, p2, p3, l0, l1, l2, l3, WIDTH: tl.constexpr):
    """The convolution at one row from its input and the previous ones, the oldest first."""
    if WIDTH >= 4:
        acc = p3 * l3 + p2 * l2
    elif WIDTH >= 3:
        acc = p2 * l2
    else:
        acc = tl.zeros(x.shape, tl.float32)
    return acc + p1 * l1 + x * l0


@device_function
def _silu(x):
    """``x * sigmoid(x)`` as ``x * rcp(1 + 2^(-x log2 e))`` with the hardware's approximate ex2 and
    rcp (a few ulp, as ``tl.sigmoid``'s own ex2), flushing denormals: ``tl.sigmoid`` lowers to
    ex2 and an IEEE-range division whose fix-ups were ~60% of the prefill kernel's instructions."""
    if _INTERPRETED:
        return x * tl.sigmoid(x)
    else:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [e + 1.0],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return x * r


@triton.jit
def _conv_prefill_kernel(
    x_ptr, x_st, w_ptr, state_ptr, st_ss, st_sc, st_sk,
    slot_ptr, cu_ptr, out_ptr,
    num_tokens, channels, num_requests,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    x_c = x_ptr + c
    out_c = out_ptr + c
    state_c = state_ptr + c * st_sc
    l0 = _lag_weight(w_ptr, c, channels, 0, WIDTH)
    l1 = _lag_weight(w_ptr, c, channels, 1, WIDTH)
    l2 = _lag_weight(w_ptr, c, channels, 2, WIDTH)
    l3 = _lag_weight(w_ptr, c, channels, 3, WIDTH)
    zero = tl.zeros([BLOCK_C], tl.float32)
    wdtype = w_ptr.dtype.element_ty
    seg = tl.program_id(0) * BLOCK_T
    run_end = tl.minimum(seg + BLOCK_T, num_tokens)
    # The run in segments, one per request it meets; each starts from its request's previous rows.
    while seg < run_end:
        end, p1, p2, p3 = _enter_request(
            x_c, x_st, state_c, st_ss, st_sk, slot_ptr, cu_ptr, num_requests, c, channels, seg, zero, zero,
            WIDTH, BLOCK_R,
        )
        stop = tl.minimum(end, run_end)
        for i in range(seg, stop, UNROLL):
            # The group's rows are all loaded before the first is used: UNROLL loads in flight.
            rows = ()
            for u in tl.static_range(UNROLL):
                rows = rows + (tl.load(x_c + tl.cast(i + u, tl.int64) * x_st, mask=_cols(c, i + u < stop, channels),
                                       other=0.0),)
            for u in tl.static_range(UNROLL):
                x = rows[u].to(tl.float32)
                acc = round_as(_taps(x, p1, p2, p3, l0, l1, l2, l3, WIDTH), wdtype)
                tl.store(out_c + tl.cast(i + u, tl.int64) * channels,
                         cast(_silu(acc), out_ptr.dtype.element_ty), mask=_cols(c, i + u < stop, channels))
                p3 = p2
                p2 = p1
                p1 = x
        seg = stop


@triton.jit
def _conv_state_update_kernel(
    x_ptr, x_st, state_ptr, st_ss, st_sc, st_sk, slot_ptr, cu_ptr, channels,
    WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    if length > 0:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        j = tl.arange(0, BLOCK_K)
        j_ok = j < WIDTH - 1
        rel = length - (WIDTH - 1) + j  # position in this chunk of the input that lands in state[j]
        mask = j_ok[None, :] & c_ok[:, None]
        base = state_ptr + slot * st_ss + c[:, None] * st_sc
        xv = tl.load(x_ptr + (start + rel)[None, :] * x_st + c[:, None], mask=mask & (rel >= 0)[None, :], other=0.0)
        sv = tl.load(base + (j + length)[None, :] * st_sk, mask=mask & (rel < 0)[None, :], other=0.0)
        new = tl.where((rel >= 0)[None, :], xv.to(tl.float32), sv.to(tl.float32))
        tl.store(base + j[None, :] * st_sk, cast(new, state_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    channels, width = weight.shape
    if x.shape[-1] != channels or conv_state.shape[1:] != (channels, width - 1):
        raise ValueError(
            f"causal conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv_state "
            f"{tuple(conv_state.shape)} disagree"
        )
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    x = _check(x, weight, conv_state)
    if not 2 <= weight.shape[1] <= MAX_PREFILL_WIDTH:
        raise ValueError(f"causal conv1d prefill: weight width {weight.shape[1]} outside 2..{MAX_PREFILL_WIDTH}")
    weight = weight.contiguous()
    num_tokens, channels = x.shape
    num_requests = state_slots.shape[0]
    out = new_empty((num_tokens, channels), x.dtype, x.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    launch_prefill(x, weight, conv_state, state_slots, cu_seqlens, out, prefill_tiles(channels))
    block_c = min(pow2(channels), 256)
    _conv_state_update_kernel[(num_requests, triton.cdiv(channels, block_c))](
        x, x.stride(0), conv_state, *conv_state.stride(), state_slots, cu_seqlens, channels,
        WIDTH=weight.shape[1], BLOCK_K=pow2(weight.shape[1] - 1), BLOCK_C=block_c,
    )
    return out


@dataclass(frozen=True)
class PrefillTiles:
    """One prefill program's share and its compile options."""

    rows: int  # the run of rows it walks
    channels: int  # its block of channels
    warps: int
    unroll: int  # rows loaded ahead (divides ``rows``)
    maxnreg: int | None = None  # register cap per thread (None: the compiler's choice)


def prefill_tiles(channels: int) -> PrefillTiles:
    """128 channels a one-warp program (4 bf16 or float32 a thread), runs of 32 rows (the 3-row
    halo a run re-reads is ~10% of its reads, from L2), 8 rows in flight: the H200 sweep's best
    (`benchmarks/bench_conv1d_prefill.py --sweep`: 84.7 us at 8k x 8192 channels against 93.2 for
    256 channels capped at 128 registers, floor 62.8)."""
    return PrefillTiles(rows=32, channels=min(pow2(channels), 128), warps=1, unroll=8, maxnreg=None)


def launch_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    tiles: PrefillTiles,
) -> None:
    """The convolution launch alone (no state update), with its tiles given (benchmarks sweep them)."""
    num_tokens, channels = x.shape
    options = {} if tiles.maxnreg is None else {"maxnreg": tiles.maxnreg}
    _conv_prefill_kernel[(triton.cdiv(num_tokens, tiles.rows), triton.cdiv(channels, tiles.channels))](
        x, x.stride(0), weight, conv_state, *conv_state.stride(),
        state_slots, cu_seqlens, out,
        num_tokens, channels, state_slots.shape[0],
        WIDTH=weight.shape[1], BLOCK_T=tiles.rows, BLOCK_C=tiles.channels, UNROLL=min(tiles.unroll, tiles.rows),
        BLOCK_R=32, num_warps=tiles.warps, **options,
    )


@triton.jit
def _conv_decode_kernel(
    x_ptr, x_st, w_ptr, state_ptr, st_ss, st_sc, st_sk, slot_ptr, out_ptr, channels,
    WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # every input may be an earlier launch's output: wait before any load, then let the next launch start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    slot = tl.load(slot_ptr + b).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    base = state_ptr + slot * st_ss + c[:, None] * st_sc
    x = tl.load(x_ptr + b * x_st + c, mask=c_ok, other=0.0).to(tl.float32)
    # The window: state[0 .. WIDTH-2], then x.
    in_state = (j < WIDTH - 1)[None, :] & c_ok[:, None]
    window = tl.load(base + j[None, :] * st_sk, mask=in_state, other=0.0).to(tl.float32)
    window = tl.where((j == WIDTH - 1)[None, :], x[:, None], window)
    w = tl.load(w_ptr + c[:, None] * WIDTH + j[None, :], mask=(j < WIDTH)[None, :] & c_ok[:, None], other=0.0)
    wdtype = w_ptr.dtype.element_ty
    acc = round_as(tl.sum(round_as(window * w.to(tl.float32), wdtype), 1), wdtype)
    tl.store(out_ptr + b * channels + c, cast(acc * tl.sigmoid(acc), out_ptr.dtype.element_ty), mask=c_ok)
    # Shift: state[j] = window[j + 1].
    shifted = tl.load(base + (j + 1)[None, :] * st_sk, mask=((j + 1) < WIDTH - 1)[None, :] & c_ok[:, None], other=0.0)
    shifted = tl.where((j == WIDTH - 2)[None, :], x[:, None], shifted.to(tl.float32))
    tl.store(base + j[None, :] * st_sk, cast(shifted, state_ptr.dtype.element_ty), mask=in_state)


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    x = _check(x, weight, conv_state)
    weight = weight.contiguous()
    batch, channels = x.shape
    width = weight.shape[1]
    out = new_empty((batch, channels), x.dtype, x.device)
    if batch == 0:
        return out
    block_c = min(pow2(channels), 256)
    _conv_decode_kernel[(batch, triton.cdiv(channels, block_c))](
        x, x.stride(0), weight, conv_state, *conv_state.stride(), state_slots, out, channels,
        WIDTH=width, BLOCK_K=pow2(width), BLOCK_C=block_c, PDL=_pdl_available(), launch_pdl=_pdl_available(),
    )
    return out
