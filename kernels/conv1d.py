"""Depthwise causal conv1d with a carried state, as Gated DeltaNet runs it (SiLU activation).

The state of a request is the last ``K - 1`` inputs it saw, ``[C, K - 1]``, kept in a slot pool
``conv_state [num_slots, C, K - 1]`` in the activations' dtype. A fresh request's slot is zeroed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op


def causal_conv1d_prefill_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """``silu(conv(state ++ x))`` for each request's chunk of ``x [T, C]``; updates its state slot.

    ``weight [C, K]``; request ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b+1]`` and slot ``state_slots[b]``.
    """
    width = weight.shape[1]
    out = torch.empty_like(x)
    starts = cu_seqlens.tolist()
    for b, slot in enumerate(state_slots.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        padded = torch.cat([conv_state[slot], x[start:end].T], dim=-1)  # [C, K-1+L]
        conv = F.conv1d(padded[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
        out[start:end] = F.silu(conv).T.to(x.dtype)
        conv_state[slot] = padded[:, -(width - 1):]
    return out


def causal_conv1d_decode_reference(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    """One step for each request: ``x [B, C]``, request ``b`` in slot ``state_slots[b]``."""
    slots = state_slots.long()
    window = torch.cat([conv_state[slots], x[:, :, None]], dim=-1)  # [B, C, K]
    conv_state[slots] = window[:, :, 1:]
    return F.silu((window.to(weight.dtype) * weight[None]).sum(-1)).to(x.dtype)


causal_conv1d_prefill = op("conv1d")(causal_conv1d_prefill_reference)
causal_conv1d_decode = op("conv1d")(causal_conv1d_decode_reference)
