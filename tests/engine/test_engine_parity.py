"""The engine against transformers for every model family and checkpoint shape (tests/oracle.py):
float32 greedy tokens equal transformers' generate() on every batching, chunking, preemption and
arrival path; bf16 logits as close to the exact ones as transformers' own bf16 forward.

The Qwen4-Exp checkpoints have hyper-connections, GDN and QSA layers, MoE with a shared expert and
PLE on linear layers; prompts plus outputs are far longer than the QSA budget plus a block, so
every request's later queries drop blocks.
"""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from oracle import (
    CASES,
    DEMO,
    FAMILIES,
    PAGE_SIZE,
    PROMPTS,
    Case,
    assert_greedy_batch,
    batch_prompts,
    checkpoint,
    random_prompts,
    reference_greedy,
    reference_logits,
)

cases = pytest.mark.parametrize("case", CASES, ids=str)


def _llm(case: Case, max_prefill_length: int = 16, dtype: torch.dtype = torch.float32, **kwargs) -> LLM:
    return LLM(
        model=str(checkpoint(case, dtype)),
        dtype=str(dtype).removeprefix("torch."),
        device="cpu",
        max_prefill_length=max_prefill_length,
        page_size=PAGE_SIZE,
        **kwargs,
    )


@cases
@pytest.mark.parametrize("max_prefill_length", [16, 8192], ids=["chunked16", "unchunked"])
def test_batched_greedy_equals_transformers(case, max_prefill_length):
    llm = _llm(case, max_prefill_length)
    assert_greedy_batch(llm, case)


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
def test_preempted_requests_recompute_equal_transformers(case):
    """Pages for the first request's prompt and outputs and the second's prompt only: the second
    one's outputs run the pool dry while the first decodes, so requests are preempted mid-decode and
    recomputed from scratch, which must reset their recurrent (GDN, conv, PLE, n-gram) state.
    ignore_eos makes the schedule independent of the tokens: every request grows to full length."""
    max_tokens = FAMILIES[case.family].max_tokens
    prompts = batch_prompts(case)
    usable = -(-(len(prompts[0]) + max_tokens) // PAGE_SIZE) + -(-len(prompts[1]) // PAGE_SIZE)
    llm = _llm(case, num_pages=usable)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.runtime.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        expected = reference_greedy(checkpoint(case), prompt, max_tokens)
        assert output.token_ids[: len(expected)] == expected, f"prompt of {len(prompt)} tokens diverged"
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
def test_requests_arriving_while_others_decode(case):
    llm = _llm(case)
    runtime = llm.runtime
    prompts = batch_prompts(case)
    max_tokens = FAMILIES[case.family].max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    finished = {}
    for index, prompt in enumerate(prompts):
        runtime.submit(runtime.make_request(f"r{index}", prompt, params))
        for _ in range(2 + index):  # others decode, or are mid-prefill, when the next one arrives
            finished.update({o.request_id: o for o in runtime.step() if o.finished})
    while runtime.has_work:
        finished.update({o.request_id: o for o in runtime.step() if o.finished})
    for index, prompt in enumerate(prompts):
        expected = reference_greedy(checkpoint(case), prompt, max_tokens)
        # ignore_eos: transformers stops at eos, the engine goes on; compare what both produced.
        assert finished[f"r{index}"].token_ids[: len(expected)] == expected


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
def test_bf16_logits_close_to_transformers(case):
    """Against transformers running the same bf16 checkpoint: relative L2 error <= 1e-2, in prefill
    chunks of 16. Against the exact logits (the same bf16 weights computed in float32) the engine is
    as accurate as transformers' own bf16 forward at a typical position (the median over positions:
    a router near a tie may send one position to another expert in either implementation, which
    moves that position's logits by a few percent)."""
    path = checkpoint(case, torch.bfloat16)
    llm = _llm(case, dtype=torch.bfloat16)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    def typical_error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).median().item()

    for prompt in batch_prompts(case):
        ours = llm.prompt_logits(prompt)
        hf_bf16 = reference_logits(path, prompt, torch.bfloat16)
        exact = reference_logits(path, prompt, torch.float32)
        assert error(ours, hf_bf16) <= 1e-2
        assert typical_error(ours, exact) <= 1.25 * typical_error(hf_bf16, exact)


@pytest.mark.slow
@cases
@pytest.mark.parametrize("max_prefill_length", [7, 16, 8192])
def test_long_outputs_many_prompts(case, max_prefill_length):
    llm = _llm(case, max_prefill_length)
    assert_greedy_batch(llm, case, random_prompts(8), max_tokens=40)


def test_text_prompt_and_offline_api_shapes(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")
    single = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(single) == 1
    ids = llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert single[0].token_ids == reference_greedy(demo_checkpoint, ids, 8)
    assert single[0].text == llm.tokenizer.decode(single[0].token_ids, skip_special_tokens=True)
    by_ids = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=8))
    assert by_ids[0].token_ids == single[0].token_ids


def test_chat_uses_the_chat_template(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")
    messages = [{"role": "user", "content": "hello"}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    params = SamplingParams(temperature=0.0, max_tokens=6)
    assert llm.chat(messages, params)[0].token_ids == llm.generate(text, params)[0].token_ids
