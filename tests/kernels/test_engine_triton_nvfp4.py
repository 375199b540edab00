"""NVFP4 checkpoints through the Triton W4A16 kernels (the interpreter on the CPU, compiled on a
GPU): float32 greedy tokens equal transformers' on the dequantized weights."""

from __future__ import annotations

import pytest

from freetoken import LLM, SamplingParams
from kernel_checks import DEVICE
from nvfp4_checkpoints import FORMATS, case
from oracle import reference_greedy


# The kernels are the same for both producers (their loading is tested on the torch path): the
# ModelOpt run under the interpreter is a slow test.
@pytest.mark.parametrize("producer", [pytest.param(p, marks=[pytest.mark.slow] if p == "modelopt" else []) for p in FORMATS])
def test_float32_greedy_tokens_equal_transformers_through_w4a16_kernels(producer):
    quantized, dequantized = case("qwen3_5_moe", producer)
    llm = LLM(
        model=str(quantized),
        dtype="float32",
        device=DEVICE.type,
        kernel_backend="triton",
        max_prefill_length=16,  # a chunked prefill next to decodes
        page_size=4,
        num_pages=64,
    )
    prompts = [[5, 17, 200, 33, 98, 120, 7, 64, 301, 12, 45, 77, 150, 222, 9, 31, 180, 260, 3, 88], [42, 7, 300]]
    max_tokens = 4
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        assert output.token_ids == reference_greedy(dequantized, prompt, max_tokens)


@pytest.mark.parametrize("slots", [16, pytest.param(3, marks=pytest.mark.slow)], ids=["in_slots", "passes"])
def test_offloaded_nvfp4_experts_through_the_kernels(slots):
    """``moe_offload`` with NVFP4 experts: the grouped W4A16 kernels read the cache's span views
    (``experts.span``) in their slots through the slot map (16 slots over 2 layers of 8 experts;
    passes over a cache of 3), the zero-copy decode kernel the slots' and the host's, with no copy;
    float32 greedy tokens equal transformers' on the dequantized weights."""
    quantized, dequantized = case("qwen3_5_moe", "compressed-tensors")
    llm = LLM(model=str(quantized), dtype="float32", device=DEVICE.type, kernel_backend="triton",
              max_prefill_length=16, page_size=4, num_pages=64, moe_offload=True, expert_cache_slots=slots)
    prompts = [[5, 17, 200, 33, 98, 120, 7, 64, 301, 12, 45, 77, 150, 222, 9, 31, 180, 260, 3, 88], [42, 7, 300]]
    max_tokens = 4
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        assert output.token_ids == reference_greedy(dequantized, prompt, max_tokens)
    stats = llm.runtime.stats().expert_cache
    assert stats.misses > 0 and stats.slots == slots
