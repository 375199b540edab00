"""Triton Gated DeltaNet: chunked prefill (chunks of 64, initial and final state) and the decode step.

Prefill is the chunked WY / UT-transform form of the reference (``chunked_delta_rule``) in three
launches, so that only two dependent products per chunk remain sequential:

1. ``_intra_chunk_kernel``, parallel over every chunk of every request and head: the chunk's
   unit lower-triangular system ``L = I + strict_lower((β·k̂) k̂ᵀ ⊙ Γ)`` (``Γ`` the pairwise decay),
   its inverse in registers (the four 16x16 diagonal blocks by forward substitution, as one
   batch; the blocks below them as four 64-wide products), ``W = L⁻¹ (β k̂ e^γ)`` and
   ``U = L⁻¹ (β v)``.
2. ``_state_pass_kernel``, parallel over (request, head, block of value dims), sequential over the
   request's chunks: stores the state at each chunk's start, ``v' = U − W·S`` and updates ``S``
   (float32, in registers); the value block is narrowed until the launch fills the SMs twice.
3. ``_output_kernel``, parallel over (chunk, value block; head):
   ``o = (q̂ e^γ) S_start + (q̂ k̂ᵀ ⊙ Γ, causal) v'``.

Chunks are counted per request on the device (``cu_chunks``, and the request of every chunk);
grids use an upper bound of the chunk count so nothing waits for the host. W, U, v' and the chunk
states are stored in the activations' dtype in bf16/fp16 runs (the dot operands of the tensor
cores, as flash-linear-attention does) and in float32 with exact (``ieee``) dots in float32 runs;
the inverse is float32 (TF32 dots in bf16 runs), and all state and decay arithmetic is float32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from freetoken.kernels.prefill_snapshots import DELTA_RULE_CHUNK, PrefillSnapshots
from freetoken.kernels.triton._common import cast, device_function, dot, dot_precision, new_empty, pow2

CHUNK = DELTA_RULE_CHUNK
# Loads of the state pass are issued this many chunks minus one ahead: with 2 (round 1) the next
# chunk's W and keys were requested only after this chunk's products, so every chunk waited for them.
STATE_PASS_STAGES = 3
# Value columns per program of the outputs: the whole head (128) reads q and k and forms q kᵀ once
# per (chunk, head); round 1 took 64 (two programs each).
OUTPUT_BLOCK_V = 128


@device_function
def _row_rsqrt(x):
    """1 / sqrt(Σ x² + 1e-6) per row: the reference's L2 normalisation, applied as a row scale."""
    x = x.to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, 1) + 1e-6)


@device_function
def _diagonal_inverses(a, PRECISION: tl.constexpr, SUB: tl.constexpr):
    """Inverses of the unit lower-triangular blocks ``I + a[b]`` of a batch ``a [B, SUB, SUB]``,
    all blocks at once, by forward substitution: row i is e_i - Σ_{j<i} a[i, j] · (row j of the
    inverse). Rows of tokens past the end are rows of the identity (their keys are zero)."""
    idx = tl.arange(0, SUB)
    eye = (idx[:, None] == idx[None, :]).to(tl.float32)[None, :, :]
    inv = eye + tl.zeros(a.shape, tl.float32)
    for i in range(1, SUB):
        # Only row i of each product is kept; a (batched) dot is cheaper than extracting the row.
        row_i = (idx == i)[None, :, None]
        inv = tl.where(row_i, eye - dot(tl.where(row_i, a, 0.0), inv, PRECISION), inv)
    return inv


@device_function
def _chunk_inverse(a, PRECISION: tl.constexpr, CHUNK_SIZE: tl.constexpr):
    """``(I + a)⁻¹`` for the strictly lower ``a [CHUNK, CHUNK]`` of one chunk. With ``D`` the unit
    block diagonal (four 16x16 blocks) and ``E`` the rest: ``(D + E)⁻¹ = (I + M)⁻¹ D⁻¹``,
    ``M = D⁻¹E`` strictly block-lower, so ``M⁴ = 0`` and ``(I + M)⁻¹ = I - M + M² - M³``: the block
    substitution as four 64-wide products; the diagonal blocks by substitution, as one batch."""
    SUB: tl.constexpr = CHUNK_SIZE // 4
    idx = tl.arange(0, CHUNK_SIZE)
    blk = tl.arange(0, 4)
    on_diagonal = (blk[:, None, None, None] == blk[None, None, :, None])  # [4, 1, 4, 1]
    blocks = tl.reshape(a, [4, SUB, 4, SUB])
    d_inv = _diagonal_inverses(tl.sum(tl.where(on_diagonal, blocks, 0.0), 2), PRECISION, SUB)
    d_inv = tl.reshape(tl.where(on_diagonal, d_inv[:, :, None, :], 0.0), [CHUNK_SIZE, CHUNK_SIZE])
    e = tl.where((idx[:, None] // SUB) > (idx[None, :] // SUB), a, 0.0)
    m = dot(d_inv, e, PRECISION)
    m2 = dot(m, m, PRECISION)
    eye = (idx[:, None] == idx[None, :]).to(tl.float32)
    return dot(eye - m + m2 - dot(m2, m, PRECISION), d_inv, PRECISION)


@triton.jit
def _intra_chunk_kernel(
    k_ptr, k_st, k_sh, v_ptr, v_st, v_sh, beta_ptr, beta_st, g_ptr, g_st,
    cu_ptr, cu_chunks_ptr, chunk_request_ptr, w_ptr, u_ptr, to_end_ptr, chunk_decay_ptr,
    num_requests, num_tokens, num_v_heads, key_dim, value_dim,
    HEAD_RATIO: tl.constexpr, CHUNK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One chunk of one head, in parallel over all: the system ``L = I + strict_lower((β k̂) k̂ᵀ ⊙ Γ)``,
    its inverse (``_chunk_inverse``, in registers), ``W = L⁻¹ (β k̂ e^γ)`` and ``U = L⁻¹ (β v)``
    (``k̂`` the normalised keys, ``γ`` the decay from the chunk start, ``Γ`` the pairwise decay),
    stored ``[head, token, dim]`` in the dot-operand dtype; and what the state pass needs,
    ``‖k‖⁻¹ e^(γ_last − γ)`` per token and ``e^γ_last`` per chunk. The raw keys and values are the
    dot operands: the normalisation and the row factors go on the rows and columns of the products."""
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    request = tl.load(chunk_request_ptr + chunk)
    if request < num_requests:
        op = w_ptr.dtype.element_ty
        t0 = tl.load(cu_ptr + request) + (chunk - tl.load(cu_chunks_ptr + request)) * CHUNK_SIZE
        end = tl.load(cu_ptr + request + 1)
        idx = tl.arange(0, CHUNK_SIZE)
        rows = t0 + idx
        row_ok = rows < end
        kcols = tl.arange(0, BLOCK_K)
        k_ok = kcols < key_dim
        vcols = tl.arange(0, BLOCK_V)
        v_ok = vcols < value_dim
        k = tl.load(k_ptr + rows[:, None] * k_st + (h // HEAD_RATIO) * k_sh + kcols[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * v_st + h * v_sh + vcols[None, :],
                    mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        beta = tl.load(beta_ptr + rows * beta_st + h, mask=row_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows * g_st + h, mask=row_ok, other=0.0).to(tl.float32)
        decay = tl.cumsum(g, 0)
        decay_last = tl.sum(g, 0)  # padding has g = 0, as in the reference
        k_scale = _row_rsqrt(k)
        k_op = cast(k.to(tl.float32), op)
        lower = idx[:, None] > idx[None, :]
        gram = dot(k_op, tl.trans(k_op), PRECISION) * (beta * k_scale)[:, None] * k_scale[None, :]
        # The exponent is masked too: above the diagonal it could overflow.
        a = tl.where(lower, gram * tl.exp(tl.where(lower, decay[:, None] - decay[None, :], 0.0)), 0.0)
        inv = _chunk_inverse(a, PRECISION, CHUNK_SIZE)
        w = dot(cast(inv * (beta * k_scale * tl.exp(decay))[None, :], op), k_op, PRECISION)
        u = dot(cast(inv * beta[None, :], op), cast(v.to(tl.float32), op), PRECISION)
        head_rows = h.to(tl.int64) * num_tokens + rows
        tl.store(w_ptr + head_rows[:, None] * key_dim + kcols[None, :], cast(w, op),
                 mask=row_ok[:, None] & k_ok[None, :])
        tl.store(u_ptr + head_rows[:, None] * value_dim + vcols[None, :], cast(u, op),
                 mask=row_ok[:, None] & v_ok[None, :])
        tl.store(to_end_ptr + head_rows, k_scale * tl.exp(decay_last - decay), mask=row_ok)
        tl.store(chunk_decay_ptr + chunk * num_v_heads + h, tl.exp(decay_last))


@triton.jit
def _state_pass_kernel(
    k_ptr, k_st, k_sh, w_ptr, u_ptr, to_end_ptr, chunk_decay_ptr,
    state_ptr, st_ss, st_sh, st_sk, slot_ptr, cu_ptr, cu_chunks_ptr, states_ptr, v_new_ptr,
    request_chunks_ptr, chunk_rows_ptr, chunk_ends_ptr, chunk_snapshot_ptr,
    num_tokens, num_v_heads, key_dim, value_dim,
    HEAD_RATIO: tl.constexpr, CHUNK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr, SEGMENTED: tl.constexpr,
):
    """The only sequential part, per (request, head, block of value dims): for each chunk, store
    the state at its start, ``v' = U − W·S`` (stored), ``S = e^γ_last S + k̂ᵀ (e^(γ_last−γ) v')``.
    Two dependent products per chunk; the loads do not depend on the state, so they pipeline.
    The state's columns evolve independently, so value blocks need no communication.

    ``SEGMENTED`` (prefix-cache snapshots inside the chunk, ``PrefillSnapshots``): the request's
    chunks are those of its segments, in order, each chunk's rows read from the per-chunk tables
    (three independent loads, no chain); the state after a chunk that ends a segment at a snapshot
    is stored in the snapshot's row too."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    op = w_ptr.dtype.element_ty
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vcols < value_dim
    kcols = tl.arange(0, BLOCK_K)
    k_ok = kcols < key_dim
    s_mask = k_ok[:, None] & v_ok[None, :]
    if SEGMENTED:
        first_chunk = tl.load(request_chunks_ptr + b)
        num_chunks = tl.load(request_chunks_ptr + b + 1) - first_chunk
    else:
        start = tl.load(cu_ptr + b)
        end = tl.load(cu_ptr + b + 1)
        first_chunk = tl.load(cu_chunks_ptr + b)
        num_chunks = tl.cdiv(end - start, CHUNK_SIZE)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_cols = h * st_sh + kcols[:, None] * st_sk + vcols[None, :]
    s_ptrs = state_ptr + slot * st_ss + s_cols
    state = tl.load(s_ptrs, mask=s_mask, other=0.0)
    idx = tl.arange(0, CHUNK_SIZE)
    kp = k_ptr + (h // HEAD_RATIO) * k_sh
    # The chunk decay is loaded a chunk ahead by hand: the software pipeline prefetches tensors only.
    next_decay = tl.load(chunk_decay_ptr + first_chunk * num_v_heads + h, mask=num_chunks > 0, other=1.0)
    for c in range(0, num_chunks):
        chunk_decay = next_decay
        next_decay = tl.load(chunk_decay_ptr + (first_chunk + c + 1) * num_v_heads + h, mask=c + 1 < num_chunks,
                             other=1.0)
        if SEGMENTED:
            rows = tl.load(chunk_rows_ptr + first_chunk + c) + idx
            row_ok = rows < tl.load(chunk_ends_ptr + first_chunk + c)
            snapshot = tl.load(chunk_snapshot_ptr + first_chunk + c)
        else:
            rows = start + c * CHUNK_SIZE + idx
            row_ok = rows < end
        head_rows = h.to(tl.int64) * num_tokens + rows
        chunk = (first_chunk + c) * num_v_heads + h
        tl.store(states_ptr + chunk.to(tl.int64) * (key_dim * value_dim) + kcols[:, None] * value_dim + vcols[None, :],
                 cast(state, op), mask=s_mask)
        w = tl.load(w_ptr + head_rows[:, None] * key_dim + kcols[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        u = tl.load(u_ptr + head_rows[:, None] * value_dim + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :],
                    other=0.0)
        k_t = tl.load(kp + rows[None, :] * k_st + kcols[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        to_end = tl.load(to_end_ptr + head_rows, mask=row_ok, other=0.0)
        v_new = u.to(tl.float32) - dot(w, cast(state, op), PRECISION)
        tl.store(v_new_ptr + head_rows[:, None] * value_dim + vcols[None, :], cast(v_new, op),
                 mask=row_ok[:, None] & v_ok[None, :])
        state = state * chunk_decay + dot(cast(k_t.to(tl.float32), op), cast(v_new * to_end[:, None], op), PRECISION)
        if SEGMENTED:
            if snapshot >= 0:  # the chunk ends a segment at a snapshot: the state goes there
                tl.store(state_ptr + snapshot * st_ss + s_cols, state, mask=s_mask)
    tl.store(s_ptrs, state, mask=s_mask)


@triton.jit
def _output_kernel(
    q_ptr, q_st, q_sh, k_ptr, k_st, k_sh, g_ptr, g_st,
    cu_ptr, cu_chunks_ptr, chunk_request_ptr, states_ptr, v_new_ptr, out_ptr,
    num_requests, num_tokens, num_v_heads, key_dim, value_dim, q_scale,
    HEAD_RATIO: tl.constexpr, CHUNK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Outputs of one chunk, in parallel over all: ``o = (q̂ e^γ) S_start + (q̂ k̂ᵀ ⊙ Γ, causal) v'``.
    The raw q and k are the dot operands; their normalisation is applied to the products' rows
    and columns."""
    # Value blocks of one (chunk, head) are neighbours in the launch: the second reads q and k from L2.
    num_v_blocks = tl.cdiv(value_dim, BLOCK_V)
    chunk = tl.program_id(0) // num_v_blocks
    h = tl.program_id(1)
    request = tl.load(chunk_request_ptr + chunk)
    if request < num_requests:
        op = states_ptr.dtype.element_ty
        t0 = tl.load(cu_ptr + request) + (chunk - tl.load(cu_chunks_ptr + request)) * CHUNK_SIZE
        end = tl.load(cu_ptr + request + 1)
        idx = tl.arange(0, CHUNK_SIZE)
        rows = t0 + idx
        row_ok = rows < end
        kcols = tl.arange(0, BLOCK_K)
        k_ok = kcols < key_dim
        vcols = (tl.program_id(0) % num_v_blocks) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = vcols < value_dim
        kh = h // HEAD_RATIO
        qk_mask = row_ok[:, None] & k_ok[None, :]
        q = tl.load(q_ptr + rows[:, None] * q_st + kh * q_sh + kcols[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * k_st + kh * k_sh + kcols[None, :], mask=qk_mask, other=0.0)
        decay = tl.cumsum(tl.load(g_ptr + rows * g_st + h, mask=row_ok, other=0.0).to(tl.float32), 0)
        q_row = _row_rsqrt(q) * q_scale
        q_op = cast(q.to(tl.float32), op)
        causal = idx[:, None] >= idx[None, :]
        qk = dot(q_op, tl.trans(cast(k.to(tl.float32), op)), PRECISION)
        qk = qk * (tl.exp(tl.where(causal, decay[:, None] - decay[None, :], 0.0)) * _row_rsqrt(k)[None, :])
        qk = tl.where(causal, qk, 0.0)
        chunk_state = states_ptr + (chunk * num_v_heads + h).to(tl.int64) * (key_dim * value_dim)
        s = tl.load(chunk_state + kcols[:, None] * value_dim + vcols[None, :], mask=k_ok[:, None] & v_ok[None, :],
                    other=0.0)
        head_rows = h.to(tl.int64) * num_tokens + rows
        v_new = tl.load(v_new_ptr + head_rows[:, None] * value_dim + vcols[None, :],
                        mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        out = dot(q_op, s, PRECISION) * tl.exp(decay)[:, None] + dot(cast(qk, op), v_new, PRECISION)
        out = out * q_row[:, None]
        tl.store(out_ptr + rows[:, None] * (num_v_heads * value_dim) + h * value_dim + vcols[None, :],
                 cast(out, out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])


@device_function
def _chunk_ends(cu_ptr, idx, num_requests, before, CHUNK_SIZE: tl.constexpr):
    """The chunk offsets where requests ``idx`` end (``before`` chunks ahead of the first), and
    their chunks in all."""
    ok = idx < num_requests
    lens = (tl.load(cu_ptr + idx + 1, mask=ok, other=0) - tl.load(cu_ptr + idx, mask=ok, other=0)).to(tl.int32)
    chunks = (lens + CHUNK_SIZE - 1) // CHUNK_SIZE
    return before + tl.cumsum(chunks, 0), tl.sum(chunks, 0)


@triton.jit
def _chunk_layout_kernel(cu_ptr, cu_chunks_ptr, chunk_request_ptr, num_requests, max_chunks,
                         CHUNK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The chunk offsets of the requests (``cu_chunks [R + 1]``) and the request of every chunk of
    the grid's upper bound (``chunk_request [max_chunks]``, R past the last chunk), in one launch
    (they were eight small torch ops in every layer). One program: R and the chunks are few."""
    r = tl.arange(0, BLOCK_R)
    tl.store(cu_chunks_ptr, num_requests * 0)
    before = num_requests * 0
    for r0 in range(0, num_requests, BLOCK_R):
        ends, total = _chunk_ends(cu_ptr, r0 + r, num_requests, before, CHUNK_SIZE)
        tl.store(cu_chunks_ptr + r0 + r + 1, ends, mask=r0 + r < num_requests)
        before += total
    for c0 in range(0, max_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        count = tl.zeros([BLOCK_C], tl.int32)
        before = num_requests * 0
        for r0 in range(0, num_requests, BLOCK_R):
            ends, total = _chunk_ends(cu_ptr, r0 + r, num_requests, before, CHUNK_SIZE)
            # Requests whose chunks end at or before chunk c (searchsorted, right).
            done = (ends[None, :] <= c[:, None]) & (r0 + r < num_requests)[None, :]
            count += tl.sum(done.to(tl.int32), 1)
            before += total
        tl.store(chunk_request_ptr + c, count, mask=c < max_chunks)


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


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def state_pass_block_v(num_programs_per_block: int, value_dim: int, device: torch.device) -> int:
    """Value columns per program of the sequential pass: the widest block (≤ 64) that still gives
    two programs per SM, so one program's dependent products overlap another's (at least 16)."""
    block = min(pow2(value_dim, 16), 64)
    while block > 16 and num_programs_per_block * triton.cdiv(value_dim, block) < 2 * _num_sms(device):
        block //= 2
    return block


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    snapshots: PrefillSnapshots | None = None,
) -> torch.Tensor:
    """Three launches: the chunk inverses applied as W and U (parallel over every chunk of every
    request and head), the sequential state pass, the outputs (parallel). Intermediates are stored
    in the dot-operand dtype: the activations' half-precision dtype (full-rate tensor cores),
    float32 in float32 runs. With ``snapshots`` the chunks are those of the requests' segments
    (laid out on the host) and the state pass also stores the states at the snapshot boundaries."""
    _check(q, k, v, g, beta, state)
    q, k, v, g, beta = _unit_stride(q, k, v, g, beta)
    num_tokens, num_v_heads, value_dim = v.shape
    num_k_heads, key_dim = k.shape[1:]
    num_requests = state_slots.shape[0]
    out = new_empty((num_tokens, num_v_heads, value_dim), v.dtype, v.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    device = v.device
    if snapshots is None:
        num_segments = num_requests
        segment_cu = cu_seqlens
        max_chunks = triton.cdiv(num_tokens, CHUNK) + num_requests
        cu_chunks = new_empty((num_requests + 1,), torch.int32, device)
        chunk_request = new_empty((max_chunks,), torch.int32, device)
        _chunk_layout_kernel[(1,)](
            cu_seqlens, cu_chunks, chunk_request, num_requests, max_chunks, CHUNK_SIZE=CHUNK, BLOCK_R=64, BLOCK_C=128
        )
        request_chunks = chunk_rows = chunk_ends = chunk_snapshot = cu_chunks  # unread
    else:
        num_segments = num_requests + snapshots.num_snapshots
        segment_cu, cu_chunks, chunk_request = snapshots.segment_cu, snapshots.segment_chunks_cu, snapshots.chunk_segment
        request_chunks, chunk_rows, chunk_ends = snapshots.request_chunks, snapshots.chunk_rows, snapshots.chunk_ends
        chunk_snapshot = snapshots.chunk_snapshot
        max_chunks = snapshots.num_chunks
    operand = k.dtype if k.dtype in (torch.bfloat16, torch.float16) else torch.float32
    precision = dot_precision(v.dtype)
    block_k, block_v = pow2(key_dim, 16), pow2(value_dim, 16)
    ratio = num_v_heads // num_k_heads
    common = dict(HEAD_RATIO=ratio, CHUNK_SIZE=CHUNK, BLOCK_K=block_k, PRECISION=precision)

    w = new_empty((num_v_heads, num_tokens, key_dim), operand, device)
    u = new_empty((num_v_heads, num_tokens, value_dim), operand, device)
    to_end = new_empty((num_v_heads, num_tokens), torch.float32, device)
    chunk_decay = new_empty((max_chunks, num_v_heads), torch.float32, device)
    _intra_chunk_kernel[(max_chunks, num_v_heads)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), beta, beta.stride(0), g, g.stride(0),
        segment_cu, cu_chunks, chunk_request, w, u, to_end, chunk_decay,
        num_segments, num_tokens, num_v_heads, key_dim, value_dim,
        **common, BLOCK_V=block_v, num_warps=4,
    )
    states = new_empty((max_chunks, num_v_heads, key_dim, value_dim), operand, device)
    v_new = new_empty((num_v_heads, num_tokens, value_dim), operand, device)
    pass_v = state_pass_block_v(num_requests * num_v_heads, value_dim, device)
    pass_grid = (num_requests, num_v_heads, triton.cdiv(value_dim, pass_v))
    _state_pass_kernel[pass_grid](
        k, k.stride(0), k.stride(1), w, u, to_end, chunk_decay,
        state, state.stride(0), state.stride(1), state.stride(2), state_slots, segment_cu, cu_chunks, states,
        v_new, request_chunks, chunk_rows, chunk_ends, chunk_snapshot,
        num_tokens, num_v_heads, key_dim, value_dim,
        **common, BLOCK_V=pass_v, SEGMENTED=snapshots is not None, num_warps=4, num_stages=STATE_PASS_STAGES,
    )
    out_v = min(block_v, OUTPUT_BLOCK_V)
    _output_kernel[(max_chunks * triton.cdiv(value_dim, out_v), num_v_heads)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), g, g.stride(0),
        segment_cu, cu_chunks, chunk_request, states, v_new, out,
        num_segments, num_tokens, num_v_heads, key_dim, value_dim, key_dim**-0.5,
        **common, BLOCK_V=out_v, num_warps=4,
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
