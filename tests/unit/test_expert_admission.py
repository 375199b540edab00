"""Admission of zero-copy decode misses (``lrfu-admit``) and the offloaded-decode replay
(``bench.offload_sim``): the replay's one-step lag matches the engine's ordering, and admission
cuts the copies where routing has no token persistence without losing hits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from freetoken.bench.offload_sim import OffloadReplay
from freetoken.bench.routing_trace import QWEN3_ROUTING, generate_trace
from freetoken.experts.cache import SlotTable
from freetoken.experts.eviction import AdmittingLRFUPolicy, make_policy


def _warm(policy: AdmittingLRFUPolicy, hot: list[tuple[int, int]], passes: int) -> None:
    for _ in range(passes):
        policy.access(hot)


def test_admits_compares_the_long_run_scores_and_changes_nothing():
    policy = AdmittingLRFUPolicy()
    hot = [(0, 0), (0, 1)]
    for key in hot:
        policy.insert(key)
    _warm(policy, hot, 20)
    policy.access([(0, 2)])  # once: its long-run score is below either resident's
    assert not policy.admits((0, 2), protected={(0, 2)})
    _warm(policy, [(0, 2), (0, 1)], 60)  # now routed every pass, (0, 0) not since
    assert policy.admits((0, 2), protected={(0, 2)})
    assert policy.evict({(0, 2)}) == (0, 0)  # admits put its peeked victim back


def test_observe_leaves_a_cold_miss_in_host_memory_once_the_cache_was_full():
    table = SlotTable(2, make_policy("lrfu-admit"), expert_bytes=10)
    for _ in range(10):  # two hot experts fill the cache (free slots: admitted without asking)
        placed, _ = table.observe(0, [0, 1], [table.slot_of((0, e)) is not None for e in (0, 1)])
    assert {table.slot_of((0, 0)), table.slot_of((0, 1))} == {0, 1}
    table.reserve(1, set())  # the cache has evicted once: from now on a miss must earn its slot
    (victim_slot,) = list(table._free)
    placed, evicted = table.observe(1, [5], [False])
    assert placed == [] and evicted == [] and table.counters.not_admitted == 1
    for _ in range(80):  # routed every pass: it earns the slot
        placed, _ = table.observe(1, [5], [table.slot_of((1, 5)) is not None])
        if placed:
            break
    assert placed == [(5, victim_slot)]


def test_replay_maps_a_miss_two_steps_later():
    replay = OffloadReplay(8, make_policy("lrfu"))
    steps = replay.decode(np.array([[[3, 4]]] * 4))  # one layer, top-2, the same experts each step
    # Step 0 misses both; its settle runs while step 1 runs (which misses again); step 2 hits.
    assert steps.misses == [2, 2, 0, 0] and steps.fills == [2, 0, 0, 0]


def test_admission_cuts_copies_without_losing_hits_when_routing_has_no_persistence():
    model = replace(QWEN3_ROUTING, request_skew=0.0, persistence=0.0, drift_share=0.0, request_tokens=10_000)
    trace = generate_trace(4, 32, 4, 400, seed=0, model=model)[:, 0]
    runs = {}
    for name in ("lrfu", "lrfu-admit"):
        replay = OffloadReplay(64, make_policy(name), num_experts=32)  # half of 4 x 32 experts
        replay.prefill(trace[:32])
        runs[name] = replay.decode(trace[32:])
    assert sum(runs["lrfu-admit"].fills) < 0.6 * sum(runs["lrfu"].fills)
    assert runs["lrfu-admit"].hit_rate(100) >= runs["lrfu"].hit_rate(100)
