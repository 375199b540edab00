"""MoE expert offload (issue 11) on the CPU: the routed experts live in host memory and run from a
device cache far smaller than one layer's experts, so every prefill layer runs in passes (decode
forwards run the zero-copy kernel: tests/engine/test_expert_offload_decode.py); float32 greedy
tokens still equal transformers' (batched, chunked, preempted; both families, NVFP4 experts too),
and the cache's counters add up."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.experts.cache import SlotTable
from freetoken.experts.eviction import LRUPolicy
from freetoken.experts.store import OffloadedExperts
from freetoken.layers.moe import SparseMoE
from oracle import DEMO, FAMILIES, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint, reference_greedy

# Demo models: Qwen3.5 8 experts top-2, Qwen4-Exp 4 experts top-2. Three slots for four layers of
# eight, one slot for four layers of four: a step's layer needs more experts than the whole cache.
SLOTS = {"qwen3_5_moe": 3, "qwen4_exp": 1}
families = pytest.mark.parametrize("family", list(DEMO), ids=str)


def _llm(family: str, max_prefill_length: int = 16, slots: int | None = None, **kwargs) -> LLM:
    return LLM(
        model=str(checkpoint(DEMO[family])),
        dtype="float32",
        device="cpu",
        max_prefill_length=max_prefill_length,
        page_size=PAGE_SIZE,
        moe_offload=True,
        expert_cache_slots=slots or SLOTS[family],
        **kwargs,
    )


@families
def test_offloaded_batched_chunked_greedy_equals_transformers(family):
    llm = _llm(family)
    assert all(isinstance(m.experts, OffloadedExperts) for m in llm.runtime.engine.model.modules()
               if isinstance(m, SparseMoE))
    assert_greedy_batch(llm, DEMO[family], batch_prompts(DEMO[family])[:4])
    stats = llm.runtime.stats().expert_cache
    assert stats is not None and stats.slots == SLOTS[family] and stats.misses > 0


@families
def test_offloaded_preempted_requests_equal_transformers(family):
    """As test_engine_parity's preemption test: pages for the first request's prompt and outputs and
    the second one's prompt only, so requests are preempted mid-decode and recomputed."""
    case = DEMO[family]
    max_tokens = FAMILIES[family].max_tokens
    prompts = batch_prompts(case)[:3]
    usable = -(-(len(prompts[0]) + max_tokens) // PAGE_SIZE) + -(-len(prompts[1]) // PAGE_SIZE)
    llm = _llm(family, num_pages=usable)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.runtime.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        expected = reference_greedy(checkpoint(case), prompt, max_tokens)
        assert output.token_ids[: len(expected)] == expected, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "eager_only"])
def test_counters_add_up_to_the_routed_uses(zero_copy):
    """hits + misses = the distinct (layer, expert) pairs each forward routes to (counted here from
    the router, apart from the cache). Every forward here has at most 8 tokens, so all run the
    zero-copy decode path, where a miss is read from host memory and copied in later, at most once:
    bytes copied <= misses x one expert's bytes; with that path switched off, every miss is copied
    in before its layer runs: bytes copied = misses x one expert's bytes. Twelve slots for four
    layers of eight experts: hits and misses both."""
    family, num_slots = "qwen3_5_moe", 12
    llm = _llm(family, max_prefill_length=8, slots=num_slots)
    if not zero_copy:
        llm.runtime.engine.offload.log = None  # as an offload without the zero-copy decode
    model = llm.runtime.engine.model
    uses = []

    def count(module: SparseMoE, inputs: tuple[torch.Tensor]) -> None:
        logits = inputs[0] @ module.gate_weight[: module.num_experts].T
        uses.append(torch.topk(logits, module.top_k, dim=-1).indices.unique().numel())

    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m in moe:
        m.register_forward_pre_hook(count)
    prompts = batch_prompts(DEMO[family])[:3]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6))
    stats = llm.runtime.stats().expert_cache
    text = model.config
    expert_bytes = 3 * text.moe_intermediate_size * text.hidden_size * 4  # gate, up, down rows; float32
    assert stats.hits + stats.misses == sum(uses) > 0
    assert stats.hits > 0 and stats.misses > 0
    if zero_copy:
        assert stats.bytes_copied % expert_bytes == 0 and 0 < stats.bytes_copied <= stats.misses * expert_bytes
    else:
        assert stats.bytes_copied == stats.misses * expert_bytes
    assert stats.prefetched == stats.prefetch_hits == 0
    slots = llm.runtime.engine.offload.slots
    assert [tuple(t.shape) for t in slots.tensors] == [
        (num_slots, 2 * text.moe_intermediate_size, text.hidden_size),
        (num_slots, text.hidden_size, text.moe_intermediate_size),
    ]
    # more slots than a layer's experts: the GEMMs read each expert in its slot, the cache is its slots alone
    assert slots.nbytes == sum(t.nbytes for t in slots.tensors)
    assert all(m.w13.shape[0] == text.num_experts for m in moe)  # every expert stays in host memory


PREFETCH_SLOTS = {"qwen3_5_moe": 12, "qwen4_exp": 6}  # one layer's experts and some room


@families
def test_prefetch_greedy_equals_transformers_and_counts(family):
    """The next layer's router on this layer's input picks experts to copy ahead (prefill chunks:
    the eager path): tokens unchanged; prefetches are not uses (hits + misses still count the
    routed ones), their bytes are counted."""
    llm = _llm(family, slots=PREFETCH_SLOTS[family], expert_prefetch=True)
    uses = []

    def count(module: SparseMoE, inputs: tuple[torch.Tensor]) -> None:
        logits = inputs[0] @ module.gate_weight[: module.num_experts].T
        uses.append(torch.topk(logits, module.top_k, dim=-1).indices.unique().numel())

    for m in llm.runtime.engine.model.modules():
        if isinstance(m, SparseMoE):
            m.register_forward_pre_hook(count)
    assert_greedy_batch(llm, DEMO[family], batch_prompts(DEMO[family])[:4])
    stats = llm.runtime.stats().expert_cache
    assert stats.hits + stats.misses == sum(uses)
    assert 0 < stats.prefetch_hits <= stats.prefetched
    # every copy is a miss's or a prefetch's (a zero-copy decode miss is copied at most once)
    expert_bytes = llm.runtime.engine.offload.expert_bytes
    assert stats.bytes_copied % expert_bytes == 0
    assert stats.prefetched * expert_bytes < stats.bytes_copied <= (stats.misses + stats.prefetched) * expert_bytes


def test_one_pass_when_the_cache_holds_everything():
    """A cache of every layer's experts: each expert is copied once, then every use hits."""
    llm = LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), dtype="float32", device="cpu", page_size=PAGE_SIZE,
              moe_offload=True, expert_cache_slots=10_000)
    config = llm.runtime.engine.model.config
    assert llm.runtime.stats().expert_cache.slots == config.num_experts * config.num_hidden_layers
    prompts = batch_prompts(DEMO["qwen3_5_moe"])[:2]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=4))
    first = llm.runtime.stats().expert_cache
    assert first.misses <= config.num_experts * config.num_hidden_layers
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=4))
    again = llm.runtime.stats().expert_cache
    assert again.misses == first.misses and again.hits > first.hits


def test_dummy_weights_offloaded_generate_as_resident():
    """``load_format="dummy"``: the offloaded experts get the values the resident model of the same
    seed has, and the same greedy tokens come out."""
    common = dict(model=str(checkpoint(DEMO["qwen4_exp"])), load_format="dummy", dtype="float32", device="cpu",
                  page_size=PAGE_SIZE, max_prefill_length=16)
    resident, offloaded = LLM(**common), LLM(**common, moe_offload=True, expert_cache_slots=2)
    for a, b in zip(resident.runtime.engine.model.modules(), offloaded.runtime.engine.model.modules()):
        if isinstance(a, SparseMoE):
            assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
    prompts = [{"prompt_token_ids": p} for p in batch_prompts(DEMO["qwen4_exp"])[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in offloaded.generate(prompts, params)] == [
        o.token_ids for o in resident.generate(prompts, params)
    ]


def test_nvfp4_experts_offloaded_packed():
    """NVFP4 experts stay packed in host memory and in the slots (uint8 codes, e4m3 scales, float32
    row scales); tokens equal transformers' on the dequantized weights."""
    from freetoken.layers.linear import NVFP4Weight
    from nvfp4_checkpoints import case

    quantized, dequantized = case("qwen3_5_moe", "compressed-tensors")
    llm = LLM(model=str(quantized), dtype="float32", device="cpu", max_prefill_length=16, page_size=4,
              moe_offload=True, expert_cache_slots=3)
    engine = llm.runtime.engine
    assert all(isinstance(m.w13, NVFP4Weight) and m.w13.packed.device.type == "cpu"
               for m in engine.model.modules() if isinstance(m, SparseMoE))
    assert [t.dtype for t in engine.offload.slots.tensors] == [torch.uint8, torch.float8_e4m3fn, torch.float32] * 2
    # One byte span an expert, on the host and in the slots: the parts are views of it (one copy an expert).
    span = engine.offload.expert_bytes
    for layer in engine.offload.layers:
        assert layer.host_span().shape == (layer.num_experts, span)
        assert all(p.data_ptr() - layer.host_span().data_ptr() < span and p.stride(0) * p.itemsize == span
                   for p in layer.host_parts())
    assert all(t.stride(0) * t.itemsize == span for t in engine.offload.slots.tensors)
    prompts = batch_prompts(DEMO["qwen3_5_moe"])[4:7]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == reference_greedy(dequantized, prompt, 8)
    text = engine.model.config
    i, h = text.moe_intermediate_size, text.hidden_size
    packed_bytes = 3 * i * h // 2 + 3 * i * h // 16 + (2 * i + h) * 4  # codes, block scales, row scales
    stats = llm.runtime.stats().expert_cache
    assert stats.bytes_copied % packed_bytes == 0 and 0 < stats.bytes_copied <= stats.misses * packed_bytes


def test_span_slots_copy_an_expert_as_one_block():
    """With a span layout (NVFP4 experts) the cache holds one ``[S, span]`` block: fills copy whole
    spans, and every part view reads its expert."""
    from freetoken.experts.slots import DeviceSlots
    from freetoken.experts.span import SpanLayout

    host = [torch.arange(5 * 6 * 4, dtype=torch.uint8).view(5, 6, 4),
            torch.arange(5 * 6, dtype=torch.float32).view(5, 6) / 7]
    layout = SpanLayout.of(host)
    span = layout.empty(5, "cpu")
    parts = layout.views(span)
    for view, part in zip(parts, host):
        view.copy_(part)
    assert layout.holds(span, parts) and not layout.holds(span, host)
    slots = DeviceSlots([[span]], num_slots=7, device=torch.device("cpu"), layout=layout)
    assert slots.nbytes == 7 * layout.nbytes and slots.tensors[1].stride(0) == layout.nbytes // 4
    slots.fill(0, [(3, 6), (0, 2)], [])
    for slot, expert in ((6, 3), (2, 0)):
        assert all(torch.equal(t[slot], p[expert]) for t, p in zip(slots.tensors, host))


def test_slot_table_passes_and_eviction():
    table = SlotTable(2, LRUPolicy(), expert_bytes=10)
    assert table.passes(0, [5, 1, 3]) == [[5, 1], [3]]
    assert table.admit(0, [5, 1]) == ([(5, 0), (1, 1)], [])
    # cached experts go first; the missing one evicts the least recently used outside its pass
    assert table.passes(0, [3, 1]) == [[1, 3]]
    placed, evicted = table.admit(0, [1, 3])
    assert placed == [(3, 0)] and evicted == [(0, 5)]
    assert (table.counters.hits, table.counters.misses, table.counters.bytes_copied) == (1, 3, 30)
    with pytest.raises(ValueError, match="do not fit 2 cache slots"):
        table.admit(1, [0, 1, 2])


def test_slot_table_prefetch_keeps_the_running_layer():
    table = SlotTable(3, LRUPolicy(), expert_bytes=10)
    table.admit(0, [0, 1])
    running = {(0, 0), (0, 1)}
    # one slot outside the running layer's: only the first predicted expert is copied ahead
    assert table.prefetch(1, [4, 5], running) == ([(4, 2)], [])
    assert table.prefetch(1, [4, 5], running) == ([], [])  # cached already, no room for 5
    table.admit(1, [4])
    counters = table.counters
    assert (counters.hits, counters.misses, counters.prefetched, counters.prefetch_hits) == (1, 2, 1, 1)
    assert counters.bytes_copied == 30


def test_default_policy_is_the_eviction_modules():
    from freetoken.config import EngineConfig
    from freetoken.experts.eviction import DEFAULT_POLICY

    assert EngineConfig().expert_cache_policy == DEFAULT_POLICY


def test_offload_options_are_checked():
    with pytest.raises(ValueError, match="expert_cache_policy must be one of"):
        LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), device="cpu", moe_offload=True, expert_cache_policy="mru")
    with pytest.raises(ValueError, match="expert_cache_slots must be >= 1"):
        LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), device="cpu", moe_offload=True, expert_cache_slots=0)


def test_bench_reports_the_expert_cache(tmp_path, capsys):
    import json

    from freetoken.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(checkpoint(DEMO["qwen3_5_moe"])), "--load-format", "dummy", "--moe-offload",
            "--expert-cache-slots", "4", "--batch-sizes", "2", "--input-len", "8", "--output-len", "3",
            "--dtype", "float32", "--device", "cpu", "--resident-ms-per-step", "1.0", "--json", str(out)]
    assert main(argv) == 0
    (result,) = json.loads(out.read_text())["results"]
    cache = result["expert_cache"]
    # Split by path: the prefill (eager), then the zero-copy decode forwards, one per steady step.
    phases = result["expert_cache_phases"]
    rows = phases["per_step"]
    assert len(rows) == result["steps"] and sum(r["steady"] for r in rows) == result["steady_steps"] == 2
    assert sum(r["hits"] for r in rows) == cache["hits"] and sum(r["misses"] for r in rows) == cache["misses"]
    prefill, decode = phases["prefill"], phases["decode"]
    assert prefill["steps"] == 1 and prefill["misses"] > 0
    assert decode["forwards"] == 2
    assert prefill["hits"] + decode["hits"] == cache["hits"] and prefill["misses"] + decode["misses"] == cache["misses"]
    assert decode["zero_copy_bytes"] == pytest.approx(decode["zero_copy_ms_per_step"] * 55e9 * 2 / 1e3)
    assert phases["vs_resident"]["resident_ms_per_step"] == 1.0
    assert cache["slots"] == 4 and cache["misses"] > 0
    assert cache["hit_rate"] == pytest.approx(cache["hits"] / (cache["hits"] + cache["misses"]))
    assert cache["copy_floor_ms_per_step"] == pytest.approx(cache["bytes_copied"] / 55e9 / result["steps"] * 1e3)
    config = json.loads((checkpoint(DEMO["qwen3_5_moe"]) / "config.json").read_text())
    text = config.get("text_config", config)
    expert_bytes = 3 * text["moe_intermediate_size"] * text["hidden_size"] * 4  # gate, up, down rows; float32
    assert cache["miss_floor_ms_per_step"] == pytest.approx(cache["misses"] * expert_bytes / 55e9 / result["steps"] * 1e3)
    printed = capsys.readouterr().out
    assert "batch 2: expert cache of 4 slots: hit rate" in printed
    assert "batch 2: zero-copy decode, 2 forwards: expert cache hit rate" in printed and "batch 2: vs resident" in printed
