"""Triton depthwise causal conv1d + SiLU with per-request state slots (Gated DeltaNet's short conv).

Prefill runs two launches: the convolution over tiles of (tokens x channels) of the flat token
dimension, each token finding its request by comparing with ``cu_seqlens`` (no host sync), and
then the state update, which must read the old state only after every tile has. Decode runs one
program per (request, channel block). ``x`` may be a strided slice of the packed projection (unit
stride along channels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, new_empty, pow2, round_as


@triton.jit
def _conv_prefill_kernel(
    x_ptr, x_st, w_ptr, state_ptr, st_ss, st_sc, st_sk,
    slot_ptr, cu_ptr, out_ptr,
    num_tokens, channels, num_requests,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < num_tokens
    c_ok = c < channels
    request = tl.zeros([BLOCK_T], tl.int32)
    for i in range(1, num_requests):
        request += (t >= tl.load(cu_ptr + i)).to(tl.int32)
    start = tl.load(cu_ptr + request, mask=t_ok, other=0)
    slot = tl.load(slot_ptr + request, mask=t_ok, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for k in tl.static_range(WIDTH):
        src = t - (WIDTH - 1) + k
        from_x = src >= start
        xv = tl.load(
            x_ptr + src[:, None] * x_st + c[None, :], mask=(t_ok & from_x)[:, None] & c_ok[None, :], other=0.0
        )
        sv = tl.load(
            state_ptr + slot[:, None] * st_ss + c[None, :] * st_sc + (src - start + WIDTH - 1)[:, None] * st_sk,
            mask=(t_ok & ~from_x)[:, None] & c_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + c * WIDTH + k, mask=c_ok, other=0.0).to(tl.float32)
        acc += tl.where(from_x[:, None], xv.to(tl.float32), sv.to(tl.float32)) * w[None, :]
    dtype = out_ptr.dtype.element_ty
    acc = round_as(acc, w_ptr.dtype.element_ty)
    tl.store(out_ptr + t[:, None] * channels + c[None, :], cast(acc * tl.sigmoid(acc), dtype),
             mask=t_ok[:, None] & c_ok[None, :])


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
    weight = weight.contiguous()
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_requests = state_slots.shape[0]
    out = new_empty((num_tokens, channels), x.dtype, x.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    block_t, block_c = 16, min(pow2(channels), 128)
    state_strides = conv_state.stride()
    _conv_prefill_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))](
        x, x.stride(0), weight, conv_state, *state_strides,
        state_slots, cu_seqlens, out,
        num_tokens, channels, num_requests,
        WIDTH=width, BLOCK_T=block_t, BLOCK_C=block_c,
    )
    block_c = min(pow2(channels), 256)
    _conv_state_update_kernel[(num_requests, triton.cdiv(channels, block_c))](
        x, x.stride(0), conv_state, *state_strides, state_slots, cu_seqlens, channels,
        WIDTH=width, BLOCK_K=pow2(width - 1), BLOCK_C=block_c,
    )
    return out


@triton.jit
def _conv_decode_kernel(
    x_ptr, x_st, w_ptr, state_ptr, st_ss, st_sc, st_sk, slot_ptr, out_ptr, channels,
    WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
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
        WIDTH=width, BLOCK_K=pow2(width), BLOCK_C=block_c,
    )
    return out
