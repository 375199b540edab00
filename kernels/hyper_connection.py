"""Hyper-connections (Qwen4-Exp): ``n`` residual streams per token, laid out ``[T, n * H]``.

Around each block a hyper-connection normalises every stream (``hc_norm``), mixes the streams into
the block's input through a learned low-rank gate (``hc_mix``), and adds the block's output back to
every stream with a per-stream injection weight (``hc_combine``). The GEMMs between these steps are
plain ``F.linear`` calls in the layer.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op


def hc_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, num_streams: int) -> torch.Tensor:
    """Zero-centred RMSNorm of each of the ``num_streams`` streams of ``x [T, n * H]``: ``x̂ · (1 + w)``.

    ``weight [n * H]``; statistics per stream, arithmetic in float32, result in ``x``'s dtype.
    """
    xf = x.float().unflatten(-1, (num_streams, -1))
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def hc_mix_reference(mix_logits: torch.Tensor, normed: torch.Tensor, num_streams: int) -> torch.Tensor:
    """The block input ``mean_s(sigmoid(mix_logits_s) · normed_s)``: ``[T, n * H]`` twice -> ``[T, H]``."""
    weights = torch.sigmoid(mix_logits).unflatten(-1, (num_streams, -1))
    return (weights * normed.unflatten(-1, (num_streams, -1))).mean(dim=-2)


def hc_combine_reference(
    hyper: torch.Tensor, block_out: torch.Tensor, inject_logits: torch.Tensor, num_streams: int
) -> torch.Tensor:
    """``hyper_s + block_out · 2 sigmoid(inject_logits_s / n)`` for each stream ``s``.

    ``hyper [T, n * H]``, ``block_out [T, H]``, ``inject_logits [T, n]`` (the un-scaled GEMM output).
    """
    inject = 2 * torch.sigmoid(inject_logits / num_streams)
    return hyper + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


hc_norm = op("hyper_connection")(hc_norm_reference)
hc_mix = op("hyper_connection")(hc_mix_reference)
hc_combine = op("hyper_connection")(hc_combine_reference)
