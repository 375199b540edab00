"""Triton hyper-connection ops: per-stream norm, stream mix, and stream combine.

Each program handles one token (and one stream or one feature block): the ``n`` streams of a token
are a handful of rows of ``H`` features, so these are bandwidth-bound elementwise/row kernels.
Rounding follows the references: where a reference computes in the activations' dtype, the kernel
computes in float32 and rounds there (``round_as``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, new_empty, pow2, round_as


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _hc_norm_kernel(x_ptr, x_st, w_ptr, out_ptr, hidden, eps, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    stream = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    base = stream * hidden
    x = tl.load(x_ptr + t * x_st + base + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_rms * (1.0 + w)
    tl.store(out_ptr + t * (hidden * tl.num_programs(1)) + base + cols, cast(y, out_ptr.dtype.element_ty), mask=mask)


def hc_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_streams: int) -> torch.Tensor:
    x = _rows(x, "hc_norm: x")
    num_tokens, width = x.shape
    if width % num_streams or weight.shape != (width,):
        raise ValueError(f"hc_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not make {num_streams} streams")
    hidden = width // num_streams
    out = new_empty((num_tokens, width), x.dtype, x.device)
    if num_tokens:
        _hc_norm_kernel[(num_tokens, num_streams)](x, x.stride(0), weight, out, hidden, eps, BLOCK=pow2(hidden))
    return out


@triton.jit
def _hc_mix_kernel(
    l_ptr, l_st, n_ptr, n_st, out_ptr, hidden,
    NUM_STREAMS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(NUM_STREAMS):
        logit = tl.load(l_ptr + t * l_st + s * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        normed = tl.load(n_ptr + t * n_st + s * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        acc += round_as(round_as(tl.sigmoid(logit), dtype) * normed, dtype)
    tl.store(out_ptr + t * hidden + cols, cast(acc / NUM_STREAMS, dtype), mask=mask)


def hc_mix(mix_logits: torch.Tensor, normed: torch.Tensor, num_streams: int) -> torch.Tensor:
    mix_logits, normed = _rows(mix_logits, "hc_mix: mix_logits"), _rows(normed, "hc_mix: normed")
    num_tokens, width = normed.shape
    if mix_logits.shape != normed.shape or width % num_streams:
        raise ValueError(f"hc_mix: mix_logits {tuple(mix_logits.shape)}, normed {tuple(normed.shape)}, {num_streams} streams")
    hidden = width // num_streams
    out = new_empty((num_tokens, hidden), normed.dtype, normed.device)
    block = min(pow2(hidden), 1024)
    if num_tokens:
        _hc_mix_kernel[(num_tokens, triton.cdiv(hidden, block))](
            mix_logits, mix_logits.stride(0), normed, normed.stride(0), out, hidden,
            NUM_STREAMS=num_streams, BLOCK=block,
        )
    return out


@triton.jit
def _hc_combine_kernel(
    h_ptr, h_st, y_ptr, y_st, i_ptr, i_st, out_ptr, hidden,
    NUM_STREAMS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    stream = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    logit = tl.load(i_ptr + t * i_st + stream).to(tl.float32)
    inject = 2.0 * round_as(tl.sigmoid(round_as(logit / NUM_STREAMS, dtype)), dtype)
    y = tl.load(y_ptr + t * y_st + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + t * h_st + stream * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    out = h + round_as(y * inject, dtype)
    tl.store(out_ptr + t * (hidden * NUM_STREAMS) + stream * hidden + cols, cast(out, dtype), mask=mask)


def hc_combine(
    hyper: torch.Tensor, block_out: torch.Tensor, inject_logits: torch.Tensor, num_streams: int
) -> torch.Tensor:
    hyper, block_out = _rows(hyper, "hc_combine: hyper"), _rows(block_out, "hc_combine: block_out")
    inject_logits = _rows(inject_logits, "hc_combine: inject_logits")
    num_tokens, width = hyper.shape
    hidden = block_out.shape[1]
    if width != num_streams * hidden or block_out.shape[0] != num_tokens or inject_logits.shape != (num_tokens, num_streams):
        raise ValueError(
            f"hc_combine: hyper {tuple(hyper.shape)}, block_out {tuple(block_out.shape)}, "
            f"inject_logits {tuple(inject_logits.shape)} do not fit {num_streams} streams"
        )
    out = new_empty((num_tokens, width), hyper.dtype, hyper.device)
    block = min(pow2(hidden), 1024)
    if num_tokens:
        _hc_combine_kernel[(num_tokens, num_streams, triton.cdiv(hidden, block))](
            hyper, hyper.stride(0), block_out, block_out.stride(0), inject_logits, inject_logits.stride(0), out, hidden,
            NUM_STREAMS=num_streams, BLOCK=block,
        )
    return out
