"""A projection of a normalized residual stream: ``linear(norm(x + residual), W)``, the seam where
the residual add + RMSNorm before a decode projection folds into that projection's GEMV.

The Qwen3.5 decoder layer normalizes its stream three times a step before a projection (the
mixer's first projection, the router, the final norm before the lm_head). At a few rows a separate
RMSNorm launch is pure latency, so there ``kernels.add_rms_norm_gemv`` does both in one launch
(``kernels.add_rms_norm_nvfp4_gemv`` for an NVFP4 weight); for prefill, many rows, or weights the GEMV does not take, the norm and ``linear`` run apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from freetoken import kernels
from freetoken.kernels.gemv_configs import prefers_normed_gemv
from freetoken.kernels.normed_nvfp4_gemv import NORMED_NVFP4_MAX_ROWS
from freetoken.layers.linear import NVFP4Weight, Weight, linear, takes_gemv
from freetoken.layers.moe_partial import MoEPartial
from freetoken.layers.norm import RMSNorm


class NormedProjection(NamedTuple):
    out: torch.Tensor  # linear(norm(x + residual), weight)
    normed: torch.Tensor | None  # norm(x + residual), where asked for
    residual: torch.Tensor  # x + residual (x without a residual): the stream after the add


def normed_linear(
    norm: RMSNorm,
    x: torch.Tensor | MoEPartial,
    residual: torch.Tensor | None,
    weight: Weight,
    return_normed: bool = False,
    out_dtype: torch.dtype | None = None,
) -> NormedProjection:
    """``linear(norm(x + residual), weight)`` (converted to ``out_dtype`` where given: the lm_head's
    float32 logits, stored so by the fused launch), the new residual, and the normalized rows when
    ``return_normed`` (the MoE block reads them besides its router). ``residual=None``: the stream
    starts at ``x`` (the first layer); ``x`` a ``MoEPartial``: the MoE block's output in parts,
    summed in the norm's launch."""
    if isinstance(x, MoEPartial):
        assert residual is not None, "a MoE block's output always has a residual stream before it"
        normed, residual = x.add_rms_norm(norm, residual)
        return NormedProjection(_as(linear(normed, weight), out_dtype), normed if return_normed else None, residual)
    if fuses(norm, x, weight):
        return NormedProjection(
            *kernels.add_rms_norm_gemv(
                x, residual, norm.weight, norm.eps, norm.zero_centered, weight, return_normed, out_dtype
            )
        )
    if fuses_nvfp4(norm, x, weight):
        out, normed, residual = kernels.add_rms_norm_nvfp4_gemv(
            x, residual, norm.weight, norm.eps, norm.zero_centered,
            weight.packed, weight.scales, weight.row_scales, return_normed,
        )
        return NormedProjection(_as(out, out_dtype), normed, residual)
    if residual is None:
        normed, residual = norm(x), x
    else:
        normed, residual = norm.add_forward(x, residual)
    return NormedProjection(_as(linear(normed, weight), out_dtype), normed if return_normed else None, residual)


def _as(out: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return out if dtype is None else out.to(dtype)


def fuses(norm: RMSNorm, x: torch.Tensor | MoEPartial, weight: Weight) -> bool:
    """Where the fused launch runs: a dense weight the GEMV takes at this row count, and a norm whose
    output has ``x``'s dtype (zero-centred, or a weight of that dtype)."""
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and takes_gemv(x, weight)
        and (norm.zero_centered or norm.weight.dtype == x.dtype)
        and prefers_normed_gemv(x.numel() // weight.shape[1], weight.shape[0], weight.shape[1])
    )


# Whether an NVFP4 projection takes its norm in its GEMV's launch (``kernels.add_rms_norm_nvfp4_gemv``)
# at a few rows: in NVFP4 mode the full-attention layers' packed q/k/v; off, the norm launches apart.
NVFP4_NORMED_GEMV = True


def fuses_nvfp4(norm: RMSNorm, x: torch.Tensor | MoEPartial, weight: Weight) -> bool:
    """Where the fused NVFP4 launch runs: a 2-D NVFP4 weight at up to ``NORMED_NVFP4_MAX_ROWS`` rows
    (the NVFP4 GEMV's), and a norm whose output has ``x``'s dtype."""
    return (
        NVFP4_NORMED_GEMV
        and isinstance(x, torch.Tensor)
        and isinstance(weight, NVFP4Weight)
        and weight.packed.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and x.numel() // weight.shape[1] <= NORMED_NVFP4_MAX_ROWS
        and (norm.zero_centered or norm.weight.dtype == x.dtype)
    )
