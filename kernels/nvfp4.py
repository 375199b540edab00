"""NVFP4 weights with bf16/float32 activations (W4A16): dequantization, the dense GEMM and the
grouped MoE GEMMs.

A weight ``[*, out, in]`` is kept as

- ``packed`` uint8 ``[*, out, in / 2]``: two e2m1 codes a byte, the even column in the low nibble;
  a code is sign (bit 3), exponent (bits 2-1), mantissa (bit 0): 0, 0.5, 1, 1.5, 2, 3, 4, 6;
- ``scales`` float8_e4m3fn ``[*, out, in / 16]``: one scale per 16 input columns;
- ``row_scales`` float32 ``[*, out]``: the checkpoint's per-tensor scale, one per row so that rows
  fused from tensors with different scales (q/k/v, gate/up) stay exact.

``value = e2m1 · e4m3 · row_scale``. The product ``e2m1 · e4m3`` has at most 6 significant bits, so
it is exact in bf16; the kernels therefore multiply bf16 tiles on the tensor cores and apply the
row scale to the float32 accumulator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op
from freetoken.kernels.moe import (
    moe_sort_tokens_reference,
    moe_topk_softmax_reference,
    shared_expert_combine_reference,
    silu_and_mul_reference,
)

GROUP_SIZE = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[*, n / 2]`` -> float32 ``[*, n]``: the low nibble is the even column."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).long()
    return table[codes].flatten(-2)


def dequantize_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``[*, out, in]`` in ``dtype``: ``e2m1 · e4m3 · row_scale`` in float32, then rounded.

    Plain torch on any device: the references use it, and so does loading where a packed tensor
    must become dense (a fused weight with quantized and unquantized parts)."""
    values = unpack_e2m1(packed)
    block = scales.float().repeat_interleave(GROUP_SIZE, dim=-1)
    return (values * block * row_scales.float()[..., None]).to(dtype)


def nvfp4_linear_reference(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor
) -> torch.Tensor:
    """``x @ W.T`` for the NVFP4 weight ``W [out, in]`` (``x [..., in]``, result in ``x``'s dtype)."""
    return F.linear(x, dequantize_nvfp4(packed, scales, row_scales, x.dtype))


def fused_experts_nvfp4_reference(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_row_scales: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_experts`` over NVFP4 experts (``w13 [E, 2I, H]``, ``w2 [E, H, I]``), one expert
    dequantized at a time. ``expert_slots [E]`` (int32), as ``fused_experts``': expert ``e``'s parts
    are row ``expert_slots[e]`` of each part (an expert cache's slots; entries of experts no id
    names are never read); None: row ``e``."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13_packed.shape[0] if expert_slots is None else expert_slots.shape[0]
    rows = list(range(num_experts)) if expert_slots is None else expert_slots.tolist()
    order, offsets = moe_sort_tokens_reference(topk_ids, num_experts)
    out = torch.zeros_like(x)
    bounds = offsets.tolist()
    for e in range(num_experts):
        pairs = order[bounds[e] : bounds[e + 1]].long()
        if pairs.numel() == 0:
            continue
        tokens = pairs // top_k
        r = rows[e]
        w13 = dequantize_nvfp4(w13_packed[r], w13_scales[r], w13_row_scales[r], x.dtype)
        w2 = dequantize_nvfp4(w2_packed[r], w2_scales[r], w2_row_scales[r], x.dtype)
        hidden = silu_and_mul_reference(F.linear(x[tokens], w13))
        expert_out = F.linear(hidden, w2) * topk_weights.flatten()[pairs, None]
        out.index_add_(0, tokens, expert_out.to(out.dtype))
    return out


def sparse_moe_decode_nvfp4_reference(
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
    """``sparse_moe_decode`` (``kernels/moe_decode.py``: the MoE block after its router GEMM, for a
    few tokens) over NVFP4 routed and shared experts, composed from the general ops exactly as the
    layer composes them."""
    num_experts = w13_packed.shape[0]
    weights, ids = moe_topk_softmax_reference(gate_logits[:, :num_experts], top_k, renormalize)
    routed = fused_experts_nvfp4_reference(
        x, w13_packed, w13_scales, w13_row_scales, w2_packed, w2_scales, w2_row_scales, weights, ids
    )
    hidden = silu_and_mul_reference(
        nvfp4_linear_reference(x, shared_gate_up_packed, shared_gate_up_scales, shared_gate_up_row_scales)
    )
    shared = nvfp4_linear_reference(hidden, shared_down_packed, shared_down_scales, shared_down_row_scales)
    return shared_expert_combine_reference(routed, shared, gate_logits[:, num_experts:])


nvfp4_linear = op("nvfp4")(nvfp4_linear_reference)
fused_experts_nvfp4 = op("nvfp4")(fused_experts_nvfp4_reference)
sparse_moe_decode_nvfp4 = op("nvfp4_decode")(sparse_moe_decode_nvfp4_reference)
