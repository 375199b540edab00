"""float32 greedy tokens equal transformers' generate() on every batching and chunking path."""

from __future__ import annotations

import random

import pytest

from oracle import CHECKPOINT_SHAPES, PROMPTS, reference_greedy
from freetoken import LLM, SamplingParams

MAX_TOKENS = 24


def _token_prompts(llm: LLM, seed: int) -> list[list[int]]:
    """Text prompts, plus random-token prompts of 31-47 tokens (longer than any prefill chunk here)."""
    rng = random.Random(seed)
    vocab = len(llm.tokenizer) - 3  # no special tokens inside prompts
    prompts = [llm.runtime.tokenize(p) for p in PROMPTS]
    prompts += [[rng.randrange(vocab) for _ in range(rng.randint(31, 47))] for _ in range(3)]
    return prompts


@pytest.mark.parametrize("shape", list(CHECKPOINT_SHAPES))
@pytest.mark.parametrize("max_prefill_length", [16, 8192], ids=["chunked16", "unchunked"])
def test_batched_greedy_equals_transformers(checkpoint_factory, shape, max_prefill_length):
    path = checkpoint_factory(shape)
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_prefill_length=max_prefill_length, page_size=4)
    prompts = _token_prompts(llm, seed=len(shape))
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    )
    for prompt, output in zip(prompts, outputs):
        expected = reference_greedy(path, prompt, MAX_TOKENS)
        assert output.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert output.finish_reason.value == ("length" if len(expected) == MAX_TOKENS else "stop")
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0


def test_requests_arriving_while_others_decode(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", max_prefill_length=16, page_size=4)
    runtime = llm.runtime
    prompts = _token_prompts(llm, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished = {}
    for index, prompt in enumerate(prompts):
        runtime.submit(runtime.make_request(f"r{index}", prompt, params))
        for _ in range(3 + index):  # others decode, or are mid-prefill, when the next one arrives
            finished.update({o.request_id: o for o in runtime.step() if o.finished})
    while runtime.has_work:
        finished.update({o.request_id: o for o in runtime.step() if o.finished})
    for index, prompt in enumerate(prompts):
        expected = reference_greedy(demo_checkpoint, prompt, MAX_TOKENS)
        # ignore_eos: transformers stops at eos, the engine goes on; compare what both produced.
        assert finished[f"r{index}"].token_ids[: len(expected)] == expected


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
