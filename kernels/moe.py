"""Sparse mixture-of-experts: routing, grouping tokens by expert, expert GEMMs, shared expert.

Expert weights are fused as transformers stores them: ``w13 [E, 2I, H]`` (gate rows, then up rows)
and ``w2 [E, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op
from freetoken.kernels.norm import add_rms_norm_reference


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
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_j weight_j · down_e(silu(gate_e(x)) · up_e(x))`` over each token's chosen experts ``e = ids_j``.
    ``expert_slots [E]`` (int32): expert ``e``'s weights are ``w13[expert_slots[e]]`` and
    ``w2[expert_slots[e]]`` (an expert cache's slots, where the weight tensors hold more or fewer
    rows than ``E``; entries of experts no id names are never read); None: ``w13[e]``."""
    if expert_slots is not None:
        used = torch.unique(topk_ids.flatten().long())
        index = torch.zeros(expert_slots.shape[0], dtype=torch.long, device=w13.device)
        index[used] = expert_slots.long()[used]
        w13, w2 = w13[index], w2[index]
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


def fused_experts_pairs_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Each (token, choice) pair's weighted expert output, not yet summed: ``[T, k, H]``, ``[t, j]``
    = ``weight_j · down_e(silu(gate_e(x_t)) · up_e(x_t))`` for ``e = ids[t, j]`` (what
    ``fused_experts`` sums), so the sum can run in a later kernel with the residual add and norm."""
    num_tokens, top_k = topk_ids.shape
    order, offsets = moe_sort_tokens_reference(topk_ids, w13.shape[0])
    out = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for expert in range(w13.shape[0]):
        pairs = order[bounds[expert] : bounds[expert + 1]].long()
        if pairs.numel() == 0:
            continue
        hidden = silu_and_mul_reference(F.linear(x[pairs // top_k], w13[expert]))
        out[pairs] = (F.linear(hidden, w2[expert]) * topk_weights.flatten()[pairs, None]).to(out.dtype)
    return out.view(num_tokens, top_k, x.shape[1])


def fused_experts_shared_pairs_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    shared_gate_logit: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_experts_pairs`` and the gated shared expert, ``sigmoid(gate_logit) · shared(x)``
    ``[T, H]``, rounded as ``shared_expert_combine`` rounds its shared term: the decode batch's
    shared expert runs as more tiles of the grouped expert GEMMs instead of its own GEMMs."""
    shared = F.linear(silu_and_mul_reference(F.linear(x, shared_gate_up)), shared_down)
    gated = torch.sigmoid(shared_gate_logit) * shared
    return fused_experts_pairs_reference(x, w13, w2, topk_weights, topk_ids), gated


def moe_combine_add_rms_norm_reference(
    pairs: torch.Tensor,
    shared: torch.Tensor,
    shared_gate_logit: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's output added to the residual stream and normalized, from its parts: the pairs'
    outputs ``[T, k, H]`` summed in float32 (as ``fused_experts``), plus the shared term (``shared``
    gated by ``sigmoid(shared_gate_logit)`` as ``shared_expert_combine``, or already gated when the
    logit is ``None``), then ``add_rms_norm`` with ``residual``. ``rows``: only those rows (the
    final norm before the lm_head). Returns ``(norm(moe + residual), moe + residual)``."""
    if rows is not None:
        pairs, shared, residual = pairs[rows], shared[rows], residual[rows]
        shared_gate_logit = None if shared_gate_logit is None else shared_gate_logit[rows]
    routed = pairs.float().sum(1).to(pairs.dtype)
    moe = routed + shared if shared_gate_logit is None else shared_expert_combine_reference(routed, shared, shared_gate_logit)
    return add_rms_norm_reference(moe, residual, weight, eps, zero_centered)


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
fused_experts_pairs = op("moe")(fused_experts_pairs_reference)
fused_experts_shared_pairs = op("moe")(fused_experts_shared_pairs_reference)
moe_combine_add_rms_norm = op("moe")(moe_combine_add_rms_norm_reference)
