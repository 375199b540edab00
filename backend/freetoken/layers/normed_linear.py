"""A projection of a normalized residual stream: ``linear(norm(x + residual), W)``, the seam where
the residual add + RMSNorm before a decode projection folds into that projection's GEMV.

The Qwen3.5 decoder layer normalizes its stream three times a step before a projection (the
mixer's first projection, the router, the final norm before the lm_head). At a few rows a separate
RMSNorm launch is pure latency, so there ``kernels.add_rms_norm_gemv`` does both in one launch;
for prefill, many rows, or weights the GEMV does not take, the norm and ``linear`` run apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from freetoken import kernels
from freetoken.kernels.gemv_configs import prefers_normed_gemv
from freetoken.layers.linear import Weight, linear, takes_gemv
from freetoken.layers.norm import RMSNorm


class NormedProjection(NamedTuple):
    out: torch.Tensor  # linear(norm(x + residual), weight)
    normed: torch.Tensor | None  # norm(x + residual), where asked for
    residual: torch.Tensor  # x + residual (x without a residual): the stream after the add


def normed_linear(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: Weight,
    return_normed: bool = False,
    out_dtype: torch.dtype | None = None,
) -> NormedProjection:
    """``linear(norm(x + residual), weight)`` (converted to ``out_dtype`` where given: the lm_head's
    float32 logits, stored so by the fused launch), the new residual, and the normalized rows when
    ``return_normed`` (the MoE block reads them besides its router). ``residual=None``: the stream
    starts at ``x`` (the first layer)."""
    if fuses(norm, x, weight):
        return NormedProjection(
            *kernels.add_rms_norm_gemv(
                x, residual, norm.weight, norm.eps, norm.zero_centered, weight, return_normed, out_dtype
            )
        )
    if residual is None:
        normed, residual = norm(x), x
    else:
        normed, residual = norm.add_forward(x, residual)
    out = linear(normed, weight)
    return NormedProjection(out if out_dtype is None else out.to(out_dtype), normed if return_normed else None, residual)


def fuses(norm: RMSNorm, x: torch.Tensor, weight: Weight) -> bool:
    """Where the fused launch runs: a dense weight the GEMV takes at this row count, and a norm whose
    output has ``x``'s dtype (zero-centred, or a weight of that dtype)."""
    return (
        isinstance(weight, torch.Tensor)
        and takes_gemv(x, weight)
        and (norm.zero_centered or norm.weight.dtype == x.dtype)
        and prefers_normed_gemv(x.numel() // weight.shape[1], weight.shape[0], weight.shape[1])
    )
