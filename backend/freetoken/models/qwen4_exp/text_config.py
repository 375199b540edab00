"""Reading Qwen4-Exp's transformers text config: what this implementation supports, and the sizes of
the layers only this family has (those it shares with Qwen3.5 are read in ``models.qwen_layers``)."""

from __future__ import annotations

from transformers import PretrainedConfig

from freetoken.layers.ple import NGramSizes, PLESizes
from freetoken.layers.qsa_indexer import QSASizes

_QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def check_config(config: PretrainedConfig) -> None:
    """What this implementation supports beyond what transformers' config validation checks."""
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen4-Exp: hidden_act must be silu, got {config.hidden_act!r}")
    if "indexed_attention" in config.layer_types:
        missing = [name for name in _QSA_FIELDS if getattr(config, name, None) is None]
        if missing:
            raise ValueError(f"Qwen4-Exp indexed_attention layers need the QSA config fields {missing}")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"Qwen4-Exp: rope_parameters.rope_type {rope_type!r} is not supported (only default)")


def qsa_sizes(config: PretrainedConfig) -> QSASizes:
    return QSASizes(
        num_heads=config.indexer_n_heads,
        head_dim=config.indexer_head_dim,
        compress_ratio=config.indexer_compress_ratio,
        budget=config.indexer_budget,
    )


def ngram_sizes(config: PretrainedConfig) -> NGramSizes:
    return NGramSizes(
        vocab_size=config.vocab_size,
        ngram_size=config.ngram_size,
        heads_per_ngram=config.heads_per_ngram,
        embed_dim=config.ple_embed_dim,
        vocab_size_base=config.ngram_vocab_size_base,
        rows_divisible_by=config.make_ngram_vocab_size_divisible_by,
        split_parts=config.split_ngram_parts,
        seed=config.seed,
    )


def ple_sizes(config: PretrainedConfig) -> PLESizes:
    return PLESizes(
        hidden_size=config.hidden_size,
        num_streams=config.hc_count,
        eps=config.rms_norm_eps,
        conv_kernel_size=config.ple_conv_kernel_size,
        ngram=ngram_sizes(config),
    )


def deltanet_gate_activation(config: PretrainedConfig) -> str:
    """The Gated DeltaNet output gate's activation: ``output_gate_type``, default ``hidden_act``."""
    return config.output_gate_type or config.hidden_act
