"""Qwen4-Exp PLE (per-layer embedding) ops: the stream gate and the dilated short convolution.

Activations are ``[T, n * H]`` (``n`` hyper-connection streams of ``H`` features). The short
convolution is depthwise, kernel ``K``, dilation ``d``, SiLU output; each request carries its last
``S = (K - 1) · d`` inputs in a slot pool ``conv_state [num_slots, S, C]`` (oldest first, zeros for
a fresh request). The flat batch layout is that of :mod:`freetoken.kernels.ngram`: request ``b``
owns rows ``cu_seqlens[b] : cu_seqlens[b + 1]``, ``token_request [T]`` names each token's request.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op


def ple_gate_reference(
    key_normed: torch.Tensor, query_normed: torch.Tensor, value: torch.Tensor, num_streams: int
) -> torch.Tensor:
    """``sigmoid(g_s) · value`` per stream ``s``, ``g_s = signed_sqrt(<key_s, query_s> / sqrt(H))``.

    ``key_normed, query_normed [T, n * H]``, ``value [T, H]`` -> ``[T, n * H]``.
    """
    hidden = value.shape[-1]
    key = key_normed.unflatten(-1, (num_streams, hidden))
    query = query_normed.unflatten(-1, (num_streams, hidden))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)


def ple_short_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    token_request: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dilation: int,
) -> torch.Tensor:
    """``silu(Σ_k w[:, k] · x_{p - (K-1-k)·d})`` for every token of ``x [T, C]``; ``weight [C, K]``.

    Inputs before a request's first new token come from its state slot, which then advances to the
    request's last ``S`` inputs. Decode tokens and prefill chunks go through the same path.
    """
    num_tokens, width = x.shape[0], weight.shape[1]
    state_len = conv_state.shape[1]
    flat = torch.arange(num_tokens, device=x.device)
    request = token_request.long()
    local = flat - cu_seqlens.long()[request]
    slot = state_slots.long()[request]
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for tap in range(width):
        back = (width - 1 - tap) * dilation
        from_chunk = x[(flat - back).clamp_min(0)]
        from_state = conv_state[slot, (state_len + local - back).clamp(0, state_len - 1)]
        inputs = torch.where((local >= back)[:, None], from_chunk, from_state)
        acc += inputs.float() * weight[:, tap].float()
    out = F.silu(acc).to(x.dtype)
    _advance_state(x, conv_state, state_slots, cu_seqlens)
    return out


def _advance_state(x: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor):
    state_len = conv_state.shape[1]
    starts = cu_seqlens.long()[:-1]
    lengths = cu_seqlens.long()[1:] - starts
    source = lengths[:, None] + torch.arange(state_len, device=x.device)[None, :]  # index in state ++ chunk
    slots = state_slots.long()
    from_state = conv_state[slots[:, None], source.clamp(max=state_len - 1)]
    from_chunk = x[(starts[:, None] + source - state_len).clamp(0, x.shape[0] - 1)]
    conv_state[slots] = torch.where((source < state_len)[..., None], from_state, from_chunk.to(conv_state.dtype))


ple_gate = op("ple")(ple_gate_reference)
ple_short_conv = op("ple")(ple_short_conv_reference)
