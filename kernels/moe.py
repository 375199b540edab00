"""Sparse mixture-of-experts: routing, grouping tokens by expert, expert GEMMs, shared expert.

Expert weights are fused as transformers stores them: ``w13 [E, 2I, H]`` (gate rows, then up rows)
and ``w2 [E, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op


def moe_topk_softmax_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top-k, optional renormalisation to sum 1.

    Returns ``(weights [T, k]`` in the logits' dtype``, expert ids [T, k] int32)``, as the reference router.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


def moe_sort_tokens_reference(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the ``T·k`` (token, choice) pairs by expert.

    Returns ``(order [T·k] int32, expert_offsets [E + 1] int32)``: ``order[expert_offsets[e]:expert_offsets[e+1]]``
    are the flat indices ``t·k + j`` routed to expert ``e``, in increasing order.
    """
    flat = topk_ids.flatten().long()
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    offsets[1:] = counts.cumsum(0)
    return order, offsets


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for ``x = [gate | up]`` along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``Σ_j weight_j · down_e(silu(gate_e(x)) · up_e(x))`` over each token's chosen experts ``e = ids_j``."""
    num_tokens, top_k = topk_ids.shape
    order, offsets = moe_sort_tokens_reference(topk_ids, w13.shape[0])
    out = torch.zeros_like(x)
    bounds = offsets.tolist()
    for expert in range(w13.shape[0]):
        pairs = order[bounds[expert] : bounds[expert + 1]].long()
        if pairs.numel() == 0:
            continue
        tokens = pairs // top_k
        hidden = silu_and_mul_reference(F.linear(x[tokens], w13[expert]))
        expert_out = F.linear(hidden, w2[expert]) * topk_weights.flatten()[pairs, None]
        out.index_add_(0, tokens, expert_out.to(out.dtype))
    return out


def shared_expert_combine_reference(
    routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor
) -> torch.Tensor:
    """``routed + sigmoid(gate_logit) · shared``; ``gate_logit [T, 1]``."""
    return routed + torch.sigmoid(gate_logit) * shared


moe_topk_softmax = op("moe")(moe_topk_softmax_reference)
moe_sort_tokens = op("moe")(moe_sort_tokens_reference)
silu_and_mul = op("moe")(silu_and_mul_reference)
fused_experts = op("moe")(fused_experts_reference)
shared_expert_combine = op("moe")(shared_expert_combine_reference)
