"""Triton few-token sparse MoE block of an offloaded layer: ``kernels/triton/moe_decode.py``'s
three launches (for NVFP4 experts, the routing launch and ``kernels/triton/nvfp4_decode_stream.py``'s
two), each routed expert read from its cache slot or, on a miss, from pinned host memory.

The routing launch routes each token (``moe_decode._top_k``), loads each choice's slot from the
layer's slot map and writes the choice into the caller's ``routed`` buffer as ``e`` (a hit) or
``-1 - e`` (a miss). The gate/up and down launches decode it, load the slot again and pick the
base of the expert's rows with ``tl.where``: the slot in the device cache, or the expert in the
host tensor (pinned host memory is addressable from kernels through unified virtual addressing; a
miss streams its rows over PCIe, read once per (token, choice) as the resident block reads HBM).
The map does not change during a step (every update is queued between steps, ``experts.slots``),
and an entry always points at a copy of its expert's weights, so each load alone is safe. Both
copies of an expert hold the same values, so hit or miss changes no result bit.

Read-through fill (``fills`` and ``lend`` given; ``kernels/moe_decode_offload.py`` has the
contract): the routing launch is one program that routes the tokens in turn, gives each distinct
miss the next slot the host lent and maps it at once (the later launches take a slot from the map
only for a hit's code, so this step still reads the claimed expert from host memory); the gate/up
and down programs that load a claimed expert's tiles also store them into its slot.

The rest (rounding, launch shapes and tiles, the shared expert) is the resident block's, without
programmatic dependent launch (each launch starts once the previous one is done). NVFP4 experts run
the resident NVFP4 block's two streams (``nvfp4_decode_stream``, ``OFFLOAD``) behind the same routing
launch, under programmatic dependent launch as the resident block: each stream reads the codes and
picks the base of each of an expert's three parts (packed codes, block scales, row scales) in its
slot or on the host, from the part's expert stride (an offloaded layer's parts are views of one
span an expert, ``experts.span``, in the slots and on the host alike; only their rows need be
contiguous); with the fill, the stream programs store a claimed expert's tiles into its slot as the
dense ones do. The streams' loads before their wait (the down pass's first tile, and its routing)
read what the routing launch wrote: it ended before the gate/up programs' wait returned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import cast, new_empty, pow2
from freetoken.kernels.triton import moe_decode, nvfp4_decode
from freetoken.kernels.triton.moe_decode import _down_choices, _gate_up_pairs, _top_k
from freetoken.kernels.triton.nvfp4 import GROUP
from freetoken.kernels.triton.nvfp4_decode_stream import _down_stream_kernel, _gate_up_stream_kernel


@triton.jit
def _offload_route_kernel(
    logits_ptr, l_st, map_ptr, topw_ptr, topi_ptr, fill_ptr, lend_ptr, num_tokens, num_experts, ring,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    FILL: tl.constexpr,
):
    # One program routes every token in turn, so a miss routed by several tokens claims one slot
    # (the first token's choice fills it), with no atomics: the layers' launches are in order.
    e = tl.arange(0, BLOCK_E)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < TOP_K
    claimed = tl.sum(tl.zeros([BLOCK_C], tl.int32), 0)
    limit = claimed
    if FILL:
        claimed = tl.load(lend_ptr)
        limit = tl.load(lend_ptr + 1)
    taken = tl.zeros([BLOCK_E], tl.int32)  # this layer's experts an earlier token missed
    for t in range(num_tokens):
        weights, experts = _top_k(logits_ptr + t * l_st, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
        lane = e[None, :] == c[:, None]  # [BLOCK_C, BLOCK_E]: choice c in lane c
        choice = tl.sum(tl.where(lane, experts[None, :], 0), 1)
        weight = tl.sum(tl.where(lane, weights[None, :], 0.0), 1)
        slot = tl.load(map_ptr + choice, mask=c_ok, other=-1)
        onehot = choice[:, None] == e[None, :]
        # An expert an earlier token missed is a miss for this one too, even once its claim mapped it.
        seen = tl.sum(tl.where(onehot, taken[None, :], 0), 1)
        hit = (slot >= 0) & (seen == 0)
        tl.store(topw_ptr + t * TOP_K + c, weight, mask=c_ok)
        tl.store(topi_ptr + t * TOP_K + c, tl.where(hit, choice, -1 - choice), mask=c_ok)
        if FILL:
            new = c_ok & ~hit & (seen == 0)
            k = claimed + tl.cumsum(new.to(tl.int32), 0) - 1
            granted = new & (k < limit)
            target = tl.load(lend_ptr + 2 + k % ring, mask=granted, other=-1)
            tl.store(fill_ptr + t * TOP_K + c, tl.where(granted, target, -1), mask=c_ok)
            # Published at once: this step's later kernels find the slot only through a hit's code,
            # so they read a claimed expert from host memory (filling its slot), later steps from the slot.
            tl.store(map_ptr + choice, target, mask=granted)
            claimed += tl.sum(granted.to(tl.int32), 0)
        taken = tl.maximum(taken, tl.max(tl.where(onehot & (c_ok & ~hit)[:, None], 1, 0), 0))
    if FILL:
        tl.store(lend_ptr, claimed)


@triton.jit
def _offload_gate_up_kernel(
    x_ptr, x_st, map_ptr, slot_w13_ptr, host_w13_ptr, w13_se, w13_sn, sw_ptr, sw_sn, topi_ptr, fill_ptr, h_ptr,
    h_width, num_pairs, hidden, inter, shared_inter,
    TOP_K: tl.constexpr, PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FILL: tl.constexpr,
):
    # Pair q = t·(TOP_K + 1) + j: token t's choice j, or its shared expert at j = TOP_K.
    q = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    q_ok = q < num_pairs
    t = q // (TOP_K + 1)
    j = q % (TOP_K + 1)
    routed = j < TOP_K
    code = tl.load(topi_ptr + t * TOP_K + j, mask=q_ok & routed, other=0)
    expert = tl.where(code >= 0, code, -1 - code)
    # A hit's slot (the map entries of hits do not change during a step); a miss reads host memory.
    slot = tl.load(map_ptr + expert, mask=q_ok & routed & (code >= 0), other=-1)
    expert_base = tl.where(slot >= 0, slot_w13_ptr + slot.to(tl.int64) * w13_se,
                           host_w13_ptr + expert.to(tl.int64) * w13_se)
    base = tl.where(routed, expert_base, sw_ptr)
    fill_ok = q_ok & routed
    if FILL:
        fill = tl.load(fill_ptr + t * TOP_K + j, mask=q_ok & routed, other=-1)
        fill_ok = fill_ok & (fill >= 0)
    else:
        fill = tl.zeros([PAIRS], tl.int32)
    fill_base = slot_w13_ptr + tl.maximum(fill, 0).to(tl.int64) * w13_se
    _gate_up_pairs(x_ptr, x_st, base, routed, w13_sn, sw_sn, q, q_ok, t, h_ptr, h_width, hidden, inter, shared_inter,
                   fill_base, fill_ok, PAIRS, BLOCK_N, BLOCK_K, FILL)


@triton.jit
def _offload_down_kernel(
    h_ptr, h_width, map_ptr, slot_w2_ptr, host_w2_ptr, w2_se, w2_sn, sd_ptr, sd_sn, topw_ptr, topi_ptr, fill_ptr,
    logits_ptr, l_st, out_ptr, hidden, inter, shared_inter, num_experts,
    TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FILL: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    c = tl.arange(0, BLOCK_C)
    c_ok = c < TOP_K
    dtype = out_ptr.dtype.element_ty
    code = tl.load(topi_ptr + t * TOP_K + c, mask=c_ok, other=0)
    expert = tl.where(code >= 0, code, -1 - code)
    slot = tl.load(map_ptr + expert, mask=c_ok & (code >= 0), other=-1)
    expert_base = tl.where(slot >= 0, slot_w2_ptr + slot.to(tl.int64) * w2_se, host_w2_ptr + expert.to(tl.int64) * w2_se)
    # The weights as the reference holds them: rounded to the activations' dtype.
    weight = tl.load(topw_ptr + t * TOP_K + c, mask=c_ok, other=0.0)
    weight = cast(weight, dtype).to(tl.float32)
    w_rows = expert_base[:, None] + n[None, :] * w2_sn
    if FILL:
        fill = tl.load(fill_ptr + t * TOP_K + c, mask=c_ok, other=-1)
    else:
        fill = tl.full([BLOCK_C], -1, tl.int32)
    fill_rows = (slot_w2_ptr + tl.maximum(fill, 0).to(tl.int64) * w2_se)[:, None] + n[None, :] * w2_sn
    _down_choices(h_ptr, h_width, w_rows, sd_ptr, sd_sn, weight, logits_ptr, l_st, out_ptr, t, n, n_ok, c, c_ok,
                  hidden, inter, shared_inter, num_experts, fill_rows, c_ok & (fill >= 0), TOP_K, BLOCK_C, BLOCK_N,
                  BLOCK_K, False, FILL)


def _check_fill(routed: torch.Tensor, fills: torch.Tensor | None, lend: torch.Tensor | None) -> None:
    if (fills is None) != (lend is None):
        raise ValueError("sparse_moe_decode_offload: fills and lend come together (the read-through fill)")
    if fills is None or lend is None:
        return
    if fills.shape != routed.shape or fills.dtype != torch.int32 or not fills.is_contiguous():
        raise ValueError(f"sparse_moe_decode_offload: fills {tuple(fills.shape)} ({fills.dtype}) must be contiguous "
                         f"int32 shaped as routed {tuple(routed.shape)}")
    if lend.dim() != 1 or lend.numel() < 3 or lend.dtype != torch.int32 or not lend.is_contiguous():
        raise ValueError(f"sparse_moe_decode_offload: lend {tuple(lend.shape)} ({lend.dtype}) must be contiguous "
                         f"int32 [2 + ring] (claimed, limit, then the ring of lent slots)")


def _check(x, gate_logits, slot_map, slot_w13, slot_w2, host_w13, host_w2, shared_gate_up, shared_down,
           top_k, routed) -> None:
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = host_w13.shape
    inter, shared_inter = two_inter // 2, shared_gate_up.shape[0] // 2
    expert_shapes = ((2 * inter, hidden), (hidden, inter))
    if (
        gate_logits.shape != (num_tokens, num_experts + 1)
        or host_w13.shape[2] != hidden
        or host_w2.shape != (num_experts, hidden, inter)
        or (tuple(slot_w13.shape[1:]), tuple(slot_w2.shape[1:])) != expert_shapes
        or slot_w13.shape[0] != slot_w2.shape[0]
        or slot_map.shape != (num_experts,)
        or shared_gate_up.shape != (2 * shared_inter, hidden)
        or shared_down.shape != (hidden, shared_inter)
        or routed.shape != (num_tokens, top_k)
        or not 0 < top_k <= num_experts
    ):
        raise ValueError(
            f"sparse_moe_decode_offload: x {tuple(x.shape)}, gate_logits {tuple(gate_logits.shape)}, "
            f"slot_map {tuple(slot_map.shape)}, slot_w13 {tuple(slot_w13.shape)}, slot_w2 {tuple(slot_w2.shape)}, "
            f"host_w13 {tuple(host_w13.shape)}, host_w2 {tuple(host_w2.shape)}, "
            f"shared_gate_up {tuple(shared_gate_up.shape)}, shared_down {tuple(shared_down.shape)}, "
            f"routed {tuple(routed.shape)}, top_k {top_k} disagree"
        )
    if slot_map.dtype != torch.int32 or routed.dtype != torch.int32 or not routed.is_contiguous():
        raise ValueError(
            f"sparse_moe_decode_offload: slot_map ({slot_map.dtype}) and routed ({routed.dtype}, contiguous "
            f"{routed.is_contiguous()}) must be contiguous int32"
        )
    for name, w in (("slot_w13", slot_w13), ("slot_w2", slot_w2), ("host_w13", host_w13), ("host_w2", host_w2)):
        if not w.is_contiguous():
            raise ValueError(f"sparse_moe_decode_offload: {name} must be contiguous (slot and host rows share strides)")


def sparse_moe_decode_offload(
    x: torch.Tensor,
    gate_logits: torch.Tensor,
    slot_map: torch.Tensor,
    slot_w13: torch.Tensor,
    slot_w2: torch.Tensor,
    host_w13: torch.Tensor,
    host_w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routed: torch.Tensor,
    fills: torch.Tensor | None = None,
    lend: torch.Tensor | None = None,
) -> torch.Tensor:
    _check(x, gate_logits, slot_map, slot_w13, slot_w2, host_w13, host_w2, shared_gate_up, shared_down, top_k, routed)
    _check_fill(routed, fills, lend)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = host_w13.shape
    inter, shared_inter = two_inter // 2, shared_gate_up.shape[0] // 2
    out = new_empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_logits = gate_logits if gate_logits.stride(-1) == 1 else gate_logits.contiguous()
    shared_gate_up, shared_down = shared_gate_up.contiguous(), shared_down.contiguous()
    h_width, pairs = max(inter, shared_inter), num_tokens * (top_k + 1)
    h = new_empty((pairs, h_width), x.dtype, x.device)
    top_w = new_empty((num_tokens, top_k), torch.float32, x.device)
    tiles = moe_decode.TILES
    fill = lend is not None
    fills_arg = fills if fills is not None else routed  # not read without the fill
    lend_arg = lend if lend is not None else routed
    ring = lend.numel() - 2 if lend is not None else 1
    _offload_route_kernel[(1,)](
        gate_logits, gate_logits.stride(0), slot_map, top_w, routed, fills_arg, lend_arg, num_tokens, num_experts,
        ring, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=pow2(num_experts), BLOCK_C=pow2(top_k), FILL=fill,
        num_warps=moe_decode.ROUTE_WARPS,
    )
    _offload_gate_up_kernel[(triton.cdiv(pairs, tiles.gate_up_pairs), triton.cdiv(h_width, tiles.gate_up_block_n))](
        x, x.stride(0), slot_map, slot_w13, host_w13, host_w13.stride(0), host_w13.stride(1),
        shared_gate_up, shared_gate_up.stride(0), routed, fills_arg, h, h_width, pairs, hidden, inter, shared_inter,
        TOP_K=top_k, PAIRS=tiles.gate_up_pairs, BLOCK_N=tiles.gate_up_block_n,
        BLOCK_K=min(pow2(hidden), tiles.gate_up_block_k), FILL=fill, num_warps=tiles.gate_up_warps,
    )
    _offload_down_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_block_n))](
        h, h_width, slot_map, slot_w2, host_w2, host_w2.stride(0), host_w2.stride(1), shared_down,
        shared_down.stride(0), top_w, routed, fills_arg, gate_logits, gate_logits.stride(0), out,
        hidden, inter, shared_inter, num_experts,
        TOP_K=top_k, BLOCK_C=pow2(top_k), BLOCK_N=tiles.down_block_n,
        BLOCK_K=min(pow2(h_width), tiles.down_block_k), FILL=fill, num_warps=tiles.down_warps,
    )
    return out


def sparse_moe_decode_offload_nvfp4(
    x: torch.Tensor,
    gate_logits: torch.Tensor,
    slot_map: torch.Tensor,
    slot_w13_packed: torch.Tensor,
    slot_w13_scales: torch.Tensor,
    slot_w13_row_scales: torch.Tensor,
    slot_w2_packed: torch.Tensor,
    slot_w2_scales: torch.Tensor,
    slot_w2_row_scales: torch.Tensor,
    host_w13_packed: torch.Tensor,
    host_w13_scales: torch.Tensor,
    host_w13_row_scales: torch.Tensor,
    host_w2_packed: torch.Tensor,
    host_w2_scales: torch.Tensor,
    host_w2_row_scales: torch.Tensor,
    shared_gate_up_packed: torch.Tensor,
    shared_gate_up_scales: torch.Tensor,
    shared_gate_up_row_scales: torch.Tensor,
    shared_down_packed: torch.Tensor,
    shared_down_scales: torch.Tensor,
    shared_down_row_scales: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routed: torch.Tensor,
    fills: torch.Tensor | None = None,
    lend: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = host_w13_packed.shape
    inter, shared_inter = two_inter // 2, shared_gate_up_packed.shape[0] // 2
    num_slots = slot_w13_packed.shape[0]
    if (
        gate_logits.shape != (num_tokens, num_experts + 1)
        or slot_map.shape != (num_experts,)
        or routed.shape != (num_tokens, top_k)
        or not 0 < top_k <= num_experts
    ):
        raise ValueError(
            f"sparse_moe_decode_offload_nvfp4: x {tuple(x.shape)}, gate_logits {tuple(gate_logits.shape)}, "
            f"slot_map {tuple(slot_map.shape)}, routed {tuple(routed.shape)}, {num_experts} experts, top_k {top_k} "
            "disagree"
        )
    if slot_map.dtype != torch.int32 or routed.dtype != torch.int32 or not routed.is_contiguous():
        raise ValueError("sparse_moe_decode_offload_nvfp4: slot_map and routed must be contiguous int32")
    _check_fill(routed, fills, lend)
    check = nvfp4_decode._check
    check("host w13", host_w13_packed, host_w13_scales, host_w13_row_scales, (num_experts, two_inter, hidden))
    check("host w2", host_w2_packed, host_w2_scales, host_w2_row_scales, (num_experts, hidden, inter))
    check("slot w13", slot_w13_packed, slot_w13_scales, slot_w13_row_scales, (num_slots, two_inter, hidden))
    check("slot w2", slot_w2_packed, slot_w2_scales, slot_w2_row_scales, (num_slots, hidden, inter))
    check("shared_gate_up", shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales,
          (2 * shared_inter, hidden))
    check("shared_down", shared_down_packed, shared_down_scales, shared_down_row_scales, (hidden, shared_inter))
    pairs_of_parts = {
        "w13_packed": (slot_w13_packed, host_w13_packed), "w13_scales": (slot_w13_scales, host_w13_scales),
        "w13_row_scales": (slot_w13_row_scales, host_w13_row_scales), "w2_packed": (slot_w2_packed, host_w2_packed),
        "w2_scales": (slot_w2_scales, host_w2_scales), "w2_row_scales": (slot_w2_row_scales, host_w2_row_scales),
    }
    for name, (slot_part, host_part) in pairs_of_parts.items():
        for side, part in (("slot", slot_part), ("host", host_part)):
            if part.shape[0] and not part[0].is_contiguous():
                raise ValueError(f"sparse_moe_decode_offload_nvfp4: {side}_{name} {tuple(part.shape)} strides "
                                 f"{part.stride()} must have contiguous rows (any expert stride; a copy of host "
                                 "memory would defeat the zero-copy read)")
        if slot_part.shape[0] > 1 and host_part.shape[0] > 1 and slot_part.stride(0) != host_part.stride(0):
            raise ValueError(f"sparse_moe_decode_offload_nvfp4: slot_{name} and host_{name} must have one expert "
                             f"stride (the slots hold the host's layout), got {slot_part.stride(0)} and "
                             f"{host_part.stride(0)}")
    out = new_empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_logits = gate_logits if gate_logits.stride(-1) == 1 else gate_logits.contiguous()

    def routed_parts(slot_parts, host_parts):
        """The slot and host parts as the stream kernels read them (packed codes as int32 words), then
        each part's expert stride (the host's where it has more than one expert)."""
        as_read = [(p[0].view(torch.int32), p[1].view(torch.uint8), p[2]) for p in (slot_parts, host_parts)]
        return (*as_read[0], *as_read[1], *(h.stride(0) if h.shape[0] > 1 else s.stride(0)
                                           for s, h in zip(*as_read)))

    def words(packed, scales, row_scales):
        return packed.contiguous().view(torch.int32), scales.contiguous().view(torch.uint8), row_scales.contiguous()

    h_width = max(inter, shared_inter)
    h = new_empty((num_tokens * (top_k + 1), h_width), x.dtype, x.device)
    top_w = new_empty((num_tokens, top_k), torch.float32, x.device)
    fill = lend is not None
    fills_arg = fills if fills is not None else routed  # not read without the fill
    lend_arg = lend if lend is not None else routed
    _offload_route_kernel[(1,)](
        gate_logits, gate_logits.stride(0), slot_map, top_w, routed, fills_arg, lend_arg, num_tokens, num_experts,
        lend.numel() - 2 if lend is not None else 1, TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_E=pow2(num_experts), BLOCK_C=pow2(top_k), FILL=fill, num_warps=moe_decode.ROUTE_WARPS,
    )
    tiles = nvfp4_decode.TILES
    pdl = tiles.pdl and moe_decode._pdl_available()
    stream = dict(TOP_K=top_k, BLOCK_C=pow2(top_k), PREFETCH=tiles.prefetch, PDL=pdl, OFFLOAD=True, FILL=fill,
                  launch_pdl=pdl)
    gate_up_parts = routed_parts((slot_w13_packed, slot_w13_scales, slot_w13_row_scales),
                                 (host_w13_packed, host_w13_scales, host_w13_row_scales))
    gate_up_tiles = (top_k + 1) * triton.cdiv(h_width, tiles.gate_up_block_n)
    _gate_up_stream_kernel[(num_tokens, nvfp4_decode._stream_programs(x.device, max(1, tiles.gate_up_per_sm),
                                                                      num_tokens, gate_up_tiles))](
        x, x.stride(0), *gate_up_parts, slot_map, fills_arg,
        *words(shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales), top_w, routed,
        h, h_width, hidden, hidden // 8, hidden // GROUP, inter, shared_inter, BLOCK_N=tiles.gate_up_block_n, NB=triton.cdiv(h_width, tiles.gate_up_block_n),
        BLOCK_K=pow2(hidden), SHARED_FIRST=tiles.shared_first, num_warps=tiles.gate_up_warps, **stream,
    )
    down_parts = routed_parts((slot_w2_packed, slot_w2_scales, slot_w2_row_scales),
                              (host_w2_packed, host_w2_scales, host_w2_row_scales))
    _down_stream_kernel[(num_tokens, nvfp4_decode._stream_programs(x.device, max(1, tiles.down_per_sm), num_tokens,
                                                                   triton.cdiv(hidden, tiles.down_block_n)))](
        h, h_width, *down_parts, slot_map, fills_arg,
        *words(shared_down_packed, shared_down_scales, shared_down_row_scales), top_w, routed,
        gate_logits, gate_logits.stride(0), out, hidden, inter, shared_inter, inter // 8, inter // GROUP,
        shared_inter // 8, shared_inter // GROUP, num_experts, BLOCK_N=tiles.down_block_n, BLOCK_K=pow2(h_width),
        num_warps=tiles.down_warps, **stream,
    )
    return out
