"""``linear(norm(x + residual), W)`` for a few activation rows: the residual add and RMSNorm that
precede a decode projection, done in that projection's GEMV prologue (one launch instead of two).

At batch 1 an RMSNorm launch is latency-bound (about 1.8 us on the H200 for 4 KB of work) and a
decode step has about 110 of them; each one sits before a projection (the layer's first projection,
the router, the lm_head). Fused, every GEMV program recomputes the norm of its 2048-element rows
itself (4 KB from L2) and one program writes ``x + residual`` (and the normalized rows when asked)
to buffers no program of the launch reads. ``layers.normed_linear`` takes it where the GEMV runs
(``gemv_configs.prefers_normed_gemv``); elsewhere the norm and the projection run apart.

Roundings are those of ``add_rms_norm`` then ``gemv``: the sum rounded to the activations' dtype,
the normalized value rounded to it before the product, the product accumulated in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.conv1d import causal_conv1d_decode_reference
from freetoken.kernels.dispatch import op
from freetoken.kernels.norm import add_rms_norm_reference, rms_norm_reference


def add_rms_norm_gemv_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    weight: torch.Tensor,
    return_normed: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(norm(s) @ weight.T, norm(s) if return_normed else None, s)`` for ``s = x + residual``
    (``s = x`` without a residual: the first layer's norm), ``norm`` as ``kernels.rms_norm``. The
    product is rounded to the activations' dtype, then converted to ``out_dtype`` where given (the
    lm_head's float32 logits, without a launch of their own)."""
    if residual is None:
        normed, summed = rms_norm_reference(x, norm_weight, eps, zero_centered), x
    else:
        normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps, zero_centered)
    out = F.linear(normed, weight)
    return out if out_dtype is None else out.to(out_dtype), normed if return_normed else None, summed


add_rms_norm_gemv = op("normed_gemv")(add_rms_norm_gemv_reference)


def add_rms_norm_gemv_conv_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    weight: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet's fused decode input launch: ``add_rms_norm_gemv`` of its ``in_proj``, then
    ``causal_conv1d_decode`` of the first ``conv_weight.shape[0]`` output columns (q|k|v) in the
    rows' state slots (``conv_state`` updated in place): ``(projected, conv_out, summed)``."""
    out, _, summed = add_rms_norm_gemv_reference(x, residual, norm_weight, eps, zero_centered, weight)
    conv = causal_conv1d_decode_reference(out[:, : conv_weight.shape[0]], conv_weight, conv_state, state_slots)
    return out, conv, summed


add_rms_norm_gemv_conv = op("normed_gemv")(add_rms_norm_gemv_conv_reference)
