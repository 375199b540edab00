"""The offloaded experts of one model: every layer's routed-expert weights in host memory and the
one device cache of expert slots all layers share.

The models build their MoE blocks through one factory (``experts.store.make_store``); while
``building(offload)`` is active it places each layer's experts in host memory and registers the
layer here, so no model file knows about offloading. Once the weights are loaded and the pools
sized, ``allocate`` makes the device cache.

Two paths run an offloaded layer. Decode forwards of at most ``decode_tokens`` tokens run the
zero-copy decode kernel (dense or NVFP4 experts, the shared expert stored alike): a miss is read from pinned host memory, nothing syncs,
so the step can be a CUDA graph; their routed ids reach the host after the step
(``experts.decode_log``) and ``settle`` counts them. Misses are filled read-through, dense and
NVFP4 experts alike: the kernel that reads a miss writes it into a slot the host lent it before
the step (``experts.lend``) and maps it, so the miss crosses PCIe once and the next step hits;
``settle`` only books those claims, and ``between_steps`` lends slots for the next ones. Larger
forwards read the routed ids on the host in each layer and copy the misses in before the layer
runs (``begin``), after taking back the slots lent and not claimed. Prompt chunks (``streams``)
also stream the next layer's experts in while a layer computes: at each layer's routing the host
applies the next layer's router to this layer's MoE input and queues the copies of what it picks
(``stream_ahead``), behind this layer's own remaining misses, so the copy stream always holds the
next layer's work; the first layer's are queued at the forward's start from the token embeddings
(``start_forward``). With ``stream_depth`` D > 1 each routing also applies the routers of the D - 1
layers after the next one to the same input and queues their picks behind (refining, for the
nearer ones, what an earlier routing streamed), so the copy stream holds D layers' work while the
host launches a layer. They go into cache slots, so the chunk's experts stay cached for its decode;
a chunk that routes most experts takes its victims from the layers it has passed
(``SlotTable.passed``), not from those ahead it still needs (docs/architecture.md has the measured
choice against a staging area).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import numpy as np
import torch

from freetoken.experts.cache import RESERVE_DIVISOR, CacheCounters, SlotTable
from freetoken.experts.decode_log import RoutedLog, RoutedRecord
from freetoken.experts.eviction import make_policy
from freetoken.experts.lend import SlotLender
from freetoken.experts.slots import DeviceSlots
from freetoken.experts.span import SpanLayout
from freetoken.experts.timeline import PrefillTimeline

logger = logging.getLogger(__name__)

DEMAND_WINDOW = 16  # decode forwards whose misses size the slots lent (``ExpertOffload._lend``)
# Eager forwards of at least this many tokens (prompt chunks) stream their experts in ahead of each
# layer (``ExpertOffload.streams``): their union of routed experts is large and stable, so the next
# layer's router on this layer's input predicts it well, and a wrong guess costs one expert's copy
# against the whole layer's. Smaller eager forwards (decode batches over ``DECODE_MAX_TOKENS``)
# stream only with ``prefetch``.
STREAM_MIN_TOKENS = 256


class HostExperts(Protocol):
    num_experts: int
    top_k: int

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """The top-k expert ids ``[T, k]`` this layer's router picks for ``x``, on the device."""

    def host_parts(self) -> list[torch.Tensor]:
        """The layer's expert weights in host memory, each ``[E, ...]``."""

    def host_span(self) -> torch.Tensor | None:
        """The uint8 ``[E, span]`` the parts are views of (NVFP4 experts, ``experts.span``), or None."""

    def pin_host(self) -> None:
        """Page-lock the host weights (the parts stay views of the span where there is one)."""

    def is_nvfp4(self) -> bool: ...

    def zero_copy_ready(self) -> bool:
        """The zero-copy decode kernel can run this layer (its shared expert stored as its experts)."""


class ExpertOffload:
    def __init__(self, policy: str, pin: bool, prefetch: bool = False, prefill_stream: bool = True,
                 stream_depth: int = 1) -> None:
        """``pin``: keep the host weights in page-locked memory (CUDA: asynchronous copies at full
        PCIe speed, 55 GB/s pinned against 20 GB/s pageable on the H200). ``prefill_stream``: eager
        forwards of at least ``STREAM_MIN_TOKENS`` tokens copy in the experts the next layer's
        router picks for this layer's input while this layer computes, the first layer's from the
        token embeddings at the forward's start (``streams``); ``prefetch``: every eager forward.
        ``stream_depth``: how many layers ahead a streaming forward copies (``ahead``)."""
        if stream_depth < 1:
            raise ValueError(f"prefill_stream_depth must be >= 1, got {stream_depth}")
        self.policy = policy
        self.pin = pin
        self.prefetch = prefetch
        self.prefill_stream = prefill_stream
        self.stream_depth = stream_depth
        self.layers: list[HostExperts] = []
        self.table: SlotTable | None = None
        self.slots: DeviceSlots | None = None
        self.log: RoutedLog | None = None  # the zero-copy decode forwards' routed ids
        self.lender: SlotLender | None = None  # with the zero-copy decode (its read-through fill)
        # Distinct misses of the last settled decode forwards: how many slots to keep lent.
        self._demand: deque[int] = deque(maxlen=DEMAND_WINDOW)
        self.nvfp4 = False
        self.timeline: PrefillTimeline | None = None  # ``record_timeline``

    def record_timeline(self) -> PrefillTimeline | None:
        """From now on the streamed eager forwards record their per-layer timeline (CUDA timing
        events, ``experts.timeline``; the bench's timed run). None on the CPU (no copy stream)."""
        if self.slots is None or self.slots.copy_stream is None:
            return None
        self.timeline = PrefillTimeline(len(self.layers))
        self.slots.timeline = self.timeline
        return self.timeline

    def stop_timeline(self) -> None:
        """The forwards record no timeline any more (what ``record_timeline`` returned keeps its own)."""
        self.timeline = None
        if self.slots is not None:
            self.slots.timeline = None

    def mark_routed(self, layer: int) -> None:
        """The host read ``layer``'s routed ids (the timeline's routing point)."""
        if self.timeline is not None:
            self.timeline.routed(layer, torch.cuda.current_stream(self.slots.device))

    def mark_computed(self, layer: int) -> None:
        """``layer``'s experts are queued (the timeline's end of the layer's experts)."""
        if self.timeline is not None:
            self.timeline.computed(layer, torch.cuda.current_stream(self.slots.device))

    def register(self, layer: HostExperts) -> int:
        """A new layer's index in the cache's keys."""
        self.layers.append(layer)
        return len(self.layers) - 1

    @property
    def expert_bytes(self) -> int:
        """Device bytes of one expert (the same in every layer): its span where it has one."""
        span = self.layers[0].host_span()
        return span.shape[1] if span is not None else sum(p[0].nbytes for p in self.layers[0].host_parts())

    @property
    def num_experts(self) -> int:
        """Experts of one layer."""
        return self.layers[0].num_experts

    @property
    def num_slots(self) -> int:
        return 0 if self.table is None else self.table.num_slots

    def allocate(self, num_slots: int, device: torch.device, decode_tokens: int = 0) -> None:
        """The device cache of ``num_slots`` experts, after loading (NVFP4 loading replaces the dense
        host weights by packed ones, placed in one span an expert, ``OffloadedExperts.place_span``;
        whatever is not page-locked yet is pinned here). Forwards of at most ``decode_tokens``
        tokens run the zero-copy decode kernel, when every layer's routed and shared experts are
        stored alike (both dense or both NVFP4)."""
        kinds = {layer.is_nvfp4() for layer in self.layers}
        if len(kinds) != 1:
            raise ValueError("moe_offload: every layer's experts must be stored alike (all NVFP4 or all dense)")
        self.nvfp4 = kinds.pop()
        if self.nvfp4:
            unspanned = [index for index, layer in enumerate(self.layers) if layer.host_span() is None]
            if unspanned:
                raise ValueError(f"moe_offload: the NVFP4 experts of layers {unspanned} are not placed in one span "
                                 "an expert (OffloadedExperts.place_span, run by the NVFP4 loader)")
        if self.pin:
            for layer in self.layers:
                layer.pin_host()
        parts = [layer.host_parts() for layer in self.layers]
        shapes = {tuple((p.shape, p.dtype) for p in layer_parts) for layer_parts in parts}
        if len(shapes) != 1:
            raise ValueError("moe_offload: the layers' experts differ in shape; one cache cannot hold them")
        spans = [layer.host_span() for layer in self.layers]
        layout = SpanLayout.of(parts[0]) if self.nvfp4 else None
        if layout is not None:
            for index, (layer_parts, span) in enumerate(zip(parts, spans)):
                if not layout.holds(span, layer_parts):
                    raise ValueError(f"moe_offload: layer {index}'s experts are not laid out as experts.span lays "
                                     "them out; the device cache could not copy them as one span")
        blocks = [layer_parts if span is None else [span] for layer_parts, span in zip(parts, spans)]
        self.table = SlotTable(num_slots, make_policy(self.policy), self.expert_bytes)
        self.slots = DeviceSlots(blocks, num_slots, device, layout)
        if decode_tokens > 0 and all(layer.zero_copy_ready() for layer in self.layers):
            self.log = RoutedLog(len(self.layers), decode_tokens, self.layers[0].top_k, device, read_through=True)
            self.lender = SlotLender(lender_capacity(num_slots), device)
        else:
            logger.info("moe_offload: no zero-copy decode (a layer's shared expert is stored unlike its "
                        "experts): every forward reads its routed ids on the host, without CUDA graphs")
        logger.info(
            "expert cache: %d slots of %.2f MiB (%.2f GiB) for %d layers x %d experts (%.1f%%), policy %s",
            num_slots, self.expert_bytes / 2**20, self.slots.nbytes / 2**30, len(self.layers), self.num_experts,
            100 * num_slots / (len(self.layers) * self.num_experts), self.policy,
        )

    @property
    def zero_copy(self) -> bool:
        """Decode forwards run the zero-copy kernel (no host sync: CUDA graphs can capture them)."""
        return self.log is not None

    def decodes(self, num_tokens: int) -> bool:
        """A forward of ``num_tokens`` tokens runs the zero-copy decode kernel in every offloaded layer."""
        return self.log is not None and num_tokens <= self.log.max_tokens

    def routed_out(self, layer: int, num_tokens: int) -> torch.Tensor:
        """Where layer ``layer``'s decode kernel writes its routed ids."""
        assert self.log is not None
        return self.log.out(layer, num_tokens)

    def fill_args(self, layer: int, num_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The read-through fill's ``(fills, lend)`` for layer ``layer``'s decode kernel, or
        ``(None, None)`` without the zero-copy decode."""
        if self.lender is None:
            return None, None
        assert self.log is not None
        return self.log.fills_out(layer, num_tokens), self.lender.lend

    def collect(self, num_tokens: int) -> None:
        """After a forward that ran the decode kernels (``decodes``): its routed ids of its first
        ``num_tokens`` (real) tokens go to the host, for ``settle``."""
        assert self.log is not None
        self.log.collect(num_tokens)

    def settle(self, wait: bool = False) -> None:
        """Count the routed ids that reached the host and book the slots their kernels claimed
        for their misses (the read-through fill). Runs between steps: when a step is resolved, and
        before one is launched. ``wait``: also the records still in flight."""
        if self.log is None:
            return
        for record in self.log.ready(wait):
            self._settle(record)

    def _settle(self, record: RoutedRecord) -> None:
        start = time.perf_counter()
        table = self._table()
        assert self.lender is not None  # the zero-copy decode always fills read-through
        claims = record.claims()
        self.lender.claimed(len(claims))
        misses = table.settle_decode(*record.uses(), (((layer, expert), slot) for layer, expert, slot in claims))
        self._demand.append(misses)
        table.counters.zero_copy_bytes += record.missed_pairs() * table.expert_bytes
        table.counters.settle_seconds += time.perf_counter() - start

    def between_steps(self) -> None:
        """Before a step is launched: settle what arrived, lend slots for the next misses."""
        if self.log is None:
            return
        self.settle()
        self._lend()

    def _lend(self) -> None:
        """Keep lent, for the next decode forwards' misses, twice the most distinct misses of the
        last ones (at most the lender's capacity), evicting ahead for them: none while the decode
        forwards miss nothing (a cache that holds what they route gives nothing up)."""
        if self.lender is None:
            return
        want = slots_to_lend(self.lender.capacity, self._demand, self.lender.outstanding)
        if want <= 0:
            return
        lent, evicted = self._table().lend(want)
        assert self.slots is not None
        self.slots.unmap(evicted)  # queued before the lend: no forward claims a slot still mapped
        self.lender.give(lent)

    def _revoke(self) -> None:
        """Before a forward that reads the map on the host: every decode record settled, and the
        slots lent and not claimed back in the table (which the eager path hands out)."""
        if self.lender is None:
            return
        self.settle(wait=True)
        self._table().give_back(self.lender.revoke())

    def begin(self, layer: int, experts: list[int]) -> list[list[int]]:
        """A layer's routed experts: their passes (``SlotTable.passes``), the first one's copies
        queued (the misses the stream did not bring in ahead)."""
        self._revoke()
        groups = self._table().passes(layer, experts)
        self.bring_in(layer, groups[0])
        return groups

    def streams(self, num_tokens: int) -> bool:
        """An eager forward of ``num_tokens`` tokens copies each layer's experts in ahead: while the
        layer before computes, those its router picks for that layer's input (``stream_ahead``)."""
        if self.decodes(num_tokens):
            return False
        return self.prefetch or (self.prefill_stream and num_tokens >= STREAM_MIN_TOKENS)

    def start_forward(self, embeddings: torch.Tensor) -> None:
        """At the start of an eager forward that ``streams``: queue the copies of the experts the
        first layer's router picks for the token embeddings (``embeddings``, ``[T, H]``; a sync),
        so they cross PCIe during the first layer's attention."""
        if self.timeline is not None:
            self.timeline.start(torch.cuda.current_stream(self.slots.device))
        layers = self.ahead(-1)
        ids = [self.layers[layer].route(embeddings) for layer in layers]
        predicted = [list(p) for p in distinct_experts(ids, self.num_experts)]
        self._revoke()
        self.stream_ahead(0, predicted, [])

    def ahead(self, layer: int) -> range:
        """The layers a streaming forward's copies reach at ``layer``'s routing (-1: at its start):
        the next ``stream_depth`` ones that exist."""
        return range(layer + 1, min(layer + 1 + self.stream_depth, len(self.layers)))

    def stream_ahead(self, first: int, predicted: list[list[int]], running: list[int]) -> None:
        """Queue the copies of the experts predicted for layers ``first``, ``first + 1``, ...
        (``predicted[i]`` for ``first + i``, most wanted first) that are not cached, nearest layer
        first (the copy stream runs them in order). Each layer's go into the slots left by the
        layer being computed (``running``, of ``first - 1``), its own predicted experts and every
        expert of the layers between (pending: queued or streamed ahead, not yet run), so a copy
        for a farther layer never overwrites a slot a nearer one still needs. Each layer's experts
        kernel waits for its own copies (``DeviceSlots.wait``), not for the others queued."""
        table = self._table()
        assert self.slots is not None
        keep = {(first - 1, e) for e in running}
        for layer, experts in enumerate(predicted, start=first):
            placed, evicted = table.prefetch(layer, experts, keep)
            self.slots.fill(layer, placed, evicted, ahead=True)
            keep |= {(layer, e) for e in range(self.num_experts)}

    def passed(self, layer: int, counts: dict[int, int]) -> None:
        """An eager forward's layer ``layer`` routed ``counts`` (expert -> tokens) and is queued: its
        experts become victims for the forward's later layers (``SlotTable.passed``)."""
        self._table().passed(layer, counts, self.num_experts)

    def bring_in(self, layer: int, experts: list[int]) -> None:
        placed, evicted = self._table().admit(layer, experts)
        assert self.slots is not None
        self.slots.fill(layer, placed, evicted)

    @property
    def counters(self) -> CacheCounters:
        """The cache's counters, with the timings of the eager copies completed so far."""
        counters = self._table().counters
        if self.slots is not None:
            copying, waiting = self.slots.eager_seconds()
            counters.eager_copy_seconds += copying
            counters.eager_wait_seconds += waiting
        return counters

    def _table(self) -> SlotTable:
        if self.table is None:
            raise RuntimeError("the expert cache is used before ExpertOffload.allocate")
        return self.table


def lender_capacity(num_slots: int) -> int:
    """The most slots the read-through fill keeps lent in a cache of ``num_slots``."""
    return max(1, num_slots // RESERVE_DIVISOR)


def slots_to_lend(capacity: int, demand: Iterable[int], outstanding: int) -> int:
    """How many more slots to lend before a decode forward (``ExpertOffload._lend``): twice the
    most distinct misses of the last settled decode forwards (``demand``), at most ``capacity``
    outstanding, less the ``outstanding`` ones (<= 0: none)."""
    return min(capacity, 2 * max(demand, default=0)) - outstanding


def distinct_experts(ids: list[torch.Tensor], num_experts: int) -> list[dict[int, int]]:
    """The distinct experts of each ``[T, k]`` tensor of routed ids with their token counts, most
    routed first (ties by id), through one device-to-host copy of the counts: ``num_experts``
    numbers each instead of ``T x k`` ids (65,536 at an 8k chunk, top-8: milliseconds of host time
    a layer)."""
    return [_ranked(row) for row in expert_counts(ids, num_experts)]


def expert_counts(ids: list[torch.Tensor], num_experts: int) -> np.ndarray:
    """``[len(ids), num_experts]`` tokens routed to each expert, on the host (the one sync)."""
    return torch.stack([torch.bincount(t.flatten(), minlength=num_experts) for t in ids]).cpu().numpy()


def _ranked(row: np.ndarray) -> dict[int, int]:
    """The experts ``row`` routes (count > 0) -> their counts, most routed first, ties by id: one
    stable sort of the whole count vector instead of a Python sort keyed per expert."""
    order = np.argsort(-row, kind="stable")
    order = order[: int(np.count_nonzero(row))]
    return dict(zip(order.tolist(), row[order].tolist()))


_BUILDING: ContextVar[ExpertOffload | None] = ContextVar("freetoken_expert_offload", default=None)


@contextmanager
def building(offload: ExpertOffload | None) -> Iterator[None]:
    """MoE blocks built meanwhile keep their experts in ``offload`` (None: resident)."""
    token = _BUILDING.set(offload)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def offload_being_built() -> ExpertOffload | None:
    return _BUILDING.get()
