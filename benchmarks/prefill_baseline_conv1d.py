"""The causal conv1d prefill as it was before the register-window kernel: a frozen copy of
kernels/triton/conv1d.py at 8f00fc2 (prefill only), kept for benchmarks/bench_conv1d_prefill.py.
Its programs are tiles of 16 tokens x 128 channels that load every input row once per tap and
gather every tap's slot-window element under a mask.
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
