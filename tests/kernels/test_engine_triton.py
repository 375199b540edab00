"""The whole engine through the Triton kernels (the interpreter on the CPU, compiled on a GPU):
float32 greedy tokens equal transformers' for a batch of prompts, with chunked prefill, paged KV
and a decode batch."""

from __future__ import annotations

import pytest

from freetoken import LLM, SamplingParams
from freetoken.demo import build_checkpoint
from kernel_checks import DEVICE
from oracle import reference_greedy

# Both layer kinds, GQA, partial rotary, more GDN value heads than key heads, top-2 of 4 experts;
# two layers keep the interpreter run short.
TINY = dict(
    hidden_size=48,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
)
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Numbers: 1024 3.14 café", "hi"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny-triton"), TINY, seed=11)


def test_float32_greedy_tokens_equal_transformers_through_triton(tiny_checkpoint):
    llm = LLM(
        model=str(tiny_checkpoint),
        dtype="float32",
        device=DEVICE.type,
        kernel_backend="triton",
        max_prefill_length=16,  # 22, 16 and 2 prompt tokens: chunked prefills next to decodes
        page_size=4,
        num_pages=64,
    )
    max_tokens = 8
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.error is None, output.error
        ids = llm.runtime.tokenize(prompt)
        assert output.token_ids == reference_greedy(tiny_checkpoint, ids, max_tokens), prompt
