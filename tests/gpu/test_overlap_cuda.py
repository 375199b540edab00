"""The overlapped loop on CUDA: the same outputs as the synchronous loop, and staging, sampling and
the output copy of a decode step never make the host wait for the device."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from oracle import DEMO, PROMPTS, checkpoint

pytestmark = pytest.mark.gpu

OPTIONS = dict(dtype="float32", device="cuda", max_prefill_length=32, page_size=4)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=30, max_tokens=20, seed=11, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.8, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2,
                       max_tokens=20, seed=5, ignore_eos=True),
        SamplingParams(temperature=1.5, max_tokens=24, min_tokens=8, seed=3, stop_token_ids=[5, 9, 17]),
    ]


def test_overlapped_equals_synchronous_on_cuda():
    path = str(checkpoint(DEMO["qwen3_5_moe"]))
    results = {}
    for overlap in (True, False):
        llm = LLM(model=path, overlap_schedule=overlap, **OPTIONS)
        outputs = llm.generate(PROMPTS, _params())
        results[overlap] = [(o.token_ids, o.text, o.finish_reason) for o in outputs]
        stats = llm.runtime.stats()
        assert (stats.pages_used, stats.slots_used) == (0, 0)
    assert results[True] == results[False]


def test_decode_staging_and_sampling_do_not_synchronize():
    llm = LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), **OPTIONS)
    runtime = llm.runtime
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=64, ignore_eos=True, repetition_penalty=1.2)
        runtime.submit(runtime.make_request(f"r{i}", prompt, params))
    scheduler = runtime.scheduler
    runtime.step()  # the submissions reach the scheduler through the engine thread's inbox
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        runtime.step()  # until every request is past its prompt and decodes
    if runtime._in_flight is not None:
        runtime._land(*runtime._in_flight)
        runtime._in_flight = None
    step = runtime.scheduler.schedule()
    assert step.plan.num_decodes == len(step.plan.rows) and not step.plan.admissions
    engine = runtime.engine
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        staged = engine.buffers.stage(step.plan, engine.sampler.last_token)
        logits = engine.model(staged.batch)
        host_slots = [row.slot for row in step.plan.sampling_rows]
        token_ids, logprobs = engine.sampler.sample(logits, staged.sample_slots, host_slots)
        pending = engine.outputs.send(token_ids, logprobs, staged.sampled_rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, _ = pending.result()
    assert len(tokens) == len(step.plan.rows)
    assert engine.sampler.last_token[[row.slot for row in step.plan.rows]].tolist() == tokens
