"""Qwen4-Exp text model: ``hc_count`` hyper-connection residual streams through Gated DeltaNet and
QSA indexed-attention layers, each followed by a sparse MoE with a shared expert; PLE n-gram
embeddings injected before some linear-attention layers; a final stream mixer before ``lm_head``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.layers.gated_deltanet import GatedDeltaNet
from freetoken.layers.hyper_connection import HyperConnection
from freetoken.layers.indexed_attention import IndexedAttention
from freetoken.layers.linear import linear
from freetoken.layers.moe import SparseMoE
from freetoken.layers.ple import PLELayer
from freetoken.layers.slot_state import SlotStates, copy_rows
from freetoken.layers.weights import WeightTarget, new_param
from freetoken.models.base import CausalLM
from freetoken.models.qwen4_exp.gdn import Qwen4GatedDeltaNet
from freetoken.models.qwen4_exp.text_config import (
    check_config,
    deltanet_gate_activation,
    ple_sizes,
    qsa_sizes,
)
from freetoken.models.qwen_layers import attention_sizes, deltanet_sizes, rotary_cache_of, sparse_moe


@dataclass
class StepState:
    """Per-forward values every layer shares, computed once on the device."""

    token_request: torch.Tensor  # [T] int64: the request (row of the batch) of each token
    max_blocks: int  # bound on the complete QSA blocks any query of the step sees
    ngram_context: torch.Tensor | None  # [num_slots, ngram_size - 1] int64 pool (PLE models)
    eos_token_id: int


class DecoderLayer(nn.Module):
    """``ple`` (some linear-attention layers), then ``mixer`` and ``mlp``, each between its
    hyper-connection's stream mix and combine."""

    def __init__(
        self,
        mixer: Qwen4GatedDeltaNet | IndexedAttention,
        mlp: SparseMoE,
        ple: PLELayer | None,
        attn_hc: HyperConnection,
        mlp_hc: HyperConnection,
    ) -> None:
        super().__init__()
        self.mixer = mixer
        self.mlp = mlp
        self.ple = ple
        self.attn_hc = attn_hc
        self.mlp_hc = mlp_hc

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        mixer = "linear_attn." if isinstance(self.mixer, GatedDeltaNet) else "self_attn."
        targets = self.mixer.weight_targets(prefix + mixer)
        targets.update(self.mlp.weight_targets(prefix + "mlp."))
        targets.update(self.attn_hc.weight_targets(prefix + "attn_hyper_connection."))
        targets.update(self.mlp_hc.weight_targets(prefix + "mlp_hyper_connection."))
        if self.ple is not None:
            targets.update(self.ple.weight_targets(prefix + "ple."))
        return targets

    def forward(self, hyper: torch.Tensor, batch: ForwardBatch, step: StepState) -> torch.Tensor:
        if self.ple is not None:
            hyper = self.ple(hyper, batch, step.token_request, step.ngram_context, step.eos_token_id)
        block_input, inject = self.attn_hc.mix(hyper)
        if isinstance(self.mixer, IndexedAttention):
            out = self.mixer(block_input, batch, step.token_request, step.max_blocks)
        else:
            out = self.mixer(block_input, batch)
        hyper = self.attn_hc.combine(hyper, out, inject)
        block_input, inject = self.mlp_hc.mix(hyper)
        return self.mlp_hc.combine(hyper, self.mlp(block_input), inject)


class Qwen4ExpModel(CausalLM):
    """Built from a ``Qwen4ExpTextConfig`` (transformers' config class parses the checkpoint's config).

    The QSA score width of a step is ``batch.max_seq_len // compress_ratio``, a host-side bound: the
    batch's longest context when eager, ``max_model_len`` in a CUDA graph (fixed shapes, no sync).
    """

    def __init__(self, text_config, tie_word_embeddings: bool) -> None:
        super().__init__()
        check_config(text_config)
        self.config = text_config
        self.vocab_size = text_config.vocab_size
        self.max_position_embeddings = text_config.max_position_embeddings
        self.tie_word_embeddings = tie_word_embeddings
        self.num_streams = text_config.hc_count
        eos = text_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.compress_ratio = text_config.indexer_compress_ratio
        self.register_buffer("rotary_cache", rotary_cache_of(text_config), persistent=False)
        self.embed_tokens = new_param(text_config.vocab_size, text_config.hidden_size)
        self.layers = nn.ModuleList(self._layer(text_config, i) for i in range(text_config.num_hidden_layers))
        self.final_mixer = HyperConnection(
            text_config.hidden_size, text_config.hc_count, text_config.hc_lowrank, text_config.rms_norm_eps, False
        )
        self.lm_head = new_param(text_config.vocab_size, text_config.hidden_size)
        self.ngram_context: torch.Tensor | None = None
        self.slot_states: SlotStates | None = None  # the Gated DeltaNet and PLE states (allocate_state)

    def _layer(self, config, layer_idx: int) -> DecoderLayer:
        layer_type = config.layer_types[layer_idx]
        if layer_type == "linear_attention":
            mixer = Qwen4GatedDeltaNet(deltanet_sizes(config), deltanet_gate_activation(config))
        elif layer_type == "indexed_attention":
            mixer = IndexedAttention(attention_sizes(config), qsa_sizes(config), self.rotary_cache)
        else:
            raise ValueError(f"unsupported Qwen4-Exp layer type {layer_type!r}")
        mlp = sparse_moe(config, renormalize=config.norm_topk_prob)
        ple_ids = list(config.ple_layer_ids or [])  # 1-based layer numbers
        ple = PLELayer(ple_sizes(config), ple_ids.index(layer_idx + 1)) if layer_idx + 1 in ple_ids else None
        hc = (config.hidden_size, config.hc_count, config.hc_lowrank, config.rms_norm_eps)
        return DecoderLayer(mixer, mlp, ple, HyperConnection(*hc), HyperConnection(*hc))

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = {"embed_tokens.weight": WeightTarget(self.embed_tokens), "lm_head.weight": WeightTarget(self.lm_head)}
        for i, layer in enumerate(self.layers):
            targets.update(layer.weight_targets(f"layers.{i}."))
        targets.update(self.final_mixer.weight_targets("hyper_connection_mixer."))
        return targets

    def _of_type(self, cls: type) -> list[nn.Module]:
        return [layer.mixer for layer in self.layers if isinstance(layer.mixer, cls)]

    def _ple_layers(self) -> list[PLELayer]:
        return [layer.ple for layer in self.layers if layer.ple is not None]

    def kv_bytes_per_page(self, page_size: int) -> int:
        return sum(a.kv_bytes_per_page(page_size, self.embed_tokens.dtype) for a in self._of_type(IndexedAttention))

    def state_bytes_per_slot(self) -> int:
        dtype = self.embed_tokens.dtype
        total = sum(g.state_bytes_per_slot(dtype) for g in self._of_type(Qwen4GatedDeltaNet))
        total += sum(p.state_bytes_per_slot(dtype) for p in self._ple_layers())
        if self._ple_layers():
            total += (self.config.ngram_size - 1) * torch.int64.itemsize
        return total

    def allocate_state(self, num_pages: int, page_size: int, num_slots: int) -> None:
        dtype, device = self.embed_tokens.dtype, self.embed_tokens.device
        for attention in self._of_type(IndexedAttention):
            attention.allocate_kv(num_pages, page_size, dtype, device)
        self.slot_states = SlotStates([*self._of_type(Qwen4GatedDeltaNet), *self._ple_layers()], num_slots, dtype, device)
        if self._ple_layers():
            shape = (num_slots, self.config.ngram_size - 1)
            self.ngram_context = torch.full(shape, self.eos_token_id, dtype=torch.int64, device=device)

    def reset_slots(self, slots: torch.Tensor) -> None:
        self.slot_states.reset(slots)
        if self.ngram_context is not None:
            # A request's text starts after an EOS (index_fill_: no host sync).
            self.ngram_context.index_fill_(0, slots, self.eos_token_id)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.slot_states.copy(src, dst)
        if self.ngram_context is not None:
            copy_rows(self.ngram_context, src, dst)

    def prefix_alignment(self, page_size: int) -> int:
        """A QSA block's pooled key lives in the page of its first token: a prefix ending inside a
        block spanning pages would have its continuation write that key into a shared page, so
        prefixes end at whole blocks too."""
        if self.compress_ratio is None:
            return page_size
        return math.lcm(page_size, self.compress_ratio)

    def _step_state(self, batch: ForwardBatch) -> StepState:
        tokens = torch.arange(batch.num_tokens, device=batch.input_ids.device)
        token_request = torch.searchsorted(batch.cu_seqlens[1:].long(), tokens, right=True)
        max_blocks = 0 if self.compress_ratio is None else batch.max_seq_len // self.compress_ratio
        return StepState(token_request, max_blocks, self.ngram_context, self.eos_token_id)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        step = self._step_state(batch)
        hyper = F.embedding(batch.input_ids, self.embed_tokens).repeat(1, self.num_streams)
        for layer in self.layers:
            hyper = layer(hyper, batch, step)
        if self.ngram_context is not None:
            kernels.ngram_update_context(batch.input_ids, self.ngram_context, batch.state_slots, batch.cu_seqlens)
        hidden, _ = self.final_mixer.mix(hyper[batch.logits_indices])
        return linear(hidden, self.lm_head).float()
