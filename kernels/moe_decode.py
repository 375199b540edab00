"""The sparse MoE block after its router GEMM, fused for a few tokens (the decode step's launches).

Its reference composes the general ops of :mod:`freetoken.kernels.moe` exactly as the layer does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op
from freetoken.kernels.moe import (
    fused_experts_reference,
    moe_topk_softmax_reference,
    shared_expert_combine_reference,
    silu_and_mul_reference,
)


def sparse_moe_decode_reference(
    x: torch.Tensor,
    gate_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """The whole sparse MoE block after its router GEMM, for a few tokens (decode).

    ``gate_logits [T, E + 1]``: the router logits, then the shared expert's gate logit (the layer's
    one GEMM). Routed experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; shared expert
    ``shared_gate_up [2Is, H]``, ``shared_down [H, Is]``. Returns
    ``routed + sigmoid(gate) · shared`` exactly as the unfused ops compose it.
    """
    num_experts = w13.shape[0]
    weights, ids = moe_topk_softmax_reference(gate_logits[:, :num_experts].float(), top_k, renormalize)
    routed = fused_experts_reference(x, w13, w2, weights.to(x.dtype), ids)
    shared = F.linear(silu_and_mul_reference(F.linear(x, shared_gate_up)), shared_down)
    return shared_expert_combine_reference(routed, shared, gate_logits[:, num_experts:])


sparse_moe_decode = op("moe_decode")(sparse_moe_decode_reference)
