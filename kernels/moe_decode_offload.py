"""The few-token sparse MoE block of an offloaded layer (``moe_offload``): each routed expert is read
from its device cache slot when it has one, else straight from pinned host memory (zero-copy over
PCIe). No host sync, so a decode step with offloaded layers can be captured in a CUDA graph. Dense
experts (``sparse_moe_decode_offload``) and NVFP4 ones (``sparse_moe_decode_offload_nvfp4``: each
weight's packed codes, block scales and row scales, in the slots and on the host alike).

The references build the layer's experts as the kernel reads them and run the resident block's
reference (``kernels/moe_decode.py``, ``kernels/nvfp4.py``) on them, so both compose the ops
exactly alike.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op
from freetoken.kernels.moe import moe_topk_softmax_reference
from freetoken.kernels.moe_decode import sparse_moe_decode_reference
from freetoken.kernels.nvfp4 import sparse_moe_decode_nvfp4_reference


def _route(gate_logits: torch.Tensor, slot_map: torch.Tensor, num_experts: int, top_k: int, renormalize: bool,
           routed: torch.Tensor) -> None:
    """Each (token, choice)'s expert into ``routed``: ``e`` when it has a slot, ``-1 - e`` when not."""
    _, ids = moe_topk_softmax_reference(gate_logits[:, :num_experts], top_k, renormalize)
    hit = slot_map[ids.long()] >= 0
    routed.copy_(torch.where(hit, ids, -1 - ids).to(routed.dtype))


def _claim(routed: torch.Tensor, fills: torch.Tensor, lend: torch.Tensor) -> list[tuple[int, int]]:
    """The read-through fill's claims, as the kernel makes them: each distinct missed expert, in
    (token, choice) order, takes the next lent slot while there are any (``lend``: claimed so far,
    the limit, then the ring of lent slots; ``experts.lend``); ``fills`` gets the slot at the first
    (token, choice) routed to it, -1 elsewhere. Returns ``(expert, slot)`` of the claims."""
    claimed, limit = int(lend[0]), int(lend[1])
    ring = lend.numel() - 2
    fills.fill_(-1)
    seen: set[int] = set()
    claims: list[tuple[int, int]] = []
    for t, row in enumerate(routed.tolist()):
        for j, code in enumerate(row):
            if code >= 0 or code in seen:
                continue
            seen.add(code)
            if claimed < limit:
                slot = int(lend[2 + claimed % ring])
                fills[t, j] = slot
                claims.append((-1 - code, slot))
                claimed += 1
    lend[0] = claimed
    return claims


def _as_read(slot_map: torch.Tensor, slot_part: torch.Tensor, host_part: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One weight part of the layer's experts ``[E, ...]`` as the kernel reads them: a cached
    expert's from its slot, the others' from host memory (compared as bytes: any dtype)."""
    cached = (slot_map >= 0).to(device)
    rows = slot_map.clamp(min=0).long().to(slot_part.device)
    from_slots = slot_part[rows].to(device).contiguous().view(torch.uint8)
    from_host = host_part.to(device).contiguous().view(torch.uint8)
    mask = cached.view(-1, *([1] * (from_host.dim() - 1)))
    return torch.where(mask, from_slots, from_host).view(host_part.dtype)


def sparse_moe_decode_offload_reference(
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
    """``sparse_moe_decode`` with the routed experts split between a device cache and host memory.

    ``slot_map [E]`` int32: expert ``e``'s slot in ``slot_w13 [S, 2I, H]`` / ``slot_w2 [S, H, I]``,
    or -1: then it is read from ``host_w13 [E, 2I, H]`` / ``host_w2 [E, H, I]`` (pinned host memory
    on CUDA). Writes each (token, choice)'s expert into ``routed [T, top_k]`` (int32) as ``e`` when
    it was read from a slot, ``-1 - e`` when from host memory: the cache's bookkeeping learns the
    step's hits and misses from it without a sync (``experts.decode_log``).

    Read-through fill (``fills [T, top_k]`` int32 and ``lend`` int32 ``[2 + ring]``, both or
    neither): each distinct missed expert claims the next slot the host lent (``_claim``); the
    kernel writes the weights it read from host memory into that slot and maps the expert to it
    (``slot_map[e] = slot``) for the later forwards, so a miss crosses PCIe once; ``fills`` records
    the claims for the host's bookkeeping. This forward reads every miss from host memory.
    """
    num_experts = host_w13.shape[0]
    if (fills is None) != (lend is None):
        raise ValueError("sparse_moe_decode_offload: fills and lend come together (the read-through fill)")
    _route(gate_logits, slot_map, num_experts, top_k, renormalize, routed)
    w13 = _as_read(slot_map, slot_w13, host_w13, x.device)
    w2 = _as_read(slot_map, slot_w2, host_w2, x.device)
    out = sparse_moe_decode_reference(x, gate_logits, w13, w2, shared_gate_up, shared_down, top_k, renormalize)
    if fills is not None and lend is not None:
        for expert, slot in _claim(routed, fills, lend):
            slot_w13[slot].copy_(host_w13[expert])
            slot_w2[slot].copy_(host_w2[expert])
            slot_map[expert] = slot
    return out


def sparse_moe_decode_offload_nvfp4_reference(
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
    """``sparse_moe_decode_offload`` over NVFP4 routed and shared experts (``kernels/nvfp4.py``'s
    layout): each routed weight's three parts, in the slots ``[S, ...]`` and on the host ``[E, ...]``,
    with one expert (dim 0) stride on both sides and contiguous rows (an offloaded layer's are views
    of one byte span an expert, ``experts.span``). The read-through fill (``fills``, ``lend``) as
    there: a claimed slot gets all six parts of its expert."""
    num_experts = host_w13_packed.shape[0]
    if (fills is None) != (lend is None):
        raise ValueError("sparse_moe_decode_offload_nvfp4: fills and lend come together (the read-through fill)")
    _route(gate_logits, slot_map, num_experts, top_k, renormalize, routed)
    slot_parts = (slot_w13_packed, slot_w13_scales, slot_w13_row_scales, slot_w2_packed, slot_w2_scales,
                  slot_w2_row_scales)
    host_parts = (host_w13_packed, host_w13_scales, host_w13_row_scales, host_w2_packed, host_w2_scales,
                  host_w2_row_scales)
    experts = [_as_read(slot_map, s, h, x.device) for s, h in zip(slot_parts, host_parts)]
    out = sparse_moe_decode_nvfp4_reference(
        x, gate_logits, *experts, shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales,
        shared_down_packed, shared_down_scales, shared_down_row_scales, top_k, renormalize,
    )
    if fills is not None and lend is not None:
        for expert, slot in _claim(routed, fills, lend):
            for slot_part, host_part in zip(slot_parts, host_parts):
                slot_part[slot].copy_(host_part[expert])
            slot_map[expert] = slot
    return out


sparse_moe_decode_offload = op("moe_decode_offload")(sparse_moe_decode_offload_reference)
sparse_moe_decode_offload_nvfp4 = op("moe_decode_offload")(sparse_moe_decode_offload_nvfp4_reference)
