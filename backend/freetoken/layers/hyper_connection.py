"""Hyper-connection residual streams (Qwen4-Exp ``*_hyper_connection`` and ``hyper_connection_mixer``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import kernels
from freetoken.layers.linear import linear
from freetoken.layers.weights import WeightTarget, new_param, packed_targets


class HyperConnection(nn.Module):
    """``n`` residual streams ``[T, n * H]`` around one block.

    ``mix(hyper)`` normalises the streams and mixes them into the block input ``[T, H]`` through a
    rank-``r`` gate; ``combine`` adds the block output back to every stream, weighted per stream.
    ``input_mix_weight_down`` and ``block_inject_weight`` read the same normalised streams, so they run
    as one GEMM (``down_inject`` holds both). Without ``combine`` (the final mixer) only the mix exists.
    """

    def __init__(self, hidden_size: int, num_streams: int, rank: int, eps: float, combine: bool = True) -> None:
        super().__init__()
        self.num_streams, self.rank, self.eps = num_streams, rank, eps
        width = num_streams * hidden_size
        self.norm_weight = new_param(width)
        self.down_inject = new_param(rank + (num_streams if combine else 0), width)
        self.up = new_param(width, rank)
        self.combine_streams = combine

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        parts = [("input_mix_weight_down.weight", self.rank)]
        if self.combine_streams:
            parts.append(("block_inject_weight.weight", self.num_streams))
        targets = packed_targets(self.down_inject, prefix, parts)
        targets[f"{prefix}hc_norm.weight"] = WeightTarget(self.norm_weight)
        targets[f"{prefix}input_mix_weight_up.weight"] = WeightTarget(self.up)
        return targets

    def mix(self, hyper: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(block input [T, H], injection logits [T, n] or None)``."""
        normed = kernels.hc_norm(hyper, self.norm_weight, self.eps, self.num_streams)
        projected = linear(normed, self.down_inject)
        down, inject = projected[:, : self.rank], projected[:, self.rank :]
        mix_logits = linear(F.silu(down / self.num_streams), self.up)
        block_input = kernels.hc_mix(mix_logits, normed, self.num_streams)
        return block_input, (inject if self.combine_streams else None)

    def combine(self, hyper: torch.Tensor, block_out: torch.Tensor, inject_logits: torch.Tensor) -> torch.Tensor:
        return kernels.hc_combine(hyper, block_out, inject_logits, self.num_streams)
