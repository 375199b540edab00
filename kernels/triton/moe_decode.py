"""Triton sparse MoE block for a few tokens (decode): routing, routed and shared experts in three launches.

``sparse_moe_decode`` replaces, after the router GEMM, the eleven launches of the general path
(top-k softmax, count, scatter, grouped gate/up, grouped down, per-token sum, shared gate/up GEMM,
SiLU-and-mul, shared down GEMM, combine) with three, each shaped so that its weight loads are
issued together (at one token the block is a pure weight stream: about 56 MB per layer at the
Qwen3.6-35B-A3B shape, 13 us at the H200's bandwidth):

1. ``_route_kernel``, one program per token: softmax and top-k over its router logits (lowest
   index among ties, as the general kernel), optionally renormalized; writes the float32 routing
   weights and int32 expert ids. Done once here, the eight dependent reductions no longer delay
   every gate/up program's first weight load (docs/benchmarks.md, issue 9). Beside it
   (``DecodeTiles.shared_in_route``), one-warp programs compute the shared expert's ``silu(gate) ·
   up``, which needs no routing: they load its weight rows before waiting for the router's launch,
   whose small GEMV leaves HBM mostly idle, so the shared expert's 4 MB leave the gate/up pass.
2. ``_gate_up_kernel``, one program per (``gate_up_pairs`` consecutive (token, choice, or shared
   expert where launch 1 did not run it) pairs, block of intermediate columns): loads its pairs'
   expert ids and streams their gate and up rows as one gathered ``[pairs, block_n, block_k]`` load
   each, writing ``silu(gate) · up``.
   No sort: each pair reads its expert's rows, so an expert two tokens share is read twice (from L2
   when they run together); that is why the layers take this path only for a few tokens
   (``layers.moe.DECODE_MAX_TOKENS``).
3. ``_down_kernel``, one program per (token, block of hidden columns): the down rows of all the
   token's choices as one gathered ``[top_k, block_n, block_k]`` load (per-choice expert offsets),
   beside the shared expert's rows; each choice's projection rounded and scaled by its routing
   weight, summed in float32 (a fixed order, no atomics), plus ``sigmoid(gate) · shared``.

Where the GPU has programmatic dependent launch (sm_90 on; ``DecodeTiles.pdl``), each of the three
starts while the previous one finishes and waits (``griddepcontrol.wait``) only before reading its
output: the gate/up programs are resident when the routing is done, and the down programs stream
their weights while the gate/up pass ends. ``DecodeTiles`` sets the launch shapes;
``benchmarks/tune_moe_decode.py`` times the candidates on the GPU.

Every routing here, and the grouped path's one-warp top-k, is ``_top_k_rows``.

Rounding follows the reference (projections, SiLU, products and the combine rounded to the
activations' dtype). Grids depend only on the token count, so the launches are capture-safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import INTERPRETED, cast, device_function, new_empty, pow2, round_as

# One warp routes a token: 256 logits are 8 per lane, and every reduction stays within the warp.
ROUTE_WARPS = 1
# The shared expert's programs in the routing launch (one warp each) load at most this many columns
# of a weight row at a time (2048: Qwen3.6's whole hidden size in one load, 64 values a thread a row).
SHARED_MAX_K = 2048


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shapes: rows per program (``*_block_n``), the reduction step (``*_block_k``, capped at
    the reduced dimension: at the cap one load covers it), (token, expert) pairs per gate/up program
    (``gate_up_pairs``) and warps, all powers of two; ``pdl``: programmatic dependent launch, where
    the GPU has it (sm_90 on), so each launch starts while the previous one finishes and the down
    pass's weight loads overlap the gate/up pass."""

    gate_up_block_n: int = 4
    gate_up_block_k: int = 2048
    gate_up_pairs: int = 1
    gate_up_warps: int = 8
    down_block_n: int = 8
    down_block_k: int = 256
    down_warps: int = 8
    pdl: bool = True
    # The shared expert's gate/up rows computed in the routing launch (``shared_in_route``), by one-warp
    # programs of ``shared_block_n`` gate rows (and their up rows) each beside the routing program,
    # instead of as one more pair of the gate/up launch. They load their weights before the PDL
    # wait, i.e. while the router's latency-bound GEMV runs, and the gate/up launch then streams
    # only the routed experts (at one token 33.6 of 37.7 MB).
    shared_in_route: bool = True
    shared_block_n: int = 1

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool) and (value < 1 or value & (value - 1)):
                raise ValueError(f"DecodeTiles.{field.name} must be a power of two, got {value}")


TILES = DecodeTiles()


@device_function
def _top_k_rows(logits, e, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """(routing weights in float32, expert ids), both ``[R, BLOCK_E]`` with choice ``c`` in column
    ``c`` (columns from ``TOP_K`` on hold zeros), of rows of float32 router ``logits [R, BLOCK_E]``
    (``e``: the column index ``[1, BLOCK_E]``; columns from ``num_experts`` on are ignored). The
    routing of the one-token decode block, of its fused router GEMV, and of the grouped path's
    one-warp top-k kernel: the lowest expert id first among ties, the renormalising sum adding the
    choices in order.

    The choices compare the probabilities' bits as int32 (non-negative floats order as their bits
    do): in one warp a choice is two int32 reductions of one ``redux.sync`` each (the largest
    probability's bits, then the lowest expert id holding them), where floats take five shuffles."""
    ok = e < num_experts
    logits = tl.where(ok, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    key = tl.where(ok, (p / tl.sum(p, 1)[:, None]).to(tl.int32, bitcast=True), -1)  # padding: below every p
    total = tl.zeros([logits.shape[0], 1], tl.float32)
    weights = tl.zeros([logits.shape[0], BLOCK_E], tl.float32)
    experts = tl.zeros([logits.shape[0], BLOCK_E], tl.int32)
    for c in tl.static_range(TOP_K):
        best_key = tl.max(key, 1)[:, None]
        best_i = tl.min(tl.where(key == best_key, e, BLOCK_E), 1)[:, None]
        best = best_key.to(tl.float32, bitcast=True)
        total += best
        weights = tl.where(e == c, best, weights)
        experts = tl.where(e == c, best_i, experts)
        key = tl.where(e == best_i, -1, key)
    if RENORMALIZE:
        weights = weights / total
    return weights, experts


@device_function
def _top_k(row_ptr, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """``_top_k_rows`` of the one token whose router logits start at ``row_ptr``, as ``[BLOCK_E]``
    vectors (choice ``c`` in lane ``c``)."""
    e = tl.arange(0, BLOCK_E)[None, :]
    logits = tl.load(row_ptr + e, mask=e < num_experts, other=0.0).to(tl.float32)
    weights, experts = _top_k_rows(logits, e, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
    return tl.reshape(weights, [BLOCK_E]), tl.reshape(experts, [BLOCK_E])


@triton.jit
def _route_kernel(
    logits_ptr, l_st, topw_ptr, topi_ptr, num_experts,
    x_ptr, x_st, sw_ptr, sw_sn, h_ptr, h_width, hidden, shared_inter,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
    SHARED: tl.constexpr, SHARED_N: tl.constexpr, SHARED_K: tl.constexpr,
):
    """Grid ``(tokens, 1 + shared row blocks)``: program ``(t, 0)`` routes token ``t``; with
    ``SHARED``, programs ``(t, b > 0)`` compute its shared expert's ``silu(gate) · up`` rows of block
    ``b - 1`` into its ``h`` row (``_shared_gate_up``)."""
    t = tl.program_id(0)
    if tl.program_id(1) == 0:
        if PDL:  # the router logits are the previous launch's output; the gate/up programs may start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        weights, experts = _top_k(logits_ptr + t * l_st, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
        c = tl.arange(0, BLOCK_E)
        tl.store(topw_ptr + t * TOP_K + c, weights, mask=c < TOP_K)
        tl.store(topi_ptr + t * TOP_K + c, experts, mask=c < TOP_K)
    else:
        if SHARED:
            _shared_gate_up(x_ptr + t * x_st, sw_ptr, sw_sn, h_ptr + (t.to(tl.int64) * (TOP_K + 1) + TOP_K) * h_width,
                            tl.program_id(1) - 1, hidden, shared_inter, SHARED_N, SHARED_K, PDL)


@device_function
def _shared_gate_up(x_row, sw_ptr, sw_sn, h_row, block, hidden, shared_inter,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """``silu(gate) · up`` of the shared expert's rows ``[block · BLOCK_N, ...)`` for one token (its
    normed input ``x_row``), stored at ``h_row``. The first
    ``BLOCK_K`` columns of the weight rows are loaded before the PDL wait: no launch writes weights."""
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < shared_inter
    gate_rows = sw_ptr + n.to(tl.int64)[:, None] * sw_sn
    up_rows = gate_rows + shared_inter * sw_sn
    k = tl.arange(0, BLOCK_K)
    mask = n_ok[:, None] & (k < hidden)[None, :]
    w_gate = tl.load(gate_rows + k[None, :], mask=mask, other=0.0)
    w_up = tl.load(up_rows + k[None, :], mask=mask, other=0.0)
    if PDL:  # x is the router launch's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    xv = tl.load(x_row + k, mask=k < hidden, other=0.0).to(tl.float32)[None, :]
    acc_gate = tl.sum(w_gate.to(tl.float32) * xv, 1)
    acc_up = tl.sum(w_up.to(tl.float32) * xv, 1)
    for k0 in range(BLOCK_K, hidden, BLOCK_K):
        kk = k0 + k
        mask = n_ok[:, None] & (kk < hidden)[None, :]
        xv = tl.load(x_row + kk, mask=kk < hidden, other=0.0).to(tl.float32)[None, :]
        acc_gate += tl.sum(tl.load(gate_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32) * xv, 1)
        acc_up += tl.sum(tl.load(up_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32) * xv, 1)
    dtype = h_row.dtype.element_ty
    tl.store(h_row + n, cast(_silu_and_mul(acc_gate, acc_up, dtype), dtype), mask=n_ok)


@device_function
def _silu_and_mul(acc_gate, acc_up, dtype: tl.constexpr):
    """``silu(gate) · up`` from the float32 projections, rounded to ``dtype`` where the reference rounds."""
    gate = round_as(acc_gate, dtype)
    return round_as(gate * tl.sigmoid(gate), dtype) * round_as(acc_up, dtype)


@device_function
def _gate_up_pairs(x_ptr, x_st, base, routed, w13_sn, sw_sn, h_row, q_ok, t, h_ptr, h_width, hidden, inter,
                   shared_inter, fill_base, fill_ok, PAIRS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, FILL: tl.constexpr):
    """``silu(gate) · up`` of the pairs of ``q_ok`` (token ``t``'s routed choice or shared expert, whose
    ``[2·I, hidden]`` weight starts at ``base``), column block ``program_id(1)``, stored in ``h``'s
    rows ``h_row``.
    ``FILL`` (the offloaded block's read-through fill): the pairs of ``fill_ok`` also store the
    weight tiles they loaded at ``fill_base`` (a cache slot, with the same strides)."""
    row_st = tl.where(routed, w13_sn, sw_sn).to(tl.int64)
    limit = tl.where(routed, inter, shared_inter)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = q_ok[:, None] & (n[None, :] < limit[:, None])
    gate_rows = base[:, None] + n[None, :] * row_st[:, None]
    up_rows = gate_rows + limit[:, None] * row_st[:, None]
    acc_gate = tl.zeros([PAIRS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([PAIRS, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        xv = tl.load(x_ptr + t[:, None] * x_st + k[None, :], mask=q_ok[:, None] & k_ok[None, :], other=0.0)
        xv = xv.to(tl.float32)[:, None, :]
        mask = n_ok[:, :, None] & k_ok[None, None, :]
        w_gate = tl.load(gate_rows[:, :, None] + k[None, None, :], mask=mask, other=0.0)
        w_up = tl.load(up_rows[:, :, None] + k[None, None, :], mask=mask, other=0.0)
        if FILL:
            fill_gate = fill_base[:, None] + n[None, :] * row_st[:, None]
            fill_up = fill_gate + limit[:, None] * row_st[:, None]
            fill_mask = mask & fill_ok[:, None, None]
            tl.store(fill_gate[:, :, None] + k[None, None, :], w_gate, mask=fill_mask)
            tl.store(fill_up[:, :, None] + k[None, None, :], w_up, mask=fill_mask)
        acc_gate += tl.sum(w_gate.to(tl.float32) * xv, 2)
        acc_up += tl.sum(w_up.to(tl.float32) * xv, 2)
    dtype = h_ptr.dtype.element_ty
    h = _silu_and_mul(acc_gate, acc_up, dtype)
    tl.store(h_ptr + h_row.to(tl.int64)[:, None] * h_width + n[None, :], cast(h, dtype), mask=n_ok)


@triton.jit
def _gate_up_kernel(
    x_ptr, x_st, w13_ptr, w13_se, w13_sn, sw_ptr, sw_sn, topi_ptr, h_ptr, h_width,
    num_pairs, hidden, inter, shared_inter,
    TOP_K: tl.constexpr, PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    SHARED: tl.constexpr,
):
    """``SHARED``: the pairs include each token's shared expert (``num_pairs`` = tokens x (TOP_K + 1));
    else only the routed choices (tokens x TOP_K: the routing launch computed the shared rows)."""
    if PDL:  # the expert ids are the routing launch's output; the down programs may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Pair q: token t's choice j, or with SHARED its shared expert at j = TOP_K; h row t·(TOP_K + 1) + j.
    PER_TOKEN: tl.constexpr = TOP_K + 1 if SHARED else TOP_K
    q = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    q_ok = q < num_pairs
    t = q // PER_TOKEN
    j = q % PER_TOKEN
    routed = j < TOP_K
    expert = tl.load(topi_ptr + t * TOP_K + j, mask=q_ok & routed, other=0).to(tl.int64)
    base = tl.where(routed, w13_ptr + expert * w13_se, sw_ptr)
    h_row = t * (TOP_K + 1) + j
    _gate_up_pairs(x_ptr, x_st, base, routed, w13_sn, sw_sn, h_row, q_ok, t, h_ptr, h_width, hidden, inter,
                   shared_inter, base, routed, PAIRS, BLOCK_N, BLOCK_K, False)


@device_function
def _down_choices(h_ptr, h_width, w_rows, sd_ptr, sd_sn, weight, logits_ptr, l_st, out_ptr, t, n, n_ok, c, c_ok,
                  hidden, inter, shared_inter, num_experts, fill_rows, fill_ok, TOP_K: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                  FILL: tl.constexpr):
    """Token ``t``'s output columns ``n``: its choices' down rows (``w_rows [BLOCK_C, BLOCK_N]``, at
    the routing ``weight``) summed, plus the gated shared expert's. Under ``PDL`` the weights of the
    first step are loaded before waiting for the gate/up launch's ``h``. ``FILL`` (the offloaded
    block's read-through fill): the choices of ``fill_ok`` also store the rows they loaded at
    ``fill_rows [BLOCK_C, BLOCK_N]`` (a cache slot's)."""
    dtype = out_ptr.dtype.element_ty
    h_rows = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + c) * h_width
    h_shared = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + TOP_K) * h_width
    acc = tl.zeros([BLOCK_C, BLOCK_N], tl.float32)
    acc_shared = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, h_width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok, ks_ok = k < inter, k < shared_inter
        mask = c_ok[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :]
        w = tl.load(w_rows[:, :, None] + k[None, None, :], mask=mask, other=0.0)
        if FILL:
            tl.store(fill_rows[:, :, None] + k[None, None, :], w, mask=mask & fill_ok[:, None, None])
        ws = tl.load(sd_ptr + n[:, None] * sd_sn + k[None, :], mask=n_ok[:, None] & ks_ok[None, :], other=0.0)
        if PDL:  # returns at once after the first step
            tl.extra.cuda.gdc_wait()
        hv = tl.load(h_rows[:, None] + k[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        hs = tl.load(h_shared + k, mask=ks_ok, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * hv.to(tl.float32)[:, None, :], 2)
        acc_shared += tl.sum(ws.to(tl.float32) * hs[None, :], 1)
    scaled = round_as(round_as(acc, dtype) * weight[:, None], dtype)
    # One float32 sum over the choices in a fixed (tree) order: deterministic, as the reference's
    # (expert order) differs from both it and choice order only in float32 rounding.
    routed = tl.sum(scaled, 0)
    gate = round_as(tl.sigmoid(tl.load(logits_ptr + t * l_st + num_experts).to(tl.float32)), dtype)
    out = round_as(routed, dtype) + round_as(gate * round_as(acc_shared, dtype), dtype)
    tl.store(out_ptr + t * hidden + n, cast(out, dtype), mask=n_ok)


@triton.jit
def _down_kernel(
    h_ptr, h_width, w2_ptr, w2_se, w2_sn, sd_ptr, sd_sn, topw_ptr, topi_ptr, logits_ptr, l_st, out_ptr,
    hidden, inter, shared_inter, num_experts,
    TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # Under PDL this runs while the gate/up launch finishes: the routing launch before it is done
    # (each gate/up program waited for it before letting this one start), so the routing is read
    # here, from L2 (.cg: L1 may hold an earlier layer's ids at the same address), and the weights
    # streamed; ``h``, the gate/up output, only after the wait.
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    c = tl.arange(0, BLOCK_C)
    c_ok = c < TOP_K
    dtype = out_ptr.dtype.element_ty
    expert = tl.load(topi_ptr + t * TOP_K + c, mask=c_ok, other=0, cache_modifier=".cg").to(tl.int64)
    # The weights as the reference holds them: rounded to the activations' dtype.
    weight = tl.load(topw_ptr + t * TOP_K + c, mask=c_ok, other=0.0, cache_modifier=".cg")
    weight = cast(weight, dtype).to(tl.float32)
    w_rows = w2_ptr + expert[:, None] * w2_se + n[None, :] * w2_sn
    _down_choices(h_ptr, h_width, w_rows, sd_ptr, sd_sn, weight, logits_ptr, l_st, out_ptr, t, n, n_ok, c, c_ok,
                  hidden, inter, shared_inter, num_experts, w_rows, c_ok, TOP_K, BLOCK_C, BLOCK_N, BLOCK_K, PDL, False)


@functools.cache
def _pdl_available() -> bool:
    """Whether the kernels are compiled for a GPU with programmatic dependent launch (sm_90 on)."""
    if INTERPRETED:
        return False
    target = triton.runtime.driver.active.get_current_target()
    return target.backend == "cuda" and target.arch >= 90


class SharedInRoute(NamedTuple):
    """The shared expert's gate/up, computed in the routing launch (``DecodeTiles.shared_in_route``):
    the block's normed input ``x [T, hidden]``, ``shared_gate_up [2·Is, hidden]``, the ``h`` buffer
    ``[T·(top_k + 1), width]`` whose rows ``t·(top_k + 1) + top_k`` receive it, and the rows a program."""

    x: torch.Tensor
    shared_gate_up: torch.Tensor
    h: torch.Tensor
    block_n: int


def route(
    gate_logits: torch.Tensor, num_experts: int, top_k: int, renormalize: bool, pdl: bool = False,
    shared: SharedInRoute | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] float32, expert ids [T, top_k] int32)`` of the router logits
    ``gate_logits[:, :num_experts]`` (row stride free, unit column stride): ``moe_topk_softmax``'s
    choices, with the weights not yet rounded to the activations' dtype. ``pdl``: launched to start
    while the previous launch finishes (``DecodeTiles.pdl``). ``shared``: the launch also computes
    the shared expert's gate/up into ``shared.h``."""
    num_tokens = gate_logits.shape[0]
    top_w = new_empty((num_tokens, top_k), torch.float32, gate_logits.device)
    top_i = new_empty((num_tokens, top_k), torch.int32, gate_logits.device)
    if not num_tokens:
        return top_w, top_i
    if shared is None:
        x, sw, h, blocks, hidden, shared_inter, block_n = gate_logits, gate_logits, top_w, 0, 0, 0, 1
    else:
        x, sw, h = shared.x, shared.shared_gate_up, shared.h
        hidden, shared_inter, block_n = x.shape[1], sw.shape[0] // 2, shared.block_n
        blocks = triton.cdiv(shared_inter, block_n)
    _route_kernel[(num_tokens, 1 + blocks)](
        gate_logits, gate_logits.stride(0), top_w, top_i, num_experts,
        x, x.stride(0), sw, sw.stride(0), h, h.stride(0), hidden, shared_inter,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=pow2(num_experts), PDL=pdl, SHARED=shared is not None,
        SHARED_N=block_n, SHARED_K=min(pow2(max(hidden, 1)), SHARED_MAX_K), num_warps=ROUTE_WARPS, launch_pdl=pdl,
    )
    return top_w, top_i


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
    num_experts = _check(x, gate_logits, w13, w2, shared_gate_up, shared_down, top_k, "sparse_moe_decode")
    if x.shape[0] == 0:
        return new_empty(x.shape, x.dtype, x.device)
    gate_logits = gate_logits if gate_logits.stride(-1) == 1 else gate_logits.contiguous()
    pdl = tiles.pdl and _pdl_available()
    x = x if x.stride(-1) == 1 else x.contiguous()
    h = _h_buffer(x, w13, shared_gate_up, top_k)
    shared = SharedInRoute(x, shared_gate_up.contiguous(), h, tiles.shared_block_n) if tiles.shared_in_route else None
    top_w, top_i = route(gate_logits, num_experts, top_k, renormalize, pdl, shared)
    return _experts(x, gate_logits, top_w, top_i, w13, w2, shared_gate_up, shared_down, tiles, h, shared is not None)


def _check(x, gate_logits, w13, w2, shared_gate_up, shared_down, top_k: int, name: str) -> int:
    """The routed experts' count, after checking that the block's operands agree."""
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
            f"{name}: x {tuple(x.shape)}, gate_logits {tuple(gate_logits.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, shared_gate_up {tuple(shared_gate_up.shape)}, "
            f"shared_down {tuple(shared_down.shape)}, top_k {top_k} disagree"
        )
    return num_experts


def _h_buffer(x: torch.Tensor, w13: torch.Tensor, shared_gate_up: torch.Tensor, top_k: int) -> torch.Tensor:
    """The gate/up output ``[T·(top_k + 1), max(I, Is)]``: token ``t``'s choice ``j`` in row
    ``t·(top_k + 1) + j``, its shared expert's in row ``t·(top_k + 1) + top_k``."""
    width = max(w13.shape[1], shared_gate_up.shape[0]) // 2
    return new_empty((x.shape[0] * (top_k + 1), width), x.dtype, x.device)


def _experts(
    x, gate_logits, top_w, top_i, w13, w2, shared_gate_up, shared_down, tiles: DecodeTiles, h: torch.Tensor,
    shared_done: bool,
) -> torch.Tensor:
    """The gate/up and down launches over a routing (float32 weights, int32 ids ``[T, top_k]``) into
    ``h`` (``_h_buffer``); ``shared_done``: the routing launch computed the shared expert's rows."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, shared_inter = two_inter // 2, shared_gate_up.shape[0] // 2
    top_k = top_i.shape[1]
    out = new_empty((num_tokens, hidden), x.dtype, x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    shared_gate_up, shared_down = shared_gate_up.contiguous(), shared_down.contiguous()
    h_width = h.shape[1]
    pairs = num_tokens * (top_k if shared_done else top_k + 1)
    pdl = tiles.pdl and _pdl_available()
    _gate_up_kernel[(triton.cdiv(pairs, tiles.gate_up_pairs), triton.cdiv(h_width, tiles.gate_up_block_n))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), shared_gate_up, shared_gate_up.stride(0), top_i,
        h, h_width, pairs, hidden, inter, shared_inter,
        TOP_K=top_k, PAIRS=tiles.gate_up_pairs, BLOCK_N=tiles.gate_up_block_n,
        BLOCK_K=min(pow2(hidden), tiles.gate_up_block_k), PDL=pdl, SHARED=not shared_done,
        num_warps=tiles.gate_up_warps, launch_pdl=pdl,
    )
    _down_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_block_n))](
        h, h_width, w2, w2.stride(0), w2.stride(1), shared_down, shared_down.stride(0), top_w, top_i,
        gate_logits, gate_logits.stride(0), out, hidden, inter, shared_inter, num_experts,
        TOP_K=top_k, BLOCK_C=pow2(top_k), BLOCK_N=tiles.down_block_n,
        BLOCK_K=min(pow2(h_width), tiles.down_block_k), PDL=pdl, num_warps=tiles.down_warps, launch_pdl=pdl,
    )
    return out
