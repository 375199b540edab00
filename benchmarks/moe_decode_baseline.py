"""The fused MoE decode block as of 6137181 (two launches: routing inside every gate/up program, a
down pass walking the choices one after another): a frozen copy of kernels/triton/moe_decode.py
then, kept only so that ``tune_moe_decode.py`` times the current launches against it in one run.

Triton sparse MoE block for a few tokens (decode): routing, routed and shared experts in two launches.

``sparse_moe_decode`` replaces, after the router GEMM, the eleven launches of the general path
(top-k softmax, count, scatter, grouped gate/up, grouped down, per-token sum, shared gate/up GEMM,
SiLU-and-mul, shared down GEMM, combine) with two:

1. ``_gate_up_kernel``, one program per (token, choice or shared expert, block of intermediate
   columns): the program finds its token's ``j``-th expert from the router logits itself (softmax
   and top-k over one row, cheap next to the weight rows it reads; lowest index among ties, as the
   general kernel), the column block 0 program stores the routing weight and expert id, and every
   program writes its ``silu(gate) · up`` block. No sort: each (token, expert) pair reads its
   expert's rows, so an expert two tokens share is read twice (from L2 when they run together);
   that is why the layers take this path only for a few tokens (``layers.moe.DECODE_MAX_TOKENS``).
2. ``_down_kernel``, one program per (token, block of hidden columns): the down projections of the
   token's choices, each rounded and scaled by its routing weight, summed in float32, plus
   ``sigmoid(gate) · shared`` (the shared expert's down projection). ``DecodeTiles`` sets the
   launch shape; ``benchmarks/tune_moe_decode.py`` times the candidates on the GPU (the default
   was the fastest at one token on the H200; docs/benchmarks.md).

Rounding follows the reference (projections, SiLU, products and the combine rounded to the
activations' dtype). Grids depend only on the token count, so the launch is capture-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, device_function, new_empty, pow2, round_as


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of the two passes: rows per program (``block_n``), the reduction step
    (``block_k``, capped at the reduced dimension) and warps."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 256
    gate_up_warps: int = 4
    down_block_n: int = 8
    down_block_k: int = 256
    down_warps: int = 4


TILES = DecodeTiles()


@device_function
def _choice(row_ptr, num_experts, j, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """(routing weight in float32, expert id) of choice ``j`` of one token's router logits."""
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    logits = tl.load(row_ptr + e, mask=ok, other=0.0).to(tl.float32)
    logits = tl.where(ok, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(ok, p / tl.sum(p, 0), -1.0)
    total = tl.sum(tl.zeros([BLOCK_E], tl.float32), 0)
    weight = total
    expert = tl.sum(tl.zeros([BLOCK_E], tl.int32), 0)
    for c in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        best_i = tl.min(tl.where(p == best, e, BLOCK_E), 0)
        total += best
        weight = tl.where(j == c, best, weight)
        expert = tl.where(j == c, best_i, expert)
        p = tl.where(e == best_i, -2.0, p)
    if RENORMALIZE:
        weight = weight / total
    return weight, expert


@device_function
def _gate_up_row(x_row, w_base, w_sn, hidden, inter, n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 ``(x·w_gate[n], x·w_up[n])`` of one row ``x`` against a ``[2·inter, hidden]`` weight."""
    n_ok = n < inter
    acc_gate = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(w_base + n[:, None] * w_sn + k[None, :], mask=mask, other=0.0).to(tl.float32)
        w_up = tl.load(w_base + (inter + n)[:, None] * w_sn + k[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_gate += tl.sum(w_gate * xv, 1)
        acc_up += tl.sum(w_up * xv, 1)
    return acc_gate, acc_up


@device_function
def _down_row(h_row, w_base, w_sn, inter, n, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 ``h·w[n]`` of one row ``h [inter]`` against a ``[hidden, inter]`` weight."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        hv = tl.load(h_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_base + n[:, None] * w_sn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * hv, 1)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, x_st, logits_ptr, l_st, w13_ptr, w13_se, w13_sn, sw_ptr, sw_sn,
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
        acc_gate, acc_up = _gate_up_row(
            x_row, w13_ptr + expert.to(tl.int64) * w13_se, w13_sn, hidden, inter, n, BLOCK_N, BLOCK_K
        )
        limit = inter
    else:
        acc_gate, acc_up = _gate_up_row(x_row, sw_ptr, sw_sn, hidden, shared_inter, n, BLOCK_N, BLOCK_K)
        limit = shared_inter
    gate = round_as(acc_gate, dtype)
    h = round_as(gate * tl.sigmoid(gate), dtype) * round_as(acc_up, dtype)
    tl.store(h_ptr + p.to(tl.int64) * h_width + n, cast(h, dtype), mask=n < limit)


@triton.jit
def _down_kernel(
    h_ptr, h_width, w2_ptr, w2_se, w2_sn, sd_ptr, sd_sn, topw_ptr, topi_ptr, logits_ptr, l_st, out_ptr,
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
        expert = tl.load(topi_ptr + t * TOP_K + j).to(tl.int64)
        # The weight as the reference holds it: rounded to the activations' dtype.
        weight = cast(tl.load(topw_ptr + t * TOP_K + j), dtype).to(tl.float32)
        acc = _down_row(h_ptr + (pairs + j) * h_width, w2_ptr + expert * w2_se, w2_sn, inter, n, n_ok, BLOCK_N, BLOCK_K)
        routed += round_as(round_as(acc, dtype) * weight, dtype)
    shared = _down_row(h_ptr + (pairs + TOP_K) * h_width, sd_ptr, sd_sn, shared_inter, n, n_ok, BLOCK_N, BLOCK_K)
    gate = round_as(tl.sigmoid(tl.load(logits_ptr + t * l_st + num_experts).to(tl.float32)), dtype)
    out = round_as(routed, dtype) + round_as(gate * round_as(shared, dtype), dtype)
    tl.store(out_ptr + t * hidden + n, cast(out, dtype), mask=n_ok)


def sparse_moe_decode(
    x: torch.Tensor,
    gate_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    return sparse_moe_decode_tiled(x, gate_logits, w13, w2, shared_gate_up, shared_down, top_k, renormalize, TILES)


def sparse_moe_decode_tiled(
    x: torch.Tensor,
    gate_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    tiles: DecodeTiles,
) -> torch.Tensor:
    """``sparse_moe_decode`` launched in the given tiles (``benchmarks/tune_moe_decode.py``)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, shared_inter = two_inter // 2, shared_gate_up.shape[0] // 2
    if (
        gate_logits.shape != (num_tokens, num_experts + 1)
        or w13.shape[2] != hidden
        or w2.shape != (num_experts, hidden, inter)
        or shared_gate_up.shape != (2 * shared_inter, hidden)
        or shared_down.shape != (hidden, shared_inter)
        or not 0 < top_k <= num_experts
    ):
        raise ValueError(
            f"sparse_moe_decode: x {tuple(x.shape)}, gate_logits {tuple(gate_logits.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, shared_gate_up {tuple(shared_gate_up.shape)}, "
            f"shared_down {tuple(shared_down.shape)}, top_k {top_k} disagree"
        )
    out = new_empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_logits = gate_logits if gate_logits.stride(-1) == 1 else gate_logits.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    shared_gate_up, shared_down = shared_gate_up.contiguous(), shared_down.contiguous()
    h_width, pairs = max(inter, shared_inter), num_tokens * (top_k + 1)
    h = new_empty((pairs, h_width), x.dtype, x.device)
    top_w = new_empty((num_tokens, top_k), torch.float32, x.device)
    top_i = new_empty((num_tokens, top_k), torch.int32, x.device)
    _gate_up_kernel[(pairs, triton.cdiv(h_width, tiles.gate_up_block_n))](
        x, x.stride(0), gate_logits, gate_logits.stride(0), w13, w13.stride(0), w13.stride(1),
        shared_gate_up, shared_gate_up.stride(0), h, h_width, top_w, top_i,
        hidden, inter, shared_inter, num_experts,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=pow2(num_experts),
        BLOCK_N=tiles.gate_up_block_n, BLOCK_K=min(pow2(hidden), tiles.gate_up_block_k),
        num_warps=tiles.gate_up_warps,
    )
    _down_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_block_n))](
        h, h_width, w2, w2.stride(0), w2.stride(1), shared_down, shared_down.stride(0), top_w, top_i,
        gate_logits, gate_logits.stride(0), out, hidden, inter, shared_inter, num_experts,
        TOP_K=top_k, BLOCK_N=tiles.down_block_n, BLOCK_K=min(pow2(h_width), tiles.down_block_k),
        num_warps=tiles.down_warps,
    )
    return out
