"""Which cached expert gives up its device slot when a missing one must come in.

The expert cache keeps one policy for all layers; it tells the policy every routed use of an expert
(a hit or a miss), every expert that became resident, and asks it for a victim when it needs a slot.
``protected`` are the experts the layer being computed needs: they must stay until it ran.

Policies (``POLICIES``; measured on a routing trace fitted to Qwen3 MoE statistics in
docs/benchmarks.md, "Expert cache policies (issue 11)": ``benchmarks/expert_cache.py``, a replay
that fills every miss at once, layer by layer, not ``bench/offload_sim.py``'s read-through decode):

* ``lru``: least recently used, the baseline.
* ``lrfu``: least recently/frequently used (Lee et al., IEEE Trans. Computers 2001): each access
  adds 1 to an expert's score, and scores halve every ``half_life`` forward passes. At batch 1 it
  ranks about as LRU does; where LRU (and ARC) thrash, when one step's experts (the union over a
  batch) approach the cache size and LRU evicts exactly what the next step needs, it keeps the
  experts routed step after step and gives up those routed once: 0% -> 52% hits at batch 16 with a
  quarter of Qwen3.6's experts resident, 23% fewer misses with half. The default (``DEFAULT_POLICY``).
* ``arc``: adaptive replacement cache (Megiddo & Modha, FAST 2003), as Fate uses
  (https://arxiv.org/abs/2502.12224): recency and frequency lists balanced by ghost hits.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol

ExpertKey = tuple[int, int]  # (layer index, expert id)

_REBASE_WEIGHT = 2.0**500
_ALL_PROTECTED = "every cached expert is needed by the layer being computed: the cache is too small"


class EvictionPolicy(Protocol):
    def access(self, keys: Sequence[ExpertKey]) -> None:
        """Routed experts of one step (hits and misses): one layer's, or several layers' of one
        forward in layer order (a zero-copy decode forward's, settled at once), in routing order."""

    def insert(self, key: ExpertKey) -> None:
        """``key`` now holds a device slot."""

    def evict(self, protected: Container[ExpertKey]) -> ExpertKey:
        """Choose a resident key not in ``protected``, forget it and return it."""

    def discard(self, key: ExpertKey) -> None:
        """Resident ``key`` gives up its slot by the cache's choice (``SlotTable``'s evict-behind):
        forget it as ``evict`` would have."""


def _pop_oldest(order: OrderedDict[ExpertKey, None], protected: Container[ExpertKey]) -> ExpertKey | None:
    for key in order:
        if key not in protected:
            del order[key]
            return key
    return None


class LRUPolicy:
    """Least recently used: the baseline the other policies are measured against."""

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first

    def access(self, keys: Sequence[ExpertKey]) -> None:
        for key in keys:
            if key in self._order:
                self._order.move_to_end(key)

    def insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def evict(self, protected: Container[ExpertKey]) -> ExpertKey:
        key = _pop_oldest(self._order, protected)
        if key is None:
            raise MemoryError(_ALL_PROTECTED)
        return key

    def discard(self, key: ExpertKey) -> None:
        self._order.pop(key, None)


class LRFUPolicy:
    """Evict the resident expert with the smallest exponentially decayed access count.

    Time is counted in forward passes: a pass starts when ``access`` sees a layer index not above
    the last one of the previous call (the cache walks the layers in order each step). Scores are kept as
    ``sum_i 2**((t_i - base) / half_life)`` over the accesses ``t_i``: decaying every score by the
    same factor does not change their order, so a score changes only when its expert is accessed
    (one addition), and only grows; ``base`` moves up every few hundred half-lives, rescaling all
    scores, before the weights overflow. The heap holds one entry per resident expert with its
    score when pushed, a lower bound of its score now; ``evict`` re-pushes stale entries it pops until the top is current,
    which is then the true minimum. So ``access`` is O(1) per key and ``insert`` / ``evict`` are
    amortised O(log n). Scores are kept for evicted experts too (at most layers x experts of them),
    so an expert that comes back resumes its history instead of starting cold.
    """

    def __init__(self, half_life: float = 12.0) -> None:
        if not half_life > 0:
            raise ValueError(f"LRFUPolicy half_life must be > 0 forward passes, got {half_life}")
        self._half_life = half_life
        self._weight = 1.0  # 2 ** ((step - base) / half_life): what an access adds now
        self._base = 0
        self._score: dict[ExpertKey, float] = {}
        self._resident: set[ExpertKey] = set()
        self._heap: list[tuple[float, int, ExpertKey]] = []  # (score when pushed, tie-break, key)
        self._held: list[tuple[float, int, ExpertKey]] = []  # resident, protected at the last evict
        self._tie = itertools.count()
        self._step = 0
        self._last_layer: int | None = None

    def access(self, keys: Sequence[ExpertKey]) -> None:
        if not keys:
            return
        layer = keys[0][0]
        if self._last_layer is not None and layer <= self._last_layer:
            self._step += 1
            self._weight = 2.0 ** ((self._step - self._base) / self._half_life)
            if self._weight > _REBASE_WEIGHT:
                self._rebase()
        self._last_layer = keys[-1][0]
        weight, score = self._weight, self._score
        for key in keys:
            score[key] = score.get(key, 0.0) + weight

    def _rebase(self) -> None:
        """Divide every score by the current weight (amortised O(1): once per ~500 half-lives)."""
        scale = 1.0 / self._weight
        self._score = {key: value * scale for key, value in self._score.items()}
        self._base, self._weight = self._step, 1.0
        self._heap = [(self._score[key], next(self._tie), key) for key in self._resident]
        heapq.heapify(self._heap)
        self._held = []

    def insert(self, key: ExpertKey) -> None:
        if key in self._resident:
            return
        self._resident.add(key)
        score = self._score.setdefault(key, self._weight)
        heapq.heappush(self._heap, (score, next(self._tie), key))

    def evict(self, protected: Container[ExpertKey]) -> ExpertKey:
        # Protected experts popped off the heap wait in ``_held`` instead of going back at once: the
        # cache evicts many times for one layer with the same ``protected``, and the layer's own
        # newly inserted experts have the smallest scores, so re-pushing them every call would cost
        # O(layer's experts x log n) per eviction.
        # Entries of keys no longer resident (``discard``; or a key re-inserted since, which pushed a
        # second entry) are dropped as they come up.
        resident = self._resident
        held = [entry for entry in self._held if entry[2] in protected and entry[2] in resident]
        for entry in self._held:
            if entry[2] not in protected and entry[2] in resident:
                heapq.heappush(self._heap, (self._score[entry[2]], next(self._tie), entry[2]))
        self._held = held
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[2]
            current = self._score[key]
            if key not in resident:
                continue
            if entry[0] != current:
                heapq.heappush(self._heap, (current, next(self._tie), key))
            elif key in protected:
                self._held.append(entry)
            else:
                self._resident.remove(key)
                return key
        raise MemoryError(_ALL_PROTECTED)

    def discard(self, key: ExpertKey) -> None:
        self._resident.discard(key)  # its heap entry is dropped when it comes up


class ARCPolicy:
    """Adaptive replacement cache over the resident experts.

    ``T1`` holds experts used once since they came in, ``T2`` those used again; ``B1`` / ``B2``
    remember the keys recently evicted from each. A miss found in ``B1`` grows the target size ``p``
    of ``T1``, one found in ``B2`` shrinks it. The protocol does not pass the cache size, so it is
    taken as the number of resident experts when the first eviction is asked for (the cache evicts
    only when full). ``p`` adapts on ``insert``, after the eviction that made room, where ARC
    proper adapts before it: a one-miss lag. All operations are amortised O(1) plus the protected
    keys skipped.
    """

    def __init__(self) -> None:
        self._t1: OrderedDict[ExpertKey, None] = OrderedDict()
        self._t2: OrderedDict[ExpertKey, None] = OrderedDict()
        self._b1: OrderedDict[ExpertKey, None] = OrderedDict()
        self._b2: OrderedDict[ExpertKey, None] = OrderedDict()
        self._p = 0.0
        self._capacity = 0

    def access(self, keys: Sequence[ExpertKey]) -> None:
        for key in dict.fromkeys(keys):  # a key routed twice in one step is one use
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)

    def insert(self, key: ExpertKey) -> None:
        if key in self._b1:
            self._p = min(float(self._capacity), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        elif key not in self._t1 and key not in self._t2:
            self._t1[key] = None
        self._capacity = max(self._capacity, len(self._t1) + len(self._t2))
        while self._b1 and len(self._t1) + len(self._b1) > self._capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * self._capacity:
            self._b2.popitem(last=False)

    def evict(self, protected: Container[ExpertKey]) -> ExpertKey:
        self._capacity = max(self._capacity, len(self._t1) + len(self._t2))
        lists = [(self._t1, self._b1), (self._t2, self._b2)]
        if not (self._t1 and len(self._t1) > self._p):
            lists.reverse()
        for resident, ghost in lists:
            key = _pop_oldest(resident, protected)
            if key is not None:
                ghost[key] = None
                return key
        raise MemoryError(_ALL_PROTECTED)

    def discard(self, key: ExpertKey) -> None:
        for resident, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if resident.pop(key, 1) is None:  # was resident there: remembered as evict remembers
                ghost[key] = None


POLICIES: dict[str, type] = {"lru": LRUPolicy, "lrfu": LRFUPolicy, "arc": ARCPolicy}
DEFAULT_POLICY = "lrfu"


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"expert_cache_policy {name!r}: expected one of {sorted(POLICIES)}") from None
