"""Pools, admission and aborts: memory always comes back, nothing is lost (preemption with every
model family: tests/engine/test_engine_parity.py)."""

from __future__ import annotations

import random

from oracle import reference_greedy
from freetoken import LLM, FinishReason, SamplingParams


def _run_to_end(runtime) -> dict:
    finished = {}
    while runtime.has_work:
        finished.update({o.request_id: o for o in runtime.step() if o.finished})
    return finished


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(300) for _ in range(length)]


def test_pools_return_to_full_after_finished_and_aborted_requests(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", max_prefill_length=16, page_size=4)
    runtime = llm.runtime
    full = runtime.stats()
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        runtime.submit(runtime.make_request(f"r{i}", _random_prompt(rng, 20 + 7 * i), params))
    outputs = {}
    for _ in range(4):
        outputs.update({o.request_id: o for o in runtime.step() if o.finished})
    assert runtime.stats().pages_used > 0
    runtime.abort("r1")  # running
    runtime.abort("r5")  # maybe mid-prefill
    runtime.abort("unknown-id")  # ignored
    outputs.update(_run_to_end(runtime))
    assert outputs["r1"].finish_reason is FinishReason.ABORT
    assert outputs["r5"].finish_reason is FinishReason.ABORT
    assert all(outputs[f"r{i}"].finish_reason is FinishReason.LENGTH for i in (0, 2, 3, 4))
    stats = runtime.stats()
    assert (stats.pages_used, stats.slots_used, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
    assert stats.pages_total == full.pages_total and stats.slots_total == full.slots_total


def test_request_larger_than_free_pages_waits_then_completes(demo_checkpoint):
    # 11 usable pages of 4 tokens: one 30-token prompt + 10 outputs needs 10 pages, so the
    # second request must wait for the first to finish.
    llm = LLM(
        model=str(demo_checkpoint), dtype="float32", device="cpu", page_size=4, num_pages=11, max_prefill_length=64
    )
    runtime = llm.runtime
    rng = random.Random(1)
    prompts = [_random_prompt(rng, 30), _random_prompt(rng, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        runtime.submit(runtime.make_request(f"r{i}", prompt, params))
    outputs = {}
    while runtime.has_work:
        stats = runtime.stats()
        assert stats.num_running <= 1
        for output in runtime.step():
            if output.finished:
                outputs[output.request_id] = output
            if output.request_id == "r1" and output.new_token_ids:
                assert "r0" in outputs, "r1 ran before r0 released its pages"
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(demo_checkpoint, prompt, 10)
        assert outputs[f"r{i}"].token_ids[: len(expected)] == expected
    assert runtime.stats().pages_used == 0


def test_prompt_that_can_never_fit_is_rejected(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", page_size=4, num_pages=5)
    try:
        llm.generate({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=2))
    except ValueError as exc:
        assert "prompt has 40 tokens" in str(exc)
    else:
        raise AssertionError("a prompt larger than the whole KV cache must be rejected")


def test_output_stops_at_the_kv_cache_capacity(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", page_size=4, num_pages=5)
    out = llm.generate({"prompt_token_ids": list(range(10))}, SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason is FinishReason.LENGTH
    assert 10 + len(out.token_ids) == 5 * 4
