"""MoE expert offload on CUDA: experts in pinned host memory, copied into the device cache on the
copy stream; float32 greedy tokens equal transformers' (and so the resident engine's) with a cache
smaller than one layer's experts; the cache sized from free memory, under --gpu-memory-gib."""

from __future__ import annotations

import gc

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.memory import GiB
from freetoken.layers.moe import SparseMoE
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint

pytestmark = pytest.mark.gpu

SLOTS = {"qwen3_5_moe": 3, "qwen4_exp": 1}  # fewer than one layer's experts (8 and 4)


@pytest.mark.parametrize("family", list(DEMO))
def test_offloaded_float32_greedy_equals_transformers_on_cuda(family):
    case = DEMO[family]
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cuda", max_prefill_length=16,
              page_size=PAGE_SIZE, moe_offload=True, expert_cache_slots=SLOTS[family])
    engine = llm.runtime.engine
    assert engine.graph_runner is None  # graphs off with offload
    for m in engine.model.modules():
        if isinstance(m, SparseMoE):
            assert m.w13.device.type == "cpu" and m.w13.is_pinned() and m.w2.is_pinned()
    assert all(t.device.type == "cuda" for t in engine.offload.slots.tensors)
    assert_greedy_batch(llm, case)
    stats = llm.runtime.stats().expert_cache
    assert stats.misses > 0 and stats.bytes_copied == stats.misses * engine.offload.expert_bytes


def test_offloaded_greedy_equals_resident_on_cuda():
    path = str(checkpoint(DEMO["qwen3_5_moe"]))
    common = dict(model=path, dtype="float32", device="cuda", page_size=PAGE_SIZE, max_prefill_length=16)
    prompts = [{"prompt_token_ids": p} for p in batch_prompts(DEMO["qwen3_5_moe"])]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    resident = [o.token_ids for o in LLM(**common).generate(prompts, params)]
    gc.collect()
    torch.cuda.empty_cache()
    offloaded = [o.token_ids for o in LLM(**common, moe_offload=True, expert_cache_slots=16).generate(prompts, params)]
    assert offloaded == resident


def test_cache_sized_from_free_memory_under_the_cap():
    """No expert_cache_slots: the cache takes what the budget leaves after the KV pool (here every
    expert, the model is tiny); with --gpu-memory-gib the pools and the cache stay under the cap."""
    path = str(checkpoint(DEMO["qwen3_5_moe"]))
    llm = LLM(model=path, dtype="bfloat16", device="cuda", moe_offload=True, num_pages=64)
    config = llm.runtime.engine.model.config
    assert llm.runtime.stats().expert_cache.slots == config.num_experts * config.num_hidden_layers
    del llm
    gc.collect()  # the MoE blocks and their stores reference each other
    torch.cuda.empty_cache()
    capped = LLM(model=path, dtype="bfloat16", device="cuda", moe_offload=True, gpu_memory_gib=3.0,
                 max_running_requests=4)
    engine = capped.runtime.engine
    used = engine.pool_sizes.total_bytes + engine.offload.slots.nbytes
    assert used <= 3.0 * GiB
    out = capped.generate("The quick", SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].token_ids) == 4


def test_preset_shape_with_half_the_experts_cached(tmp_path):
    """Qwen3.6-35B-A3B's layer shape (2 layers, dummy weights drawn on the GPU and copied to pinned
    host memory), half of the experts cached: decoding runs and copies only misses."""
    from freetoken.bench.presets import write_preset_dir

    model_dir = write_preset_dir("qwen3.6-35b-a3b", tmp_path / "preset", num_layers=2)
    llm = LLM(model=str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda", moe_offload=True,
              expert_cache_slots=256, num_pages=64, max_running_requests=2, max_model_len=512)
    out = llm.generate({"prompt_token_ids": list(range(1, 65))}, SamplingParams(temperature=0.0, max_tokens=8,
                                                                                  ignore_eos=True))
    assert len(out[0].token_ids) == 8
    stats = llm.runtime.stats().expert_cache
    assert stats.slots == 256 and stats.hits + stats.misses > 0
    assert stats.bytes_copied == stats.misses * 3 * 512 * 2048 * 2  # bf16 gate, up, down of one expert
