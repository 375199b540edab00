"""Qwen4-Exp: float32 greedy tokens equal transformers' on every batching and chunking path.

The checkpoints (tests/models/qwen4_cases.py) have hyper-connections, GDN and QSA layers, MoE with a
shared expert and PLE on linear layers; prompts plus outputs are far longer than the QSA budget plus
a block, so every request's later queries drop blocks.
"""

from __future__ import annotations

import pytest

from freetoken import LLM, SamplingParams
from qwen4_cases import PAGE_SIZE, SHAPES, checkpoint, prompts, reference_greedy, reference_logits

MAX_TOKENS = 16


def _llm(shape: str, max_prefill_length: int, **kwargs) -> LLM:
    kwargs.setdefault("device", "cpu")
    return LLM(
        model=str(checkpoint(shape)),
        dtype="float32",
        max_prefill_length=max_prefill_length,
        page_size=PAGE_SIZE,
        **kwargs,
    )


def _check_batch(shape: str, max_prefill_length: int, count: int, max_tokens: int, **kwargs) -> None:
    llm = _llm(shape, max_prefill_length, **kwargs)
    batch = prompts(count)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, output in zip(batch, outputs):
        expected = reference_greedy(shape, prompt, max_tokens)
        assert output.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_batched_chunked_greedy_equals_transformers(shape):
    _check_batch(shape, max_prefill_length=16, count=4, max_tokens=MAX_TOKENS)


def test_unchunked_prefill_equals_transformers():
    _check_batch("blocks_of_a_page", max_prefill_length=8192, count=4, max_tokens=MAX_TOKENS)


def test_preempted_requests_recompute_equal_transformers():
    """Too few pages for every request: some are preempted mid-decode and recomputed from scratch,
    which must reset their GDN, PLE and n-gram state."""
    llm = _llm("blocks_of_a_page", 16, num_pages=34)
    batch = prompts(4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert llm.runtime.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs):
        assert output.token_ids == reference_greedy("blocks_of_a_page", prompt, MAX_TOKENS)


def test_requests_arriving_while_others_decode():
    shape = "blocks_of_a_page"
    llm = _llm(shape, 16)
    runtime = llm.runtime
    batch = prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished = {}
    for index, prompt in enumerate(batch):
        runtime.submit(runtime.make_request(f"r{index}", prompt, params))
        for _ in range(2 + index):  # others decode, or are mid-prefill, when the next one arrives
            finished.update({o.request_id: o for o in runtime.step() if o.finished})
    while runtime.has_work:
        finished.update({o.request_id: o for o in runtime.step() if o.finished})
    for index, prompt in enumerate(batch):
        expected = reference_greedy(shape, prompt, MAX_TOKENS)
        assert finished[f"r{index}"].token_ids[: len(expected)] == expected


def test_bf16_logits_close_to_transformers():
    """The same bf16 checkpoint: relative L2 error <= 1e-2 against transformers' bf16 forward, and
    about as close as it to the exact logits (the bf16 weights computed in float32) at a typical
    position (the median: a router near a tie may flip one position in either implementation)."""
    import torch

    shape = "blocks_of_a_page"
    path = checkpoint(shape, torch.bfloat16)
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu", max_prefill_length=16, page_size=PAGE_SIZE)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    def typical_error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).median().item()

    for prompt in prompts(2):
        ours = llm.prompt_logits(prompt)
        hf_bf16 = reference_logits(shape, prompt, torch.bfloat16, torch.bfloat16)
        exact = reference_logits(shape, prompt, torch.bfloat16, torch.float32)
        assert error(ours, hf_bf16) <= 1e-2
        assert typical_error(ours, exact) <= 1.25 * typical_error(hf_bf16, exact)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("max_prefill_length", [7, 16, 8192])
def test_long_outputs_many_prompts(shape, max_prefill_length):
    _check_batch(shape, max_prefill_length=max_prefill_length, count=8, max_tokens=40)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_engine_equals_transformers(shape):
    """The whole engine on CUDA (its Triton kernels, the n-gram table in host memory), float32."""
    _check_batch(shape, max_prefill_length=16, count=4, max_tokens=MAX_TOKENS, device="cuda")


@pytest.mark.slow
def test_triton_kernels_in_the_engine_equal_transformers():
    """Every op through its Triton kernel (the interpreter on a CPU, a few minutes here): chunked
    prefill, decode, and requests sharing steps."""
    _check_batch("blocks_of_a_page", max_prefill_length=16, count=2, max_tokens=8, kernel_backend="triton")


def test_page_size_and_compress_ratio_must_divide_one_another():
    with pytest.raises(ValueError, match=r"page_size \(6\) and indexer_compress_ratio \(4\)"):
        LLM(model=str(checkpoint("blocks_of_a_page")), dtype="float32", device="cpu", page_size=6)
