"""Replay requests, a prompt chunk then decode steps, through the offloaded expert cache's own
bookkeeping (``experts.cache.SlotTable``, its eviction policy and ``experts.lend.SlotLender``), on
the CPU: the decode hit rate the engine's zero-copy path would see, the misses its read-through
fill writes into slots, and what a prefill does to the experts the decode keeps hot.

The replay calls what the engine calls, in the engine's order (``experts.offload``). Before every
step is launched (``ExpertOffload.between_steps``) the records of the decode steps launched two or
more before it are settled (the overlapped loop resolves step N after launching N + 1), then slots
are lent for the next misses (``ExpertOffload._lend``: twice the most distinct misses of the last
``DEMAND_WINDOW`` settled steps, at most the lender's capacity outstanding, evicting ahead by the
policy in a cache of ``RESERVE_DIVISOR`` slots or more), the evicted experts unmapped at once. A
decode step's kernel reads an expert from a slot if the slot map holds it at launch (a hit), else
from host memory (a miss); each layer's distinct misses, in routing order, claim the next lent
slots while any is left and are mapped there at once, the rest stay misses (no copy). Its record
is settled as ``ExpertOffload._settle`` does it: the uses counted and told to the policy, the
claims booked in the table. A prompt chunk first takes back the slots lent and not claimed (every
record settled, ``ExpertOffload._revoke``), then runs the eager path (``OffloadedExperts.prepare``):
per layer ``SlotTable.passes`` then ``admit`` of each pass; its copies are mapped at once. No
device, no copies: counts only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from freetoken.experts.cache import SlotTable
from freetoken.experts.eviction import EvictionPolicy, ExpertKey
from freetoken.experts.lend import SlotLender
from freetoken.experts.offload import DEMAND_WINDOW, lender_capacity, slots_to_lend

# A step's record is settled before the step this many launches after it (the overlapped loop
# resolves step N, and settles its routed ids, after launching N + 1).
SETTLE_LAG = 2


@dataclass
class DecodeSteps:
    """Per decode step: distinct routed uses, misses (read from host memory), and of those the
    read-through fills (misses the step's kernel wrote into a lent slot)."""

    uses: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    read_through_fills: list[int] = field(default_factory=list)

    def hit_rate(self, start: int = 0, stop: int | None = None) -> float:
        uses, misses = sum(self.uses[start:stop]), sum(self.misses[start:stop])
        return 1.0 - misses / max(uses, 1)

    def per_step(self, values: list[int], start: int = 0, stop: int | None = None) -> float:
        part = values[start:stop]
        return sum(part) / max(len(part), 1)


@dataclass
class _Record:
    """A decode step's routed experts as its kernel read them, on their way to the settle."""

    step: int  # its launch's index
    layers: list[tuple[list[int], list[bool]]]  # per layer: distinct experts in routing order, hits
    claims: list[tuple[ExpertKey, int]]  # (key, slot) of each read-through fill, in claim order


class OffloadReplay:
    """One cache of ``slots`` slots replaying requests in turn (batch 1)."""

    def __init__(self, slots: int, policy: EvictionPolicy, num_experts: int | None = None) -> None:
        """``num_experts``: of one layer, which ``prefill`` needs (its routed share decides whether
        it evicts behind, ``SlotTable.passed``)."""
        self.table = SlotTable(slots, policy, expert_bytes=1)
        self.num_experts = num_experts
        self.lender = SlotLender(lender_capacity(slots), torch.device("cpu"))
        self.visible: set[ExpertKey] = set()  # what the device's slot map holds (claims included)
        self._demand: deque[int] = deque(maxlen=DEMAND_WINDOW)  # distinct misses of settled steps
        self._records: deque[_Record] = deque()  # decode steps launched and not settled
        self._launches = 0  # steps launched so far, prompt chunks included

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
        self._launch()
        self._revoke()
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
        self.visible = set(self.table._slot_of)  # every claim is booked; the eager path maps its copies at once
        return copied

    def decode(self, steps: np.ndarray) -> DecodeSteps:
        """Decode steps, ``[steps, layers, top_k]`` routed ids, on the zero-copy path; the last
        steps' records stay unsettled until the next launch that settles them (as in the engine)."""
        out = DecodeSteps()
        for routed in steps:
            step = self._launches
            self._launch()
            record = self._run(step, routed)
            self._records.append(record)
            out.uses.append(sum(len(experts) for experts, _ in record.layers))
            out.misses.append(sum(hits.count(False) for _, hits in record.layers))
            out.read_through_fills.append(len(record.claims))
        return out

    def _launch(self) -> None:
        """Before a step is launched (``ExpertOffload.between_steps``): settle the records due,
        then lend slots for the next misses (``ExpertOffload._lend``)."""
        while self._records and self._records[0].step <= self._launches - SETTLE_LAG:
            self._settle(self._records.popleft())
        self._launches += 1
        want = slots_to_lend(self.lender.capacity, self._demand, self.lender.outstanding)
        if want <= 0:
            return
        lent, evicted = self.table.lend(want)
        self.visible.difference_update(evicted)  # unmapped before the lend: no forward claims a mapped slot
        self.lender.give(lent)

    def _run(self, step: int, routed: np.ndarray) -> _Record:
        """One decode step's kernels (``[layers, top_k]`` routed ids), layer after layer: a hit is
        an expert the map holds; each distinct miss claims the next lent slot while any is left
        (``kernels.moe_decode_offload._claim``) and is mapped there at once."""
        lend = self.lender.lend.tolist()  # [claimed, limit, ring...], as the kernels read it
        claimed, limit, ring = lend[0], lend[1], lend[2:]
        layers: list[tuple[list[int], list[bool]]] = []
        claims: list[tuple[ExpertKey, int]] = []
        for layer, ids in enumerate(routed.tolist()):
            experts = list(dict.fromkeys(ids))
            hits = [(layer, e) in self.visible for e in experts]
            for expert, hit in zip(experts, hits):
                if not hit and claimed < limit:
                    claims.append(((layer, expert), ring[claimed % len(ring)]))
                    claimed += 1
            layers.append((experts, hits))
        self.lender.lend[0] = claimed
        self.visible.update(key for key, _ in claims)
        return _Record(step, layers, claims)

    def _settle(self, record: _Record) -> None:
        """A decode step's record, as ``ExpertOffload._settle`` books it."""
        keys = [(layer, e) for layer, (experts, _) in enumerate(record.layers) for e in experts]
        hits = np.array([hit for _, hits in record.layers for hit in hits], dtype=bool)
        self.lender.claimed(len(record.claims))
        self._demand.append(self.table.settle_decode(keys, hits, record.claims))

    def _revoke(self) -> None:
        """Before an eager forward (``ExpertOffload._revoke``): every record settled, and the slots
        lent and not claimed back in the table."""
        while self._records:
            self._settle(self._records.popleft())
        self.table.give_back(self.lender.revoke())
