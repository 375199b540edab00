"""The expert cache's bookkeeping: which (layer, expert) holds which device slot, who gives a slot
up (the eviction policy; for an eager forward that routes most experts, first its passed layers'
experts: ``SlotTable.passed``), how a layer's experts are split into passes that fit, and the
counters.

Pure host state: the device tensors and copies are ``experts.slots``. One table serves all layers.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from freetoken.experts.eviction import EvictionPolicy, ExpertKey

# The read-through fill keeps at most num_slots / this slots lent ahead of the decode's misses
# (``ExpertOffload.allocate``); a cache under this many slots lends only slots already free (``lend``).
RESERVE_DIVISOR = 16
# An eager forward whose layers so far routed at least this share of their experts evicts behind
# (``SlotTable.passed``): it will route most of what is cached for the layers ahead too.
BEHIND_SHARE = 0.5


@dataclass
class CacheCounters:
    """Since start. A use is one layer's routed expert in one forward (however many tokens chose it):
    ``hits + misses`` is the number of uses. On the eager path a miss is copied in before the layer
    runs (``bytes_copied`` counts those copies); in a zero-copy decode forward a miss is read from
    host memory, and the kernel that read it writes it into a lent slot while one is left (the
    read-through fill, ``experts.lend``): no copy."""

    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    # The zero-copy decode forwards alone (``ExpertOffload.settle``), a part of the above: what a
    # benchmark of the steady decode judges (the eager path's prefill copies are the rest).
    decode_forwards: int = 0  # zero-copy decode forwards settled
    decode_hits: int = 0
    decode_misses: int = 0
    read_through_fills: int = 0  # decode misses the kernel that read them wrote into a lent slot (no copy)
    zero_copy_bytes: int = 0  # expert bytes the kernels read from host memory: missed (token, choice) pairs
    settle_seconds: float = 0.0  # host time the settles took (counting, telling the policy, booking claims)
    # The eager forwards' copies (prompt chunks, streamed ahead or not), CUDA only: device time the
    # copy stream spent copying (PCIe busy), and the compute stream spent waiting for them (exposed).
    eager_copy_seconds: float = 0.0
    eager_wait_seconds: float = 0.0


class SlotTable:
    """``num_slots`` device slots shared by every layer's experts."""

    def __init__(self, num_slots: int, policy: EvictionPolicy, expert_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"expert_cache_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.expert_bytes = expert_bytes  # host -> device bytes of one expert's copy
        self.policy = policy
        self.counters = CacheCounters()
        self._slot_of: dict[ExpertKey, int] = {}
        # Oldest first: a slot evicted ahead (``lend``) is handed out after those freed before it.
        self._free = deque(range(num_slots))
        self._prefetched: set[ExpertKey] = set()  # copied ahead of their layer, not used since
        # The eager forward in progress (``passed``): its layers run so far, their routed share,
        # and their experts as victims, least routed first: (tokens routed, tie, key).
        self._forward_layer = -1
        self._forward_shares: list[float] = []
        self._behind: list[tuple[int, int, ExpertKey]] = []
        self._tie = itertools.count()

    def passed(self, layer: int, counts: dict[int, int], num_experts: int) -> None:
        """An eager forward routed ``counts`` (expert -> tokens) in ``layer`` and queued the layer.
        Once its layers so far route ``BEHIND_SHARE`` of their experts or more, the slots its later
        layers' experts need (``admit``, ``prefetch``) are taken first from the experts of its
        layers before this one, least routed first (evict behind): such a forward will route most
        of the experts cached for the layers ahead as well, so a policy victim there (which looks
        oldest: the forward has not reached it) would be copied back in a few layers later. A
        layer index not above the last one starts a new forward."""
        if layer <= self._forward_layer:
            self._behind.clear()
            self._forward_shares.clear()
        self._forward_layer = layer
        self._forward_shares.append(len(counts) / num_experts)
        for expert, tokens in counts.items():
            heapq.heappush(self._behind, (tokens, next(self._tie), (layer, expert)))

    def _behind_victim(self, layer: int, protected: set[ExpertKey]) -> ExpertKey | None:
        """A cached expert of the eager forward's layers before ``layer``, least routed first, not
        in ``protected``; None when the forward does not evict behind or has none left."""
        if layer < self._forward_layer:  # a new forward, before its first ``passed``: the pool is stale
            self._behind.clear()
            self._forward_shares.clear()
            self._forward_layer = -1
        shares = self._forward_shares
        if not shares or sum(shares) < BEHIND_SHARE * len(shares):
            return None
        skipped = []
        victim = None
        while self._behind:
            entry = heapq.heappop(self._behind)
            key = entry[2]
            if key not in self._slot_of:
                continue  # evicted since
            if key[0] >= layer or key in protected:
                skipped.append(entry)
                continue
            victim = key
            break
        for entry in skipped:
            heapq.heappush(self._behind, entry)
        if victim is not None:
            self.policy.discard(victim)
        return victim

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def passes(self, layer: int, experts: list[int]) -> list[list[int]]:
        """``experts`` (one layer's routed ids, distinct) in groups of at most ``num_slots``, those
        already cached first: the first group's hits are never evicted before they run, and a
        layer that fits the cache runs in one pass."""
        self.policy.access([(layer, e) for e in experts])
        cached = [e for e in experts if (layer, e) in self._slot_of]
        ordered = cached + [e for e in experts if (layer, e) not in self._slot_of]
        return [ordered[i : i + self.num_slots] for i in range(0, len(ordered), self.num_slots)]

    def admit(self, layer: int, experts: list[int]) -> tuple[list[tuple[int, int]], list[ExpertKey]]:
        """Make every expert of ``experts`` (at most ``num_slots``) cached for ``layer``; count a hit
        for each one that was, a miss for each other. Returns ``(expert, slot)`` of the misses (their
        slots must be filled before the layer runs) and the keys evicted for them."""
        if len(experts) > self.num_slots:
            raise ValueError(f"{len(experts)} experts do not fit {self.num_slots} cache slots in one pass")
        protected = {(layer, e) for e in experts}
        placed: list[tuple[int, int]] = []
        evicted: list[ExpertKey] = []
        for expert in experts:
            key = (layer, expert)
            if key in self._slot_of:
                self.counters.hits += 1
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    self.counters.prefetch_hits += 1
                continue
            self.counters.misses += 1
            placed.append((expert, self._place(key, protected, evicted, behind=True)))
        return placed, evicted

    def count_decode(self, keys: list[ExpertKey], hits: np.ndarray) -> None:
        """One zero-copy decode forward's distinct routed experts (``RoutedRecord.uses``: layer by
        layer) and whether the kernel read each from a slot: counted, and told to the policy in
        one ``access`` (the read-through fill placed the misses: ``claim``)."""
        self.policy.access(keys)
        hit_count = int(np.count_nonzero(hits))
        self.counters.hits += hit_count
        self.counters.misses += len(keys) - hit_count
        if self._prefetched:
            found = self._prefetched.intersection(itertools.compress(keys, hits.tolist()))
            self._prefetched -= found
            self.counters.prefetch_hits += len(found)

    def settle_decode(self, keys: list[ExpertKey], hits: np.ndarray,
                      claims: Iterable[tuple[ExpertKey, int]]) -> int:
        """One zero-copy decode forward settled: its uses counted and told to the policy
        (``count_decode``), the slots its misses claimed booked (``claim``), and the ``decode_*``
        counters. Returns its misses (distinct routed experts read from host memory)."""
        counters = self.counters
        hits_before, misses_before = counters.hits, counters.misses
        self.count_decode(keys, hits)
        for key, slot in claims:
            if self.claim(key, slot):
                counters.read_through_fills += 1
        counters.decode_forwards += 1
        counters.decode_hits += counters.hits - hits_before
        counters.decode_misses += counters.misses - misses_before
        return counters.misses - misses_before

    def _evict_ahead(self, count: int) -> list[ExpertKey]:
        """Evict by the policy until ``count`` slots are free (at most every slot); returns the
        evicted keys."""
        evicted: list[ExpertKey] = []
        target = min(count, self.num_slots)
        while len(self._free) < target and self._slot_of:
            victim = self.policy.evict(())
            self._free.append(self._slot_of.pop(victim))
            self._prefetched.discard(victim)
            evicted.append(victim)
        return evicted

    def lend(self, count: int) -> tuple[list[int], list[ExpertKey]]:
        """Up to ``count`` free slots for the read-through fill (``experts.lend``), evicting by the
        policy for them (not in a cache under ``RESERVE_DIVISOR`` slots, which could not spare
        one: there only free slots are lent): they leave the free list until ``claim`` or
        ``give_back``. Returns the slots and the keys evicted (the caller unmaps them before any
        forward claims a slot)."""
        evicted = self._evict_ahead(count) if self.num_slots >= RESERVE_DIVISOR else []
        slots = [self._free.popleft() for _ in range(min(count, len(self._free)))]
        return slots, evicted

    def claim(self, key: ExpertKey, slot: int) -> bool:
        """A decode forward filled lent ``slot`` with ``key`` and mapped it there. False when the
        table had cached ``key`` meanwhile (an eager forward after it copied it in and mapped it
        elsewhere, the later map write): then ``slot`` is free again."""
        if key in self._slot_of:
            self._free.append(slot)
            return False
        self._slot_of[key] = slot
        self.policy.insert(key)
        return True

    def give_back(self, slots: list[int]) -> None:
        """Lent slots no forward claimed: free again."""
        self._free.extend(slots)

    def prefetch(
        self, layer: int, experts: list[int], running: set[ExpertKey]
    ) -> tuple[list[tuple[int, int]], list[ExpertKey]]:
        """Copy ahead the experts of ``layer`` predicted to be routed (not uses: no hit or miss), in
        the slots neither ``running`` (the layer being computed) nor the predicted ones hold; as
        many as fit, in the order given. Returns what ``admit`` does."""
        keep = running | {(layer, e) for e in experts}
        room = self.num_slots - sum(1 for key in keep if key in self._slot_of)
        missing = [e for e in experts if (layer, e) not in self._slot_of][: max(0, room)]
        placed: list[tuple[int, int]] = []
        evicted: list[ExpertKey] = []
        for expert in missing:
            key = (layer, expert)
            placed.append((expert, self._place(key, keep, evicted, behind=True)))
            self._prefetched.add(key)
            self.counters.prefetched += 1
        return placed, evicted

    def _place(self, key: ExpertKey, protected: set[ExpertKey], evicted: list[ExpertKey], behind: bool = False) -> int:
        """A slot for ``key``: a free one, else the policy's victim outside ``protected`` (the eager
        path, ``behind``: first the forward's own passed layers', ``_behind_victim``)."""
        self.counters.bytes_copied += self.expert_bytes
        if self._free:
            slot = self._free.popleft()
        else:
            victim = self._behind_victim(key[0], protected) if behind else None
            if victim is None:
                victim = self.policy.evict(protected)
            slot = self._slot_of.pop(victim)
            self._prefetched.discard(victim)
            evicted.append(victim)
        self._slot_of[key] = slot
        self.policy.insert(key)
        return slot
