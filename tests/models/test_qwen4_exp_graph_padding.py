"""Qwen4-Exp decode through the graph runner's padded static batch (eager, CPU): the padding rows
run QSA, PLE and the n-gram context on the scratch page and slot only, and the static QSA width
(``max_model_len // compress_ratio``) selects the same blocks, so tokens equal transformers'."""

from __future__ import annotations

import pytest

from freetoken import LLM, SamplingParams
from graph_padding import with_padded_decode
from qwen4_cases import PAGE_SIZE, checkpoint, prompts, reference_greedy

MAX_TOKENS = 16  # and prompts(4): test_qwen4_exp's, so transformers' answers are cached in one run


@pytest.mark.parametrize("shape", ["blocks_of_a_page", "blocks_across_pages"])
def test_padded_decode_greedy_equals_transformers(shape):
    llm = LLM(model=str(checkpoint(shape)), dtype="float32", device="cpu", max_prefill_length=16, page_size=PAGE_SIZE)
    runner = with_padded_decode(llm, max_batch_size=4)
    batch = prompts(4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, output in zip(batch, outputs):
        assert output.token_ids == reference_greedy(shape, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    assert any(size > n for n, size in runner.runs), runner.runs
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0
