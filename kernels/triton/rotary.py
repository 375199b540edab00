"""Triton partial NeoX rotary: one program rotates a block of (token, head) rows.

cos/sin are rounded to the activations' dtype and the products and sums are rounded to it, as the
reference (and transformers) compute them. Inputs may be strided ``[T, H, D]`` views (unit-stride last dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, new_empty, pow2, round_as, rows_per_program


@triton.jit
def _rotary_kernel(
    x_ptr, x_st, x_sh,
    out_ptr,
    pos_ptr, cache_ptr,
    num_rows, num_heads, head_dim,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) pairs
    row_ok = (rows < num_rows)[:, None]
    t = (rows // num_heads)[:, None]
    h = (rows % num_heads)[:, None]
    pos = tl.load(pos_ptr + t, mask=row_ok, other=0)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = row_ok & (cols < HALF)
    dtype = out_ptr.dtype.element_ty
    cos = round_as(tl.load(cache_ptr + pos * (2 * HALF) + cols, mask=mask, other=0.0), dtype)
    sin = round_as(tl.load(cache_ptr + pos * (2 * HALF) + HALF + cols, mask=mask, other=0.0), dtype)
    src = x_ptr + t * x_st + h * x_sh
    dst = out_ptr + rows[:, None] * head_dim
    x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    # Each product and the sum rounded to the activations' dtype, as the reference computes them.
    first = round_as(x1 * cos, dtype) - round_as(x2 * sin, dtype)
    second = round_as(x2 * cos, dtype) + round_as(x1 * sin, dtype)
    tl.store(dst + cols, cast(first, dtype), mask=mask)
    tl.store(dst + HALF + cols, cast(second, dtype), mask=mask)
    if BLOCK_REST > 0:
        rest = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]
        rmask = row_ok & (rest < head_dim)
        tl.store(dst + rest, tl.load(src + rest, mask=rmask), mask=rmask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary_cache: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"rotary input must be [T, H, D], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    out = new_empty((num_tokens, num_heads, head_dim), x.dtype, x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    half = rotary_dim // 2
    block_r = rows_per_program(num_rows, pow2(head_dim))
    _rotary_kernel[(triton.cdiv(num_rows, block_r),)](
        x, x.stride(0), x.stride(1),
        out,
        positions, rotary_cache,
        num_rows, num_heads, head_dim,
        HALF=half,
        BLOCK_HALF=pow2(half),
        BLOCK_REST=pow2(head_dim - rotary_dim) if head_dim > rotary_dim else 0,
        BLOCK_R=block_r,
    )
    return out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_cache: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if rotary_dim % 2 or rotary_dim > q.shape[-1] or rotary_cache.shape[-1] != rotary_dim:
        raise ValueError(
            f"rotary_dim {rotary_dim} must be even, <= head_dim {q.shape[-1]} and match the cache's {rotary_cache.shape[-1]}"
        )
    positions = positions.contiguous()
    rotary_cache = rotary_cache.contiguous()
    return _rotate(q, positions, rotary_cache, rotary_dim), _rotate(k, positions, rotary_cache, rotary_dim)
