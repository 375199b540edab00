"""The NVFP4 MoE decode block as of 3243eab (two launches: routing inside every gate/up program, a
down pass walking the choices one after another), with the byte-wise tile decode and the one-row
tensor-core linear of kernels/triton/nvfp4.py then: frozen copies, kept only so that
``tune_nvfp4_decode.py`` times the current kernels against them in one run.

Triton sparse MoE block for a few tokens over NVFP4 experts: the two launches the bf16 block
(``kernels/triton/moe_decode.py``, which now routes in a launch of its own) had, with W4A16 weight rows.

The general W4A16 path at batch 1 runs one program per (expert, 32 rows) over the whole K (8 x 16
= 128 working programs on 132 SMs, in a grid of 4,112 whose other programs exit at once) after
three sort launches (docs/benchmarks.md). Here, as in the bf16 decode block:

1. ``_gate_up_kernel``, one program per (token, choice or shared expert, block of intermediate
   columns): it routes its token from the router logits (``moe_decode._choice``), decodes its
   expert's gate and up rows (``nvfp4._load_tile``, float32) and reduces them against the token
   (no tensor cores: one row), then writes ``silu(gate) · up``;
2. ``_down_kernel``, one program per (token, block of hidden columns): the down rows of each
   choice, scaled by the routing weight and summed, plus ``sigmoid(gate) · shared``.

The per-row scale multiplies each float32 dot product; rounding follows the reference (the
projections, SiLU, the products and the combine rounded to the activations' dtype). Grids depend
only on the token count, so the launch is capture-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import _INTERPRETED, cast, device_function, dot, dot_precision, new_empty, pow2, round_as
from moe_decode_baseline import _choice  # the same routing as the old bf16 block
from freetoken.kernels.triton.nvfp4 import GROUP

GATE_UP_BLOCK_N = 16
DOWN_BLOCK_N = 16
BLOCK_K = 256


@device_function
def _decode_tile(packed, scale_bytes, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 ``[BLOCK_N, BLOCK_K / 2]`` codes and ``[BLOCK_N, BLOCK_K / 16]`` e4m3 bytes -> ``dtype``
    ``[BLOCK_N, BLOCK_K]`` weights ``e2m1 · e4m3`` (the row scale is applied by the caller).

    Each nibble's bits are moved into an e4m3 code (sign to bit 7, exponent and mantissa to bits
    4-2), which is ``e2m1 · 2^-6`` for all 16 codes (the subnormal 0.5 lands on e4m3's subnormal
    2^-7), so the hardware fp8 conversion decodes it; ``2^6`` goes into the block scale. Three
    integer ops a weight instead of an exponent / mantissa decode. ``e2m1 · e4m3`` has at most 6
    significant bits and lies in [2^-10, 2688]: exact in bf16 and fp16, so the scale multiplies in
    ``dtype``, with no float32 round trip."""
    lo = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)  # the even column
    hi = (packed & 0x80) | ((packed & 0x70) >> 2)
    codes = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)).to(tl.float8e4nv, bitcast=True)
    scales = scale_bytes.to(tl.float8e4nv, bitcast=True)
    if _INTERPRETED:  # no bf16 arithmetic there: the same exact product, formed in float32
        values, scale = codes.to(tl.float32), scales.to(tl.float32) * 64.0
    else:
        values, scale = codes.to(dtype), scales.to(dtype) * 64.0
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


@device_function
def _rows_dot(x_row, w_ptr, s_ptr, rows, rows_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 ``x · W[rows]`` over the ``K`` columns of NVFP4 rows (``w_ptr`` packed ``[*, K / 2]``,
    ``s_ptr`` e4m3 ``[*, K / 16]``), before the row scale."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        w = _load_tile(w_ptr, s_ptr, rows, rows_ok, k0, K, tl.float32, BLOCK_N, BLOCK_K)
        acc += tl.sum(w * xv[None, :], 1)
    return acc


@device_function
def _gate_up(x_row, w_ptr, s_ptr, r_ptr, hidden, inter, n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``silu(gate) · up`` in float32 (rounded as the reference) of rows ``n`` of a ``[2·inter, hidden]``
    NVFP4 weight (gate rows, then up rows) against one token."""
    n_ok = n < inter
    gate = _rows_dot(x_row, w_ptr, s_ptr, n, n_ok, hidden, BLOCK_N, BLOCK_K)
    up = _rows_dot(x_row, w_ptr, s_ptr, inter + n, n_ok, hidden, BLOCK_N, BLOCK_K)
    return gate * tl.load(r_ptr + n, mask=n_ok, other=0.0), up * tl.load(r_ptr + inter + n, mask=n_ok, other=0.0)


@triton.jit
def _gate_up_kernel(
    x_ptr, x_st, logits_ptr, l_st,
    w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr,
    h_ptr, h_width, topw_ptr, topi_ptr,
    hidden, inter, shared_inter, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    p = tl.program_id(0)
    t = p // (TOP_K + 1)
    j = p % (TOP_K + 1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = h_ptr.dtype.element_ty
    x_row = x_ptr + t * x_st
    if j < TOP_K:
        weight, expert = _choice(logits_ptr + t * l_st, num_experts, j, TOP_K, RENORMALIZE, BLOCK_E)
        if tl.program_id(1) == 0:
            tl.store(topw_ptr + t * TOP_K + j, weight)
            tl.store(topi_ptr + t * TOP_K + j, expert)
        rows = expert.to(tl.int64) * 2 * inter  # the expert's first row of the flattened [E * 2I, H] weight
        gate, up = _gate_up(x_row, w13_ptr + rows * (hidden // 2), w13_s_ptr + rows * (hidden // 16), w13_r_ptr + rows,
                            hidden, inter, n, BLOCK_N, BLOCK_K)
        limit = inter
    else:
        gate, up = _gate_up(x_row, sw_ptr, sw_s_ptr, sw_r_ptr, hidden, shared_inter, n, BLOCK_N, BLOCK_K)
        limit = shared_inter
    gate = round_as(gate, dtype)
    h = round_as(gate * tl.sigmoid(gate), dtype) * round_as(up, dtype)
    tl.store(h_ptr + p.to(tl.int64) * h_width + n, cast(h, dtype), mask=n < limit)


@device_function
def _down(h_row, w_ptr, s_ptr, r_ptr, inter, n, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 ``h · W[n]`` times the row scales, of rows ``n`` of a ``[hidden, inter]`` NVFP4 weight."""
    acc = _rows_dot(h_row, w_ptr, s_ptr, n, n_ok, inter, BLOCK_N, BLOCK_K)
    return acc * tl.load(r_ptr + n, mask=n_ok, other=0.0)


@triton.jit
def _down_kernel(
    h_ptr, h_width, w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr,
    topw_ptr, topi_ptr, logits_ptr, l_st, out_ptr,
    hidden, inter, shared_inter, num_experts,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    pairs = t.to(tl.int64) * (TOP_K + 1)
    routed = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):
        rows = tl.load(topi_ptr + t * TOP_K + j).to(tl.int64) * hidden  # the expert's first row of [E * H, I]
        # The weight as the reference holds it: rounded to the activations' dtype.
        weight = cast(tl.load(topw_ptr + t * TOP_K + j), dtype).to(tl.float32)
        acc = _down(h_ptr + (pairs + j) * h_width, w2_ptr + rows * (inter // 2), w2_s_ptr + rows * (inter // 16),
                    w2_r_ptr + rows, inter, n, n_ok, BLOCK_N, BLOCK_K)
        routed += round_as(round_as(acc, dtype) * weight, dtype)
    shared = _down(h_ptr + (pairs + TOP_K) * h_width, sd_ptr, sd_s_ptr, sd_r_ptr, shared_inter, n, n_ok, BLOCK_N, BLOCK_K)
    gate = round_as(tl.sigmoid(tl.load(logits_ptr + t * l_st + num_experts).to(tl.float32)), dtype)
    out = round_as(routed, dtype) + round_as(gate * round_as(shared, dtype), dtype)
    tl.store(out_ptr + t * hidden + n, cast(out, dtype), mask=n_ok)


def _check(name: str, packed: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor, shape: tuple[int, ...]) -> None:
    *lead, rows, cols = shape
    expected = ((*lead, rows, cols // 2), (*lead, rows, cols // GROUP), (*lead, rows))
    if cols % GROUP or (tuple(packed.shape), tuple(scales.shape), tuple(row_scales.shape)) != expected:
        raise ValueError(
            f"sparse_moe_decode_nvfp4: {name} packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
            f"row_scales {tuple(row_scales.shape)} are not an NVFP4 weight of shape {shape}"
        )


def sparse_moe_decode_nvfp4(
    x: torch.Tensor,
    gate_logits: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_row_scales: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scales: torch.Tensor,
    shared_gate_up_packed: torch.Tensor,
    shared_gate_up_scales: torch.Tensor,
    shared_gate_up_row_scales: torch.Tensor,
    shared_down_packed: torch.Tensor,
    shared_down_scales: torch.Tensor,
    shared_down_row_scales: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13_packed.shape
    inter, shared_inter = two_inter // 2, shared_gate_up_packed.shape[0] // 2
    if gate_logits.shape != (num_tokens, num_experts + 1) or not 0 < top_k <= num_experts:
        raise ValueError(
            f"sparse_moe_decode_nvfp4: x {tuple(x.shape)}, gate_logits {tuple(gate_logits.shape)}, "
            f"{num_experts} experts, top_k {top_k} disagree"
        )
    _check("w13", w13_packed, w13_scales, w13_row_scales, (num_experts, two_inter, hidden))
    _check("w2", w2_packed, w2_scales, w2_row_scales, (num_experts, hidden, inter))
    _check("shared_gate_up", shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales,
           (2 * shared_inter, hidden))
    _check("shared_down", shared_down_packed, shared_down_scales, shared_down_row_scales, (hidden, shared_inter))
    out = new_empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_logits = gate_logits if gate_logits.stride(-1) == 1 else gate_logits.contiguous()

    def weight(packed, scales, row_scales):
        return packed.contiguous(), scales.contiguous().view(torch.uint8), row_scales.contiguous()

    h_width = max(inter, shared_inter)
    h = new_empty((num_tokens * (top_k + 1), h_width), x.dtype, x.device)
    top_w = new_empty((num_tokens, top_k), torch.float32, x.device)
    top_i = new_empty((num_tokens, top_k), torch.int32, x.device)
    _gate_up_kernel[(num_tokens * (top_k + 1), triton.cdiv(h_width, GATE_UP_BLOCK_N))](
        x, x.stride(0), gate_logits, gate_logits.stride(0),
        *weight(w13_packed, w13_scales, w13_row_scales),
        *weight(shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales),
        h, h_width, top_w, top_i, hidden, inter, shared_inter, num_experts,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=pow2(num_experts),
        BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=min(pow2(hidden), BLOCK_K), num_warps=4,
    )
    _down_kernel[(num_tokens, triton.cdiv(hidden, DOWN_BLOCK_N))](
        h, h_width, *weight(w2_packed, w2_scales, w2_row_scales),
        *weight(shared_down_packed, shared_down_scales, shared_down_row_scales),
        top_w, top_i, gate_logits, gate_logits.stride(0), out, hidden, inter, shared_inter, num_experts,
        TOP_K=top_k, BLOCK_N=DOWN_BLOCK_N, BLOCK_K=min(pow2(h_width), BLOCK_K), num_warps=4,
    )
    return out


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


def nvfp4_linear_one_row(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """``nvfp4_linear`` for a decode-sized ``x [rows <= 16, K]`` as it ran then: 16 x (16 or 32) x 256 tiles."""
    n_out, k_in = packed.shape[0], x.shape[1]
    out = new_empty((x.shape[0], n_out), x.dtype, x.device)
    block_n = 16 if n_out <= 4096 else 32
    _linear_kernel[(triton.cdiv(n_out, block_n), 1)](
        x, x.stride(0), packed, scales.view(torch.uint8), row_scales, out, x.shape[0], n_out, k_in,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, PRECISION=dot_precision(x.dtype), num_warps=4, num_stages=4,
    )
    return out
