"""Shared by the expert-offload tests (CPU and GPU): the slot map's invariant (``experts.slots``)."""

from __future__ import annotations

import torch

from freetoken.experts.offload import ExpertOffload


def check_slot_map_invariant(offload: ExpertOffload) -> None:
    """Every mapped entry's slot holds its expert's host weights, and the table agrees (or the entry
    is a read-through fill not settled yet): each cached expert is mapped to its slot. (On CUDA:
    call after a sync.)"""
    slots, table = offload.slots, offload.table
    slot_map = slots.slot_map.cpu()
    for layer in range(len(offload.layers)):
        parts = offload.layers[layer].host_parts()
        for expert in range(offload.num_experts):
            key, slot = (layer, expert), int(slot_map[layer, expert])
            if slot >= 0:
                # A read-through fill whose record is not settled yet: mapped by the kernel, the
                # slot still lent (``experts.lend``).
                unsettled = table.slot_of(key) is None and offload.lender is not None and slot in offload.lender.lent()
                assert unsettled or table.slot_of(key) == slot, \
                    f"{key} mapped to {slot}, the table says {table.slot_of(key)}"
                assert all(torch.equal(dst[slot].cpu(), src[expert]) for dst, src in zip(slots.tensors, parts))
            else:
                assert table.slot_of(key) is None, f"{key} cached in the table in slot {table.slot_of(key)}, not mapped"
