"""The whole engine through the Triton kernels (the interpreter on the CPU, compiled on a GPU):
float32 greedy tokens equal transformers' for a batch of prompts, with chunked prefill, paged KV
and a decode batch, for every model family."""

from __future__ import annotations

import pytest

from freetoken import LLM
from kernel_checks import DEVICE
from oracle import PAGE_SIZE, Case, assert_greedy_batch, checkpoint

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Numbers: 1024 3.14 café", "hi"]
CASES = [
    Case("qwen3_5_moe", "two_layers"),
    # Every Qwen4-Exp op through the interpreter takes a few minutes here.
    pytest.param(Case("qwen4_exp", "blocks_of_a_page"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_greedy_tokens_equal_transformers_through_triton(case):
    llm = LLM(
        model=str(checkpoint(case)),
        dtype="float32",
        device=DEVICE.type,
        kernel_backend="triton",
        max_prefill_length=16,  # 22, 16 and 2 prompt tokens: chunked prefills next to decodes
        page_size=PAGE_SIZE,
        num_pages=64,
    )
    assert_greedy_batch(llm, case, [llm.runtime.tokenize(p) for p in PROMPTS], max_tokens=8)
