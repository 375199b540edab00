"""Tiny random Qwen4-Exp checkpoints saved by transformers itself (the released layout, n-gram tables
split into ``split_ngram_parts`` shards), with the demo's trained tokenizer: the test oracle."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from freetoken.demo import build_tokenizer

TINY_TEXT_CONFIG: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=4,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    hc_count=3,
    hc_lowrank=8,
    ple_layer_ids=[1, 3],
    ple_embed_dim=16,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=61,
    make_ngram_vocab_size_divisible_by=16,
    split_ngram_parts=12,
    # Eight indexer heads: a block scores 0 only when all eight see it negatively, so exact ties
    # (which torch.topk breaks arbitrarily) between dropped and kept blocks stay out of the tests.
    indexer_n_heads=8,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=8,
    indexer_compress_ratio=4,
    max_position_embeddings=1024,
    initializer_range=0.05,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give the parameters transformers initialises to constants non-trivial values: norm multipliers
    (zero-centred ones around 0, the gated GDN norm around 1), the PLE convolutions (zeros), and
    n-gram tables large enough that a wrong row changes the output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(".linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif "norm" in name.rsplit(".", 2)[-2]:
                param.copy_(0.2 * noise)
            elif name.endswith(".ple.conv1d.weight"):
                param.copy_(0.3 * noise)
            elif name.endswith("ngram_embedding.weight"):
                param.copy_(noise)


def build_qwen4_checkpoint(
    out_dir: str | os.PathLike,
    text_config: dict[str, Any] | None = None,
    *,
    text_only: bool = False,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer_vocab_size: int = 400,
    max_shard_size: str | None = None,
) -> Path:
    """A random Qwen4-Exp checkpoint plus tokenizer in ``out_dir`` (EOS is ``<|im_end|>``)."""
    from transformers import (
        GenerationConfig,
        Qwen4ExpConfig,
        Qwen4ExpForCausalLM,
        Qwen4ExpForConditionalGeneration,
        Qwen4ExpTextConfig,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_size = build_tokenizer(out, tokenizer_vocab_size)
    eos_id = tokenizer_size - 1
    fields = {**TINY_TEXT_CONFIG, **(text_config or {})}
    fields.update(
        vocab_size=tokenizer_size, eos_token_id=eos_id, pad_token_id=tokenizer_size - 3,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    if text_only:
        config = Qwen4ExpTextConfig(**fields)
        config.architectures = ["Qwen4ExpForCausalLM"]
        model = Qwen4ExpForCausalLM(config)
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=fields["hidden_size"])
        config = Qwen4ExpConfig(text_config=fields, vision_config=vision, tie_word_embeddings=tie_word_embeddings)
        model = Qwen4ExpForConditionalGeneration(config)
    randomize(model, torch.Generator().manual_seed(seed + 1))
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=fields["pad_token_id"]).save_pretrained(str(out))
    return out
