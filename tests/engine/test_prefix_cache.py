"""Prefix caching against transformers for both model families: prompts sharing a long prefix
(a common system text with different questions, an exact repeat, a prompt extending another),
sent one after another (a warm cache) and all together, chunked and unchunked; a hit computes
only the uncached tokens; eviction, preemption and snapshot-slot pressure keep outputs exact;
the pools return to full after ``reset_prefix_cache``. The prompts: tests/prefix_prompts.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.plan import StepPlan
from oracle import CASES, DEMO, EOS, PAGE_SIZE, Case, checkpoint, reference_greedy
from prefix_prompts import WARM_HITS, shared_prefix_prompts as _prompts

MAX_TOKENS = 8


def _llm(case: Case, max_prefill_length: int = 16, **kwargs) -> LLM:
    return LLM(model=str(checkpoint(case)), dtype="float32", device="cpu",
               max_prefill_length=max_prefill_length, page_size=PAGE_SIZE, **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], ignore_eos: bool = False):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _assert_equal_transformers(case: Case, prompt: list[int], output) -> None:
    assert output.error is None, output.error
    expected = reference_greedy(checkpoint(case), prompt, MAX_TOKENS)
    assert output.token_ids[: len(expected)] == expected, f"prompt of {len(prompt)} tokens diverged"


def _assert_pools_full(llm: LLM) -> None:
    stats = llm.runtime.stats()
    assert (stats.pages_used, stats.slots_used, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)


# Every checkpoint, chunked (chunks end at the snapshot boundaries) and unchunked (snapshots
# inside the chunk: taken by the forward for Qwen3.5, by a cut chunk for Qwen4-Exp); in the
# default suite, both families both ways, with the checkpoint whose QSA blocks span pages (the
# prefix alignment is two pages there) chunked. The others are marked slow.
ACROSS_PAGES = Case("qwen4_exp", "blocks_across_pages")
DEFAULT_RUNS = {(DEMO["qwen3_5_moe"], 16), (ACROSS_PAGES, 16), (DEMO["qwen3_5_moe"], 8192), (DEMO["qwen4_exp"], 8192)}
WARM_RUNS = [
    pytest.param(case, chunk, id=f"{'chunked16' if chunk == 16 else 'unchunked'}-{case}",
                 marks=() if (case, chunk) in DEFAULT_RUNS else pytest.mark.slow)
    for chunk in (16, 8192) for case in CASES
]


@pytest.mark.parametrize("case, max_prefill_length", WARM_RUNS)
def test_shared_prefixes_one_after_another_then_together_equal_transformers(case, max_prefill_length):
    llm = _llm(case, max_prefill_length)
    prompts = _prompts()
    for name, prompt in prompts.items():
        (output,) = _generate(llm, [prompt])
        _assert_equal_transformers(case, prompt, output)
        assert output.num_cached_tokens == WARM_HITS[name], name
    stats = llm.runtime.stats().prefix_cache
    assert stats.hit_tokens == sum(WARM_HITS.values())
    assert stats.queried_tokens == sum(len(p) for p in prompts.values())
    assert stats.snapshot_slots_used > 0 and stats.cached_pages > 0
    outputs = _generate(llm, list(prompts.values()))  # all together into the warm cache: every one hits
    for prompt, output in zip(prompts.values(), outputs):
        _assert_equal_transformers(case, prompt, output)
        assert output.num_cached_tokens > 0
    _assert_pools_full(llm)


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
@pytest.mark.parametrize("max_prefill_length", [16, 8192], ids=["chunked16", "unchunked"])
def test_shared_prefixes_together_into_an_empty_cache_equal_transformers(case, max_prefill_length):
    """Admitted in the same or neighbouring steps: pages and snapshots join the index while others
    of the batch are still computing the same prefix."""
    llm = _llm(case, max_prefill_length)
    prompts = list(_prompts().values())
    for prompt, output in zip(prompts, _generate(llm, prompts)):
        _assert_equal_transformers(case, prompt, output)
    _assert_pools_full(llm)


@pytest.mark.parametrize("case, overlap", [
    pytest.param(DEMO["qwen3_5_moe"], True, id="overlap-qwen3_5_moe"),
    pytest.param(DEMO["qwen4_exp"], False, id="sync-qwen4_exp"),
])
def test_a_hit_computes_only_the_uncached_tokens(case, overlap):
    """Counted in the forward: a prompt hitting ``h`` cached tokens runs ``len - h`` prompt tokens
    through the model, then one per decode after its first token."""
    llm = _llm(case, overlap_schedule=overlap)
    model = llm.runtime.engine.model
    forward = model.forward
    counted: list[int] = []

    def counting(batch):
        counted.append(batch.num_tokens)
        return forward(batch)

    model.forward = counting
    for name, prompt in _prompts().items():
        counted.clear()
        (output,) = _generate(llm, [prompt], ignore_eos=True)
        assert output.num_cached_tokens == WARM_HITS[name]
        assert sum(counted) == len(prompt) - WARM_HITS[name] + MAX_TOKENS - 1, name
        _assert_equal_transformers(case, prompt, output)


@pytest.mark.parametrize("case, prompt_forwards", [
    pytest.param(DEMO["qwen3_5_moe"], 1, id="in-forward-qwen3_5_moe"),
    pytest.param(DEMO["qwen4_exp"], 2, id="cut-qwen4_exp"),
])
def test_a_snapshot_inside_the_chunk_costs_no_forward(case, prompt_forwards):
    """Unchunked: a prompt extending A by 30 tokens (65) hits A's snapshot (32) and snapshots its
    own last full page (64), inside its one chunk. Qwen3.5 takes that snapshot in the forward
    (``StepPlan.snapshots``), so the prompt runs as ONE forward; Qwen4-Exp cuts the chunk there
    (two). Either way the repeat then hits at 64, and every output is transformers'."""
    llm = _llm(case, 8192)
    model, engine = llm.runtime.engine.model, llm.runtime.engine
    forward, launch = model.forward, engine.launch
    counted: list[int] = []
    plans: list[StepPlan] = []
    model.forward = lambda batch: counted.append(batch.num_tokens) or forward(batch)
    engine.launch = lambda plan: plans.append(plan) or launch(plan)
    a = _prompts()["A"]
    extended = a + [random.Random(1).randrange(EOS - 3) for _ in range(30)]
    (output,) = _generate(llm, [a], ignore_eos=True)
    _assert_equal_transformers(case, a, output)
    for expected_hit in (32, 64):  # the extension, then its repeat
        counted.clear()
        plans.clear()
        (output,) = _generate(llm, [extended], ignore_eos=True)
        assert output.num_cached_tokens == expected_hit
        _assert_equal_transformers(case, extended, output)
        assert sum(counted) == len(extended) - expected_hit + MAX_TOKENS - 1
        if expected_hit == 32:
            assert len(counted) == prompt_forwards + MAX_TOKENS - 1
            in_forward = [(s.offset, p.rows[s.row].num_computed) for p in plans for s in p.snapshots]
            assert in_forward == ([(32, 32)] if prompt_forwards == 1 else [])
    _assert_pools_full(llm)


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
def test_eviction_under_memory_pressure_keeps_outputs_exact(case):
    """16 usable pages: a request needs up to 14, so cached pages are evicted all along, and one
    snapshot slot: every new snapshot evicts the last one. Hits still happen where they survive."""
    llm = _llm(case, num_pages=16, max_snapshot_slots=1)
    prompts = list(_prompts().values())
    for prompt in prompts:
        (output,) = _generate(llm, [prompt])
        _assert_equal_transformers(case, prompt, output)
    outputs = _generate(llm, prompts)  # together: they also wait for each other's pages
    for prompt, output in zip(prompts, outputs):
        _assert_equal_transformers(case, prompt, output)
    cache = llm.runtime.scheduler.prefix_cache
    assert cache.counters.evicted_pages > 0 and cache.counters.hit_tokens > 0
    assert llm.runtime.stats().prefix_cache.snapshot_slots_used == 1
    _assert_pools_full(llm)


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
def test_preempted_requests_recompute_from_their_cached_prefix(case, monkeypatch):
    """Pages for two requests' prompts and outputs: four requests decoding together run the pool
    dry, so some are preempted; readmitted, they restart from the longest cached prefix (their
    own prompt's, snapshotted before they were preempted) and still equal transformers."""
    prompts = [p for name, p in _prompts().items() if name != "A again"]
    usable = 2 * -(-(len(prompts[-1]) + MAX_TOKENS) // PAGE_SIZE)
    llm = _llm(case, num_pages=usable)
    scheduler = llm.runtime.scheduler
    take_hit = scheduler._take_hit
    readmitted_at: list[int] = []

    def recording(req, hit):
        take_hit(req, hit)
        if req.num_preemptions:
            readmitted_at.append(req.num_computed)

    monkeypatch.setattr(scheduler, "_take_hit", recording)
    outputs = _generate(llm, prompts, ignore_eos=True)
    assert scheduler.num_preemptions > 0 and any(readmitted_at)
    for prompt, output in zip(prompts, outputs):
        _assert_equal_transformers(case, prompt, output)
    _assert_pools_full(llm)


def test_reset_prefix_cache_returns_the_pools_to_full():
    case = DEMO["qwen3_5_moe"]
    llm = _llm(case)
    prompts = _prompts()
    for prompt in prompts.values():
        _generate(llm, [prompt])
    runtime = llm.runtime
    cache = runtime.scheduler.prefix_cache
    assert cache.num_cached_pages > 0 and cache.num_snapshots > 0
    assert runtime.scheduler.pages.num_free < runtime.scheduler.pages.capacity
    llm.reset_prefix_cache()
    stats = runtime.stats()
    assert (stats.prefix_cache.cached_pages, stats.prefix_cache.snapshot_slots_used) == (0, 0)
    assert runtime.scheduler.pages.num_free == runtime.scheduler.pages.capacity
    (output,) = _generate(llm, [prompts["C"]])  # a cold cache again
    assert output.num_cached_tokens == 0
    _assert_equal_transformers(case, prompts["C"], output)


def test_prefix_caching_off_reports_no_cache_and_no_snapshot_slots(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", page_size=PAGE_SIZE,
              enable_prefix_caching=False)
    prompt = _prompts()["A"]
    outputs = _generate(llm, [prompt, prompt])
    assert [o.num_cached_tokens for o in outputs] == [0, 0] and outputs[0].token_ids == outputs[1].token_ids
    assert llm.runtime.stats().prefix_cache is None
    assert llm.runtime.engine.pool_sizes.num_snapshot_slots == 0


def test_snapshot_and_restore_copy_every_state_row():
    """``copy_slots`` reads every pair's source before writing any destination."""
    for case in DEMO.values():
        llm = _llm(case, max_running_requests=3)
        model = llm.runtime.engine.model
        states = [t for t in (*(m.conv_state for m in model.modules() if hasattr(m, "conv_state")),
                              *(m.recurrent_state for m in model.modules() if hasattr(m, "recurrent_state")),
                              getattr(model, "ngram_context", None)) if t is not None]
        assert states
        for state in states:
            state.copy_(torch.arange(state.shape[0]).view(-1, *[1] * (state.dim() - 1)).expand_as(state))
        model.copy_slots(torch.tensor([1, 2, 4]), torch.tensor([2, 5, 1]))  # 2 is a source and a destination
        for state in states:
            assert state[:, ...].flatten(1)[:, 0].tolist() == [0, 4, 1, 3, 4, 2, 6][: state.shape[0]]


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
def test_parallel_samples_prefill_the_prompt_once(case):
    """n = 3 (``Runtime.make_requests``, as the serving layer runs it): the siblings wait for the
    first sample's prefill and hit its prompt's last full page; greedy, all three are transformers'."""
    llm = _llm(case)
    runtime = llm.runtime
    model = runtime.engine.model
    forward = model.forward
    counted: list[int] = []
    model.forward = lambda batch: counted.append(batch.num_tokens) or forward(batch)
    prompt = _prompts()["D"]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for request in runtime.make_requests("r", prompt, params):
        runtime.submit(request)
    finished = {}
    while runtime.has_work:
        finished.update({o.request_id: o for o in runtime.step() if o.finished})
    hit = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
    assert [finished[f"r#{i}"].num_cached_tokens for i in range(3)] == [0, hit, hit]
    assert sum(counted) == len(prompt) + 2 * (len(prompt) - hit) + 3 * (MAX_TOKENS - 1)
    for i in range(3):
        _assert_equal_transformers(case, prompt, finished[f"r#{i}"])
    _assert_pools_full(llm)


def test_plans_snapshot_after_the_boundary_and_restore_before_the_first_step(demo_checkpoint):
    """The plans themselves: a chunk ends at the snapshot boundary, the next plan copies the slot
    into a snapshot slot; a hit's first plan restores it (no reset) and maps the shared pages."""
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", max_prefill_length=16,
              page_size=PAGE_SIZE, overlap_schedule=False)
    runtime = llm.runtime
    plans = []
    launch = runtime.engine.launch
    runtime.engine.launch = lambda plan: plans.append(plan) or launch(plan)
    prompt = _prompts()["A"]  # 35 tokens: its last full page before the last token ends at 32
    _generate(llm, [prompt])
    assert [(p.rows[0].num_computed, p.rows[0].num_new) for p in plans[:3]] == [(0, 16), (16, 16), (32, 3)]
    slot = plans[0].rows[0].slot
    (snapshot_copy,) = plans[2].copy_slots
    assert snapshot_copy[0] == slot and snapshot_copy[1] >= runtime.engine.pool_sizes.num_slots
    assert not any(p.copy_slots for p in plans[3:]) and not any(p.copy_slots for p in plans[:2])
    pages = [page for p in plans[:2] for page in p.page_updates[0].pages]
    plans.clear()
    (output,) = _generate(llm, [prompt])
    first = plans[0]
    assert first.copy_slots == [(snapshot_copy[1], first.rows[0].slot)] and first.reset_slots == []
    assert (first.rows[0].num_computed, first.rows[0].num_new) == (32, 3) and output.num_cached_tokens == 32
    (update,) = first.page_updates
    assert update.start == 0 and list(update.pages[:8]) == pages and len(update.pages) == 9
