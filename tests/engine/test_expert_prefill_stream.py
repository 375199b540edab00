"""The offloaded prefill stream on the CPU (issue 11, deliverable 5): a prompt chunk copies the
next layer's predicted experts into cache slots while a layer computes, the first layer's from the
token embeddings at the chunk's start (``experts.offload``). The demo prompts are short, so the
chunk threshold is lowered to stream their 16-token chunks (decode forwards never stream). On the
CPU there is no copy stream: the copies are plain copies in the same order, and nothing is timed.
Checked: float32 greedy tokens equal transformers' with the stream on, with a cache far smaller
than one layer's experts and with room for it, batched, chunked and preempted, for both families;
the stream's counters and order; the slot map's invariant after it."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.experts import offload as offload_module
from freetoken.experts.offload import ExpertOffload, distinct_experts
from expert_cache_checks import check_slot_map_invariant
from oracle import DEMO, FAMILIES, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint, reference_greedy

# Demo models: 4 layers of 8 (Qwen3.5) / of 4 (Qwen4-Exp) experts, top-2. "tiny": far smaller than
# one layer's experts (every layer runs in passes, so only the chunk's first layer is streamed);
# "room": a layer's experts and more, so every layer streams the next one's in.
CACHES = {"tiny": {"qwen3_5_moe": 3, "qwen4_exp": 1}, "room": {"qwen3_5_moe": 12, "qwen4_exp": 6}}
CHUNK = 16
STREAM_FROM = 9  # the demo's 16-token chunks stream; a decode forward (<= 8 tokens) never does


@pytest.fixture
def short_chunks_stream(monkeypatch):
    monkeypatch.setattr(offload_module, "STREAM_MIN_TOKENS", STREAM_FROM)


def _llm(family: str, slots: int, **kwargs) -> LLM:
    return LLM(model=str(checkpoint(DEMO[family])), dtype="float32", device="cpu", max_prefill_length=CHUNK,
               page_size=PAGE_SIZE, moe_offload=True, expert_cache_slots=slots, **kwargs)


def _record_streams(offload: ExpertOffload, monkeypatch) -> list[tuple[int, int, list[int]]]:
    """Each ``stream_ahead`` call as (layer, how many experts were predicted, the running ones)."""
    calls: list[tuple[int, int, list[int]]] = []
    original = offload.stream_ahead

    def stream_ahead(layer: int, predicted: list[int], running: list[int]) -> None:
        calls.append((layer, len(predicted), list(running)))
        original(layer, predicted, running)

    monkeypatch.setattr(offload, "stream_ahead", stream_ahead)
    return calls


@pytest.mark.parametrize("cache", list(CACHES), ids=str)
@pytest.mark.parametrize("family", list(DEMO), ids=str)
def test_streamed_prefill_greedy_equals_transformers(short_chunks_stream, monkeypatch, family, cache):
    llm = _llm(family, CACHES[cache][family])
    offload = llm.runtime.engine.offload
    calls = _record_streams(offload, monkeypatch)
    prompts = batch_prompts(DEMO[family])[:4]
    assert max(map(len, prompts)) > CHUNK  # chunked
    assert_greedy_batch(llm, DEMO[family], prompts)
    check_slot_map_invariant(offload)
    stats = llm.runtime.stats().expert_cache
    assert calls and calls[0][0] == 0 and calls[0][2] == []  # the chunk's first layer, from its embeddings
    layers = {layer for layer, _, _ in calls}
    if cache == "room":
        assert layers == set(range(len(offload.layers)))  # every layer streamed in by the one before
        assert 0 < stats.prefetch_hits <= stats.prefetched
    else:
        assert layers == {0}  # layers in passes leave no slot to stream into
    # The CPU degrades to plain copies in order: no copy stream, nothing timed.
    counters = offload.counters
    assert counters.eager_copy_seconds == counters.eager_wait_seconds == 0.0
    assert offload.slots.eager_seconds() == (0.0, 0.0)


@pytest.mark.parametrize("family", list(DEMO), ids=str)
def test_streamed_prefill_with_preemption_equals_transformers(short_chunks_stream, family):
    """As test_expert_offload's preemption test, with the stream on: recomputed prompts stream too."""
    case = DEMO[family]
    max_tokens = FAMILIES[family].max_tokens
    prompts = batch_prompts(case)[:3]
    usable = -(-(len(prompts[0]) + max_tokens) // PAGE_SIZE) + -(-len(prompts[1]) // PAGE_SIZE)
    llm = _llm(family, CACHES["room"][family], num_pages=usable)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.runtime.scheduler.num_preemptions > 0
    assert llm.runtime.stats().expert_cache.prefetched > 0
    for prompt, output in zip(prompts, outputs):
        expected = reference_greedy(checkpoint(case), prompt, max_tokens)
        assert output.token_ids[: len(expected)] == expected, f"prompt of {len(prompt)} tokens diverged"


def test_stream_off_copies_on_demand_only(short_chunks_stream):
    llm = _llm("qwen3_5_moe", CACHES["room"]["qwen3_5_moe"], expert_prefill_stream=False)
    assert_greedy_batch(llm, DEMO["qwen3_5_moe"], batch_prompts(DEMO["qwen3_5_moe"])[:2])
    stats = llm.runtime.stats().expert_cache
    assert stats.prefetched == stats.prefetch_hits == 0 and stats.misses > 0


def test_which_forwards_stream():
    """Prompt chunks from ``STREAM_MIN_TOKENS`` tokens; decode forwards never (zero-copy kernel);
    ``prefetch`` streams every eager forward; ``prefill_stream=False`` none but those."""
    offload = ExpertOffload("lru", pin=False)
    threshold = offload_module.STREAM_MIN_TOKENS
    assert offload.streams(threshold) and offload.streams(8192) and not offload.streams(threshold - 1)
    assert not ExpertOffload("lru", pin=False, prefill_stream=False).streams(8192)
    assert ExpertOffload("lru", pin=False, prefetch=True, prefill_stream=False).streams(16)


def test_distinct_experts_counts_on_the_device_most_routed_first():
    ids = [torch.tensor([[3, 1], [3, 0], [1, 3]]), torch.tensor([[2, 0]])]
    distinct = distinct_experts(ids, 4)
    assert distinct == [{3: 3, 1: 2, 0: 1}, {0: 1, 2: 1}]
    assert [list(d) for d in distinct] == [[3, 1, 0], [0, 2]]  # most routed first, ties by id


def test_stream_ahead_is_queued_before_the_layers_experts_launch_and_passed_after(short_chunks_stream, monkeypatch):
    """At a layer's routing the host queues every copy it knows of before launching anything: the
    layer's misses (``begin``), then the next layer's stream; only ``passed`` follows the experts
    kernel's launch, once (a copy queued after the launch would wait for that kernel)."""
    from freetoken import kernels

    llm = _llm("qwen3_5_moe", CACHES["room"]["qwen3_5_moe"])
    offload = llm.runtime.engine.offload
    events: list[tuple[str, int]] = []
    for name in ("begin", "stream_ahead", "passed"):
        original = getattr(offload, name)

        def recorded(layer, *args, _name=name, _original=original):
            events.append((_name, layer))
            return _original(layer, *args)

        monkeypatch.setattr(offload, name, recorded)
    fused = kernels.fused_experts

    def launched(*args, **kwargs):
        events.append(("launch", -1))
        return fused(*args, **kwargs)

    monkeypatch.setattr(kernels, "fused_experts", launched)
    assert_greedy_batch(llm, DEMO["qwen3_5_moe"], batch_prompts(DEMO["qwen3_5_moe"])[:1])
    start = events.index(("stream_ahead", 0))  # the first chunk, streamed from its embeddings
    layers = len(offload.layers)
    expected = [("stream_ahead", 0)]
    for layer in range(layers):
        expected += [("begin", layer)]
        expected += [("stream_ahead", layer + 1)] if layer + 1 < layers else []
        expected += [("launch", -1), ("passed", layer)]
    assert events[start : start + len(expected)] == expected
