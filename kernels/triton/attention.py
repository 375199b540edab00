"""Triton paged attention (varlen prefill and decode) and the KV-cache store.

``paged_attention`` grid: (request x query block, KV head). A program's rows are (query token,
query head of the KV head's group) pairs, so GQA heads share one load of each key block and a
decode step still fills the rows of a matrix-unit tile. Keys are gathered through the page table
block by block, with an online (flash) softmax in float32.

When every request's new tokens fit in one query block (decode steps), the launch goes to
``attention_decode.paged_decode_attention`` instead: split-KV over the keys, with the split plan
derived on the device and the merge done in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import (
    cast,
    device_function,
    dot,
    dot_precision,
    new_empty,
    pow2,
    round_as,
    rows_per_program,
)
from freetoken.kernels.triton.attention_decode import paged_decode_attention


@triton.jit
def _store_kv_kernel(
    k_ptr, k_st, k_sh, v_ptr, v_st, v_sh,
    kc_ptr, vc_ptr, c_st, c_sh,
    loc_ptr, num_rows, num_heads, head_dim,
    SAME_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) pairs
    t = (rows // num_heads)[:, None]
    h = (rows % num_heads)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    row_ok = (rows < num_rows)[:, None]
    mask = row_ok & (cols < head_dim)
    loc = tl.load(loc_ptr + t, mask=row_ok, other=0).to(tl.int64)
    dst = loc * c_st + h * c_sh + cols
    k = tl.load(k_ptr + t * k_st + h * k_sh + cols, mask=mask)
    v = tl.load(v_ptr + t * v_st + h * v_sh + cols, mask=mask)
    if SAME_DTYPE:
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)
    else:
        tl.store(kc_ptr + dst, cast(k.to(tl.float32), kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, cast(v.to(tl.float32), vc_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_locations: torch.Tensor
) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (num_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("store_kv needs K and V caches with one dense layout")
    num_rows = num_tokens * num_heads
    block_d = pow2(head_dim)
    block_r = rows_per_program(num_rows, block_d)
    _store_kv_kernel[(triton.cdiv(num_rows, block_r),)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(1), k_cache.stride(2),
        kv_locations, num_rows, num_heads, head_dim,
        SAME_DTYPE=k.dtype == k_cache.dtype and v.dtype == v_cache.dtype,
        BLOCK_R=block_r, BLOCK_D=block_d,
    )


@device_function
def _attend_block(q, acc, m_i, l_i, start, hi, pos, qk_scale,
                  k_ptr, v_ptr, c_sp, c_st, c_sh, pages_ptr, page_size, kv_head, cols, col_ok,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One key block of the online softmax; ``MASKED`` blocks apply the causal and end masks.

    Few CUDA-core operations per score, which on sm_90 run between the two tensor-core products,
    not beside them: the scale folded into the exponent's FMA (``exp2(s·c - m)`` with the row
    maximum taken of the raw scores), and in unmasked blocks, where no row's maximum is ``-inf``,
    no guard for it. On the H200 at 8k tokens (``benchmarks/prefill_sweep.py``, session 21) this
    beat the scores scaled first and always guarded: head_dim 256 1,399.7 us against 1,423.9,
    head_dim 128 921.6 against 941.0."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    page = tl.load(pages_ptr + n // page_size, mask=n_ok, other=0).to(tl.int64)
    offs = page * c_sp + (n % page_size) * c_st + kv_head * c_sh
    kv_mask = n_ok[:, None] & col_ok[None, :]
    k = tl.load(k_ptr + offs[:, None] + cols[None, :], mask=kv_mask, other=0.0)
    s = dot(q, tl.trans(k), PRECISION)
    if MASKED:
        s = tl.where(n_ok[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + offs[:, None] + cols[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attention_kernel(
    q_ptr, q_st, q_sh,
    k_ptr, v_ptr, c_sp, c_st, c_sh,
    pt_ptr, pt_sb,
    cu_ptr, seq_ptr,
    gate_ptr, g_st, g_sh,
    out_ptr,
    scale, num_q_heads, page_size, head_dim, blocks_per_request,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // blocks_per_request
    q_block = blocks_per_request - 1 - pid % blocks_per_request  # longest (causal) programs first
    kv_head = tl.program_id(1)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        context = tl.load(seq_ptr + b)
        rows = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        pos = context - q_len + tok
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < head_dim
        q = tl.load(
            q_ptr + (q_start + tok)[:, None] * q_st + head[:, None] * q_sh + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        hi = context - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # keys this block sees (causal)
        qk_scale = scale * 1.4426950408889634  # softmax in base 2
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Key blocks every row of the block sees in full need no mask; the causal diagonal does.
        first_pos = context - q_len + q_block * BLOCK_Q
        mid = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, hi)
        kv = (k_ptr, v_ptr, c_sp, c_st, c_sh, pt_ptr + b * pt_sb, page_size, kv_head, cols, col_ok)
        for start in range(0, mid, BLOCK_N):
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, start, hi, pos, qk_scale, *kv, BLOCK_N, False, PRECISION)
        for start in range(mid, hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, start, hi, pos, qk_scale, *kv, BLOCK_N, True, PRECISION)
        out_rows = (q_start + tok) * num_q_heads + head
        dtype = out_ptr.dtype.element_ty
        # Rounded to the output dtype first (as the reference rounds): the float32 accumulator
        # is dead before the gate tile is loaded.
        o = cast(acc / l_i[:, None], dtype)
        if HAS_GATE:
            g = tl.load(
                gate_ptr + (q_start + tok)[:, None] * g_st + head[:, None] * g_sh + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            o = cast(o.to(tl.float32) * round_as(tl.sigmoid(g), dtype), dtype)
        tl.store(
            out_ptr + out_rows[:, None] * head_dim + cols[None, :],
            o,
            mask=row_ok[:, None] & col_ok[None, :],
        )


# The half-precision prefill kernel's register cap at head_dim <= 128 (ptxas .maxnreg; 0: the
# compiler's choice, 190 at 128 x 64 tiles, one 8-warp program an SM). 128 fits two programs an
# SM, so one's softmax overlaps the other's products, at ~30 spill stores: head_dim 128 at 8k
# tokens 711.7 us (386 TFLOP/s) against 921.6 uncapped (same sweep). Head_dim 256 runs uncapped:
# its 128 x 256 float32 accumulator alone is 128 registers a thread.
PREFILL_MAX_REGISTERS = 128


def _tile_sizes(dtype: torch.dtype, head_dim: int, group: int, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Half-precision prefill takes 128 query rows
    (16 tokens x 8 GQA heads share each key block) in two warpgroups of 64 rows, 64-key blocks two
    stages deep: the fastest tiles measured on the H200 for head_dim 256 and 128 (1408 / 934 µs at
    8k tokens; 32-key blocks for 256: 1929, three stages for 128: 979; docs/benchmarks.md run 6)
    although head_dim 256 spills a little there (the 128 x 256 float32 accumulator).
    float32 tiles are halved to fit shared memory."""
    wide = dtype == torch.float32
    if not wide and group * max_seqlen_q >= 128:
        return 128, 64, 8, 2
    block_m_max = 32 if wide and head_dim > 128 else 64
    block_m = max(min(block_m_max, pow2(group * max_seqlen_q, 16)), pow2(group))
    block_n = 32 if wide and head_dim > 128 else 64
    num_warps = 8 if block_m * pow2(head_dim) >= 64 * 128 else 4
    return block_m, block_n, num_warps, 2


def check_attention_shapes(
    op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, gate: torch.Tensor | None
) -> None:
    """``q [T, Hq, D]`` fits the caches ``[pages, page_size, Hkv, D]`` (GQA: Hkv divides Hq); ``gate`` is q's shape."""
    if q.shape[1] % k_cache.shape[2] or k_cache.shape[3] != q.shape[2] or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: q {tuple(q.shape)} does not fit the caches {tuple(k_cache.shape)}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"{op}: gate {tuple(gate.shape)} != q {tuple(q.shape)}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    check_attention_shapes("paged_attention", q, k_cache, v_cache, gate)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return new_empty((num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs K and V caches with one layout, unit-stride head dim")
    group = num_q_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = _tile_sizes(q.dtype, head_dim, group, max_seqlen_q)
    block_q = block_m // group
    blocks_per_request = triton.cdiv(max_seqlen_q, block_q)
    if blocks_per_request == 1:
        return paged_decode_attention(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, max_seqlen_q, gate=gate
        )
    out = new_empty((num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    gate_arg = gate if gate is not None else q
    _attention_kernel[(num_requests * blocks_per_request, num_kv_heads)](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table, page_table.stride(0),
        cu_seqlens_q, seq_lens,
        gate_arg, gate_arg.stride(0), gate_arg.stride(1),
        out,
        scale, num_q_heads, k_cache.shape[1], head_dim, blocks_per_request,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=pow2(head_dim),
        HAS_GATE=gate is not None, PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
        maxnreg=PREFILL_MAX_REGISTERS if PREFILL_MAX_REGISTERS and q.dtype != torch.float32 and head_dim <= 128 else None,
    )
    return out
