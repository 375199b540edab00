"""The few-token sparse MoE block of an offloaded layer (``moe_offload``): each routed expert is read
from its device cache slot when it has one, else straight from pinned host memory (zero-copy over
PCIe). No host sync, so a decode step with offloaded layers can be captured in a CUDA graph.

Its reference builds the layer's experts as the kernel sees them and runs the resident block's
reference (``kernels/moe_decode.py``) on them, so both compose the ops exactly alike.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op
from freetoken.kernels.moe import moe_topk_softmax_reference
from freetoken.kernels.moe_decode import sparse_moe_decode_reference


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
) -> torch.Tensor:
    """``sparse_moe_decode`` with the routed experts split between a device cache and host memory.

    ``slot_map [E]`` int32: expert ``e``'s slot in ``slot_w13 [S, 2I, H]`` / ``slot_w2 [S, H, I]``,
    or -1: then it is read from ``host_w13 [E, 2I, H]`` / ``host_w2 [E, H, I]`` (pinned host memory
    on CUDA). Writes each (token, choice)'s expert into ``routed [T, top_k]`` (int32) as ``e`` when
    it was read from a slot, ``-1 - e`` when from host memory: the cache's bookkeeping learns the
    step's hits and misses from it without a sync (``experts.decode_log``).
    """
    num_experts = host_w13.shape[0]
    _, ids = moe_topk_softmax_reference(gate_logits[:, :num_experts], top_k, renormalize)
    hit = slot_map[ids.long()] >= 0
    routed.copy_(torch.where(hit, ids, -1 - ids).to(routed.dtype))
    cached = (slot_map >= 0).to(x.device)
    rows = slot_map.clamp(min=0).long().to(slot_w13.device)
    w13 = torch.where(cached[:, None, None], slot_w13[rows].to(x.device), host_w13.to(x.device))
    w2 = torch.where(cached[:, None, None], slot_w2[rows].to(x.device), host_w2.to(x.device))
    return sparse_moe_decode_reference(x, gate_logits, w13, w2, shared_gate_up, shared_down, top_k, renormalize)


sparse_moe_decode_offload = op("moe_decode_offload")(sparse_moe_decode_offload_reference)
