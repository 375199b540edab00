"""RMSNorm variants of the Qwen3.5 / Qwen4-Exp families.

``zero_centered=True`` is the Gemma-style norm: the checkpoint stores ``w`` and the multiplier is
``1 + w`` computed in float32 at run time. Folding ``1 + w`` into a bf16 weight at load time rounds
small ``w`` away (it changed 77.4% of Qwen3.6-35B-A3B's norm multipliers), so it is never folded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``x̂ · (1 + w)`` (zero-centred, in float32) or ``w · x̂`` (plain, Llama order), over the last dim."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add in the model dtype, then the norm: returns ``(norm(x + residual), x + residual)``."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps, zero_centered), summed


GATE_ACTIVATIONS = ("silu", "sigmoid")


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu"
) -> torch.Tensor:
    """The Gated DeltaNet output norm: ``(w · x̂) · act(gate)``, norm before gate, over the last dim.

    ``activation`` is ``"silu"`` (Qwen3.5) or ``"sigmoid"`` (a Qwen4-Exp option); ``w · x̂`` is
    rounded to the activations' dtype, the gate applied in float32.
    """
    check_gate_activation(activation)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    act = F.silu if activation == "silu" else torch.sigmoid
    return ((weight * normed) * act(gate.float())).to(x.dtype)


def check_gate_activation(activation: str) -> None:
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gate activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")


rms_norm = op("norm")(rms_norm_reference)
add_rms_norm = op("norm")(add_rms_norm_reference)
gated_rms_norm = op("norm")(gated_rms_norm_reference)
