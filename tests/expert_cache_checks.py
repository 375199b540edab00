"""Shared by the expert-offload tests (CPU and GPU): the slot map's invariant (``experts.slots``)."""

from __future__ import annotations

import torch

from freetoken.experts.offload import ExpertOffload


def check_slot_map_invariant(offload: ExpertOffload) -> None:
    """Every mapped entry's slot holds its expert's host weights, and the table agrees: each cached
    expert is mapped to its slot or its copy is still pending. (On CUDA: call after a sync.)"""
    slots, table = offload.slots, offload.table
    slot_map = slots.slot_map.cpu()
    for layer in range(len(offload.layers)):
        parts = offload.layers[layer].host_parts()
        for expert in range(offload.num_experts):
            key, slot = (layer, expert), int(slot_map[layer, expert])
            if slot >= 0:
                assert table.slot_of(key) == slot, f"{key} mapped to {slot}, the table says {table.slot_of(key)}"
                assert all(torch.equal(dst[slot].cpu(), src[expert]) for dst, src in zip(slots.tensors, parts))
            elif table.slot_of(key) is not None:
                assert slots.is_pending(key), f"{key} cached in the table but neither mapped nor pending"
