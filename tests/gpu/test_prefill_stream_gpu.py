"""The offloaded prefill stream on CUDA (issue 11, deliverable 5): prompt chunks copy the next
layer's predicted experts into cache slots on the copy stream while a layer computes (the first
layer's from the token embeddings at the chunk's start), each layer's experts kernel waiting on
the events of its own copies only. At the demo models' size: float32 greedy tokens equal
transformers' with the overlap on (streaming one and two layers ahead, queued before or after the
layer's experts launch), decode in CUDA graphs or eager, and the copy stream's timing events report
the copy/compute overlap and the per-layer timeline that ``freetoken bench`` prints. At the
Qwen3.6-35B-A3B shape in NVFP4 (2 layers of random weights), a chunk streamed after each launch,
its copies racing the running layer's experts kernel, gives the tokens of the stream queued before
it and of no stream."""

from __future__ import annotations

import gc

import pytest
import torch

from freetoken import LLM
from freetoken.experts import offload as offload_module
from expert_cache_checks import check_slot_map_invariant
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint

pytestmark = pytest.mark.gpu

# A layer's experts and more (8 and 4 a layer): every layer streams the next one's in.
SLOTS = {"qwen3_5_moe": 12, "qwen4_exp": 6}


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("depth", [1, 2], ids=lambda d: f"depth{d}")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", list(DEMO))
def test_streamed_prefill_float32_greedy_equals_transformers_on_cuda(monkeypatch, family, eager, depth, order):
    monkeypatch.setattr(offload_module, "STREAM_MIN_TOKENS", 9)  # the demo's 16-token chunks stream
    case = DEMO[family]
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cuda", max_prefill_length=16,
              page_size=PAGE_SIZE, moe_offload=True, expert_cache_slots=SLOTS[family], enforce_eager=eager,
              prefill_stream_depth=depth, prefill_stream_order=order)
    offload = llm.runtime.engine.offload
    assert offload.stream_after_launch == (order == "after")
    streamed: list[int] = []
    stream_ahead = offload.stream_ahead

    def record(first, predicted, running, after=None):
        assert (after is not None) == (order == "after")
        streamed.extend(range(first, first + len(predicted)))
        stream_ahead(first, predicted, running, after)

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


def test_nvfp4_stream_after_the_launch_equals_before_and_none_at_the_preset_shape(tmp_path):
    """A 320-token chunk at the Qwen3.6-35B-A3B shape in NVFP4 (2 layers, random weights) into 300
    slots: each layer routes nearly all 256 experts, so the next layer's stream gets the few slots
    the running layer leaves, and its copies run while that layer's experts kernel reads its own.
    Greedy tokens are the same with the stream queued after the launch (the default for NVFP4),
    before it, and off."""
    from freetoken import SamplingParams
    from freetoken.bench.presets import write_nvfp4_config, write_preset_dir

    model_dir = write_preset_dir("qwen3.6-35b-a3b", tmp_path / "preset", num_layers=2)
    write_nvfp4_config(model_dir)
    common = dict(model=str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda", num_pages=64,
                  max_running_requests=1, max_model_len=512, moe_offload=True, expert_cache_slots=300,
                  enforce_eager=True)
    prompt = {"prompt_token_ids": [(7 * i) % 5000 + 1 for i in range(320)]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for name, options in {"auto": {}, "before": {"prefill_stream_order": "before"},
                          "off": {"expert_prefill_stream": False}}.items():
        llm = LLM(**common, **options)
        offload = llm.runtime.engine.offload
        assert offload.nvfp4 and offload.stream_after_launch == (name != "before")  # auto: after, for NVFP4
        tokens[name] = llm.generate(prompt, params)[0].token_ids
        stats = llm.runtime.stats().expert_cache
        assert (stats.prefetched > 0) == (name != "off")
        torch.cuda.synchronize()
        check_slot_map_invariant(offload)
        del llm, offload
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens["auto"] == tokens["before"] == tokens["off"]
