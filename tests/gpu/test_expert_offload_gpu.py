"""MoE expert offload on CUDA: experts in pinned host memory, copied into the device cache on the
copy stream; decode steps captured in CUDA graphs with the zero-copy decode kernel (a miss read
from pinned host memory, the slot map updated between replays); float32 greedy tokens equal
transformers' (and so the resident engine's) with a cache smaller than one layer's experts, graphs
on and off; the cache sized from free memory, under --gpu-memory-gib."""

from __future__ import annotations

import gc

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.memory import GiB
from freetoken.layers.moe import DECODE_MAX_TOKENS, SparseMoE
from expert_cache_checks import check_slot_map_invariant
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint

pytestmark = pytest.mark.gpu

SLOTS = {"qwen3_5_moe": 3, "qwen4_exp": 1}  # fewer than one layer's experts (8 and 4)


def _count_replays(llm: LLM) -> list[int]:
    """The request counts of the decode steps the engine's graph runner replays from now on."""
    runner = llm.runtime.engine.graph_runner
    assert runner is not None and runner.use_graphs and runner.graphs
    replays: list[int] = []
    run = runner.run

    def counted(batch):
        replays.append(batch.num_requests)
        return run(batch)

    runner.run = counted
    return replays


def _captured_then_lent(forward, fills: torch.Tensor, slot_map: torch.Tensor, lend: torch.Tensor, lent: int):
    """The read-through fill tests' graph: ``forward`` run once (compiles; nothing lent, so no
    claims), captured, then ``lent`` slots lent for the replays. Returns the graph and its output."""
    forward()
    assert (fills == -1).all() and (slot_map == -1).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    lend[1] = lent
    return graph, out


def _random_nvfp4(gen: torch.Generator, *shape: int) -> list[torch.Tensor]:
    """Random NVFP4 parts on the host: every code byte, e4m3 scales without NaN, small row scales."""
    *lead, rows, cols = shape
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (*lead, rows, cols // 16), generator=gen, dtype=torch.uint8)
    row_scales = torch.rand(*lead, rows, generator=gen) * 2**-6 * cols**-0.5 + 1e-4
    return [packed, scales.view(torch.float8_e4m3fn), row_scales]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", list(DEMO))
def test_offloaded_float32_greedy_equals_transformers_on_cuda(family, eager):
    case = DEMO[family]
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cuda", max_prefill_length=16,
              page_size=PAGE_SIZE, moe_offload=True, expert_cache_slots=SLOTS[family], enforce_eager=eager)
    engine = llm.runtime.engine
    assert engine.offload.zero_copy
    replays = None
    if eager:
        assert engine.graph_runner is None
    else:  # graphs on with offload, decode batches up to DECODE_MAX_TOKENS
        assert engine.graph_runner.max_batch_size <= DECODE_MAX_TOKENS
        replays = _count_replays(llm)
    for m in engine.model.modules():
        if isinstance(m, SparseMoE):
            assert m.w13.device.type == "cpu" and m.w13.is_pinned() and m.w2.is_pinned()
    assert all(t.device.type == "cuda" for t in engine.offload.slots.tensors)
    assert_greedy_batch(llm, case)
    assert replays is None or replays, "no decode step was replayed"
    stats = llm.runtime.stats().expert_cache
    assert stats.hits > 0 and stats.misses > 0
    assert 0 < stats.bytes_copied <= stats.misses * engine.offload.expert_bytes
    torch.cuda.synchronize()
    check_slot_map_invariant(engine.offload)


def test_zero_copy_decode_kernel_at_qwen36_sizes():
    """Qwen3.6-35B-A3B's layer (256 experts of 512 x 2048, top-8, shared 512) in bf16 at 1 and 8
    tokens: with every expert in a slot, none (all read from pinned host memory) or half of them in
    scattered slots, the block is bit for bit the same, close to the reference, and the routed ids
    come back with the misses marked."""
    from freetoken.kernels.moe_decode import sparse_moe_decode_reference
    from freetoken.kernels.triton.moe_decode_offload import sparse_moe_decode_offload
    from kernel_checks import assert_close

    gen = torch.Generator().manual_seed(0)
    experts, top_k, hidden, inter, shared = 256, 8, 2048, 512, 512
    dtype = torch.bfloat16

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    host_w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5).pin_memory()
    host_w2 = randn(experts, hidden, inter, scale=inter**-0.5).pin_memory()
    device_w13, device_w2 = host_w13.cuda(), host_w2.cuda()
    # half the experts in scattered slots of a cache of 160
    cached = torch.randperm(experts, generator=gen)[: experts // 2]
    slots = torch.randperm(160, generator=gen)[: cached.numel()]
    half_map = torch.full((experts,), -1, dtype=torch.int32)
    half_map[cached] = slots.to(torch.int32)
    half_w13 = torch.zeros(160, 2 * inter, hidden, dtype=dtype, device="cuda")
    half_w2 = torch.zeros(160, hidden, inter, dtype=dtype, device="cuda")
    half_w13[slots.cuda()], half_w2[slots.cuda()] = device_w13[cached.cuda()], device_w2[cached.cuda()]
    maps = {
        "all": (torch.arange(experts, dtype=torch.int32), device_w13, device_w2),
        "none": (torch.full((experts,), -1, dtype=torch.int32), device_w13, device_w2),
        "half": (half_map, half_w13, half_w2),
    }
    shared_gate_up = randn(2 * shared, hidden, scale=hidden**-0.5).cuda()
    shared_down = randn(hidden, shared, scale=shared**-0.5).cuda()
    for tokens in (1, 8):
        x = randn(tokens, hidden, scale=1.0).cuda()
        # distinct router logits, exact in bf16 (multiples of 2**-6 in [-2, 2))
        router = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) * 2**-6 - 2.0
        logits = torch.cat([router, torch.randn(tokens, 1, generator=gen)], 1).to(dtype).cuda()
        chosen = torch.topk(router, top_k).indices.to(torch.int32)
        outs = {}
        for name, (slot_map, slot_w13, slot_w2) in maps.items():
            routed = torch.full((tokens, top_k), -7, dtype=torch.int32, device="cuda")
            outs[name] = sparse_moe_decode_offload(x, logits, slot_map.cuda(), slot_w13, slot_w2, host_w13, host_w2,
                                                   shared_gate_up, shared_down, top_k, True, routed)
            routed = routed.cpu()
            assert torch.equal(torch.where(routed >= 0, routed, -1 - routed), chosen)
            assert torch.equal(routed >= 0, slot_map[chosen.long()] >= 0)
        assert torch.equal(outs["all"], outs["none"]) and torch.equal(outs["all"], outs["half"])
        want = sparse_moe_decode_reference(x, logits, device_w13, device_w2, shared_gate_up, shared_down, top_k, True)
        assert_close(outs["half"], want)


def test_read_through_fill_at_qwen36_sizes_in_a_graph():
    """Qwen3.6-35B-A3B's layer in bf16 at 1 and 8 tokens, replayed from a CUDA graph, nothing
    cached and 12 slots lent: the forward is bit for bit the all-cached one, the claims are the
    reference's (a miss routed by several tokens claims one slot, none past the lent ones), each
    claimed slot holds its expert's host bytes and is mapped, and a second replay hits them."""
    from freetoken.kernels.moe_decode_offload import sparse_moe_decode_offload_reference
    from freetoken.kernels.triton.moe_decode_offload import sparse_moe_decode_offload

    gen = torch.Generator().manual_seed(1)
    experts, top_k, hidden, inter, shared, num_slots, lent = 256, 8, 2048, 512, 512, 32, 12
    dtype = torch.bfloat16

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    host_w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5).pin_memory()
    host_w2 = randn(experts, hidden, inter, scale=inter**-0.5).pin_memory()
    shared_gate_up = randn(2 * shared, hidden, scale=hidden**-0.5).cuda()
    shared_down = randn(hidden, shared, scale=shared**-0.5).cuda()
    ring = torch.randperm(num_slots, generator=gen)[:lent].tolist()
    for tokens in (1, 8):
        x = randn(tokens, hidden, scale=1.0).cuda()
        # Every token shares token 0's first four choices (repeated misses), the rest shuffled;
        # each row a permutation of distinct values, exact in bf16.
        first = torch.randperm(experts, generator=gen)
        top = torch.topk(first, 4).indices
        rest = torch.tensor([e for e in range(experts) if e not in set(top.tolist())])
        rows = [first]
        for _ in range(tokens - 1):
            row = first.clone()
            row[rest] = first[rest[torch.randperm(rest.numel(), generator=gen)]]
            rows.append(row)
        router = torch.stack(rows) * 2**-6 - 2.0
        logits = torch.cat([router, torch.randn(tokens, 1, generator=gen)], 1).to(dtype).cuda()
        resident = sparse_moe_decode_offload(
            x, logits, torch.arange(experts, dtype=torch.int32, device="cuda"), host_w13.cuda(), host_w2.cuda(),
            host_w13, host_w2, shared_gate_up, shared_down, top_k, True,
            torch.empty(tokens, top_k, dtype=torch.int32, device="cuda"))
        slot_map = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
        slot_w13 = torch.zeros(num_slots, 2 * inter, hidden, dtype=dtype, device="cuda")
        slot_w2 = torch.zeros(num_slots, hidden, inter, dtype=dtype, device="cuda")
        routed = torch.empty(tokens, top_k, dtype=torch.int32, device="cuda")
        fills = torch.empty_like(routed)
        lend = torch.tensor([0, 0, *ring], dtype=torch.int32, device="cuda")

        def forward():
            return sparse_moe_decode_offload(x, logits, slot_map, slot_w13, slot_w2, host_w13, host_w2,
                                             shared_gate_up, shared_down, top_k, True, routed, fills=fills, lend=lend)

        graph, out = _captured_then_lent(forward, fills, slot_map, lend, lent)
        want_state = [t.cpu() for t in (slot_map, slot_w13, slot_w2, lend)]
        want_routed, want_fills = routed.cpu(), fills.cpu()
        sparse_moe_decode_offload_reference(  # writes the expected routed ids, fills, map and lend
            x.cpu(), logits.cpu(), want_state[0], want_state[1], want_state[2], host_w13, host_w2, shared_gate_up.cpu(),
            shared_down.cpu(), top_k, True, want_routed, fills=want_fills, lend=want_state[3])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, resident)
        assert torch.equal(routed.cpu(), want_routed) and torch.equal(fills.cpu(), want_fills)
        assert torch.equal(slot_map.cpu(), want_state[0]) and torch.equal(lend.cpu(), want_state[3])
        claimed = (slot_map >= 0).nonzero().squeeze(1).cpu()
        assert claimed.numel() == min(lent, len(set((-1 - want_routed).flatten().tolist())))
        for expert in claimed.tolist():
            slot = int(slot_map[expert])
            assert torch.equal(slot_w13[slot].cpu(), host_w13[expert]) and torch.equal(slot_w2[slot].cpu(), host_w2[expert])
        graph.replay()  # the claimed experts hit now; nothing more is lent
        torch.cuda.synchronize()
        assert torch.equal(out, resident)
        hits = routed.cpu() >= 0
        assert torch.equal(hits, torch.isin(torch.where(hits, routed.cpu(), -1 - routed.cpu()), claimed))
        assert hits.any()


def _reserved_after_collecting() -> int:
    """What the allocator still holds once dropped engines are collected (their MoE blocks and
    stores reference each other) and its cached blocks released."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def test_offloaded_greedy_equals_resident_on_cuda():
    path = str(checkpoint(DEMO["qwen3_5_moe"]))
    common = dict(model=path, dtype="float32", device="cuda", page_size=PAGE_SIZE, max_prefill_length=16)
    prompts = [{"prompt_token_ids": p} for p in batch_prompts(DEMO["qwen3_5_moe"])]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    resident = [o.token_ids for o in LLM(**common).generate(prompts, params)]
    _reserved_after_collecting()
    offloaded_llm = LLM(**common, moe_offload=True, expert_cache_slots=16)
    assert offloaded_llm.runtime.engine.graph_runner is not None  # graphs on, as the resident engine's
    offloaded = [o.token_ids for o in offloaded_llm.generate(prompts, params)]
    assert offloaded == resident


def test_cache_sized_from_free_memory_under_the_cap():
    """No expert_cache_slots: the cache takes what the budget leaves after the KV pool (here every
    expert, the model is tiny); a dropped LLM gives its GPU memory back (the second of two: the
    first leaves the process's one-time buffers, 68 MiB on an H100); with --gpu-memory-gib the pools
    and the cache stay under the cap.

    The cap counts what the process's allocator holds, so it is set above what was held before (an
    xdist worker runs several tests: at a flat 3 GiB the budget came out negative on an H100 after
    some of them, session 35)."""
    path = str(checkpoint(DEMO["qwen3_5_moe"]))
    left = []
    for _ in range(2):
        llm = LLM(model=path, dtype="bfloat16", device="cuda", moe_offload=True, num_pages=64)
        config = llm.runtime.engine.model.config
        assert llm.runtime.stats().expert_cache.slots == config.num_experts * config.num_hidden_layers
        del llm
        left.append(_reserved_after_collecting())
    assert left[1] <= left[0], f"a second dropped LLM left {(left[1] - left[0]) / 2**20:.1f} MiB more reserved"
    capped = LLM(model=path, dtype="bfloat16", device="cuda", moe_offload=True, gpu_memory_gib=3.0 + left[1] / GiB,
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
    expert_bytes = 3 * 512 * 2048 * 2  # bf16 gate, up, down of one expert
    assert stats.bytes_copied % expert_bytes == 0 and stats.bytes_copied <= stats.misses * expert_bytes
    torch.cuda.synchronize()
    check_slot_map_invariant(llm.runtime.engine.offload)


def test_preset_shape_graphs_equal_eager_offloaded(tmp_path):
    """Qwen3.6-35B-A3B's layer shape (2 layers, dummy weights, bf16), batch 1, half the experts
    cached: the graph-replayed zero-copy decode gives the eager offloaded engine's greedy tokens (the
    decode kernel computes bit for bit alike whichever copy it reads, so the admissions' timing
    changes nothing)."""
    from freetoken.bench.presets import write_preset_dir

    model_dir = write_preset_dir("qwen3.6-35b-a3b", tmp_path / "preset", num_layers=2)
    common = dict(model=str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda", num_pages=64,
                  max_running_requests=1, max_model_len=512, seed=0)
    prompt = {"prompt_token_ids": list(range(1, 65))}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for name in ("eager", "graphs"):
        llm = LLM(**common, moe_offload=True, expert_cache_slots=256, enforce_eager=name == "eager")
        replays = _count_replays(llm) if name == "graphs" else None
        tokens[name] = llm.generate(prompt, params)[0].token_ids
        if replays is not None:
            assert len(replays) >= params.max_tokens - 2
            assert llm.runtime.stats().expert_cache.hits > 0
        del llm
        _reserved_after_collecting()
    assert tokens["graphs"] == tokens["eager"]


def test_nvfp4_preset_shape_offloaded_with_graphs(tmp_path):
    """NVFP4 experts (a dummy ModelOpt load of the Qwen3.6-35B-A3B shape, 2 layers) offloaded,
    packed in pinned host memory and in the slots: the zero-copy decode runs in graphs and gives
    the eager offloaded engine's greedy tokens; only misses are copied."""
    from freetoken.bench.presets import write_nvfp4_config, write_preset_dir

    model_dir = write_preset_dir("qwen3.6-35b-a3b", tmp_path / "preset", num_layers=2)
    write_nvfp4_config(model_dir)
    common = dict(model=str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda", num_pages=64,
                  max_running_requests=1, max_model_len=512, moe_offload=True, expert_cache_slots=256)
    prompt = {"prompt_token_ids": list(range(1, 65))}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for name in ("eager", "graphs"):
        llm = LLM(**common, enforce_eager=name == "eager")
        engine = llm.runtime.engine
        assert engine.offload.nvfp4 and engine.offload.zero_copy
        replays = _count_replays(llm) if name == "graphs" else None
        tokens[name] = llm.generate(prompt, params)[0].token_ids
        stats = llm.runtime.stats().expert_cache
        assert stats.hits > 0 and 0 < stats.bytes_copied <= stats.misses * engine.offload.expert_bytes
        if replays is not None:
            assert len(replays) >= params.max_tokens - 2
        torch.cuda.synchronize()
        check_slot_map_invariant(engine.offload)
        del llm, engine
        _reserved_after_collecting()
    assert tokens["graphs"] == tokens["eager"]


def test_zero_copy_nvfp4_decode_kernel_at_qwen36_sizes():
    """The NVFP4 variant at the Qwen3.6-35B-A3B layer's sizes: every expert in a slot, none, or half
    of them in scattered slots give the same bits, close to the resident NVFP4 block's reference."""
    from freetoken.kernels.nvfp4 import sparse_moe_decode_nvfp4_reference
    from freetoken.kernels.triton.moe_decode_offload import sparse_moe_decode_offload_nvfp4
    from kernel_checks import assert_close

    gen = torch.Generator().manual_seed(1)
    experts, top_k, hidden, inter, shared = 256, 8, 2048, 512, 512

    def nvfp4(*shape):
        return _random_nvfp4(gen, *shape)

    host = [p.pin_memory() for p in nvfp4(experts, 2 * inter, hidden) + nvfp4(experts, hidden, inter)]
    device = [p.cuda() for p in host]
    shared_parts = [p.cuda() for p in nvfp4(2 * shared, hidden) + nvfp4(hidden, shared)]
    cached = torch.randperm(experts, generator=gen)[: experts // 2]
    slots = torch.randperm(160, generator=gen)[: cached.numel()]
    half_map = torch.full((experts,), -1, dtype=torch.int32)
    half_map[cached] = slots.to(torch.int32)
    half = []
    for part in device:
        rows = torch.zeros((160, *part.shape[1:]), dtype=torch.uint8 if part.dtype == torch.float8_e4m3fn else part.dtype,
                           device="cuda")
        source = part.view(torch.uint8) if part.dtype == torch.float8_e4m3fn else part
        rows[slots.cuda()] = source[cached.cuda()]
        half.append(rows.view(part.dtype))
    maps = {"all": (torch.arange(experts, dtype=torch.int32), device),
            "none": (torch.full((experts,), -1, dtype=torch.int32), device), "half": (half_map, half)}
    for tokens in (1, 8):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
        router = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) * 2**-6 - 2.0
        logits = torch.cat([router, torch.randn(tokens, 1, generator=gen)], 1).to(torch.bfloat16).cuda()
        outs = {}
        for name, (slot_map, slot_parts) in maps.items():
            routed = torch.full((tokens, top_k), -7, dtype=torch.int32, device="cuda")
            outs[name] = sparse_moe_decode_offload_nvfp4(x, logits, slot_map.cuda(), *slot_parts, *host,
                                                         *shared_parts, top_k, True, routed)
            assert torch.equal((routed >= 0).cpu(), slot_map[torch.topk(router, top_k).indices] >= 0)
        assert torch.equal(outs["all"], outs["none"]) and torch.equal(outs["all"], outs["half"])
        want = sparse_moe_decode_nvfp4_reference(x.float(), logits.float(), *device, *shared_parts, top_k, True)
        assert_close(outs["half"].float(), want, dtype=torch.bfloat16)


def test_trace_routing_and_decode_counters_under_graphs(tmp_path):
    """Qwen3.6-35B-A3B's layer shape (2 layers, dummy weights, bf16), batch 1, half the experts
    cached, the routers driven along the fitted trace (``bench --routing trace``): graph replays
    read the bias buffer updated between steps (the same greedy tokens as eager), and the decode
    counters the bench reads add up (one zero-copy read per missed use at batch 1, the misses filled
    read-through, the settles timed)."""
    from dataclasses import asdict

    from freetoken.bench.presets import write_preset_dir
    from freetoken.bench.routing_trace import TraceRouting

    model_dir = write_preset_dir("qwen3.6-35b-a3b", tmp_path / "preset", num_layers=2)
    common = dict(model=str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda", num_pages=64,
                  max_running_requests=1, max_model_len=512, seed=0, moe_offload=True, expert_cache_slots=256)
    prompt = {"prompt_token_ids": list(range(1, 65))}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens, counters = {}, {}
    for name in ("eager", "graphs"):
        llm = LLM(**common, enforce_eager=name == "eager")
        engine = llm.runtime.engine
        driver = TraceRouting(engine.model, seed=0)
        launch = engine.launch
        engine.launch = lambda plan, launch=launch, driver=driver: (driver.before(plan), launch(plan))[1]
        if engine.graph_runner is not None:
            engine.graph_runner.capture()
        tokens[name] = llm.generate(prompt, params)[0].token_ids
        assert driver.steps >= params.max_tokens - 2
        counters[name] = asdict(engine.offload.counters)
        expert_bytes = engine.offload.expert_bytes
        del llm, engine
        _reserved_after_collecting()
    assert tokens["graphs"] == tokens["eager"]
    for c in counters.values():
        assert c["decode_forwards"] >= params.max_tokens - 2 and c["decode_hits"] > 0
        assert c["zero_copy_bytes"] == c["decode_misses"] * expert_bytes
        # the misses are filled read-through (experts.lend): no copy
        assert 0 < c["read_through_fills"] <= c["decode_misses"]
        assert c["settle_seconds"] > 0


def test_read_through_fill_nvfp4_at_qwen36_sizes_in_a_graph():
    """The NVFP4 layer of Qwen3.6-35B-A3B at 1 and 8 tokens, its experts in span views (pinned host
    spans, a device span cache) as the offload holds them, replayed from a CUDA graph with nothing
    cached and 12 slots lent: bit for bit the all-resident block, the reference's claims, each
    claimed slot's span the expert's host span, and a second replay hits them."""
    from expert_spans import in_span
    from freetoken.experts.span import SpanLayout
    from freetoken.kernels.moe_decode_offload import _claim
    from freetoken.kernels.triton.moe_decode_offload import sparse_moe_decode_offload_nvfp4

    gen = torch.Generator().manual_seed(2)
    experts, top_k, hidden, inter, shared, num_slots, lent = 256, 8, 2048, 512, 512, 32, 12

    def nvfp4(*shape):
        return _random_nvfp4(gen, *shape)

    host_parts = nvfp4(experts, 2 * inter, hidden) + nvfp4(experts, hidden, inter)
    layout = SpanLayout.of(host_parts)
    host_spans = layout.empty(experts, "cpu", pin=True)
    host_spans.zero_()  # the padding between parts as in the zeroed cache: whole spans compare
    host = layout.views(host_spans)
    for view, part in zip(host, host_parts):
        view.copy_(part)
    resident = in_span([p.cuda() for p in host_parts])
    shared_parts = [p.cuda() for p in nvfp4(2 * shared, hidden) + nvfp4(hidden, shared)]
    ring = torch.randperm(num_slots, generator=gen)[:lent].tolist()
    for tokens in (1, 8):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
        router = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) * 2**-6 - 2.0
        router[1:, :] = router[0]  # every token routes as token 0: repeated misses claim one slot each
        logits = torch.cat([router, torch.randn(tokens, 1, generator=gen)], 1).to(torch.bfloat16).cuda()
        want = sparse_moe_decode_offload_nvfp4(
            x, logits, torch.arange(experts, dtype=torch.int32, device="cuda"), *resident, *host, *shared_parts,
            top_k, True, torch.empty(tokens, top_k, dtype=torch.int32, device="cuda"))
        slot_map = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
        cache = layout.empty(num_slots, "cuda")
        cache.zero_()
        routed = torch.empty(tokens, top_k, dtype=torch.int32, device="cuda")
        fills = torch.empty_like(routed)
        lend = torch.tensor([0, 0, *ring], dtype=torch.int32, device="cuda")

        def forward():
            return sparse_moe_decode_offload_nvfp4(x, logits, slot_map, *layout.views(cache), *host, *shared_parts,
                                                   top_k, True, routed, fills=fills, lend=lend)

        graph, out = _captured_then_lent(forward, fills, slot_map, lend, lent)
        torch.cuda.synchronize()
        want_routed = torch.topk(router, top_k).indices.to(torch.int32)
        want_fills, want_lend = torch.empty_like(want_routed), lend.cpu().clone()
        claims = _claim(-1 - want_routed, want_fills, want_lend)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(routed.cpu(), -1 - want_routed) and torch.equal(fills.cpu(), want_fills)
        assert torch.equal(lend.cpu(), want_lend) and len(claims) == min(lent, top_k)
        for expert, slot in claims:
            assert int(slot_map[expert]) == slot
            assert torch.equal(cache[slot].cpu(), host_spans[expert])
        graph.replay()  # the claimed experts hit now; nothing more is lent
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert int((routed[0] >= 0).sum()) == len(claims)
