"""The offloaded prefill stream on CUDA (issue 11, deliverable 5): prompt chunks copy the next
layer's predicted experts into cache slots on the copy stream while a layer computes (the first
layer's from the token embeddings at the chunk's start), each layer's experts kernel waiting on
the events of its own copies only. At the demo models' size: float32 greedy tokens equal
transformers' with the overlap on (streaming one and two layers ahead), decode in CUDA graphs or eager, and the copy stream's timing
events report the copy/compute overlap and the per-layer timeline that ``freetoken bench`` prints."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM
from freetoken.experts import offload as offload_module
from expert_cache_checks import check_slot_map_invariant
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint

pytestmark = pytest.mark.gpu

# A layer's experts and more (8 and 4 a layer): every layer streams the next one's in.
SLOTS = {"qwen3_5_moe": 12, "qwen4_exp": 6}


@pytest.mark.parametrize("depth", [1, 2], ids=lambda d: f"depth{d}")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", list(DEMO))
def test_streamed_prefill_float32_greedy_equals_transformers_on_cuda(monkeypatch, family, eager, depth):
    monkeypatch.setattr(offload_module, "STREAM_MIN_TOKENS", 9)  # the demo's 16-token chunks stream
    case = DEMO[family]
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cuda", max_prefill_length=16,
              page_size=PAGE_SIZE, moe_offload=True, expert_cache_slots=SLOTS[family], enforce_eager=eager,
              prefill_stream_depth=depth)
    offload = llm.runtime.engine.offload
    streamed: list[int] = []
    stream_ahead = offload.stream_ahead

    def record(first, predicted, running):
        streamed.extend(range(first, first + len(predicted)))
        stream_ahead(first, predicted, running)

    monkeypatch.setattr(offload, "stream_ahead", record)
    timeline = offload.record_timeline()
    assert_greedy_batch(llm, case, batch_prompts(case)[:4])
    offload.stop_timeline()
    forwards = timeline.summary()  # the streamed chunks' timelines, as the bench prints them
    assert forwards
    for forward in forwards:
        assert [row["layer"] for row in forward["layers"]] == list(range(len(offload.layers)))
        assert 0 <= forward["copy_busy_ms"] <= forward["span_ms"] + 1e-3
        assert forward["copy_idle_ms"] >= 0 and forward["compute_wait_ms"] >= 0
    assert any(forward["copy_busy_ms"] > 0 for forward in forwards)
    torch.cuda.synchronize()
    check_slot_map_invariant(offload)
    assert set(streamed) == set(range(len(offload.layers)))
    counters = offload.counters  # harvests the completed timing events
    assert 0 < counters.prefetch_hits <= counters.prefetched
    assert counters.eager_copy_seconds > 0  # the copy stream ran and was timed
    assert 0 <= counters.eager_wait_seconds
