"""Triton PLE ops: the per-stream gate, and the dilated short convolution with per-request state.

The convolution runs decode tokens and prefill chunks in one launch: each token finds its request
through ``token_request`` and reads the inputs before its request's first new token from the state
slot. A second launch then advances each request's state; it runs after every token has read it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, new_empty, pow2, round_as


@triton.jit
def _ple_gate_kernel(
    k_ptr, k_st, q_ptr, q_st, v_ptr, v_st, out_ptr, hidden, inv_sqrt_hidden,
    NUM_STREAMS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    stream = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    k = tl.load(k_ptr + t * k_st + stream * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + t * q_st + stream * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * v_st + cols, mask=mask, other=0.0).to(tl.float32)
    dot = round_as(tl.sum(round_as(k * q, dtype), axis=0), dtype)
    gate = round_as(dot * inv_sqrt_hidden, dtype)
    magnitude = round_as(tl.sqrt(tl.maximum(tl.abs(gate), 1e-6)), dtype)
    sign = tl.where(gate > 0, 1.0, tl.where(gate < 0, -1.0, 0.0))
    gate = round_as(tl.sigmoid(magnitude * sign), dtype)
    tl.store(out_ptr + t * (hidden * NUM_STREAMS) + stream * hidden + cols, cast(gate * v, dtype), mask=mask)


def ple_gate(key_normed: torch.Tensor, query_normed: torch.Tensor, value: torch.Tensor, num_streams: int) -> torch.Tensor:
    num_tokens, hidden = value.shape
    width = num_streams * hidden
    if key_normed.shape != (num_tokens, width) or query_normed.shape != (num_tokens, width):
        raise ValueError(
            f"ple_gate: key {tuple(key_normed.shape)}, query {tuple(query_normed.shape)}, value {tuple(value.shape)} "
            f"do not fit {num_streams} streams"
        )
    key_normed, query_normed, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key_normed, query_normed, value))
    out = new_empty((num_tokens, width), value.dtype, value.device)
    if num_tokens:
        _ple_gate_kernel[(num_tokens, num_streams)](
            key_normed, key_normed.stride(0), query_normed, query_normed.stride(0), value, value.stride(0), out,
            hidden, 1.0 / math.sqrt(hidden), NUM_STREAMS=num_streams, BLOCK=pow2(hidden),
        )
    return out


@triton.jit
def _short_conv_kernel(
    x_ptr, x_st, w_ptr, w_sc, state_ptr, st_slot, st_row, slots_ptr, req_ptr, cu_ptr, out_ptr,
    channels, state_len, dilation,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < channels
    request = tl.load(req_ptr + t)
    local = t - tl.load(cu_ptr + request)
    slot = tl.load(slots_ptr + request).to(tl.int64)
    acc = tl.zeros([BLOCK_C], tl.float32)
    for tap in tl.static_range(WIDTH):
        back = (WIDTH - 1 - tap) * dilation
        w = tl.load(w_ptr + cols * w_sc + tap, mask=mask, other=0.0).to(tl.float32)
        if local >= back:
            x = tl.load(x_ptr + (t - back) * x_st + cols, mask=mask, other=0.0)
        else:
            x = tl.load(state_ptr + slot * st_slot + (state_len + local - back) * st_row + cols, mask=mask, other=0.0)
        acc += x.to(tl.float32) * w
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t * channels + cols, cast(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _advance_state_kernel(
    x_ptr, x_st, state_ptr, st_slot, st_row, slots_ptr, cu_ptr, channels, state_len,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Request ``b``'s state becomes the last ``S`` rows of (state ++ its new inputs). One program
    owns a request's channel block, so it loads every row before storing any."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, BLOCK_S)
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slots_ptr + b).to(tl.int64)
    source = length + rows  # index in state ++ chunk
    ok = (rows < state_len)[:, None] & (cols < channels)[None, :]
    from_state = ok & (source < state_len)[:, None]
    from_chunk = ok & (source >= state_len)[:, None]
    base = state_ptr + slot * st_slot
    old = tl.load(base + source[:, None] * st_row + cols[None, :], mask=from_state, other=0.0)
    new = tl.load(x_ptr + (start + source - state_len)[:, None] * x_st + cols[None, :], mask=from_chunk, other=0.0)
    value = tl.where(from_state, old, new.to(old.dtype))
    tl.store(base + rows[:, None] * st_row + cols[None, :], value, mask=ok)


def ple_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    token_request: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dilation: int,
) -> torch.Tensor:
    num_tokens, channels = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[1]
    if weight.shape[0] != channels or conv_state.shape[2] != channels or state_len != (width - 1) * dilation:
        raise ValueError(
            f"ple_short_conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)} "
            f"and dilation {dilation} do not fit"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    if conv_state.stride(-1) != 1:
        raise ValueError("ple_short_conv: conv_state needs a unit-stride channel dim")
    out = new_empty((num_tokens, channels), x.dtype, x.device)
    num_requests = state_slots.shape[0]
    if num_tokens == 0:
        return out
    block_c = min(pow2(channels), 256)
    _short_conv_kernel[(num_tokens, triton.cdiv(channels, block_c))](
        x, x.stride(0), weight, weight.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1),
        state_slots, token_request, cu_seqlens, out, channels, state_len, dilation,
        WIDTH=width, BLOCK_C=block_c,
    )
    block_c = min(pow2(channels), max(16, 4096 // pow2(state_len)))
    _advance_state_kernel[(num_requests, triton.cdiv(channels, block_c))](
        x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), state_slots, cu_seqlens,
        channels, state_len, BLOCK_S=pow2(state_len), BLOCK_C=block_c,
    )
    return out
