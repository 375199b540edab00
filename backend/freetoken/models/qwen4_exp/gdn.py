"""Qwen4-Exp's Gated DeltaNet: Qwen3.5's, with the output gate's activation chosen by the config."""

from __future__ import annotations

from freetoken.layers.gated_deltanet import DeltaNetSizes, GatedDeltaNet


class Qwen4GatedDeltaNet(GatedDeltaNet):
    """``gate_activation`` (the config's ``output_gate_type``, default ``hidden_act``) is ``silu`` or ``sigmoid``."""

    def __init__(self, sizes: DeltaNetSizes, gate_activation: str) -> None:
        super().__init__(sizes)
        self.gate_activation = gate_activation
        if self.gate_activation not in ("silu", "sigmoid"):
            raise ValueError(f"output_gate_type must be silu or sigmoid, got {self.gate_activation!r}")
