"""Qwen3.5-MoE / Qwen3.6-MoE text model: Gated DeltaNet and gated full-attention layers, each
followed by a sparse MoE with a shared expert; zero-centred RMSNorms throughout."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.batch import ForwardBatch
from freetoken.kernels.prefill_snapshots import PrefillSnapshots, prefill_snapshots
from freetoken.layers.attention import GatedAttention
from freetoken.layers.gated_deltanet import GatedDeltaNet
from freetoken.layers.linear import linear
from freetoken.layers.moe import SparseMoE
from freetoken.layers.moe_partial import MoEPartial
from freetoken.layers.norm import RMSNorm
from freetoken.layers.normed_linear import normed_linear
from freetoken.layers.slot_state import SlotStates
from freetoken.layers.weights import WeightTarget, new_param
from freetoken.models.base import CausalLM
from freetoken.models.qwen_layers import attention_sizes, deltanet_sizes, rotary_cache_of, sparse_moe


class DecoderLayer(nn.Module):
    """``mixer`` (Gated DeltaNet or gated attention), then ``mlp``, each after a zero-centred RMSNorm
    that also adds the residual."""

    def __init__(self, mixer: GatedDeltaNet | GatedAttention, mlp: SparseMoE, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.mixer = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, zero_centered=True)

    @property
    def mixer_prefix(self) -> str:
        return "linear_attn." if isinstance(self.mixer, GatedDeltaNet) else "self_attn."

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = self.mixer.weight_targets(prefix + self.mixer_prefix)
        targets.update(self.mlp.weight_targets(prefix + "mlp."))
        targets.update(self.input_layernorm.weight_targets(prefix + "input_layernorm."))
        targets.update(self.post_attention_layernorm.weight_targets(prefix + "post_attention_layernorm."))
        return targets

    def forward(
        self, hidden: torch.Tensor | MoEPartial, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor | MoEPartial, torch.Tensor]:
        # Each norm runs with the projection after it (one launch at decode: layers.normed_linear);
        # the GDN conv step runs in in_proj's launch too (layers.gated_deltanet.FUSED_CONV), and past a
        # few rows the norm sums the previous MoE block's output (``MoEPartial``).
        hidden, residual = self.mixer.forward_normed(self.input_layernorm, hidden, residual, batch)
        return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual)


class Qwen3_5MoeModel(CausalLM):
    """Built from a ``Qwen3_5MoeTextConfig`` (transformers' config class parses the checkpoint's config)."""

    snapshots_in_forward = True

    def __init__(self, text_config, tie_word_embeddings: bool) -> None:
        super().__init__()
        self.config = text_config
        self.vocab_size = text_config.vocab_size
        self.max_position_embeddings = text_config.max_position_embeddings
        self.tie_word_embeddings = tie_word_embeddings
        self.register_buffer("rotary_cache", rotary_cache_of(text_config), persistent=False)
        self.embed_tokens = new_param(text_config.vocab_size, text_config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                self._mixer(text_config, layer_type),
                sparse_moe(text_config),
                text_config.hidden_size,
                text_config.rms_norm_eps,
            )
            for layer_type in text_config.layer_types
        )
        self.norm = RMSNorm(text_config.hidden_size, text_config.rms_norm_eps, zero_centered=True)
        self.lm_head = new_param(text_config.vocab_size, text_config.hidden_size)
        self.slot_states: SlotStates | None = None  # the Gated DeltaNet states (allocate_state)

    def _mixer(self, config, layer_type: str) -> GatedDeltaNet | GatedAttention:
        if layer_type == "linear_attention":
            return GatedDeltaNet(deltanet_sizes(config))
        if layer_type == "full_attention":
            return GatedAttention(attention_sizes(config), self.rotary_cache)
        raise ValueError(f"unsupported Qwen3.5-MoE layer type {layer_type!r}")

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = {"embed_tokens.weight": WeightTarget(self.embed_tokens), "lm_head.weight": WeightTarget(self.lm_head)}
        for i, layer in enumerate(self.layers):
            targets.update(layer.weight_targets(f"layers.{i}."))
        targets.update(self.norm.weight_targets("norm."))
        return targets

    def _attention_layers(self) -> list[GatedAttention]:
        return [layer.mixer for layer in self.layers if isinstance(layer.mixer, GatedAttention)]

    def _linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.mixer for layer in self.layers if isinstance(layer.mixer, GatedDeltaNet)]

    def kv_bytes_per_page(self, page_size: int) -> int:
        return sum(a.kv_bytes_per_page(page_size, self.embed_tokens.dtype) for a in self._attention_layers())

    def state_bytes_per_slot(self) -> int:
        return sum(g.state_bytes_per_slot(self.embed_tokens.dtype) for g in self._linear_layers())

    def allocate_state(self, num_pages: int, page_size: int, num_slots: int) -> None:
        dtype, device = self.embed_tokens.dtype, self.embed_tokens.device
        for attention in self._attention_layers():
            attention.allocate_kv(num_pages, page_size, dtype, device)
        self.slot_states = SlotStates(self._linear_layers(), num_slots, dtype, device)

    def reset_slots(self, slots: torch.Tensor) -> None:
        self.slot_states.reset(slots)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.slot_states.copy(src, dst)

    def prefill_snapshots(
        self, query_lens: Sequence[int], snapshots: Sequence[tuple[int, int, int]]
    ) -> PrefillSnapshots:
        """Its only per-slot states are the Gated DeltaNet layers' (all of one conv width)."""
        return prefill_snapshots(query_lens, snapshots, self.snapshot_conv_width(), self.embed_tokens.device)

    def snapshot_conv_width(self) -> int:
        return self._linear_layers()[0].conv_kernel - 1

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        last = batch.logits_indices
        if isinstance(hidden, MoEPartial):  # the sum, residual add and norm of the last rows only
            return linear(hidden.add_rms_norm(self.norm, residual, last)[0], self.lm_head).float()
        if last.shape[0] != hidden.shape[0]:  # else every token is a logits row, in order (a decode step): no gathers
            hidden, residual = hidden[last], residual[last]
        return normed_linear(self.norm, hidden, residual, self.lm_head, out_dtype=torch.float32).out
