"""Which cached expert gives up its device slot when a missing one must come in.

The expert cache keeps one policy for all layers; it tells the policy every routed use of an expert
(a hit or a miss), every expert that became resident, and asks it for a victim when it needs a slot.
``protected`` are the experts the layer being computed needs: they must stay until it ran.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol

ExpertKey = tuple[int, int]  # (layer index, expert id)


class EvictionPolicy(Protocol):
    def access(self, keys: Sequence[ExpertKey]) -> None:
        """One layer's routed experts of one step (hits and misses), in routing order."""

    def insert(self, key: ExpertKey) -> None:
        """``key`` now holds a device slot."""

    def evict(self, protected: Container[ExpertKey]) -> ExpertKey:
        """Choose a resident key not in ``protected``, forget it and return it."""


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
        for key in self._order:
            if key not in protected:
                del self._order[key]
                return key
        raise MemoryError("every cached expert is needed by the layer being computed: the cache is too small")


POLICIES: dict[str, type] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"expert_cache_policy {name!r}: expected one of {sorted(POLICIES)}") from None
