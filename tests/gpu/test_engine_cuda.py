"""The engine on CUDA through the Triton kernels: weights, KV/state pools and sampling on the GPU;
float32 greedy tokens equal transformers' (run on the CPU in float32), bf16 logits close to them."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM
from oracle import CASES, DEMO, PAGE_SIZE, PROMPTS, Case, assert_greedy_batch, checkpoint, reference_logits

pytestmark = pytest.mark.gpu

# Qwen3.5 with both backend choices ("auto" must pick the Triton kernels on CUDA); every Qwen4-Exp
# shape with the default one.
RUNS = [
    *(
        pytest.param(case, backend, id=f"{case}-{backend}")
        for case in (Case("qwen3_5_moe", "demo"), Case("qwen3_5_moe", "odd_heads_padded_vocab"))
        for backend in ("auto", "triton")
    ),
    *(pytest.param(case, "auto", id=f"{case}-auto") for case in CASES if case.family == "qwen4_exp"),
]


@pytest.mark.parametrize("case, kernel_backend", RUNS)
def test_float32_greedy_tokens_equal_transformers_on_cuda(case, kernel_backend):
    llm = LLM(
        model=str(checkpoint(case)),
        dtype="float32",
        device="cuda",
        kernel_backend=kernel_backend,
        max_prefill_length=16,  # the long prompts are chunked next to decodes
        page_size=PAGE_SIZE,
    )
    assert llm.runtime.engine.model.embed_tokens.device.type == "cuda"
    assert_greedy_batch(llm, case)


def test_pools_sized_from_free_gpu_memory():
    """No num_pages given: the pages come from the free memory after the weights, capped at what
    max_running_requests x max_model_len can use."""
    llm = LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), dtype="bfloat16", device="cuda", max_running_requests=8)
    engine = llm.runtime.engine
    sizes = engine.pool_sizes
    layer = next(l.mixer for l in engine.model.layers if hasattr(l.mixer, "k_cache"))
    assert layer.k_cache.device.type == "cuda" and layer.k_cache.shape[0] == sizes.num_pages
    assert sizes.num_pages == 8 * -(-engine.max_model_len // engine.config.page_size) + 1
    free, _ = torch.cuda.mem_get_info()
    assert free > 0


def test_bf16_logits_close_to_transformers():
    """bf16 on CUDA against the exact logits (float32 transformers on the CPU): relative L2 <= 2e-2."""
    path = checkpoint(DEMO["qwen3_5_moe"])
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", max_prefill_length=16, page_size=PAGE_SIZE)
    for prompt in PROMPTS:
        ids = llm.runtime.tokenize(prompt)
        ours = llm.prompt_logits(ids).float().cpu()
        exact = reference_logits(path, ids, torch.float32)
        err = ((ours - exact).norm() / exact.norm()).item()
        assert err <= 2e-2, (prompt, err)
