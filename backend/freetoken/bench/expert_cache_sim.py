"""Replay a routing trace through an expert cache of S device slots shared by all layers.

The replay does what the offloaded expert store does per layer and step: tell the eviction policy
the layer's routed experts (the union over the batch, in routing order), then for each one that is
not resident evict a victim if the slots are full (never one of the layer's own experts) and make
it resident. ``BeladyPolicy`` knows the trace's future and evicts the expert used again last (the
offline optimum for a fixed-size cache, Belady 1966): the ceiling any online policy is judged by.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from freetoken.experts.eviction import EvictionPolicy, ExpertKey


def layer_keys(trace: np.ndarray) -> Iterator[list[ExpertKey]]:
    """Each (step, layer)'s distinct routed experts over the batch, in routing order, step-major.

    ``trace`` is ``[steps, batch, layers, top_k]`` (``routing_trace.generate_trace``).
    """
    steps, _, layers, _ = trace.shape
    for t in range(steps):
        for layer in range(layers):
            yield [(layer, int(e)) for e in dict.fromkeys(trace[t, :, layer, :].ravel().tolist())]


@dataclass(frozen=True)
class CacheRun:
    hits: int
    misses: int
    steps: int  # steps counted (after warm-up)
    batch: int

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    @property
    def misses_per_step(self) -> float:
        return self.misses / max(self.steps, 1)


def simulate_cache(
    trace: np.ndarray,
    slots: int,
    policy: EvictionPolicy,
    warmup: int = 0,
    missed: list[list[ExpertKey]] | None = None,
) -> CacheRun:
    """Hits and misses of ``policy`` over ``trace`` with ``slots`` slots, starting empty.

    Steps before ``warmup`` run but are not counted (the cache fills during them). ``missed``, when
    given, receives each (step, layer)'s missing experts, step-major, warm-up included.
    """
    steps, batch, layers, _ = trace.shape
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup must be in [0, steps={steps}), got {warmup}")
    resident: set[ExpertKey] = set()
    hits = misses = 0
    for i, keys in enumerate(layer_keys(trace)):
        counted = i // layers >= warmup
        policy.access(keys)
        protected = set(keys)
        if missed is not None:
            missed.append([key for key in keys if key not in resident])
        for key in keys:
            if key in resident:
                hits += counted
                continue
            misses += counted
            if len(resident) >= slots:
                resident.remove(policy.evict(protected))
            policy.insert(key)
            resident.add(key)
    return CacheRun(hits, misses, steps - warmup, batch)


class BeladyPolicy:
    """Offline optimum: evict the resident expert whose next use in ``trace`` is farthest away.

    Must see exactly the ``access`` calls of ``simulate_cache`` over the same trace.
    """

    def __init__(self, trace: np.ndarray) -> None:
        calls = list(layer_keys(trace))
        never = len(calls)
        following: dict[ExpertKey, int] = {}
        self._next: list[list[int]] = [[] for _ in calls]  # per call, per key: index of the key's next call
        for i in range(len(calls) - 1, -1, -1):
            self._next[i] = [following.get(key, never) for key in calls[i]]
            for key in calls[i]:
                following[key] = i
        self._call = -1
        self._next_use: dict[ExpertKey, int] = {}
        self._resident: set[ExpertKey] = set()
        self._heap: list[tuple[int, ExpertKey]] = []  # (-next use, key), stale entries allowed

    def access(self, keys: Sequence[ExpertKey]) -> None:
        self._call += 1
        for key, nxt in zip(keys, self._next[self._call]):
            self._next_use[key] = nxt
            if key in self._resident:
                heapq.heappush(self._heap, (-nxt, key))

    def insert(self, key: ExpertKey) -> None:
        self._resident.add(key)
        heapq.heappush(self._heap, (-self._next_use[key], key))

    def evict(self, protected: Container[ExpertKey]) -> ExpertKey:
        skipped = []
        victim = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[1]
            if key not in self._resident or -entry[0] != self._next_use[key]:
                continue
            if key in protected:
                skipped.append(entry)
                continue
            victim = key
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if victim is None:
            raise MemoryError("every cached expert is needed by the layer being computed")
        self._resident.discard(victim)
        return victim
