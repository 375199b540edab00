"""Prefetching weights into the GPU's L2 cache ahead of the launch that streams them (issue 9).

At batch 1 a decode step alternates weight streams (the GEMVs, the MoE experts) with launches that
leave HBM mostly idle (the Gated DeltaNet step, norms, attention, routing). A prefetch queued
beside such a launch moves the next stream's bytes into L2 while HBM would idle, so the stream
reads them from L2. It computes nothing: the torch reference does nothing, and the Triton kernel
(``kernels/triton/l2_prefetch.py``) only issues cache hints, so no result can depend on it.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op

# The most tensors one launch prefetches.
MAX_TENSORS = 4


def l2_prefetch_reference(first: torch.Tensor, *more: torch.Tensor, chained: bool = False) -> None:
    """Prefetch the bytes of ``first`` and ``more`` (at most ``MAX_TENSORS`` in all, each
    contiguous) into L2. ``chained``: the launch sits in the stream's chain of programmatic
    dependent launches (it waits for the launch before it, and the launch after it waits for it);
    otherwise it runs on its own (a side stream's branch of the graph). A hint only: no effect on
    any value, so the reference does nothing."""
    if len(more) + 1 > MAX_TENSORS:
        raise ValueError(f"l2_prefetch takes at most {MAX_TENSORS} tensors, got {len(more) + 1}")


l2_prefetch = op("l2_prefetch")(l2_prefetch_reference)
