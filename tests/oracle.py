"""transformers as the oracle, and the checkpoint shapes and prompts the engine tests share."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import transformers


PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun all day long.",
    "Numbers: 0 1 2 3 42 1024 3.14159 café 日本語の文章 🙂",
    "hi",
    "Gated DeltaNet layers keep a recurrent state; full attention layers keep paged keys and values.",
]


@functools.cache
def _reference_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(path)
    model_class = getattr(transformers, config.architectures[0])
    return model_class.from_pretrained(path, dtype=dtype).eval()


def reference_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy continuation of one prompt (batch of one, no padding)."""
    model = _reference_model(str(path), torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def reference_logits(path: Path, prompt_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = _reference_model(str(path), dtype)
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0].float()


# Shapes the engine must get exactly right. Each differs from the demo model in something that
# went wrong in some engine once: odd head counts, more GDN value heads than key heads, partial
# rotary, other layer patterns, a vocabulary padded above the tokenizer's, text-only checkpoints,
# tied embeddings, sharded safetensors.
CHECKPOINT_SHAPES: dict[str, dict] = {
    "demo": dict(text_config={}),
    "odd_heads_padded_vocab": dict(
        text_config=dict(
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=24,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_key_head_dim=12,
            linear_value_head_dim=20,
            num_experts=5,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
        vocab_size=437,
    ),
    "text_only_tied_sharded": dict(
        text_config=dict(
            hidden_size=40,
            num_attention_heads=5,
            num_key_value_heads=5,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=6,
            num_experts_per_tok=1,
            num_hidden_layers=5,
            layer_types=[
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
        ),
        text_only=True,
        tie_word_embeddings=True,
        max_shard_size="100KB",
    ),
}
