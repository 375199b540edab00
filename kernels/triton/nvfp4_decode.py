"""Triton sparse MoE block for a few tokens over NVFP4 experts: the bf16 decode block's three
launches (``kernels/triton/moe_decode.py``) with W4A16 weight rows.

1. ``moe_decode.route``, the same routing launch: softmax and top-k once per token.
2. ``_gate_up_kernel``, one program per (``gate_up_pairs`` consecutive (token, choice or shared
   expert) pairs, block of intermediate columns): loads its pairs' expert ids and streams their
   packed gate and up rows and scale bytes as one gathered ``[pairs, block_n, block_k / 2]`` (and
   ``/ 16``) load each, writing ``silu(gate) · up``.
3. ``_down_kernel``, one program per (token, block of hidden columns): the packed down rows of all
   the token's choices as one gathered ``[top_k, block_n, block_k / 2]`` load beside the shared
   expert's rows; each choice's projection rounded and scaled by its routing weight, summed in
   float32 in a fixed (tree) order, plus ``sigmoid(gate) · shared``.

At one token the block is a stream of packed bytes (about 16 MB a layer at the Qwen3.6-35B-A3B
shape), so each program keeps many of them in flight, as the bf16 block does; under programmatic
dependent launch (``NVFP4DecodeTiles.pdl``, sm_90 on) each launch starts while the previous one
finishes. ``benchmarks/tune_nvfp4_decode.py`` times the launch shapes on the GPU.

Either pass can instead run as a stream (``nvfp4_decode_stream.py``; ``NVFP4DecodeTiles.gate_up_per_sm``
/ ``down_per_sm``): a grid sized to the GPU, each program looping over row tiles with the next
tile's loads in flight during the current decode. The defaults are the two streams the H200 sweep
picked (``NVFP4DecodeTiles``); one persistent launch for both passes was measured 2.7-3.4x slower and
removed (docs/benchmarks.md).

The weights are never formed: one row against one token has no tensor-core work, so
``nvfp4_rows._row_dots`` reduces the e2m1 codes (decoded a 32-bit word at a time where compiled)
against the activations per group of 16 and multiplies each group's sum by its e4m3 scale (one
multiply per 16 weights instead of one per weight), and the per-row scale multiplies the float32
dot product. Rounding follows the reference (the projections, SiLU, the
products and the combine rounded to the activations' dtype). Grids depend only on the token
count (and the GPU's SM count), so the launches are capture-safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import INTERPRETED, cast, new_empty, pow2, round_as
from freetoken.kernels.triton.moe_decode import DecodeTiles, _pdl_available, route
from freetoken.kernels.triton.nvfp4 import GROUP
from freetoken.kernels.triton.nvfp4_decode_stream import _down_stream_kernel, _gate_up_stream_kernel
from freetoken.kernels.triton.nvfp4_rows import _row_dots


@dataclass(frozen=True)
class NVFP4DecodeTiles(DecodeTiles):
    """``DecodeTiles`` for the NVFP4 block (``block_k`` counts weights, at least one group of 16).
    A packed row is a quarter of a bf16 row's bytes, so a program holds more rows for the same
    bytes in flight.

    ``gate_up_per_sm`` / ``down_per_sm``: 0 runs that pass one program per tile (the kernels here);
    above 0, as ``nvfp4_decode_stream``'s kernels, that many programs an SM (split over the tokens)
    each looping over tiles of ``*_block_n`` rows with the whole reduced dim in one load (``*_block_k``
    unused), the next tile's loads issued before the current one's decode where ``prefetch``.
    ``shared_first`` (gate/up a stream): the shared expert's tiles first, the first of them loaded
    before the wait for the previous launch and the routing.
    ``gate_up_regs`` / ``down_regs``: a register cap per thread (Triton's ``maxnreg``; 0: the
    compiler's choice), for more resident programs an SM."""

    # The defaults: the H200 sweep's best at one token (tune_nvfp4_decode.py: 13.8 us a layer against
    # 17.6 for the tile passes; at eight tokens 57.8 against 107.3), both passes as streams.
    gate_up_block_n: int = 4
    gate_up_block_k: int = 2048
    gate_up_pairs: int = 1
    gate_up_warps: int = 4
    down_block_n: int = 4
    down_block_k: int = 512
    down_warps: int = 8
    pdl: bool = True
    gate_up_per_sm: int = 4
    down_per_sm: int = 2
    prefetch: bool = True
    gate_up_regs: int = 0
    down_regs: int = 0
    shared_first: bool = False
    # The NVFP4 block's shared expert stays in its gate/up pass (``DecodeTiles.shared_in_route`` is the
    # bf16 block's).
    shared_in_route: bool = False

    def __post_init__(self) -> None:
        counts = ("gate_up_per_sm", "down_per_sm", "gate_up_regs", "down_regs")
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool):
                continue
            if field.name in counts:
                if value < 0 or (field.name.endswith("regs") and value and not 32 <= value <= 255):
                    raise ValueError(f"NVFP4DecodeTiles.{field.name} must be 0 or a count (regs 32-255), got {value}")
            elif value < 1 or value & (value - 1):
                raise ValueError(f"NVFP4DecodeTiles.{field.name} must be a power of two, got {value}")
        for name in ("gate_up_block_k", "down_block_k"):
            if getattr(self, name) < GROUP:
                raise ValueError(f"NVFP4DecodeTiles.{name} must be at least {GROUP}, got {getattr(self, name)}")
        if self.shared_in_route:
            raise ValueError("NVFP4DecodeTiles.shared_in_route: the NVFP4 block computes its shared expert in its gate/up pass")
        if self.shared_first and not self.gate_up_per_sm:
            raise ValueError("NVFP4DecodeTiles.shared_first needs gate/up as a stream (gate_up_per_sm > 0)")


TILES_ENV = "FREETOKEN_NVFP4_DECODE_TILES"


def tiles_from_text(text: str) -> NVFP4DecodeTiles:
    """``NVFP4DecodeTiles`` from ``"field=value,..."`` (the sweep's "apply:" line, e.g.
    ``down_per_sm=2,prefetch=False``; booleans as true/false or 1/0), the other fields default."""
    kinds = {f.name: f.type for f in fields(NVFP4DecodeTiles)}
    values: dict[str, int | bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if name not in kinds:
            raise ValueError(f"{TILES_ENV}: {name!r} is not an NVFP4DecodeTiles field ({', '.join(kinds)})")
        if kinds[name] in (bool, "bool"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{TILES_ENV}: {name} must be true or false, got {value!r}")
            values[name] = value.lower() in ("true", "1")
        else:
            try:
                values[name] = int(value)
            except ValueError:
                raise ValueError(f"{TILES_ENV}: {name} must be an integer, got {value!r}") from None
    return NVFP4DecodeTiles(**values)


# The launch shapes the engine runs: the defaults, or those set in $FREETOKEN_NVFP4_DECODE_TILES (an
# A/B of the sweep's best end to end without a code change).
TILES = tiles_from_text(os.environ.get(TILES_ENV, ""))


@triton.jit
def _gate_up_kernel(
    x_ptr, x_st, w13_ptr, w13_s_ptr, w13_r_ptr, sw_ptr, sw_s_ptr, sw_r_ptr, topi_ptr, h_ptr, h_width,
    num_pairs, hidden, inter, shared_inter,
    TOP_K: tl.constexpr, PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the expert ids are the routing launch's output; the down programs may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Pair q = t·(TOP_K + 1) + j: token t's choice j, or its shared expert at j = TOP_K.
    q = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    q_ok = q < num_pairs
    t = q // (TOP_K + 1)
    j = q % (TOP_K + 1)
    routed = j < TOP_K
    expert = tl.load(topi_ptr + t * TOP_K + j, mask=q_ok & routed, other=0).to(tl.int64)
    limit = tl.where(routed, inter, shared_inter)
    # The pair's first row: of the flattened [E · 2I, H] routed weight, or the shared one's.
    first = tl.where(routed, expert * 2 * inter, 0)
    packed_rows = tl.where(routed, w13_ptr, sw_ptr) + first * (hidden // 2)
    scale_rows = tl.where(routed, w13_s_ptr, sw_s_ptr) + first * (hidden // 16)
    row_scales = tl.where(routed, w13_r_ptr, sw_r_ptr) + first
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = q_ok[:, None] & (n[None, :] < limit[:, None])
    gate_n = n[None, :].to(tl.int64)
    up_n = gate_n + limit[:, None]
    acc_gate = tl.zeros([PAIRS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([PAIRS, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t[:, None] * x_st + k[None, :], mask=q_ok[:, None] & (k < hidden)[None, :], other=0.0)
        xv = xv.to(tl.float32)[:, None, :]
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        group = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        half_ok = n_ok[:, :, None] & (half < hidden // 2)[None, None, :]
        group_ok = n_ok[:, :, None] & (group < hidden // 16)[None, None, :]
        gate_w = tl.load(packed_rows[:, None, None] + gate_n[:, :, None] * (hidden // 2) + half[None, None, :],
                         mask=half_ok, other=0)
        up_w = tl.load(packed_rows[:, None, None] + up_n[:, :, None] * (hidden // 2) + half[None, None, :],
                       mask=half_ok, other=0)
        gate_s = tl.load(scale_rows[:, None, None] + gate_n[:, :, None] * (hidden // 16) + group[None, None, :],
                         mask=group_ok, other=0)
        up_s = tl.load(scale_rows[:, None, None] + up_n[:, :, None] * (hidden // 16) + group[None, None, :],
                       mask=group_ok, other=0)
        acc_gate += _row_dots(gate_w, gate_s, xv, BLOCK_N, BLOCK_K)
        acc_up += _row_dots(up_w, up_s, xv, BLOCK_N, BLOCK_K)
    dtype = h_ptr.dtype.element_ty
    gate = round_as(acc_gate * tl.load(row_scales[:, None] + gate_n, mask=n_ok, other=0.0), dtype)
    up = round_as(acc_up * tl.load(row_scales[:, None] + up_n, mask=n_ok, other=0.0), dtype)
    h = round_as(gate * tl.sigmoid(gate), dtype) * up
    tl.store(h_ptr + q.to(tl.int64)[:, None] * h_width + n[None, :], cast(h, dtype), mask=n_ok)


@triton.jit
def _down_kernel(
    h_ptr, h_width, w2_ptr, w2_s_ptr, w2_r_ptr, sd_ptr, sd_s_ptr, sd_r_ptr, topw_ptr, topi_ptr,
    logits_ptr, l_st, out_ptr, hidden, inter, shared_inter, num_experts,
    TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # Under PDL this runs while the gate/up launch finishes, as moe_decode's down pass: the routing
    # is read from L2 (.cg), the weights streamed, and ``h`` read only after the wait.
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
    rows = expert[:, None] * hidden + n[None, :]  # rows of the flattened [E · H, I] weight
    rows_ok = c_ok[:, None] & n_ok[None, :]
    h_rows = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + c) * h_width
    h_shared = h_ptr + (t.to(tl.int64) * (TOP_K + 1) + TOP_K) * h_width
    acc = tl.zeros([BLOCK_C, BLOCK_N], tl.float32)
    acc_shared = tl.zeros([1, BLOCK_N], tl.float32)
    for k0 in range(0, h_width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        group = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        w = tl.load(w2_ptr + rows[:, :, None] * (inter // 2) + half[None, None, :],
                    mask=rows_ok[:, :, None] & (half < inter // 2)[None, None, :], other=0)
        s = tl.load(w2_s_ptr + rows[:, :, None] * (inter // 16) + group[None, None, :],
                    mask=rows_ok[:, :, None] & (group < inter // 16)[None, None, :], other=0)
        ws = tl.load(sd_ptr + n[:, None] * (shared_inter // 2) + half[None, :],
                     mask=n_ok[:, None] & (half < shared_inter // 2)[None, :], other=0)
        ss = tl.load(sd_s_ptr + n[:, None] * (shared_inter // 16) + group[None, :],
                     mask=n_ok[:, None] & (group < shared_inter // 16)[None, :], other=0)
        if PDL:  # returns at once after the first step
            tl.extra.cuda.gdc_wait()
        hv = tl.load(h_rows[:, None] + k[None, :], mask=c_ok[:, None] & (k < inter)[None, :], other=0.0)
        hs = tl.load(h_shared + k, mask=k < shared_inter, other=0.0)
        acc += _row_dots(w, s, hv.to(tl.float32)[:, None, :], BLOCK_N, BLOCK_K)
        acc_shared += _row_dots(ws[None, :, :], ss[None, :, :], hs.to(tl.float32)[None, None, :], BLOCK_N, BLOCK_K)
    acc = acc * tl.load(w2_r_ptr + rows, mask=rows_ok, other=0.0)
    shared = tl.sum(acc_shared, 0) * tl.load(sd_r_ptr + n, mask=n_ok, other=0.0)
    scaled = round_as(round_as(acc, dtype) * weight[:, None], dtype)
    # One float32 sum over the choices in a fixed (tree) order, as moe_decode's.
    routed = tl.sum(scaled, 0)
    gate = round_as(tl.sigmoid(tl.load(logits_ptr + t * l_st + num_experts).to(tl.float32)), dtype)
    out = round_as(routed, dtype) + round_as(gate * round_as(shared, dtype), dtype)
    tl.store(out_ptr + t * hidden + n, cast(out, dtype), mask=n_ok)


def _regs(cap: int) -> dict:
    """The launch option capping registers per thread (none where 0, and under the interpreter)."""
    return {"maxnreg": cap} if cap and not INTERPRETED else {}


def _stream_programs(device: torch.device, per_sm: int, num_tokens: int, tiles_per_token: int) -> int:
    """Programs per token of a stream kernel: ``per_sm`` an SM over all tokens, at most one a tile.
    (On the CPU, under the interpreter, one "SM".)"""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(tiles_per_token, sms * per_sm // num_tokens))


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
    return sparse_moe_decode_nvfp4_tiled(
        x, gate_logits, w13_packed, w13_scales, w13_row_scales, w2_packed, w2_scales, w2_row_scales,
        shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales,
        shared_down_packed, shared_down_scales, shared_down_row_scales, top_k, renormalize, TILES,
    )


def sparse_moe_decode_nvfp4_tiled(
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
    tiles: NVFP4DecodeTiles,
) -> torch.Tensor:
    """``sparse_moe_decode_nvfp4`` launched in the given tiles (``benchmarks/tune_nvfp4_decode.py``)."""
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

    h_width, pairs = max(inter, shared_inter), num_tokens * (top_k + 1)
    h = new_empty((pairs, h_width), x.dtype, x.device)
    pdl = tiles.pdl and _pdl_available()
    top_w, top_i = route(gate_logits, num_experts, top_k, renormalize, pdl)
    w13 = weight(w13_packed, w13_scales, w13_row_scales)
    shared_gate_up = weight(shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales)
    w2 = weight(w2_packed, w2_scales, w2_row_scales)
    shared_down = weight(shared_down_packed, shared_down_scales, shared_down_row_scales)
    stream = dict(TOP_K=top_k, BLOCK_C=pow2(top_k), PREFETCH=tiles.prefetch, PDL=pdl, OFFLOAD=False, FILL=False,
                  launch_pdl=pdl)
    def words(weight):  # the packed codes as int32 words (8 codes each) for the stream kernels
        return (weight[0].view(torch.int32), *weight[1:])

    def routed_parts(weight):  # resident experts: the slot of each is its id, nothing on the host
        parts = words(weight)
        return (*parts, *parts, *(p.stride(0) for p in parts), top_i, top_i)  # the map, the fills: not read

    if tiles.gate_up_per_sm:
        tiles_per_token = (top_k + 1) * triton.cdiv(h_width, tiles.gate_up_block_n)
        _gate_up_stream_kernel[(num_tokens, _stream_programs(x.device, tiles.gate_up_per_sm, num_tokens, tiles_per_token))](
            x, x.stride(0), *routed_parts(w13), *words(shared_gate_up), top_w, top_i,
            h, h_width, hidden, hidden // 8, hidden // GROUP, inter, shared_inter,
            BLOCK_N=tiles.gate_up_block_n, NB=triton.cdiv(h_width, tiles.gate_up_block_n), BLOCK_K=pow2(hidden),
            SHARED_FIRST=tiles.shared_first, num_warps=tiles.gate_up_warps, **stream, **_regs(tiles.gate_up_regs),
        )
    else:
        _gate_up_kernel[(triton.cdiv(pairs, tiles.gate_up_pairs), triton.cdiv(h_width, tiles.gate_up_block_n))](
            x, x.stride(0), *w13, *shared_gate_up, top_i,
            h, h_width, pairs, hidden, inter, shared_inter,
            TOP_K=top_k, PAIRS=tiles.gate_up_pairs, BLOCK_N=tiles.gate_up_block_n,
            BLOCK_K=min(pow2(hidden), tiles.gate_up_block_k), PDL=pdl, num_warps=tiles.gate_up_warps, launch_pdl=pdl,
            **_regs(tiles.gate_up_regs),
        )
    if tiles.down_per_sm:
        tiles_per_token = triton.cdiv(hidden, tiles.down_block_n)
        _down_stream_kernel[(num_tokens, _stream_programs(x.device, tiles.down_per_sm, num_tokens, tiles_per_token))](
            h, h_width, *routed_parts(w2), *words(shared_down), top_w, top_i, gate_logits, gate_logits.stride(0), out,
            hidden, inter, shared_inter, inter // 8, inter // GROUP, shared_inter // 8, shared_inter // GROUP, num_experts,
            BLOCK_N=tiles.down_block_n, BLOCK_K=pow2(h_width), num_warps=tiles.down_warps,
            **stream, **_regs(tiles.down_regs),
        )
    else:
        _down_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_block_n))](
            h, h_width, *w2, *shared_down, top_w, top_i,
            gate_logits, gate_logits.stride(0), out, hidden, inter, shared_inter, num_experts,
            TOP_K=top_k, BLOCK_C=pow2(top_k), BLOCK_N=tiles.down_block_n,
            BLOCK_K=min(pow2(h_width), tiles.down_block_k), PDL=pdl, num_warps=tiles.down_warps, launch_pdl=pdl,
            **_regs(tiles.down_regs),
        )
    return out
