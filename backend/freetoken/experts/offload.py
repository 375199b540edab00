"""The offloaded experts of one model: every layer's routed-expert weights in host memory and the
one device cache of expert slots all layers share.

The models build their MoE blocks through one factory (``experts.store.make_store``); while
``building(offload)`` is active it places each layer's experts in host memory and registers the
layer here, so no model file knows about offloading. Once the weights are loaded and the pools
sized, ``allocate`` makes the device cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch

from freetoken.experts.cache import CacheCounters, SlotTable
from freetoken.experts.eviction import make_policy
from freetoken.experts.slots import DeviceSlots

logger = logging.getLogger(__name__)


class HostExperts(Protocol):
    num_experts: int

    def predict(self, x: torch.Tensor) -> list[int]:
        """The experts this layer's router would pick for ``x`` (distinct, in routing order)."""

    def host_parts(self) -> list[torch.Tensor]:
        """The layer's expert weights in host memory, each ``[E, ...]``."""

    def is_nvfp4(self) -> bool: ...


class ExpertOffload:
    def __init__(self, policy: str, pin: bool, prefetch: bool = False) -> None:
        """``pin``: keep the host weights in page-locked memory (CUDA: asynchronous copies at full
        PCIe speed, 55 GB/s pinned against 20 GB/s pageable on the H200). ``prefetch``: while a layer
        computes, copy in the experts the next layer's router picks for this layer's input."""
        self.policy = policy
        self.pin = pin
        self.prefetch = prefetch
        self.layers: list[HostExperts] = []
        self.table: SlotTable | None = None
        self.slots: DeviceSlots | None = None
        self.nvfp4 = False
        self._parts: list[list[torch.Tensor]] = []

    def register(self, layer: HostExperts) -> int:
        """A new layer's index in the cache's keys."""
        self.layers.append(layer)
        return len(self.layers) - 1

    @property
    def expert_bytes(self) -> int:
        """Device bytes of one expert (the same in every layer)."""
        return sum(p[0].nbytes for p in self.layers[0].host_parts())

    @property
    def num_experts(self) -> int:
        """Experts of one layer."""
        return self.layers[0].num_experts

    @property
    def num_slots(self) -> int:
        return 0 if self.table is None else self.table.num_slots

    def allocate(self, num_slots: int, device: torch.device) -> None:
        """The device cache of ``num_slots`` experts, after loading (NVFP4 loading replaces the dense
        host weights by packed ones, which are pinned here)."""
        kinds = {layer.is_nvfp4() for layer in self.layers}
        if len(kinds) != 1:
            raise ValueError("moe_offload: every layer's experts must be stored alike (all NVFP4 or all dense)")
        self.nvfp4 = kinds.pop()
        self._parts = [layer.host_parts() for layer in self.layers]
        shapes = {tuple((p.shape, p.dtype) for p in parts) for parts in self._parts}
        if len(shapes) != 1:
            raise ValueError("moe_offload: the layers' experts differ in shape; one cache cannot hold them")
        if self.pin:
            for parts in self._parts:
                for p in parts:
                    if not p.is_pinned():
                        p.data = p.data.pin_memory()
        self.table = SlotTable(num_slots, make_policy(self.policy), self.expert_bytes)
        self.slots = DeviceSlots(self._parts[0], num_slots, len(self.layers), device)
        logger.info(
            "expert cache: %d slots of %.2f MiB (%.2f GiB) for %d layers x %d experts (%.1f%%), policy %s",
            num_slots, self.expert_bytes / 2**20, self.slots.nbytes / 2**30, len(self.layers), self.num_experts,
            100 * num_slots / (len(self.layers) * self.num_experts), self.policy,
        )

    def begin(self, layer: int, experts: list[int]) -> list[list[int]]:
        """A layer's routed experts: their passes (``SlotTable.passes``), the first one's copies queued."""
        groups = self._table().passes(layer, experts)
        self.bring_in(layer, groups[0])
        return groups

    def prefetch_next(self, layer: int, x: torch.Tensor, running: list[int]) -> None:
        """With ``prefetch``: queue the copies of the experts layer ``layer + 1``'s router picks for
        ``x`` (this layer's MoE input; a second sync), in slots ``running`` (this layer's) leaves."""
        following = layer + 1
        if not self.prefetch or following >= len(self.layers):
            return
        predicted = self.layers[following].predict(x)
        placed, evicted = self._table().prefetch(following, predicted, {(layer, e) for e in running})
        assert self.slots is not None
        self.slots.fill(following, self._parts[following], placed, evicted, ahead=True)

    def bring_in(self, layer: int, experts: list[int]) -> None:
        placed, evicted = self._table().admit(layer, experts)
        assert self.slots is not None
        self.slots.fill(layer, self._parts[layer], placed, evicted)

    def slot_of(self, layer: int, expert: int) -> int:
        slot = self._table().slot_of((layer, expert))
        assert slot is not None, f"expert {expert} of layer {layer} is not cached"
        return slot

    @property
    def counters(self) -> CacheCounters:
        return self._table().counters

    def _table(self) -> SlotTable:
        if self.table is None:
            raise RuntimeError("the expert cache is used before ExpertOffload.allocate")
        return self.table


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
