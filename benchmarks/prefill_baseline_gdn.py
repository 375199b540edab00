"""Triton Gated DeltaNet: chunked prefill (chunks of 64, initial and final state) and the decode step.

Prefill, per request and value head, in two launches (the chunked WY / UT-transform form of the
reference, ``chunked_delta_rule``):

1. ``_chunk_inverse_kernel``, parallel over every chunk of every request and head: the chunk's
   unit lower-triangular system ``L = I + strict_lower((β·k) kᵀ ⊙ Γ)`` (``Γ`` the pairwise decay)
   and its inverse (blockwise: 16x16 diagonal blocks by forward substitution, then the blocks
   below them by block substitution), stored as ``[chunk, head, 64, 64]`` float32.
2. ``_chunk_scan_kernel``, parallel over (request, head, block of value dims), sequential over the
   request's chunks: applies ``L⁻¹``, reads and updates the float32 state held in registers, and
   writes the outputs. The columns of the state evolve independently, so value-dim blocks need no
   communication.

Chunks are counted per request on the device (``cu_chunks``); grids use an upper bound of the
chunk count so nothing waits for the host. Dot products are exact float32 (``ieee``) when the
activations are float32, TF32 otherwise; all state arithmetic is float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, device_function, dot, dot_precision, new_empty, pow2

CHUNK = 64


@device_function
def _load_normalized(ptr, rows, row_ok, stride_t, cols, col_ok, scale):
    """Rows of q or k as float32, L2-normalised (eps 1e-6 inside the root) and scaled."""
    x = tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    return x * (tl.rsqrt(tl.sum(x * x, 1) + 1e-6) * scale)[:, None]


@device_function
def _find_request(chunk, cu_chunks_ptr, num_requests):
    request = chunk * 0
    for i in range(1, num_requests + 1):
        request += (chunk >= tl.load(cu_chunks_ptr + i)).to(tl.int32)
    return request


@device_function
def _sub_block(k_ptr, k_st, beta_ptr, beta_st, g_ptr, g_st, h, rows, end, cols, col_ok, decay_before):
    """One 16-row block of a chunk: normalised keys, β, and the decay from the chunk start."""
    row_ok = rows < end
    k = _load_normalized(k_ptr, rows, row_ok, k_st, cols, col_ok, 1.0)
    beta = tl.load(beta_ptr + rows * beta_st + h, mask=row_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * g_st + h, mask=row_ok, other=0.0).to(tl.float32)
    return k, beta, decay_before + tl.cumsum(g, 0), decay_before + tl.sum(g, 0)


@device_function
def _off_diagonal(k_i, beta_i, decay_i, k_j, decay_j, PRECISION: tl.constexpr):
    """The block (i, j), i > j, of the system: (β k_i) k_jᵀ ⊙ exp(decay_i - decay_j)."""
    return dot(k_i * beta_i[:, None], tl.trans(k_j), PRECISION) * tl.exp(decay_i[:, None] - decay_j[None, :])


@device_function
def _diagonal_inverse(k, beta, decay, valid, PRECISION: tl.constexpr, SUB: tl.constexpr):
    """Inverse of a unit lower-triangular diagonal block by forward substitution:
    row i is e_i - Σ_{j<i} a[i, j] · (row j of the inverse). Rows past the ``valid`` tokens of the
    block are rows of the identity (their keys are zero), so the substitution stops there."""
    idx = tl.arange(0, SUB)
    lower = idx[:, None] > idx[None, :]
    a = dot(k * beta[:, None], tl.trans(k), PRECISION)
    a = tl.where(lower, a * tl.exp(tl.where(lower, decay[:, None] - decay[None, :], 0.0)), 0.0)
    eye = (idx[:, None] == idx[None, :]).to(tl.float32)
    inv = eye
    for i in range(1, tl.minimum(tl.maximum(valid, 1), SUB)):
        # Only row i of the product is kept; a dot is cheaper than extracting the row.
        row_i = idx[:, None] == i
        inv = tl.where(row_i, eye - dot(tl.where(row_i, a, 0.0), inv, PRECISION), inv)
    return inv


@device_function
def _store_block(base, value, bi: tl.constexpr, bj: tl.constexpr, SUB: tl.constexpr, CHUNK_SIZE: tl.constexpr):
    idx = tl.arange(0, SUB)
    tl.store(base + (bi * SUB + idx)[:, None] * CHUNK_SIZE + (bj * SUB + idx)[None, :], value)


@triton.jit
def _chunk_inverse_kernel(
    k_ptr, k_st, k_sh, beta_ptr, beta_st, g_ptr, g_st,
    cu_ptr, cu_chunks_ptr, inv_ptr,
    num_requests, num_v_heads, key_dim,
    HEAD_RATIO: tl.constexpr, CHUNK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """L⁻¹ of one chunk, blockwise over four 16-row blocks: the diagonal blocks by substitution,
    then ``X_ij = -D_i⁻¹ Σ_{j<=m<i} A_im X_mj`` for the blocks below the diagonal. Only blocks on
    or below the diagonal that hold tokens are written."""
    SUB: tl.constexpr = CHUNK_SIZE // 4
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    request = _find_request(chunk, cu_chunks_ptr, num_requests)
    if request < num_requests:
        t0 = tl.load(cu_ptr + request) + (chunk - tl.load(cu_chunks_ptr + request)) * CHUNK_SIZE
        end = tl.load(cu_ptr + request + 1)
        idx = tl.arange(0, SUB)
        cols = tl.arange(0, BLOCK_K)
        col_ok = cols < key_dim
        kp = k_ptr + (h // HEAD_RATIO) * k_sh
        valid = end - t0
        base = inv_ptr + (chunk * num_v_heads + h).to(tl.int64) * (CHUNK_SIZE * CHUNK_SIZE)
        # Blocks past the chunk's last token are neither computed nor stored: the scan masks them.
        k0, b0, d0, total = _sub_block(kp, k_st, beta_ptr, beta_st, g_ptr, g_st, h, t0 + idx, end, cols, col_ok, 0.0)
        x00 = _diagonal_inverse(k0, b0, d0, valid, PRECISION, SUB)
        _store_block(base, x00, 0, 0, SUB, CHUNK_SIZE)
        if valid > SUB:
            k1, b1, d1, total = _sub_block(kp, k_st, beta_ptr, beta_st, g_ptr, g_st, h, t0 + SUB + idx, end, cols,
                                           col_ok, total)
            x11 = _diagonal_inverse(k1, b1, d1, valid - SUB, PRECISION, SUB)
            a10 = _off_diagonal(k1, b1, d1, k0, d0, PRECISION)
            x10 = -dot(x11, dot(a10, x00, PRECISION), PRECISION)
            _store_block(base, x10, 1, 0, SUB, CHUNK_SIZE)
            _store_block(base, x11, 1, 1, SUB, CHUNK_SIZE)
            if valid > 2 * SUB:
                k2, b2, d2, total = _sub_block(kp, k_st, beta_ptr, beta_st, g_ptr, g_st, h, t0 + 2 * SUB + idx, end,
                                               cols, col_ok, total)
                x22 = _diagonal_inverse(k2, b2, d2, valid - 2 * SUB, PRECISION, SUB)
                a20 = _off_diagonal(k2, b2, d2, k0, d0, PRECISION)
                a21 = _off_diagonal(k2, b2, d2, k1, d1, PRECISION)
                x21 = -dot(x22, dot(a21, x11, PRECISION), PRECISION)
                x20 = -dot(x22, dot(a20, x00, PRECISION) + dot(a21, x10, PRECISION), PRECISION)
                _store_block(base, x20, 2, 0, SUB, CHUNK_SIZE)
                _store_block(base, x21, 2, 1, SUB, CHUNK_SIZE)
                _store_block(base, x22, 2, 2, SUB, CHUNK_SIZE)
                if valid > 3 * SUB:
                    k3, b3, d3, total = _sub_block(kp, k_st, beta_ptr, beta_st, g_ptr, g_st, h, t0 + 3 * SUB + idx,
                                                   end, cols, col_ok, total)
                    x33 = _diagonal_inverse(k3, b3, d3, valid - 3 * SUB, PRECISION, SUB)
                    a30 = _off_diagonal(k3, b3, d3, k0, d0, PRECISION)
                    a31 = _off_diagonal(k3, b3, d3, k1, d1, PRECISION)
                    a32 = _off_diagonal(k3, b3, d3, k2, d2, PRECISION)
                    x32 = -dot(x33, dot(a32, x22, PRECISION), PRECISION)
                    x31 = -dot(x33, dot(a31, x11, PRECISION) + dot(a32, x21, PRECISION), PRECISION)
                    x30 = -dot(x33, dot(a30, x00, PRECISION) + dot(a31, x10, PRECISION) + dot(a32, x20, PRECISION),
                               PRECISION)
                    _store_block(base, x30, 3, 0, SUB, CHUNK_SIZE)
                    _store_block(base, x31, 3, 1, SUB, CHUNK_SIZE)
                    _store_block(base, x32, 3, 2, SUB, CHUNK_SIZE)
                    _store_block(base, x33, 3, 3, SUB, CHUNK_SIZE)


@triton.jit
def _chunk_scan_kernel(
    q_ptr, q_st, q_sh, k_ptr, k_st, k_sh, v_ptr, v_st, v_sh,
    beta_ptr, beta_st, g_ptr, g_st,
    state_ptr, st_ss, st_sh, st_sk,
    slot_ptr, cu_ptr, cu_chunks_ptr, inv_ptr, out_ptr,
    num_v_heads, key_dim, value_dim, q_scale,
    HEAD_RATIO: tl.constexpr, CHUNK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // HEAD_RATIO
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vcols < value_dim
    kcols = tl.arange(0, BLOCK_K)
    k_ok = kcols < key_dim
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    first_chunk = tl.load(cu_chunks_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * st_ss + h * st_sh + kcols[:, None] * st_sk + vcols[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0)
    idx = tl.arange(0, CHUNK_SIZE)
    causal = idx[:, None] >= idx[None, :]
    for c in range(0, tl.cdiv(end - start, CHUNK_SIZE)):
        rows = start + c * CHUNK_SIZE + idx
        row_ok = rows < end
        q = _load_normalized(q_ptr + kh * q_sh, rows, row_ok, q_st, kcols, k_ok, q_scale)
        k = _load_normalized(k_ptr + kh * k_sh, rows, row_ok, k_st, kcols, k_ok, 1.0)
        v = tl.load(v_ptr + rows[:, None] * v_st + h * v_sh + vcols[None, :],
                    mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * beta_st + h, mask=row_ok, other=0.0).to(tl.float32)
        decay = tl.cumsum(tl.load(g_ptr + rows * g_st + h, mask=row_ok, other=0.0).to(tl.float32), 0)
        decay_last = tl.sum(tl.where(idx == CHUNK_SIZE - 1, decay, 0.0), 0)
        inv_base = inv_ptr + ((first_chunk + c) * num_v_heads + h).to(tl.int64) * (CHUNK_SIZE * CHUNK_SIZE)
        # Only the block-lower-triangular part over the chunk's tokens was written.
        inv_mask = ((idx[:, None] // (CHUNK_SIZE // 4)) >= (idx[None, :] // (CHUNK_SIZE // 4))) & row_ok[:, None] & row_ok[None, :]
        inv = tl.load(inv_base + idx[:, None] * CHUNK_SIZE + idx[None, :], mask=inv_mask, other=0.0)
        # W = L⁻¹ (β k e^decay) reads the state; U = L⁻¹ (β v) are the new values before correction.
        w = dot(inv, k * (beta * tl.exp(decay))[:, None], PRECISION)
        u = dot(inv, v * beta[:, None], PRECISION)
        corrected = u - dot(w, state, PRECISION)
        qk = dot(q, tl.trans(k), PRECISION)
        qk = tl.where(causal, qk * tl.exp(tl.where(causal, decay[:, None] - decay[None, :], 0.0)), 0.0)
        out = dot(q * tl.exp(decay)[:, None], state, PRECISION) + dot(qk, corrected, PRECISION)
        tl.store(out_ptr + rows[:, None] * (num_v_heads * value_dim) + h * value_dim + vcols[None, :],
                 cast(out, out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
        k_to_end = k * tl.exp(decay_last - decay)[:, None]
        state = state * tl.exp(decay_last) + dot(tl.trans(k_to_end), corrected, PRECISION)
    tl.store(s_ptrs, state, mask=s_mask)


def _unit_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _check(q, k, v, g, beta, state) -> None:
    num_k_heads, key_dim = k.shape[-2:]
    num_v_heads, value_dim = v.shape[-2:]
    if (
        q.shape != k.shape
        or num_v_heads % num_k_heads
        or g.shape != v.shape[:-1]
        or beta.shape != v.shape[:-1]
        or state.shape[1:] != (num_v_heads, key_dim, value_dim)
        or state.dtype != torch.float32
        or state.stride(-1) != 1
    ):
        raise ValueError(
            f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, state {tuple(state.shape)} {state.dtype} disagree"
        )


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    _check(q, k, v, g, beta, state)
    q, k, v, g, beta = _unit_stride(q, k, v, g, beta)
    num_tokens, num_v_heads, value_dim = v.shape
    num_k_heads, key_dim = k.shape[1:]
    num_requests = state_slots.shape[0]
    out = new_empty((num_tokens, num_v_heads, value_dim), v.dtype, v.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    cu_chunks = F.pad(torch.cumsum((lens + CHUNK - 1) // CHUNK, 0), (1, 0)).to(torch.int32)
    max_chunks = triton.cdiv(num_tokens, CHUNK) + num_requests
    inverse = new_empty((max_chunks, num_v_heads, CHUNK, CHUNK), torch.float32, v.device)
    precision = dot_precision(v.dtype)
    block_k = pow2(key_dim, 16)
    ratio = num_v_heads // num_k_heads
    _chunk_inverse_kernel[(max_chunks, num_v_heads)](
        k, k.stride(0), k.stride(1), beta, beta.stride(0), g, g.stride(0),
        cu_seqlens, cu_chunks, inverse,
        num_requests, num_v_heads, key_dim,
        HEAD_RATIO=ratio, CHUNK_SIZE=CHUNK, BLOCK_K=block_k, PRECISION=precision,
        num_warps=4,
    )
    block_v = min(pow2(value_dim, 16), 32)
    _chunk_scan_kernel[(num_requests, num_v_heads, triton.cdiv(value_dim, block_v))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        beta, beta.stride(0), g, g.stride(0),
        state, state.stride(0), state.stride(1), state.stride(2),
        state_slots, cu_seqlens, cu_chunks, inverse, out,
        num_v_heads, key_dim, value_dim, key_dim**-0.5,
        HEAD_RATIO=ratio, CHUNK_SIZE=CHUNK, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision,
        num_warps=8, num_stages=1,  # the loop over chunks is sequential; staging its loads overflows shared memory
    )
    return out


@triton.jit
def _decode_step_kernel(
    q_ptr, q_sb, q_sh, k_ptr, k_sb, k_sh, v_ptr, v_sb, v_sh,
    beta_ptr, beta_sb, g_ptr, g_sb,
    state_ptr, st_ss, st_sh, st_sk, slot_ptr, out_ptr,
    num_v_heads, key_dim, value_dim, q_scale,
    HEAD_RATIO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // HEAD_RATIO
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vcols < value_dim
    kcols = tl.arange(0, BLOCK_K)
    k_ok = kcols < key_dim
    q = tl.load(q_ptr + b * q_sb + kh * q_sh + kcols, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * k_sb + kh * k_sh + kcols, mask=k_ok, other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + b * v_sb + h * v_sh + vcols, mask=v_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b * beta_sb + h).to(tl.float32)
    g = tl.load(g_ptr + b * g_sb + h).to(tl.float32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * st_ss + h * st_sh + kcols[:, None] * st_sk + vcols[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * tl.exp(g)
    predicted = tl.sum(s * k[:, None], 0)
    s = s + k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(s_ptrs, s, mask=s_mask)
    out = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + (b * num_v_heads + h) * value_dim + vcols, cast(out, out_ptr.dtype.element_ty), mask=v_ok)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    _check(q, k, v, g, beta, state)
    q, k, v, g, beta = _unit_stride(q, k, v, g, beta)
    batch, num_v_heads, value_dim = v.shape
    num_k_heads, key_dim = k.shape[1:]
    out = new_empty((batch, num_v_heads, value_dim), v.dtype, v.device)
    if batch == 0:
        return out
    block_v = min(pow2(value_dim), 32)
    _decode_step_kernel[(batch, num_v_heads, triton.cdiv(value_dim, block_v))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        beta, beta.stride(0), g, g.stride(0),
        state, state.stride(0), state.stride(1), state.stride(2), state_slots, out,
        num_v_heads, key_dim, value_dim, key_dim**-0.5,
        HEAD_RATIO=num_v_heads // num_k_heads, BLOCK_K=pow2(key_dim), BLOCK_V=block_v,
        num_warps=4,
    )
    return out
