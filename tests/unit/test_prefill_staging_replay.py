"""The CPU replay's two places for a prompt chunk's copies (``bench.offload_sim``,
``benchmarks/prefill_staging_sim.py``): into the cache, or into a staging area that leaves it."""

from __future__ import annotations

import numpy as np

from freetoken.bench.offload_sim import OffloadReplay
from freetoken.experts.eviction import make_policy


def test_staged_chunk_copies_its_misses_and_leaves_the_cache():
    replay = OffloadReplay(4, make_policy("lrfu"), num_experts=8)
    replay.prefill(np.array([[[0, 1], [2, 3]]]))  # two layers, top-2: all four cached after
    cached, misses = dict(replay.table._slot_of), replay.table.counters.misses
    chunk = np.array([[[0, 5], [2, 6]], [[1, 5], [3, 7]]])  # layer 0 routes 0, 5, 1; layer 1 2, 6, 3, 7
    assert replay.prefill(chunk, staged=True) == 3  # 5, 6 and 7 are not cached
    assert replay.table._slot_of == cached and replay.table.counters.misses == misses


def test_inserted_chunk_copies_into_the_cache():
    replay = OffloadReplay(4, make_policy("lrfu"), num_experts=8)
    chunk = np.array([[[0, 1], [2, 3]]])
    assert replay.prefill(chunk) == 4 and replay.prefill(chunk) == 0  # the second chunk hits
    assert set(replay.table._slot_of) == {(0, 0), (0, 1), (1, 2), (1, 3)}
