"""``nvfp4_linear(norm(x + residual), W)`` for a few activation rows: the residual add and RMSNorm
before an NVFP4 decode projection done in the NVFP4 GEMV's prologue (one launch instead of two).

``kernels.add_rms_norm_gemv`` is the same fusion for dense weights. In NVFP4 mode the
full-attention layers' packed q/k/v projection is NVFP4, so its input norm ran as a launch of its
own before the GEMV (about 1.8 us of latency at batch 1 for 4 KB of work). Fused, every GEMV
program recomputes the norm of its rows (4 KB each, from L2) and one program writes
``x + residual`` (and the normalized rows when asked) to buffers no program of the launch reads.
``layers.normed_linear`` takes it for an NVFP4 weight at up to ``NORMED_NVFP4_MAX_ROWS`` rows.

Roundings are those of ``add_rms_norm`` then ``nvfp4_linear``: the sum rounded to the activations'
dtype, the normalized value rounded to it, the product with the dequantized weight.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op
from freetoken.kernels.norm import add_rms_norm_reference, rms_norm_reference
from freetoken.kernels.nvfp4 import nvfp4_linear_reference

# The Triton kernel holds every row in one program, as the NVFP4 GEMV does (``nvfp4_rows.GEMV_MAX_ROWS``).
NORMED_NVFP4_MAX_ROWS = 4


def add_rms_norm_nvfp4_gemv_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    packed: torch.Tensor,
    scales: torch.Tensor,
    row_scales: torch.Tensor,
    return_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(nvfp4_linear(norm(s), W), norm(s) if return_normed else None, s)`` for ``s = x + residual``
    (``s = x`` without a residual) and the NVFP4 weight ``W`` (``packed``, ``scales``, ``row_scales``,
    as ``kernels.nvfp4``), ``norm`` as ``kernels.rms_norm``."""
    if residual is None:
        normed, summed = rms_norm_reference(x, norm_weight, eps, zero_centered), x
    else:
        normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps, zero_centered)
    return nvfp4_linear_reference(normed, packed, scales, row_scales), normed if return_normed else None, summed


add_rms_norm_nvfp4_gemv = op("normed_nvfp4_gemv")(add_rms_norm_nvfp4_gemv_reference)
