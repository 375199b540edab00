"""Triton QSA: index-key store and block pooling, block scoring with an exact top-k, and the sparse
attention over the selected tokens (cache layout in ``freetoken.kernels.qsa``).

Every launch is sized by the number of tokens (and a static ``max_blocks`` for the score scratch);
per-token work bounds (complete blocks, selected tokens) are read on the device, so a decode step
needs no device->host sync and can be captured in a CUDA graph.

Top-k is a radix select per query: four 8-bit passes over the query's scores find the k-th largest
score's bits, a last pass keeps the blocks above it and, among blocks equal to it, the lowest block
indices; the output lists the kept blocks in ascending order. Scores are ``>= 0`` (a sum of ReLUs),
so their float32 bits order like the scores (``-0.0`` is treated as ``0``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from freetoken.kernels.qsa import blocks_per_page
from freetoken.kernels.triton.attention import check_attention_shapes
from freetoken.kernels.triton._common import cast, device_function, dot, dot_precision, new_empty, pow2, round_as

_LOG2E = tl.constexpr(1.4426950408889634)  # a plain float global is rejected by compiled Triton


@triton.jit
def _store_index_kernel(k_ptr, k_st, cache_ptr, loc_ptr, dim, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    loc = tl.load(loc_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * k_st + cols, mask=mask, other=0.0)
    tl.store(cache_ptr + loc * dim + cols, cast(k.to(tl.float32), cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pool_blocks_kernel(
    cache_ptr, c_sp, c_st, block_ptr, b_sp, b_si, pt_ptr, pt_sb, req_ptr, pos_ptr, w_ptr, rope_ptr, rope_st,
    eps, page_size, dim, ratio, half, rotary_dim,
    BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    """The token closing a block (``(p + 1) % c == 0``) pools it: mean, zero-centred RMSNorm, rotary at
    the block's first position. The dims are handled as three slices (rotary low half, high half,
    the rest) so the rotation pairs line up without a shuffle."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    if (pos + 1) % ratio == 0:
        dtype = block_ptr.dtype.element_ty
        request = tl.load(req_ptr + t)
        first = pos + 1 - ratio
        members = first + tl.arange(0, BLOCK_C)
        m_ok = members <= pos
        pages = tl.load(pt_ptr + request * pt_sb + members // page_size, mask=m_ok, other=0).to(tl.int64)
        rows = (pages * c_sp + (members % page_size) * c_st)[:, None]
        lo_c = tl.arange(0, BLOCK_HALF)
        rest_c = rotary_dim + tl.arange(0, BLOCK_REST)
        lo_ok, rest_ok = lo_c < half, rest_c < dim
        lo_mask, rest_mask = m_ok[:, None] & lo_ok[None, :], m_ok[:, None] & rest_ok[None, :]
        lo = tl.sum(tl.load(cache_ptr + rows + lo_c[None, :], mask=lo_mask, other=0.0).to(tl.float32), 0)
        hi = tl.sum(tl.load(cache_ptr + rows + (half + lo_c)[None, :], mask=lo_mask, other=0.0).to(tl.float32), 0)
        rest = tl.sum(tl.load(cache_ptr + rows + rest_c[None, :], mask=rest_mask, other=0.0).to(tl.float32), 0)
        lo, hi, rest = round_as(lo / ratio, dtype), round_as(hi / ratio, dtype), round_as(rest / ratio, dtype)
        inv_rms = tl.rsqrt((tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0) + tl.sum(rest * rest, 0)) / dim + eps)
        w_lo = tl.load(w_ptr + lo_c, mask=lo_ok, other=0.0).to(tl.float32)
        w_hi = tl.load(w_ptr + half + lo_c, mask=lo_ok, other=0.0).to(tl.float32)
        w_rest = tl.load(w_ptr + rest_c, mask=rest_ok, other=0.0).to(tl.float32)
        lo = round_as(lo * inv_rms * (1.0 + w_lo), dtype)
        hi = round_as(hi * inv_rms * (1.0 + w_hi), dtype)
        rest = round_as(rest * inv_rms * (1.0 + w_rest), dtype)
        cos = round_as(tl.load(rope_ptr + first * rope_st + lo_c, mask=lo_ok, other=0.0), dtype)
        sin = round_as(tl.load(rope_ptr + first * rope_st + half + lo_c, mask=lo_ok, other=0.0), dtype)
        out_lo = round_as(lo * cos, dtype) - round_as(hi * sin, dtype)
        out_hi = round_as(hi * cos, dtype) + round_as(lo * sin, dtype)
        page = tl.load(pt_ptr + request * pt_sb + first // page_size).to(tl.int64)
        dst = block_ptr + page * b_sp + ((first % page_size) // ratio) * b_si
        tl.store(dst + lo_c, cast(out_lo, dtype), mask=lo_ok)
        tl.store(dst + half + lo_c, cast(out_hi, dtype), mask=lo_ok)
        tl.store(dst + rest_c, cast(rest, dtype), mask=rest_ok)


def qsa_update_index(
    keys: torch.Tensor,
    index_cache: torch.Tensor,
    block_cache: torch.Tensor,
    kv_locations: torch.Tensor,
    page_table: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rotary_cache: torch.Tensor,
    rotary_dim: int,
    compress_ratio: int,
) -> None:
    num_tokens, dim = keys.shape
    num_pages, page_size, cache_dim = index_cache.shape
    if cache_dim != dim or block_cache.shape != (num_pages, blocks_per_page(page_size, compress_ratio), dim):
        raise ValueError(
            f"qsa_update_index: keys {tuple(keys.shape)} do not fit index_cache {tuple(index_cache.shape)} "
            f"and block_cache {tuple(block_cache.shape)} with compress_ratio {compress_ratio}"
        )
    if rotary_dim % 2 or rotary_dim > dim:
        raise ValueError(f"qsa_update_index: rotary_dim {rotary_dim} must be even and <= {dim}")
    if num_tokens == 0:
        return
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if not index_cache.is_contiguous() or block_cache.stride(-1) != 1:
        raise ValueError("qsa_update_index: index_cache must be contiguous, block_cache unit-stride")
    _store_index_kernel[(num_tokens,)](keys, keys.stride(0), index_cache, kv_locations, dim, BLOCK_D=pow2(dim))
    half = rotary_dim // 2
    _pool_blocks_kernel[(num_tokens,)](
        index_cache, index_cache.stride(0), index_cache.stride(1), block_cache, block_cache.stride(0),
        block_cache.stride(1), page_table, page_table.stride(0), token_request, positions, norm_weight,
        rotary_cache, rotary_cache.stride(0), eps, page_size, dim, compress_ratio, half, rotary_dim,
        BLOCK_C=pow2(compress_ratio), BLOCK_HALF=pow2(half), BLOCK_REST=pow2(dim - rotary_dim),
    )


@triton.jit
def _block_scores_kernel(
    q_ptr, q_st, q_sh, block_ptr, b_sp, b_si, pt_ptr, pt_sb, req_ptr, pos_ptr, score_ptr, score_st,
    num_heads, dim, page_size, ratio, sqrt_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    complete = (pos + 1) // ratio
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(1) * BLOCK_N < complete:
        request = tl.load(req_ptr + t)
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        q = tl.load(
            q_ptr + t * q_st + heads[:, None] * q_sh + cols[None, :],
            mask=(heads < num_heads)[:, None] & col_ok[None, :], other=0.0,
        ).to(tl.float32)
        j_ok = j < complete
        first = j * ratio
        page = tl.load(pt_ptr + request * pt_sb + first // page_size, mask=j_ok, other=0).to(tl.int64)
        keys = tl.load(
            block_ptr + (page * b_sp + ((first % page_size) // ratio) * b_si)[:, None] + cols[None, :],
            mask=j_ok[:, None] & col_ok[None, :], other=0.0,
        ).to(tl.float32)
        scores = tl.maximum(dot(q, tl.trans(keys), "ieee"), 0.0)  # [heads, blocks]
        score = tl.sum(scores, 0) / sqrt_dim
        tl.store(score_ptr + t * score_st + j, score, mask=j_ok)


@device_function
def _score_keys(score_ptr, j, ok):
    s = tl.load(score_ptr + j, mask=ok, other=0.0)
    return tl.where(s > 0.0, s.to(tl.int32, bitcast=True), 0)


@triton.jit
def _block_topk_kernel(score_ptr, score_st, pos_ptr, out_ptr, ratio, width, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    # int32 like the constexpr loop bounds of the other branch (compiled Triton wants one type per
    # loop variable); never read past the scratch row (max_blocks too small)
    complete = tl.minimum((pos + 1) // ratio, width).to(tl.int32)
    out = out_ptr + t * TOPK
    scores = score_ptr + t * score_st
    if complete <= TOPK:
        for start in range(0, TOPK, BLOCK):
            j = start + tl.arange(0, BLOCK)
            tl.store(out + j, tl.where(j < complete, j, -1), mask=j < TOPK)
    else:
        bins = tl.arange(0, 256)
        prefix = tl.full([], 0, tl.int32)  # the bits of the k-th largest key found so far
        remaining = tl.full([], TOPK, tl.int32)  # blocks still to take among keys matching the prefix
        for p in tl.static_range(4):
            shift = 24 - 8 * p  # p is a static_range constexpr, so shift is one too
            hist = tl.zeros([256], tl.int32)
            for start in range(0, complete, BLOCK):
                j = start + tl.arange(0, BLOCK)
                ok = j < complete
                key = _score_keys(scores, j, ok)
                if p > 0:
                    ok = ok & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram((key >> shift) & 255, 256, mask=ok)
            at_least = tl.cumsum(hist, 0, reverse=True)  # matching blocks with this digit or a larger one
            digit = tl.max(tl.where(at_least >= remaining, bins, -1), 0)
            remaining -= tl.sum(tl.where(bins > digit, hist, 0), 0)
            prefix = prefix | (digit << shift)
        taken = tl.full([], 0, tl.int32)
        equal_seen = tl.full([], 0, tl.int32)
        for start in range(0, complete, BLOCK):
            j = start + tl.arange(0, BLOCK)
            ok = j < complete
            key = _score_keys(scores, j, ok)
            equal = (ok & (key == prefix)).to(tl.int32)
            equal_rank = equal_seen + tl.cumsum(equal, 0) - equal
            take = ((ok & (key > prefix)) | ((equal != 0) & (equal_rank < remaining))).to(tl.int32)
            rank = taken + tl.cumsum(take, 0) - take
            tl.store(out + rank, j, mask=take != 0)
            taken += tl.sum(take, 0)
            equal_seen += tl.sum(equal, 0)


def qsa_select_blocks(
    q: torch.Tensor,
    block_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    max_blocks: int,
) -> torch.Tensor:
    num_tokens, num_heads, dim = q.shape
    if block_cache.shape[1:] != (blocks_per_page(page_size, compress_ratio), dim):
        raise ValueError(f"qsa_select_blocks: q {tuple(q.shape)} does not fit block_cache {tuple(block_cache.shape)}")
    selected = new_empty((num_tokens, block_topk), torch.int32, q.device)
    if num_tokens == 0:
        return selected
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_cache.stride(-1) != 1:
        raise ValueError("qsa_select_blocks: block_cache needs a unit-stride last dim")
    width = max(max_blocks, 1)
    scores = torch.empty((num_tokens, width), dtype=torch.float32, device=q.device)
    block_n = 64
    _block_scores_kernel[(num_tokens, triton.cdiv(width, block_n))](
        q, q.stride(0), q.stride(1), block_cache, block_cache.stride(0), block_cache.stride(1),
        page_table, page_table.stride(0), token_request, positions, scores, scores.stride(0),
        num_heads, dim, page_size, compress_ratio, math.sqrt(dim),
        BLOCK_H=pow2(num_heads, 16), BLOCK_D=pow2(dim, 16), BLOCK_N=block_n,
    )
    _block_topk_kernel[(num_tokens,)](
        scores, scores.stride(0), positions, selected, compress_ratio, width, TOPK=block_topk, BLOCK=256,
    )
    return selected


@triton.jit
def _sparse_attention_kernel(
    q_ptr, q_st, q_sh, k_ptr, v_ptr, c_sp, c_st, c_sh, pt_ptr, pt_sb, req_ptr, pos_ptr, sel_ptr,
    gate_ptr, g_st, g_sh, out_ptr, scale, num_q_heads, head_dim, page_size, ratio,
    TOPK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program: one token's query heads of one KV head, over its selected blocks then its tail,
    as one list of up to ``TOPK·c + c - 1`` token positions walked ``BLOCK_N`` at a time."""
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(req_ptr + t)
    pos = tl.load(pos_ptr + t)
    complete = (pos + 1) // ratio
    in_blocks = tl.minimum(complete, TOPK) * ratio  # list entries that come from selected blocks
    total = in_blocks + pos + 1 - complete * ratio
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < head_dim
    q = tl.load(q_ptr + t * q_st + head[:, None] * q_sh + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    qk_scale = scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, total, BLOCK_N):
        u = start + tl.arange(0, BLOCK_N)
        ok = u < total
        from_block = u < in_blocks
        block = tl.load(sel_ptr + t * TOPK + u // ratio, mask=ok & from_block, other=0)
        token = tl.where(from_block, block * ratio + u % ratio, complete * ratio + u - in_blocks)
        page = tl.load(pt_ptr + request * pt_sb + token // page_size, mask=ok, other=0).to(tl.int64)
        offs = page * c_sp + (token % page_size) * c_st + kv_head * c_sh
        kv_mask = ok[:, None] & col_ok[None, :]
        k = tl.load(k_ptr + offs[:, None] + cols[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs[:, None] + cols[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    dtype = out_ptr.dtype.element_ty
    o = acc / l_i[:, None]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if HAS_GATE:
        g = tl.load(gate_ptr + t * g_st + head[:, None] * g_sh + cols[None, :], mask=out_mask, other=0.0).to(tl.float32)
        o = round_as(o, dtype) * round_as(tl.sigmoid(g), dtype)
    tl.store(out_ptr + (t * num_q_heads + head)[:, None] * head_dim + cols[None, :], cast(o, dtype), mask=out_mask)


def qsa_sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor,
    compress_ratio: int,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    check_attention_shapes("qsa_sparse_attention", q, k_cache, v_cache, gate)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if selected.shape[0] != num_tokens or not selected.is_contiguous():
        raise ValueError(f"qsa_sparse_attention: selected {tuple(selected.shape)} must be contiguous [tokens, topk]")
    out = new_empty((num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("qsa_sparse_attention needs K and V caches with one layout, unit-stride head dim")
    group = num_q_heads // num_kv_heads
    gate_arg = gate if gate is not None else q
    _sparse_attention_kernel[(num_tokens, num_kv_heads)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table, page_table.stride(0), token_request, positions, selected,
        gate_arg, gate_arg.stride(0), gate_arg.stride(1), out, scale, num_q_heads, head_dim, k_cache.shape[1],
        compress_ratio,
        TOPK=selected.shape[1], GROUP=group, BLOCK_M=pow2(group, 16), BLOCK_N=64 if q.dtype != torch.float32 else 32,
        BLOCK_D=pow2(head_dim, 16), HAS_GATE=gate is not None, PRECISION=dot_precision(q.dtype),
    )
    return out
