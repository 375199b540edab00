"""The device-side description of one forward step, shared by the engine and every model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from freetoken.kernels.prefill_snapshots import PrefillSnapshots


@dataclass
class ForwardBatch:
    """One step over ``B`` requests whose new tokens are laid out back to back (``T`` in all).

    Decode requests (one new token each, ``num_decodes`` of them) come first, then the prefill
    chunks, so layers with separate decode and prefill kernels can slice the batch once.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its request
    cu_seqlens: torch.Tensor  # [B + 1] int32, token offsets of the requests
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    page_table: torch.Tensor  # [B, max_pages] int32, unused entries point at page 0
    kv_locations: torch.Tensor  # [T] int64, flat KV-cache location (page * page_size + offset) of each token
    state_slots: torch.Tensor  # [B] int32, recurrent-state slot of each request
    logits_indices: torch.Tensor  # [N] int64, tokens whose logits are wanted (a request's last token)
    num_decodes: int  # requests (and tokens) at the front that are single-token decodes
    max_query_len: int  # most new tokens of one request
    # Bound on seq_lens known on the host (the batch's longest context, or a static bound such as
    # max_model_len in a CUDA graph): scratch sized from it needs no device->host sync.
    max_seq_len: int
    query_lens: list[int]  # new tokens per request (host copy)
    # States the forward writes into snapshot slots at boundaries inside the prefill rows, indexed
    # like ``prefill_part()`` (its rows and tokens); None: none this step. A function builds them
    # when the first layer asks (``prefill_snapshots``): the engine defers the tables' host work
    # behind the forward's first launches.
    snapshots: PrefillSnapshots | Callable[[], PrefillSnapshots] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def has_prefill(self) -> bool:
        return self.num_decodes < self.num_requests

    def prefill_snapshots(self) -> PrefillSnapshots | None:
        """``snapshots``, built on first use when deferred."""
        if callable(self.snapshots):
            self.snapshots = self.snapshots()
        return self.snapshots

    def prefill_part(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(first token, cu_seqlens, state_slots)`` of the prefill requests, offsets rebased to 0
        (with no decodes, the batch's own: no launch for each layer that asks)."""
        first = self.num_decodes
        if not first:
            return 0, self.cu_seqlens, self.state_slots
        cu = self.cu_seqlens[first:] - self.cu_seqlens[first]
        return first, cu, self.state_slots[first:]
