"""``linear(gated_rms_norm(core, z), W)`` for a few rows: the Gated DeltaNet output norm folded into
its ``out_proj`` GEMV's prologue (one launch instead of two at decode).

The norm is per head (``[T, H, D]``, ``D`` the value head dim), gated by ``act(z)``; at batch 1 its
own launch is latency-bound work on 8 KB. Fused, each GEMV program normalizes the head columns of
every weight step itself, from the core and gate rows in L2 (``layers.gated_deltanet`` takes it where
``gemv_configs.prefers_gated_normed_gemv`` says). Roundings are ``gated_rms_norm``'s, then ``gemv``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op
from freetoken.kernels.norm import gated_rms_norm_reference


def gated_rms_norm_gemv_reference(
    x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str, weight: torch.Tensor
) -> torch.Tensor:
    """``gated_rms_norm(x, gate, norm_weight, eps, activation)`` of ``x, gate [T, H, D]`` flattened to
    ``[T, H·D]``, times ``weight [N, H·D]`` transposed: ``[T, N]``."""
    normed = gated_rms_norm_reference(x, gate, norm_weight, eps, activation)
    return F.linear(normed.reshape(x.shape[0], -1), weight)


gated_rms_norm_gemv = op("gated_norm_gemv")(gated_rms_norm_gemv_reference)
