"""Per-slot state rows: the one copy that prefix caching's snapshots and restores use."""

from __future__ import annotations

import torch


def copy_rows(state: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``state[dst[i]] = state[src[i]]`` for every ``i`` at once: all rows are read before any is
    written, so a slot may be one pair's source and another pair's destination in the same call
    (a snapshot of a finished request's slot and a restore into that slot, reused). One gather and
    one scatter, no host sync, so it is capture-safe. ``dst`` must not repeat."""
    state.index_copy_(0, dst, state.index_select(0, src))
