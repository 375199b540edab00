"""transformers as the oracle of the engine tests, the checkpoints they run (both model families,
several shapes each) and the prompts they share.

Checkpoints, reference models and greedy continuations are cached per process: transformers'
Qwen4-Exp QSA indexer loops over queries in Python (~2 s per generate here), and the scenarios of
one checkpoint run the same prompts.
"""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import transformers

from freetoken import LLM, SamplingParams
from freetoken.demo import build_checkpoint

EOS = 399  # <|im_end|> of the 400-token test tokenizer
PAGE_SIZE = 4  # small pages: every prompt spans several

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun all day long.",
    "Numbers: 0 1 2 3 42 1024 3.14159 café 日本語の文章 🙂",
    "hi",
    "Gated DeltaNet layers keep a recurrent state; full attention layers keep paged keys and values.",
]


class Family(NamedTuple):
    """What the engine scenarios of one model family run."""

    seed: int  # of the random weights
    max_tokens: int  # generated per request
    text_prompts: bool  # the batch starts with PROMPTS (Qwen4-Exp's slow reference keeps to random ones)
    random_prompts: int  # then this many random-token prompts (see random_prompts)


FAMILIES: dict[str, Family] = {
    "qwen3_5_moe": Family(seed=7, max_tokens=24, text_prompts=True, random_prompts=3),
    "qwen4_exp": Family(seed=11, max_tokens=16, text_prompts=False, random_prompts=4),
}

def text_only_tied_sharded(max_shard_size: str) -> dict:
    """A checkpoint layout of its own: no vision tower, lm_head tied to the embeddings, weights in
    several safetensors files."""
    return dict(text_only=True, tie_word_embeddings=True, max_shard_size=max_shard_size)


LINEAR, FULL, INDEXED = "linear_attention", "full_attention", "indexed_attention"  # layer types

# Shapes the engine must get exactly right, the first of each family its demo model.
SHAPES: dict[str, dict[str, dict]] = {
    # Each differs from the demo model in something that went wrong in some engine once: odd head
    # counts, more GDN value heads than key heads, partial rotary, other layer patterns, a
    # vocabulary padded above the tokenizer's, text-only checkpoints, tied embeddings, sharded
    # safetensors.
    "qwen3_5_moe": {
        "demo": dict(text_config={}),
        "odd_heads_padded_vocab": dict(
            text_config=dict(
                hidden_size=48, num_hidden_layers=4, layer_types=[LINEAR, FULL, LINEAR, FULL],
                num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=20,
                num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            ),
            vocab_size=437,
        ),
        "text_only_tied_sharded": dict(
            text_config=dict(
                hidden_size=40, num_hidden_layers=5, layer_types=[FULL, LINEAR, LINEAR, FULL, LINEAR],
                num_attention_heads=5, num_key_value_heads=5, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
                linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                num_experts=6, num_experts_per_tok=1,
            ),
            **text_only_tied_sharded("100KB"),
        ),
        # Both layer kinds, GQA, partial rotary, more GDN value heads than key heads, top-2 of 4
        # experts in two layers: short enough for Triton's interpreter. The shared expert as wide
        # as a routed one (as Qwen3.6's): past 8 tokens it runs in the grouped expert GEMMs.
        "two_layers": dict(
            text_config=dict(
                hidden_size=48, num_hidden_layers=2, layer_types=[LINEAR, FULL],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
            ),
        ),
    },
    # Each stresses another layout. Every one has PLE on linear-attention layers and a QSA budget
    # far below the prompts + outputs, so selection drops blocks.
    "qwen4_exp": {
        # Block = page (compress ratio 4, pages of 4); n-gram table in 12 uneven shards.
        "blocks_of_a_page": dict(text_config={}),
        # Two blocks per page, text-only checkpoint, sigmoid GDN output gate, two streams, 4-grams,
        # tied embeddings, sharded safetensors.
        "blocks_within_pages": dict(
            text_config=dict(
                layer_types=[INDEXED, LINEAR, LINEAR, INDEXED],
                indexer_compress_ratio=2, indexer_budget=6,
                hc_count=2, output_gate_type="sigmoid",
                ngram_size=4, heads_per_ngram=1, ple_embed_dim=24, ple_layer_ids=[3], split_ngram_parts=5,
            ),
            **text_only_tied_sharded("60KB"),
        ),
        # A block spans two pages (compress ratio 8), odd head counts, partial rotary filling the
        # index head.
        "blocks_across_pages": dict(
            text_config=dict(
                num_hidden_layers=5, layer_types=[LINEAR, LINEAR, INDEXED, LINEAR, LINEAR],
                num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                indexer_compress_ratio=8, indexer_budget=16, indexer_n_heads=7, indexer_head_dim=8,
                hc_count=3, ple_layer_ids=[1, 2, 5],
            ),
        ),
    },
}


class Case(NamedTuple):
    """One checkpoint: a model family and one of its shapes."""

    family: str
    shape: str

    def __str__(self) -> str:  # the pytest id
        return f"{self.family}.{self.shape}"


CASES = [Case(family, shape) for family, shapes in SHAPES.items() for shape in shapes]
DEMO = {family: Case(family, next(iter(shapes))) for family, shapes in SHAPES.items()}


@functools.cache
def checkpoint(case: Case, dtype: torch.dtype = torch.float32) -> Path:
    """The random checkpoint of ``case`` (weights stored in ``dtype``), built once per process."""
    root = Path(tempfile.mkdtemp(prefix=f"{case.family}-{case.shape}-"))
    atexit.register(shutil.rmtree, root, True)
    return build_checkpoint(
        root, family=case.family, seed=FAMILIES[case.family].seed, dtype=dtype, **SHAPES[case.family][case.shape]
    )


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 31-47 tokens (longer than the 16-token prefill chunks of the tests); the
    last one holds EOS tokens mid-prompt, which cut the n-grams of PLE."""
    rng = random.Random(seed)
    out = [[rng.randrange(EOS - 3) for _ in range(rng.randint(31, 47))] for _ in range(count)]
    out[-1][3] = out[-1][9] = out[-1][10] = out[-1][20] = EOS
    return out


def batch_prompts(case: Case) -> list[list[int]]:
    """The prompts every engine scenario of ``case`` runs, as token ids."""
    settings = FAMILIES[case.family]
    text = []
    if settings.text_prompts:
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint(case))
        text = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return text + random_prompts(settings.random_prompts)


@functools.cache
def _reference_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(path)
    return getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=dtype).eval()


def reference_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model of the checkpoint at ``path``, computing in ``dtype``."""
    return _reference_model(Path(path), dtype)


def reference_logits(path: Path, prompt_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(path, dtype)(torch.tensor([prompt_ids])).logits[0].float()


@functools.cache
def _greedy(path: Path, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = reference_model(path).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return tuple(out[0, len(prompt_ids) :].tolist())


def reference_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy continuation of one prompt (batch of one, no padding)."""
    return list(_greedy(Path(path), tuple(prompt_ids), max_new_tokens))


def assert_greedy_batch(
    llm: LLM, case: Case, prompts: list[list[int]] | None = None, max_tokens: int | None = None
) -> None:
    """``prompts`` (default: the family's batch) generated greedily in one batch by ``llm``, which
    runs ``checkpoint(case)``: each request's tokens equal transformers' and it ends for the reason
    they do; every page and state slot comes back after."""
    prompts = batch_prompts(case) if prompts is None else prompts
    max_tokens = FAMILIES[case.family].max_tokens if max_tokens is None else max_tokens
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        expected = reference_greedy(checkpoint(case), prompt, max_tokens)
        assert output.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert output.finish_reason.value == ("length" if len(expected) == max_tokens else "stop")
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0
