"""The engine on CUDA through the Triton kernels: weights, KV/state pools and sampling on the GPU;
float32 greedy tokens equal transformers' (run on the CPU in float32), bf16 logits close to them."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from oracle import PROMPTS, reference_greedy, reference_logits

pytestmark = pytest.mark.gpu

SHAPES = ["demo", "odd_heads_padded_vocab"]


@pytest.fixture(scope="module")
def checkpoints(checkpoint_factory):
    return {name: checkpoint_factory(name) for name in SHAPES}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel_backend", ["auto", "triton"])
def test_float32_greedy_tokens_equal_transformers_on_cuda(checkpoints, shape, kernel_backend):
    path = checkpoints[shape]
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        kernel_backend=kernel_backend,  # "auto" must pick the Triton kernels on CUDA
        max_prefill_length=32,  # the long prompts are chunked next to decodes
        page_size=4,
    )
    engine = llm.runtime.engine
    assert engine.model.embed_tokens.device.type == "cuda"
    max_tokens = 24
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.error is None, output.error
        ids = llm.runtime.tokenize(prompt)
        assert output.token_ids == reference_greedy(path, ids, max_tokens), (shape, prompt)


def test_pools_sized_from_free_gpu_memory(checkpoints):
    """No num_pages given: the pages come from the free memory after the weights, capped at what
    max_running_requests x max_model_len can use."""
    llm = LLM(model=str(checkpoints["demo"]), dtype="bfloat16", device="cuda", max_running_requests=8)
    engine = llm.runtime.engine
    sizes = engine.pool_sizes
    layer = next(l.mixer for l in engine.model.layers if hasattr(l.mixer, "k_cache"))
    assert layer.k_cache.device.type == "cuda" and layer.k_cache.shape[0] == sizes.num_pages
    assert sizes.num_pages == 8 * -(-engine.max_model_len // engine.config.page_size) + 1
    free, _ = torch.cuda.mem_get_info()
    assert free > 0


def test_bf16_logits_close_to_transformers(checkpoints):
    """bf16 on CUDA against the exact logits (float32 transformers on the CPU): relative L2 <= 2e-2."""
    path = checkpoints["demo"]
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", max_prefill_length=16, page_size=4)
    for prompt in PROMPTS:
        ids = llm.runtime.tokenize(prompt)
        ours = llm.prompt_logits(ids).float().cpu()
        exact = reference_logits(path, ids, torch.float32)
        err = ((ours - exact).norm() / exact.norm()).item()
        assert err <= 2e-2, (prompt, err)
