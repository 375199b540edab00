"""The layer sizes Qwen3.5-MoE and Qwen4-Exp read alike from their transformers text configs (the
fields have the same names and meanings in both), and the blocks built from them."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from freetoken import kernels
from freetoken.layers.attention import AttentionSizes
from freetoken.layers.gated_deltanet import DeltaNetSizes
from freetoken.layers.moe import SparseMoE


def rotary_dim_of(config: PretrainedConfig) -> int:
    """Rotated dims per head: ``head_dim · partial_rotary_factor``."""
    rope = config.rope_parameters or {}
    return int(config.head_dim * rope.get("partial_rotary_factor", 1.0))


def rotary_cache_of(config: PretrainedConfig) -> torch.Tensor:
    """The rotary table every attention layer of the model shares (``kernels.build_rotary_cache``
    for every position the model supports), on the default device."""
    rope = config.rope_parameters or {}
    return kernels.build_rotary_cache(
        rotary_dim_of(config), config.max_position_embeddings, rope.get("rope_theta", 10000.0), torch.get_default_device()
    )


def attention_sizes(config: PretrainedConfig) -> AttentionSizes:
    return AttentionSizes(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rotary_dim=rotary_dim_of(config),
        eps=config.rms_norm_eps,
    )


def deltanet_sizes(config: PretrainedConfig) -> DeltaNetSizes:
    """From the ``linear_*`` fields."""
    return DeltaNetSizes(
        hidden_size=config.hidden_size,
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps,
    )


def sparse_moe(config: PretrainedConfig, renormalize: bool = True) -> SparseMoE:
    """One decoder layer's MoE block. ``renormalize``: whether the top-k routing weights are
    rescaled to sum to 1 (Qwen3.5 always does; Qwen4-Exp follows ``norm_topk_prob``)."""
    return SparseMoE(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        config.shared_expert_intermediate_size,
        renormalize=renormalize,
    )
