"""The engine on CUDA through the Triton kernels: weights, KV/state pools and sampling on the GPU;
float32 greedy tokens equal transformers' (run on the CPU in float32), bf16 logits close to them."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.demo import build_checkpoint
from kernel_checks import reference_greedy

pytestmark = pytest.mark.gpu

SHAPES = {
    "demo": {},
    # odd head counts, more GDN value heads than key heads, padded vocabulary, attention first
    "odd_heads": dict(
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
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun all day long.",
    "Numbers: 0 1 2 3 42 1024 3.14159 café 日本語の文章 🙂",
    "hi",
    "Gated DeltaNet layers keep a recurrent state; full attention layers keep paged keys and values.",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        name: build_checkpoint(tmp_path_factory.mktemp(name), text, vocab_size=437 if name == "odd_heads" else None, seed=3)
        for name, text in SHAPES.items()
    }


@pytest.mark.parametrize("shape", list(SHAPES))
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
    import transformers

    path = checkpoints["demo"]
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", max_prefill_length=16, page_size=4)
    config = transformers.AutoConfig.from_pretrained(path)
    exact_model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = llm.runtime.tokenize(prompt)
        ours = llm.prompt_logits(ids).float().cpu()
        with torch.no_grad():
            exact = exact_model(torch.tensor([ids])).logits[0].float()
        err = ((ours - exact).norm() / exact.norm()).item()
        assert err <= 2e-2, (prompt, err)
