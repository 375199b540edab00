"""The prologue of a full-attention layer after its projection, as one op: zero-centred RMSNorm of
each query and key head, partial NeoX rotary of both, and this step's keys and values stored in
the paged cache. One launch where the layer ran five (two norms, two rotations, the store)."""

from __future__ import annotations

import torch

from freetoken.kernels.attention import store_kv_reference
from freetoken.kernels.dispatch import op
from freetoken.kernels.norm import rms_norm_reference
from freetoken.kernels.rotary import apply_rotary_reference


def norm_rotary_store_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    rotary_cache: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_locations: torch.Tensor,
) -> torch.Tensor:
    """``rotary(q_norm(q)), rotary(k_norm(k))`` at ``positions [T]``; the keys and ``v`` stored at
    ``kv_locations [T]`` (as ``store_kv``). Returns the queries ``[T, Hq, D]`` (a new tensor).

    ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` may be strided views (unit-stride last dim); the norms
    are zero-centred (``x̂ · (1 + w)``, ``w [D]``), rotary as ``apply_rotary``.
    """
    q = rms_norm_reference(q, q_norm_weight, eps, True)
    k = rms_norm_reference(k, k_norm_weight, eps, True)
    q, k = apply_rotary_reference(q, k, positions, rotary_cache, rotary_dim)
    store_kv_reference(k, v, k_cache, v_cache, kv_locations)
    return q


norm_rotary_store_kv = op("attention_prologue")(norm_rotary_store_kv_reference)
