"""Triton attention prologue: q/k zero-centred RMSNorm, partial NeoX rotary and the KV store in one
launch.

The grid is (blocks of tokens) x (Hq + 2·Hkv heads): a program takes one head of ``BLOCK_T``
tokens; query and key heads are normalised and rotated (queries written to the output, keys to
the cache), value heads copied to the cache. Roundings follow the references: the normalised row
is rounded to the activations' dtype, cos/sin too, and each rotary product and sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, new_empty, pow2, round_as, rows_per_program
from freetoken.kernels.triton.moe_decode import _pdl_available


@triton.jit
def _prologue_kernel(
    q_ptr, q_st, q_sh, k_ptr, k_st, k_sh, v_ptr, v_st, v_sh,
    qw_ptr, kw_ptr, pos_ptr, cache_ptr,
    kc_ptr, vc_ptr, c_st, c_sh, loc_ptr, out_ptr,
    num_tokens, num_q_heads, num_kv_heads, head_dim, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # every input may be an earlier launch's output: wait before any load, then let the next launch start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    h = tl.program_id(1)
    t_ok = t < num_tokens
    loc = tl.load(loc_ptr + t, mask=t_ok, other=0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = t_ok & (cols < HALF)
    rest = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]  # the dims past rotary_dim (none if it is head_dim)
    rmask = t_ok & (rest < head_dim)
    if h < num_q_heads + num_kv_heads:
        is_q = h < num_q_heads
        kh = h - num_q_heads
        src = tl.where(is_q, q_ptr + t * q_st + h * q_sh, k_ptr + t * k_st + kh * k_sh)
        w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
        # The zero-centred norm of the row, read in its three parts (rotated halves, the rest).
        x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(src + rest, mask=rmask, other=0.0).to(tl.float32)
        sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xr * xr, 1)
        inv_rms = tl.rsqrt(sq / head_dim + eps)[:, None]
        w_ok = cols < HALF
        w1 = tl.load(w_ptr + cols, mask=w_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=w_ok, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + rest, mask=rest < head_dim, other=0.0).to(tl.float32)
        x1 = round_as(x1 * inv_rms * (1.0 + w1), dtype)
        x2 = round_as(x2 * inv_rms * (1.0 + w2), dtype)
        xr = round_as(xr * inv_rms * (1.0 + wr), dtype)
        # The rotation, as apply_rotary.
        pos = tl.load(pos_ptr + t, mask=t_ok, other=0)
        cos = round_as(tl.load(cache_ptr + pos * (2 * HALF) + cols, mask=mask, other=0.0), dtype)
        sin = round_as(tl.load(cache_ptr + pos * (2 * HALF) + HALF + cols, mask=mask, other=0.0), dtype)
        first = round_as(x1 * cos, dtype) - round_as(x2 * sin, dtype)
        second = round_as(x2 * cos, dtype) + round_as(x1 * sin, dtype)
        if is_q:
            dst = out_ptr + (t * num_q_heads + h) * head_dim
            tl.store(dst + cols, cast(first, dtype), mask=mask)
            tl.store(dst + HALF + cols, cast(second, dtype), mask=mask)
            tl.store(dst + rest, cast(xr, dtype), mask=rmask)
        else:
            # Rounded to the activations' dtype first, then to the cache's (the reference's k.to()).
            cdtype = kc_ptr.dtype.element_ty
            dst = kc_ptr + loc * c_st + kh * c_sh
            tl.store(dst + cols, cast(round_as(first, dtype), cdtype), mask=mask)
            tl.store(dst + HALF + cols, cast(round_as(second, dtype), cdtype), mask=mask)
            tl.store(dst + rest, cast(xr, cdtype), mask=rmask)
    else:
        vh = h - num_q_heads - num_kv_heads
        d = tl.arange(0, BLOCK_D)[None, :]
        vmask = t_ok & (d < head_dim)
        val = tl.load(v_ptr + t * v_st + vh * v_sh + d, mask=vmask)
        tl.store(vc_ptr + loc * c_st + vh * c_sh + d, cast(val.to(tl.float32), vc_ptr.dtype.element_ty), mask=vmask)


def norm_rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    rotary_cache: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_locations: torch.Tensor,
) -> torch.Tensor:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"attention prologue: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D]")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if (
        k.shape != (num_tokens, num_kv_heads, head_dim)
        or v.shape != k.shape
        or q_norm_weight.shape != (head_dim,)
        or k_norm_weight.shape != (head_dim,)
        or k_cache.shape[2:] != (num_kv_heads, head_dim)
        or v_cache.shape != k_cache.shape
        or positions.shape != (num_tokens,)
        or kv_locations.shape != (num_tokens,)
    ):
        raise ValueError(
            f"attention prologue: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, q_norm_weight "
            f"{tuple(q_norm_weight.shape)}, k_norm_weight {tuple(k_norm_weight.shape)}, caches {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)}, positions {tuple(positions.shape)}, kv_locations {tuple(kv_locations.shape)} disagree"
        )
    if rotary_dim % 2 or rotary_dim > head_dim or rotary_cache.shape[-1] != rotary_dim:
        raise ValueError(
            f"rotary_dim {rotary_dim} must be even, <= head_dim {head_dim} and match the cache's {rotary_cache.shape[-1]}"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("attention prologue needs K and V caches with one dense layout")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = new_empty((num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    if num_tokens == 0:
        return out
    half = rotary_dim // 2
    block_t = rows_per_program(num_tokens, pow2(head_dim))
    _prologue_kernel[(triton.cdiv(num_tokens, block_t), num_q_heads + 2 * num_kv_heads)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        q_norm_weight.contiguous(), k_norm_weight.contiguous(), positions.contiguous(), rotary_cache.contiguous(),
        k_cache, v_cache, k_cache.stride(1), k_cache.stride(2), kv_locations.contiguous(), out,
        num_tokens, num_q_heads, num_kv_heads, head_dim, eps,
        HALF=half, BLOCK_HALF=pow2(half),
        BLOCK_REST=pow2(head_dim - rotary_dim), BLOCK_D=pow2(head_dim),
        BLOCK_T=block_t, PDL=_pdl_available(), launch_pdl=_pdl_available(),
    )
    return out
