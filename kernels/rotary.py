"""Rotary position embedding, NeoX (rotate-half) layout, applied to the first ``rotary_dim`` dims.

Qwen3.5's interleaved mrope reduces to this for text: all three position components are the text
position, so every frequency sees the same position.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op


def build_rotary_cache(
    rotary_dim: int, max_positions: int, base: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """float32 ``[max_positions, rotary_dim]``: cos of the ``rotary_dim/2`` frequencies, then their sin.

    Computed as transformers does (``position.float() * inv_freq`` in float32), so float32 runs match it.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_cache: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` at ``positions [T]``; returns new tensors.

    cos/sin are rounded to the activations' dtype first, as transformers does.
    """
    cos_sin = rotary_cache[positions].to(q.dtype)
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


apply_rotary = op("rotary")(apply_rotary_reference)
