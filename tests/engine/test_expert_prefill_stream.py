"""The offloaded prefill stream on the CPU (issue 11, deliverable 5): a prompt chunk copies the
next layer's predicted experts into cache slots while a layer computes, the first layer's from the
token embeddings at the chunk's start (``experts.offload``). The demo prompts are short, so the
chunk threshold is lowered to stream their 16-token chunks (decode forwards never stream). On the
CPU there is no copy stream: the copies are plain copies in the same order, and nothing is timed.
Checked: float32 greedy tokens equal transformers' with the stream on, one, two and three layers
deep, with a cache far smaller than one layer's experts and with room for it, batched, chunked and
preempted, for both families; the stream's counters and order (at every depth, all copies queued
before the launch); a deeper stream never taking a nearer pending layer's slots; the slot map's
invariant after it."""

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


def _record_streams(offload: ExpertOffload, monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Each ``stream_ahead`` call as (the layers it streams, nearest first; the running experts)."""
    calls: list[tuple[list[int], list[int]]] = []
    original = offload.stream_ahead

    def stream_ahead(first: int, predicted: list[list[int]], running: list[int]) -> None:
        calls.append((list(range(first, first + len(predicted))), list(running)))
        original(first, predicted, running)

    monkeypatch.setattr(offload, "stream_ahead", stream_ahead)
    return calls


@pytest.mark.parametrize("depth", [1, 2, 3], ids=lambda d: f"depth{d}")
@pytest.mark.parametrize("cache", list(CACHES), ids=str)
@pytest.mark.parametrize("family", list(DEMO), ids=str)
def test_streamed_prefill_greedy_equals_transformers(short_chunks_stream, monkeypatch, family, cache, depth):
    llm = _llm(family, CACHES[cache][family], prefill_stream_depth=depth)
    offload = llm.runtime.engine.offload
    calls = _record_streams(offload, monkeypatch)
    prompts = batch_prompts(DEMO[family])[:4]
    assert max(map(len, prompts)) > CHUNK  # chunked
    assert_greedy_batch(llm, DEMO[family], prompts)
    check_slot_map_invariant(offload)
    stats = llm.runtime.stats().expert_cache
    num_layers = len(offload.layers)
    # The chunk's start streams its first ``depth`` layers from its embeddings; each routing the
    # ``depth`` layers after it (those that exist).
    assert calls and calls[0] == (list(range(min(depth, num_layers))), [])
    for streamed, _ in calls:
        assert streamed == list(range(streamed[0], min(streamed[0] + depth, num_layers)))
    layers = {layer for streamed, _ in calls for layer in streamed}
    if cache == "room":
        assert layers == set(range(num_layers))  # every layer streamed in by those before
        assert 0 < stats.prefetch_hits <= stats.prefetched
    else:
        assert layers == set(range(depth))  # layers in passes leave no slot to stream into
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


def test_stream_depth_is_checked():
    with pytest.raises(ValueError, match="prefill_stream_depth must be >= 1, got 0"):
        LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), device="cpu", moe_offload=True, prefill_stream_depth=0)
    with pytest.raises(ValueError, match="prefill_stream_depth must be >= 1, got -1"):
        ExpertOffload("lru", pin=False, stream_depth=-1)


class _HostLayer:
    """A layer of 4 one-row experts whose weights name their (layer, expert)."""

    num_experts, top_k = 4, 1

    def __init__(self, layer: int) -> None:
        self.parts = [torch.arange(4, dtype=torch.float32)[:, None] + 10 * layer]

    def host_parts(self) -> list[torch.Tensor]:
        return self.parts

    def host_span(self) -> torch.Tensor | None:
        return None

    def is_nvfp4(self) -> bool:
        return False

    def zero_copy_ready(self) -> bool:
        return True


def test_a_deeper_stream_never_takes_a_nearer_pending_layers_slots():
    """Streaming layers 1 and 2 while layer 0 runs, in a cache of 5 slots: layer 1's streamed
    experts fill what layer 0's running ones leave, and layer 2's copies, which would have evicted
    them (a policy victim outside layer 0's), get no slot: the nearer pending layer keeps them."""
    offload = ExpertOffload("lru", pin=False, stream_depth=2)
    for layer in range(3):
        offload.register(_HostLayer(layer))
    offload.allocate(5, torch.device("cpu"))
    offload.bring_in(0, [0, 1])
    assert offload.ahead(0) == range(1, 3) and offload.ahead(1) == range(2, 3)
    offload.stream_ahead(1, [[0, 1, 2, 3], [0, 1, 2, 3]], running=[0, 1])
    table = offload.table
    assert [e for e in range(4) if table.slot_of((1, e)) is not None] == [0, 1, 2]
    assert all(table.slot_of((2, e)) is None for e in range(4))
    assert all(table.slot_of((0, e)) is not None for e in (0, 1))
    check_slot_map_invariant(offload)
    offload.passed(0, {0: 1, 1: 1})  # layer 0 ran; layer 1 runs now and streams layer 2
    offload.begin(1, [0, 1, 2])
    offload.stream_ahead(2, [[3, 2]], running=[0, 1, 2])
    assert [e for e in range(4) if table.slot_of((2, e)) is not None] == [2, 3]  # layer 0's slots
    assert all(table.slot_of((1, e)) is not None for e in (0, 1, 2))
    check_slot_map_invariant(offload)


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


@pytest.mark.parametrize("depth", [2, 3], ids=lambda d: f"depth{d}")
def test_a_deeper_stream_queues_every_layer_ahead_before_the_launch(short_chunks_stream, monkeypatch, depth):
    """At depth D, a layer's routing sync queues its misses, then the copies of the D layers after
    it (those that exist), nearest first, each in a batch of its own on the copy stream, all before
    the experts kernel's launch; the chunk's start queues its first D layers."""
    from freetoken import kernels

    llm = _llm("qwen3_5_moe", CACHES["room"]["qwen3_5_moe"], prefill_stream_depth=depth)
    offload = llm.runtime.engine.offload
    events: list[tuple[str, int]] = []
    begin, fill = offload.begin, offload.slots.fill

    def recorded_begin(layer, experts):
        events.append(("begin", layer))
        return begin(layer, experts)

    def recorded_fill(layer, placed, evicted, ahead=False):
        if ahead:
            events.append(("ahead", layer))
        return fill(layer, placed, evicted, ahead)

    monkeypatch.setattr(offload, "begin", recorded_begin)
    monkeypatch.setattr(offload.slots, "fill", recorded_fill)
    fused = kernels.fused_experts

    def launched(*args, **kwargs):
        events.append(("launch", -1))
        return fused(*args, **kwargs)

    monkeypatch.setattr(kernels, "fused_experts", launched)
    assert_greedy_batch(llm, DEMO["qwen3_5_moe"], batch_prompts(DEMO["qwen3_5_moe"])[:1])
    layers = len(offload.layers)
    start = events.index(("ahead", 0))
    expected = [("ahead", layer) for layer in range(min(depth, layers))]
    for layer in range(layers):
        expected += [("begin", layer)]
        expected += [("ahead", ahead) for ahead in range(layer + 1, min(layer + 1 + depth, layers))]
        expected += [("launch", -1)]
    assert events[start : start + len(expected)] == expected
