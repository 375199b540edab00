"""What every model family provides to the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from freetoken.batch import ForwardBatch
from freetoken.kernels.prefill_snapshots import PrefillSnapshots
from freetoken.layers.weights import WeightTarget


class CausalLM(nn.Module, ABC):
    """A decoder over a flat token batch, owning its layers' KV pages and recurrent-state slots.

    The engine sizes the pools from ``kv_bytes_per_page`` and ``state_bytes_per_slot``, then calls
    ``allocate_state`` once; ``reset_slots`` zeroes the state of requests that start over and
    ``copy_slots`` copies it between slots (prefix-cache snapshots).
    """

    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Every per-slot state of the model can be written by a prefill forward at a boundary inside
    # a chunk (``prefill_snapshots``), so prefix-cache snapshots need no cut chunk.
    snapshots_in_forward: bool = False

    @abstractmethod
    def weight_targets(self) -> dict[str, WeightTarget]:
        """Canonical checkpoint names (``embed_tokens.weight``, ``layers.3.mlp.gate.weight``, ...) -> targets."""

    @abstractmethod
    def kv_bytes_per_page(self, page_size: int) -> int: ...

    @abstractmethod
    def state_bytes_per_slot(self) -> int: ...

    @abstractmethod
    def allocate_state(self, num_pages: int, page_size: int, num_slots: int) -> None: ...

    @abstractmethod
    def reset_slots(self, slots: torch.Tensor) -> None: ...

    @abstractmethod
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every per-slot state tensor's row ``src[i]`` to ``dst[i]`` (all read before any is
        written; ``layers.slot_state.copy_rows``): a prefix-cache snapshot or restore."""

    def prefix_alignment(self, page_size: int) -> int:
        """Positions a cached prefix may end at are multiples of this: the KV of a prefix that ends
        there lives entirely in the prefix's own pages, so a request continuing it never writes one
        of them."""
        return page_size

    def prefill_snapshots(
        self, query_lens: Sequence[int], snapshots: Sequence[tuple[int, int, int]]
    ) -> PrefillSnapshots:
        """The device layout of ``snapshots`` = ``(prefill row, offset, slot)`` in a step whose
        prefill rows have ``query_lens`` new tokens (``ForwardBatch.snapshots``)."""
        raise NotImplementedError(f"{type(self).__name__} takes no snapshots inside a forward")

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits ``[len(batch.logits_indices), vocab_size]``."""

    def tied_weights(self) -> dict[str, str]:
        """Parameters that may be absent from a checkpoint and copied from another: ``{missing: source}``."""
        return {"lm_head.weight": "embed_tokens.weight"} if self.tie_word_embeddings else {}
