"""``x @ W.T`` for a few activation rows against a dense weight (decode's projections).

At batch 1 a projection is a pure weight stream (1-50 MB a call at the Qwen3.6-35B-A3B shape); the
Triton kernel (``kernels/triton/gemv.py``) reads it nearer the HBM's speed than cuBLAS's GEMV
kernels do. ``layers.linear.linear`` takes it where ``gemv_configs.prefers_gemv`` says it wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op

# The activation / weight dtypes the Triton kernel takes (the same for both).
GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight.T`` for ``weight [N, K]`` of ``x``'s dtype: ``[..., N]`` in that dtype,
    accumulated in float32 (as ``F.linear`` does for every dtype)."""
    return F.linear(x, weight)


gemv = op("gemv")(gemv_reference)
