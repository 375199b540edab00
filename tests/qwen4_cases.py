"""Tiny Qwen4-Exp checkpoints of several shapes, their prompts, and transformers' answers (cached
per process: transformers' QSA indexer loops over queries in Python, ~2 s per generate here)."""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from freetoken.demo import build_checkpoint

EOS = 399  # <|im_end|> of the 400-token test tokenizer

# Each shape stresses another layout. Every one has PLE on linear-attention layers and a QSA budget
# far below the prompts + outputs, so selection drops blocks.
SHAPES: dict[str, dict] = {
    # Block = page (compress ratio 4, pages of 4); n-gram table in 12 uneven shards.
    "blocks_of_a_page": dict(text_config={}),
    # Two blocks per page, text-only checkpoint, sigmoid GDN output gate, two streams, 4-grams,
    # tied embeddings, sharded safetensors.
    "blocks_within_pages": dict(
        text_config=dict(
            indexer_compress_ratio=2,
            indexer_budget=6,
            hc_count=2,
            ngram_size=4,
            heads_per_ngram=1,
            ple_embed_dim=24,
            ple_layer_ids=[3],
            output_gate_type="sigmoid",
            split_ngram_parts=5,
            layer_types=["indexed_attention", "linear_attention", "linear_attention", "indexed_attention"],
        ),
        text_only=True,
        tie_word_embeddings=True,
        max_shard_size="60KB",
    ),
    # A block spans two pages (compress ratio 8), odd head counts, partial rotary filling the index head.
    "blocks_across_pages": dict(
        text_config=dict(
            indexer_compress_ratio=8,
            indexer_budget=16,
            indexer_n_heads=7,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            indexer_head_dim=8,
            hc_count=3,
            ple_layer_ids=[1, 2, 5],
            num_hidden_layers=5,
            layer_types=[
                "linear_attention",
                "linear_attention",
                "indexed_attention",
                "linear_attention",
                "linear_attention",
            ],
        ),
    ),
}
PAGE_SIZE = 4


@functools.cache
def checkpoint(shape: str, dtype: torch.dtype = torch.float32) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"qwen4-{shape}-"))
    atexit.register(shutil.rmtree, root, True)
    return build_checkpoint(root, family="qwen4_exp", seed=11, dtype=dtype, **SHAPES[shape])


def prompts(count: int = 4, seed: int = 0) -> list[list[int]]:
    """Random prompts of 31-47 tokens (longer than the 16-token prefill chunks of the tests); the
    last one holds EOS tokens mid-prompt, which cut the n-grams of PLE."""
    rng = random.Random(seed)
    out = [[rng.randrange(EOS - 3) for _ in range(rng.randint(31, 47))] for _ in range(count)]
    out[-1][3] = out[-1][9] = out[-1][10] = out[-1][20] = EOS
    return out


@functools.cache
def _reference_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(path)
    return getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=dtype).eval()


def reference_model(shape: str, checkpoint_dtype: torch.dtype = torch.float32, dtype: torch.dtype = torch.float32):
    """transformers' model of ``checkpoint(shape, checkpoint_dtype)``, computing in ``dtype``."""
    return _reference_model(checkpoint(shape, checkpoint_dtype), dtype)


def reference_logits(shape: str, prompt: list[int], checkpoint_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(shape, checkpoint_dtype, dtype)(torch.tensor([prompt])).logits[0].float()


@functools.cache
def _greedy(shape: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference_model(shape).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return tuple(out[0, len(prompt) :].tolist())


def reference_greedy(shape: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy continuation (batch of one, no padding)."""
    return list(_greedy(shape, tuple(prompt), max_new_tokens))
