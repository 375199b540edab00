"""The rotary table a model's attention layers share, from its transformers text config."""

from __future__ import annotations

import torch

from freetoken import kernels


def rotary_dim_of(config) -> int:
    """Rotated dims per head: ``head_dim · partial_rotary_factor``."""
    rope = config.rope_parameters or {}
    return int(config.head_dim * rope.get("partial_rotary_factor", 1.0))


def rotary_cache_of(config) -> torch.Tensor:
    """``kernels.build_rotary_cache`` for every position the model supports, on the default device."""
    rope = config.rope_parameters or {}
    return kernels.build_rotary_cache(
        rotary_dim_of(config), config.max_position_embeddings, rope.get("rope_theta", 10000.0), torch.get_default_device()
    )
