"""Triton W4A16 GEMMs over NVFP4 weights (Hopper has no FP4 tensor cores).

Each program loads its weight tile packed (half a byte a weight, plus one e4m3 byte per 16), decodes
it in registers to ``e2m1 · e4m3`` (exact in bf16, see ``kernels/nvfp4.py``; the codes through the
hardware fp8 conversion, ``_decode_tile``) and multiplies it with
the activations on the tensor cores (``tl.dot``, float32 accumulation); the per-row scale is applied
to the accumulator. Decode-sized batches (a few rows) read each packed byte once and are bound by
those bytes: up to ``nvfp4_rows.GEMV_MAX_ROWS`` rows without tensor cores (``nvfp4_gemv``, whole
packed rows a program), up to 16 in narrow tensor-core tiles; prefill-sized ones run large bf16 tiles.

``fused_experts_nvfp4`` is ``fused_experts`` (``kernels/triton/moe.py``: sort pairs by expert,
grouped gate/up GEMM with SiLU-and-mul, grouped down GEMM, per-token sum) with these weight tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import _INTERPRETED, INTERPRETED, cast, device_function, dot, dot_precision, new_empty, pow2, round_as
from freetoken.kernels.triton.moe import _tile_of, moe_sort_tokens, sum_choices
from freetoken.kernels.triton.nvfp4_rows import GEMV_MAX_ROWS, _code_bf16, _e4m3_codes, nvfp4_gemv

GROUP = 16


@device_function
def _decode_tile(packed, scale_bytes, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 ``[BLOCK_N, BLOCK_K / 2]`` codes and ``[BLOCK_N, BLOCK_K / 16]`` e4m3 bytes -> ``dtype``
    ``[BLOCK_N, BLOCK_K]`` weights ``e2m1 · e4m3`` (the row scale is applied by the caller).

    Each nibble's bits are moved into an e4m3 code (sign to bit 7, exponent and mantissa to bits
    4-2), which is ``e2m1 · 2^-6`` for all 16 codes (the subnormal 0.5 lands on e4m3's subnormal
    2^-7), so the hardware fp8 conversion decodes it; ``2^6`` goes into the block scale. Three
    integer ops a weight instead of an exponent / mantissa decode. ``e2m1 · e4m3`` has at most 6
    significant bits and lies in [2^-10, 2688]: exact in bf16 and fp16, so the scale multiplies in
    ``dtype``, with no float32 round trip.

    Compiled, the codes go straight to bf16 ``e2m1`` a 32-bit word at a time in inline PTX
    (``nvfp4_rows._code_bf16``), no fp8 conversion: Triton's byte-wise ops and e4m3 -> f16 -> bf16
    conversions took ~11 instructions a weight (docs/benchmarks.md)."""
    scales = scale_bytes.to(tl.float8e4nv, bitcast=True)
    if _INTERPRETED:  # no bf16 arithmetic there: the same exact product, formed in float32
        codes = tl.reshape(_e4m3_codes(packed), (BLOCK_N, BLOCK_K)).to(tl.float8e4nv, bitcast=True)
        values, scale = codes.to(tl.float32), scales.to(tl.float32) * 64.0
    else:
        values, scale = _code_bf16(packed, BLOCK_N, BLOCK_K).to(dtype), scales.to(dtype)
    groups = tl.reshape(values, (BLOCK_N, BLOCK_K // 16, 16)) * scale[:, :, None]
    return tl.reshape(groups, (BLOCK_N, BLOCK_K)).to(dtype)


@device_function
def _load_tile(w_ptr, s_ptr, rows, rows_ok, k0, K, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decoded ``[BLOCK_N, BLOCK_K]`` tile of input columns ``k0 ...`` of weight rows ``rows``
    (``w_ptr``: packed ``[*, K / 2]`` rows, ``s_ptr``: scale ``[*, K / 16]`` rows) in ``dtype``."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_ptr + rows[:, None].to(tl.int64) * (K // 2) + half[None, :],
                     mask=rows_ok[:, None] & (half < K // 2)[None, :], other=0)
    group = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    scales = tl.load(s_ptr + rows[:, None].to(tl.int64) * (K // 16) + group[None, :],
                     mask=rows_ok[:, None] & (group < K // 16)[None, :], other=0)
    return _decode_tile(packed, scales, dtype, BLOCK_N, BLOCK_K)


@triton.jit
def _linear_kernel(
    x_ptr, x_st, w_ptr, s_ptr, r_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * x_st + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        w = _load_tile(w_ptr, s_ptr, n, n_ok, k0, K, dtype, BLOCK_N, BLOCK_K)
        acc += dot(a, tl.trans(w), PRECISION)
    row_scale = tl.load(r_ptr + n, mask=n_ok, other=0.0)
    out = acc * row_scale[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], cast(out, dtype), mask=m_ok[:, None] & n_ok[None, :])


def _linear_tiles(num_rows: int, n_out: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Decode (<= 16 rows): weight tiles narrow
    enough that a few hundred programs stream the packed bytes; prefill: 128x128 bf16 tiles."""
    if INTERPRETED:
        return min(pow2(num_rows, 16), 64), 64, 128, 4, 1
    if num_rows <= 16:
        return 16, 16 if n_out <= 4096 else 32, 256, 4, 4
    if dtype == torch.float32:
        return 64, 64, 32, 4, 2
    if num_rows <= 64:
        return 64, 128, 64, 4, 4
    return 128, 128, 64, 8, 3


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    n_out, half = packed.shape
    k_in = 2 * half
    if x.shape[-1] != k_in or scales.shape != (n_out, k_in // GROUP) or row_scales.shape != (n_out,):
        raise ValueError(
            f"nvfp4_linear: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
            f"row_scales {tuple(row_scales.shape)} disagree"
        )
    rows = x.reshape(-1, k_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = new_empty((num_rows, n_out), x.dtype, x.device)
    if 0 < num_rows <= GEMV_MAX_ROWS:
        nvfp4_gemv(rows, packed.contiguous(), scales.contiguous().view(torch.uint8), row_scales.contiguous(), out)
    elif num_rows:
        block_m, block_n, block_k, warps, stages = _linear_tiles(num_rows, n_out, x.dtype)
        _linear_kernel[(triton.cdiv(n_out, block_n), triton.cdiv(num_rows, block_m))](
            rows, rows.stride(0), packed.contiguous(), scales.contiguous().view(torch.uint8), row_scales.contiguous(), out,
            num_rows, n_out, k_in,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype),
            num_warps=warps, num_stages=stages,
        )
    return out.reshape(*x.shape[:-1], n_out)


@triton.jit
def _gate_up_kernel(
    x_ptr, x_st, w_ptr, s_ptr, r_ptr, order_ptr, offsets_ptr, h_ptr,
    hidden, inter, num_experts,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, first, end = _tile_of(tl.program_id(0), offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        token = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        dtype = h_ptr.dtype.element_ty
        gate_rows = expert * 2 * inter + n  # rows of the flattened [E * 2I, H] weight
        up_rows = gate_rows + inter
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + token[:, None].to(tl.int64) * x_st + k[None, :],
                        mask=row_ok[:, None] & (k < hidden)[None, :], other=0.0)
            w_gate = _load_tile(w_ptr, s_ptr, gate_rows, n_ok, k0, hidden, dtype, BLOCK_N, BLOCK_K)
            w_up = _load_tile(w_ptr, s_ptr, up_rows, n_ok, k0, hidden, dtype, BLOCK_N, BLOCK_K)
            acc_gate += dot(a, tl.trans(w_gate), PRECISION)
            acc_up += dot(a, tl.trans(w_up), PRECISION)
        gate = round_as(acc_gate * tl.load(r_ptr + gate_rows, mask=n_ok, other=0.0)[None, :], dtype)
        up = round_as(acc_up * tl.load(r_ptr + up_rows, mask=n_ok, other=0.0)[None, :], dtype)
        h = round_as(gate * tl.sigmoid(gate), dtype) * up
        tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + n[None, :], cast(h, dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, r_ptr, order_ptr, offsets_ptr, topk_w_ptr, y_ptr,
    hidden, inter, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, first, end = _tile_of(tl.program_id(0), offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        dtype = y_ptr.dtype.element_ty
        w_rows = expert * hidden + n  # rows of the flattened [E * H, I] weight
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + rows[:, None].to(tl.int64) * inter + k[None, :],
                        mask=row_ok[:, None] & (k < inter)[None, :], other=0.0)
            w = _load_tile(w_ptr, s_ptr, w_rows, n_ok, k0, inter, dtype, BLOCK_N, BLOCK_K)
            acc += dot(a, tl.trans(w), PRECISION)
        weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        y = round_as(acc * tl.load(r_ptr + w_rows, mask=n_ok, other=0.0)[None, :], dtype) * weight[:, None]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * hidden + n[None, :], cast(y, dtype),
                 mask=row_ok[:, None] & n_ok[None, :])


def _expert_tiles(dtype: torch.dtype, num_pairs: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from the mean pairs per expert."""
    mean_rows = num_pairs / max(num_experts, 1)
    block_m = 16 if mean_rows <= 16 else 32 if mean_rows <= 48 else 64
    if INTERPRETED:
        return block_m, 64, 128, 4, 1
    if dtype == torch.float32:
        return block_m, 64, 32, 4, 2
    if block_m == 16:  # decode: a few rows per expert, bound by the packed bytes
        return 16, 32, 256, 4, 4
    return block_m, 64, 128, 4, 3


def fused_experts_nvfp4(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_row_scales: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13_packed.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if (
        w13_packed.shape[2] * 2 != hidden
        or w13_scales.shape != (num_experts, two_inter, hidden // GROUP)
        or w13_row_scales.shape != (num_experts, two_inter)
        or w2_packed.shape != (num_experts, hidden, inter // 2)
        or w2_scales.shape != (num_experts, hidden, inter // GROUP)
        or w2_row_scales.shape != (num_experts, hidden)
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"fused_experts_nvfp4: x {tuple(x.shape)}, w13 {tuple(w13_packed.shape)}/{tuple(w13_scales.shape)}, "
            f"w2 {tuple(w2_packed.shape)}/{tuple(w2_scales.shape)}, ids {tuple(topk_ids.shape)} disagree"
        )
    out = new_empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_weights = topk_weights.contiguous()
    num_pairs = num_tokens * top_k
    order, offsets = moe_sort_tokens(topk_ids, num_experts)
    block_m, block_n, block_k, warps, stages = _expert_tiles(x.dtype, num_pairs, num_experts)
    max_tiles = triton.cdiv(num_pairs, block_m) + num_experts
    precision = dot_precision(x.dtype)
    h = new_empty((num_pairs, inter), x.dtype, x.device)
    _gate_up_kernel[(max_tiles, triton.cdiv(inter, block_n))](
        x, x.stride(0), w13_packed.contiguous(), w13_scales.contiguous().view(torch.uint8), w13_row_scales.contiguous(),
        order, offsets, h, hidden, inter, num_experts,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=pow2(num_experts), PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    y = new_empty((num_pairs, hidden), x.dtype, x.device)
    _down_kernel[(max_tiles, triton.cdiv(hidden, block_n))](
        h, w2_packed.contiguous(), w2_scales.contiguous().view(torch.uint8), w2_row_scales.contiguous(),
        order, offsets, topk_weights, y, hidden, inter, num_experts,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=pow2(num_experts), PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    sum_choices(y, out, top_k)
    return out
