"""Per-slot state rows: the pools' layout across layers, and the one copy that prefix caching's
snapshots and restores use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

StateShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class HasSlotState(Protocol):
    def state_shapes(self, num_slots: int, dtype: torch.dtype) -> StateShapes:
        """Each per-slot state tensor the layer reads, by attribute: its shape (``[num_slots, ...]``)
        and dtype."""


def copy_rows(state: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, dim: int = 0) -> None:
    """``state[dst[i]] = state[src[i]]`` (along ``dim``) for every ``i`` at once: all rows are read
    before any is written, so a slot may be one pair's source and another pair's destination in the
    same call (a snapshot of a finished request's slot and a restore into that slot, reused). One
    gather and one scatter, no host sync, so it is capture-safe. ``dst`` must not repeat."""
    state.index_copy_(dim, dst, state.index_select(dim, src))


class SlotStates:
    """The per-slot state of many layers, stacked: the layers' tensors of one attribute, shape and
    dtype are the views ``stack[i]`` of one ``[layers, num_slots, ...]`` tensor, so resetting or
    copying slots is one op per stack for all layers (Qwen3.6-35B-A3B's 30 Gated DeltaNet layers:
    2 launches, not 60, before a fresh prompt's forward). Each view is contiguous, laid out as a
    tensor of its own would be, so the kernels read it as before."""

    def __init__(self, layers: Iterable[HasSlotState], num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        groups: dict[tuple[str, tuple[int, ...], torch.dtype], list[HasSlotState]] = {}
        for layer in layers:
            for name, (shape, state_dtype) in layer.state_shapes(num_slots, dtype).items():
                groups.setdefault((name, tuple(shape), state_dtype), []).append(layer)
        self.stacks: list[torch.Tensor] = []
        for (name, shape, state_dtype), members in groups.items():
            stack = torch.zeros(len(members), *shape, dtype=state_dtype, device=device)
            for layer, view in zip(members, stack.unbind(0)):
                setattr(layer, name, view)
            self.stacks.append(stack)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the slots' rows of every stack (``index_fill_``: ``[slots] = 0`` would copy the 0
        to the device and synchronize)."""
        for stack in self.stacks:
            stack.index_fill_(1, slots, 0)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``copy_rows`` of every stack: slot ``src[i]``'s state to ``dst[i]``, all read first."""
        for stack in self.stacks:
            copy_rows(stack, src, dst, dim=1)

