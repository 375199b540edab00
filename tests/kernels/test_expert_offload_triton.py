"""Expert offload through the Triton kernels (the interpreter on the CPU, compiled on a GPU): the
grouped-GEMM kernels run prefill chunks on the experts in their slots through the slot map (a
cache smaller than a layer: in passes), and decode steps run the zero-copy decode
kernel (``kernels/triton/moe_decode_offload.py``); float32 greedy tokens equal transformers'."""

from __future__ import annotations

import pytest

from freetoken import LLM
from kernel_checks import DEVICE
from oracle import PAGE_SIZE, Case, assert_greedy_batch, checkpoint

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Numbers: 1024 3.14 café", "hi"]
CASE = Case("qwen3_5_moe", "two_layers")  # 2 layers of 4 experts, top-2


@pytest.mark.parametrize("slots", [6, pytest.param(1, marks=pytest.mark.slow)], ids=["in_slots", "passes"])
def test_offloaded_greedy_tokens_equal_transformers_through_triton(slots):
    llm = LLM(
        model=str(checkpoint(CASE)),
        dtype="float32",
        device=DEVICE.type,
        kernel_backend="triton",
        max_prefill_length=16,
        page_size=PAGE_SIZE,
        num_pages=64,
        moe_offload=True,
        expert_cache_slots=slots,
    )
    assert_greedy_batch(llm, CASE, [llm.runtime.tokenize(p) for p in PROMPTS], max_tokens=8)
    stats = llm.runtime.stats().expert_cache
    assert stats.misses > 0 and stats.slots == slots
