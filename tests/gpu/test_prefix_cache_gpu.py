"""Prefix caching on CUDA with the defaults (decode CUDA graphs, overlap scheduling): prefix hits
(restores and snapshots copied in ``Engine._prepare``, outside the replayed graphs) give the tokens
prefix caching off gives, which are transformers' float32 greedy ones; the copies never make the
host wait for the device."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.plan import PlanRow, RowSnapshot, StepPlan
from oracle import DEMO, PAGE_SIZE, checkpoint, reference_greedy
from prefix_prompts import WARM_HITS, shared_prefix_prompts

pytestmark = pytest.mark.gpu

MAX_TOKENS = 8
OPTIONS = dict(dtype="float32", device="cuda", max_prefill_length=16, page_size=PAGE_SIZE,
               max_running_requests=8)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _run(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """The prompts one after another (a warm cache), then all together: tokens and cached counts."""
    prompts = list(shared_prefix_prompts().values())
    outputs = [llm.generate({"prompt_token_ids": p}, PARAMS)[0] for p in prompts]
    outputs += llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [o.token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
@pytest.mark.parametrize("max_prefill_length", [16, 8192], ids=["chunked16", "unchunked"])
def test_prefix_hits_with_graphs_and_overlap_equal_prefix_caching_off(case, max_prefill_length):
    """Unchunked, Qwen3.5's snapshots lie inside the chunks: the Triton delta-rule kernel writes them."""
    path = str(checkpoint(case))
    options = {**OPTIONS, "max_prefill_length": max_prefill_length}
    cached = LLM(model=path, **options)
    engine = cached.runtime.engine
    runner = engine.graph_runner
    assert runner is not None and runner.graphs and cached.runtime.overlap
    replays = []
    replay = runner.run
    runner.run = lambda batch: replays.append(batch.num_requests) or replay(batch)
    in_forward = []
    launch = engine.launch
    engine.launch = lambda plan: in_forward.extend(plan.snapshots) or launch(plan)
    tokens, num_cached = _run(cached)
    assert replays, "no decode step was replayed"
    assert num_cached[:5] == list(WARM_HITS.values()) and all(n > 0 for n in num_cached[5:])
    if not engine.model.snapshots_in_forward:
        assert not in_forward, "a family without in-forward snapshots got one"
    elif max_prefill_length > 16:
        assert in_forward, "unchunked, the snapshots lie inside the chunks: the forward takes them"
    reference_tokens, reference_cached = _run(LLM(model=path, enable_prefix_caching=False, **options))
    assert tokens == reference_tokens and not any(reference_cached)
    for prompt, out in zip(shared_prefix_prompts().values(), tokens):
        expected = reference_greedy(checkpoint(case), prompt, MAX_TOKENS)
        assert out[: len(expected)] == expected
    stats = cached.runtime.stats()
    assert (stats.pages_used, stats.slots_used) == (0, 0)


def test_slot_copies_do_not_synchronize():
    llm = LLM(model=str(checkpoint(DEMO["qwen4_exp"])), **OPTIONS)
    engine = llm.runtime.engine
    snapshot = llm.runtime.engine.pool_sizes.num_slots
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine._prepare(StepPlan(copy_slots=[(1, snapshot), (snapshot + 1, 2)], reset_slots=[3]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_in_forward_snapshot_layout_does_not_synchronize():
    llm = LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), **OPTIONS)
    engine = llm.runtime.engine
    snapshot = engine.pool_sizes.num_slots
    plan = StepPlan(rows=[PlanRow(1, 0, 70, True, tuple(range(70)))], snapshots=[RowSnapshot(0, 2, snapshot),
                                                                               RowSnapshot(0, 64, snapshot + 1)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layout = engine._prefill_snapshots(plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert layout.segment_cu.tolist() == [0, 2, 64, 70] and layout.num_chunks == 3
