"""Replay requests, a prompt chunk then decode steps, through the offloaded expert cache's own
bookkeeping (``experts.cache.SlotTable`` and its eviction policy), on the CPU: the decode hit rate
the engine's zero-copy path would see, the copies it would queue, and what a prefill does to the
experts the decode keeps hot.

The replay calls what the engine calls. A prompt chunk runs the eager path
(``OffloadedExperts.prepare``): per layer ``SlotTable.passes`` then ``admit`` of each pass; its
copies are mapped at once. A decode step runs the zero-copy path: its
kernel reads an expert from a slot if the slot map had it at launch, else from host memory (a miss);
its routed ids are settled (``SlotTable.settle``) one step late, while the next step runs, so the
map a step sees is the table after the settle two steps before it. Evictions are unmapped at once;
fills into slots free before the settle (the reserve) are mapped for the step after next, fills into
slots evicted in the same settle one step later (their copies wait for the step in flight:
``experts.slots``). No device, no copies: counts only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from freetoken.experts.cache import SlotTable
from freetoken.experts.eviction import EvictionPolicy, ExpertKey

@dataclass
class DecodeSteps:
    """Per decode step: distinct routed uses, misses (read from host memory), fills queued."""

    uses: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    fills: list[int] = field(default_factory=list)

    def hit_rate(self, start: int = 0, stop: int | None = None) -> float:
        uses, misses = sum(self.uses[start:stop]), sum(self.misses[start:stop])
        return 1.0 - misses / max(uses, 1)

    def per_step(self, values: list[int], start: int = 0, stop: int | None = None) -> float:
        part = values[start:stop]
        return sum(part) / max(len(part), 1)


class OffloadReplay:
    """One cache of ``slots`` slots replaying requests in turn (batch 1)."""

    def __init__(self, slots: int, policy: EvictionPolicy, num_experts: int | None = None) -> None:
        """``num_experts``: of one layer, which ``prefill`` needs (its routed share decides whether
        it evicts behind, ``SlotTable.passed``)."""
        self.table = SlotTable(slots, policy, expert_bytes=1)
        self.num_experts = num_experts
        self.visible: set[ExpertKey] = set()  # what the slot map holds for the step being launched

    def prefill(self, prompt: np.ndarray, staged: bool = False) -> int:
        """A prompt chunk, ``[tokens, layers, top_k]`` routed ids, on the eager path (as
        ``OffloadedExperts.prepare``, evicting behind as it does: ``SlotTable.passed``); returns
        the experts it copies in. The engine's stream copies a layer's predicted experts into cache
        slots ahead of it: with a perfect prediction the table ends as admitting each layer's
        experts leaves it. ``staged``: the alternative of
        a staging area apart from the cache: the chunk reads what the cache holds and copies every
        other expert it routes into staging, which it leaves (the cache and its policy untouched).
        """
        if self.num_experts is None:
            raise ValueError("OffloadReplay.prefill needs num_experts (of one layer)")
        copied = 0
        for layer in range(prompt.shape[1]):
            ids, tokens = np.unique(prompt[:, layer].ravel(), return_counts=True)
            order = np.argsort(-tokens, kind="stable")  # most routed first, ties by id (``distinct_experts``)
            counts = {int(ids[i]): int(tokens[i]) for i in order}
            if staged:
                copied += sum(1 for e in counts if self.table.slot_of((layer, e)) is None)
                continue
            misses = self.table.counters.misses
            for group in self.table.passes(layer, list(counts)):
                self.table.admit(layer, group)
            self.table.passed(layer, counts, self.num_experts)
            copied += self.table.counters.misses - misses
        self.visible = set(self.table._slot_of)  # the eager path maps its copies at once
        return copied

    def decode(self, steps: np.ndarray) -> DecodeSteps:
        """Decode steps, ``[steps, layers, top_k]`` routed ids, on the zero-copy path."""
        out = DecodeSteps()
        layers = steps.shape[1]
        pending: dict[int, list[tuple[bool, ExpertKey, int]]] = defaultdict(list)  # step -> map updates
        for step in range(len(steps)):
            for add, key, slot in pending.pop(step, []):
                if not add:
                    self.visible.discard(key)
                elif self.table.slot_of(key) == slot:  # not evicted (nor moved) since
                    self.visible.add(key)
            per_layer = []
            uses = misses = 0
            for layer in range(layers):
                experts = list(dict.fromkeys(steps[step, layer].tolist()))
                hits = [(layer, e) in self.visible for e in experts]
                per_layer.append((layer, experts, hits))
                uses += len(experts)
                misses += hits.count(False)
            free_before = set(self.table._free)
            # Settled while step + 1 runs: its unmaps land before step + 2, its fills by then or after.
            fills, evicted = self.table.settle(per_layer)
            for key in evicted:
                pending[step + 2].append((False, key, -1))
            for layer, expert, slot in fills:
                pending[step + (2 if slot in free_before else 3)].append((True, (layer, expert), slot))
            out.uses.append(uses)
            out.misses.append(misses)
            out.fills.append(len(fills))
        for step in sorted(pending):  # the next request's prefill maps what is left (``commit(wait=True)``)
            for add, key, slot in pending[step]:
                if not add:
                    self.visible.discard(key)
                elif self.table.slot_of(key) == slot:
                    self.visible.add(key)
        return out
