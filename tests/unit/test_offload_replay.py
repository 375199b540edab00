"""The offloaded-decode replay (``bench.offload_sim``) follows the engine's read-through fill: slots
are lent from the settled steps' misses, which lag two launches, and a miss claims a lent slot as
its step reads it (or stays a miss when none is left); a small cache lends only free slots."""

from __future__ import annotations

import numpy as np

from freetoken.bench.offload_sim import OffloadReplay
from freetoken.experts.eviction import make_policy


def test_replay_lends_from_settled_misses_and_fills_them_read_through():
    replay = OffloadReplay(32, make_policy("lrfu"))  # capacity 2 lent (32 // RESERVE_DIVISOR)
    steps = replay.decode(np.array([[[3, 4]]] * 5))  # one layer, top-2, the same experts each step
    # Nothing is lent until step 0's record is settled, before step 2's launch: its two misses
    # claim the two slots lent then, and step 3 hits both.
    assert steps.misses == [2, 2, 2, 0, 0] and steps.read_through_fills == [0, 0, 2, 0, 0]
    assert replay.table.slot_of((0, 3)) is not None and replay.table.slot_of((0, 4)) is not None
    counters = replay.table.counters
    assert (counters.decode_forwards, counters.read_through_fills) == (3, 2)  # steps 3 and 4 unsettled


def test_replay_evicts_ahead_for_the_lend_and_keeps_at_most_its_capacity_outstanding():
    replay = OffloadReplay(16, make_policy("lru"), num_experts=32)  # capacity 1
    replay.prefill(np.arange(16).reshape(8, 1, 2))  # layer 0's experts 0..15 fill the cache
    steps = replay.decode(np.array([[[20, 21]]] * 6))
    # One slot lent at a time, each evicting the least recently used: 20 claims it at step 2; the
    # next is lent only once step 2's claim is settled (before step 4), and 21 claims it.
    assert steps.misses == [2, 2, 2, 1, 1, 0] and steps.read_through_fills == [0, 0, 1, 0, 1, 0]
    assert replay.table.slot_of((0, 0)) is None and replay.table.slot_of((0, 1)) is None


def test_a_cache_under_reserve_divisor_slots_lends_only_free_slots():
    replay = OffloadReplay(4, make_policy("lrfu"), num_experts=8)
    replay.prefill(np.array([[[0, 1]], [[2, 3]]]))  # the four slots taken
    steps = replay.decode(np.array([[[5, 6]]] * 6))
    assert steps.misses == [2] * 6 and sum(steps.read_through_fills) == 0
    assert replay.prefill(np.array([[[5, 6]]])) == 2  # the prefill copies them in
    steps = replay.decode(np.array([[[5, 6]]] * 2))
    assert steps.misses == [0, 0]
