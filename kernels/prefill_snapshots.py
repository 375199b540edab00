"""States a prefill forward takes inside its chunks: prefix-cache snapshots without cutting a chunk.

A request's Gated DeltaNet recurrent state and conv window at a page boundary ``p`` inside its
chunk describe the prefix up to ``p``. A chunk cut at ``p`` would leave that state in the slot after
one forward, and a second forward would run the rest; instead the forward itself writes it into a
snapshot slot. The delta rule splits the request's rows at ``p`` into *segments* and chunks each
segment from its own start (exactly the chunking the cut would have run, so the outputs and states
are those of the cut), storing the state after a segment that ends at a snapshot; the conv window
is the last ``K - 1`` conv inputs before ``p``.

Everything is laid out on the host, where the step is built, and moved to the device in one copy:
the kernels then read it without a device->host sync and without per-layer index arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Tokens per chunk of the chunked delta rule (torch reference and Triton kernel alike).
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True)
class PrefillSnapshots:
    """Snapshots of one prefill call (its rows back to back, as ``cu_seqlens`` lays them out).

    Snapshot ``j`` is of request ``requests[j]`` after its first ``offsets[j]`` rows (``0 <
    offset < its rows``), the first row after the boundary being ``tokens[j]``; its state goes
    into state row ``slots[j]`` (a snapshot slot, no request's). Sorted by token.
    """

    tokens: torch.Tensor  # [N] int64
    offsets: torch.Tensor  # [N] int64
    requests: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64
    # The delta rule's segments: the requests split at their boundaries, S = R + N of them, as the
    # parallel kernels read them (in place of the requests)...
    segment_cu: torch.Tensor  # [S + 1] int64, row offsets of the segments
    segment_chunks_cu: torch.Tensor  # [S + 1] int64, chunk offsets (chunks of DELTA_RULE_CHUNK per segment)
    chunk_segment: torch.Tensor  # [num_chunks] int64, the segment of every chunk
    # ... and as the sequential state pass reads them: by request, then by chunk.
    request_chunks: torch.Tensor  # [R + 1] int64, request b's chunks are [c[b], c[b + 1])
    chunk_rows: torch.Tensor  # [num_chunks] int64, each chunk's first row
    chunk_ends: torch.Tensor  # [num_chunks] int64, the end of each chunk's segment
    chunk_snapshot: torch.Tensor  # [num_chunks] int64, where the state after the chunk goes; -1: nowhere
    num_chunks: int
    # The conv windows: row window_rows[j, i] of the call's conv inputs, or, where window_from_state
    # (a boundary fewer than K - 1 rows into its request), column window_rows[j, i] of the
    # request's conv state as the call found it.
    window_rows: torch.Tensor  # [N, K - 1] int64
    window_from_state: torch.Tensor | None  # [N, K - 1] bool; None when every window lies in the rows

    @property
    def num_snapshots(self) -> int:
        return int(self.tokens.shape[0])


def prefill_snapshots(
    query_lens: Sequence[int],
    snapshots: Sequence[tuple[int, int, int]],
    conv_width: int,
    device: torch.device,
) -> PrefillSnapshots:
    """The layout of ``snapshots`` = ``(request, offset, slot)`` in a prefill call of requests with
    ``query_lens`` rows; ``conv_width`` is the conv kernel's ``K - 1``."""
    entries = sorted(snapshots)
    cu = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    for request, offset, slot in entries:
        if not 0 <= request < len(query_lens) or not 0 < offset < query_lens[request]:
            raise ValueError(
                f"snapshot of request {request} at offset {offset}: must lie inside its "
                f"{query_lens[request] if 0 <= request < len(query_lens) else '(no such request)'} rows"
            )
        if slot < 0:
            raise ValueError(f"snapshot of request {request} at offset {offset}: slot {slot}")
    if len({(r, o) for r, o, _ in entries}) != len(entries):
        raise ValueError(f"snapshots {entries}: a boundary repeats")
    requests = np.array([r for r, _, _ in entries], dtype=np.int64)
    offsets = np.array([o for _, o, _ in entries], dtype=np.int64)
    tokens = cu[requests] + offsets
    slots = np.array([s for _, _, s in entries], dtype=np.int64)

    segment_cu = np.sort(np.concatenate([cu, tokens]), kind="stable")
    segment_lens = np.diff(segment_cu)
    segment_chunks_cu = np.zeros(len(segment_cu), dtype=np.int64)
    np.cumsum(-(-segment_lens // DELTA_RULE_CHUNK), out=segment_chunks_cu[1:])
    num_chunks = int(segment_chunks_cu[-1])
    chunk_segment = np.repeat(np.arange(len(segment_lens)), -(-segment_lens // DELTA_RULE_CHUNK))
    # Request b's first segment: b's own plus one per snapshot of an earlier request.
    before = np.searchsorted(requests, np.arange(len(query_lens) + 1), side="left")
    request_chunks = segment_chunks_cu[np.arange(len(query_lens) + 1) + before]
    chunk_rows = segment_cu[chunk_segment] + (np.arange(num_chunks) - segment_chunks_cu[chunk_segment]) * DELTA_RULE_CHUNK
    chunk_ends = segment_cu[chunk_segment + 1]
    chunk_snapshot = np.full(num_chunks, -1, dtype=np.int64)
    # The segment ending at snapshot j's token: request r's (j - first of r)-th, j + r overall;
    # its last chunk takes the snapshot.
    chunk_snapshot[segment_chunks_cu[np.arange(len(entries)) + requests + 1] - 1] = slots

    window = offsets[:, None] + np.arange(-conv_width, 0)[None, :]  # rows into the request
    from_state = window < 0
    window_rows = np.where(from_state, window + conv_width, tokens[:, None] - offsets[:, None] + window)

    parts = [tokens, offsets, requests, slots, segment_cu, segment_chunks_cu, chunk_segment,
             request_chunks, chunk_rows, chunk_ends, chunk_snapshot, window_rows.reshape(-1), from_state.reshape(-1)]
    packed = torch.from_numpy(np.concatenate(parts).astype(np.int64))  # index_copy_ takes int64 only
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    views = list(packed.split([len(p) for p in parts]))
    n = len(entries)
    window_view = views[11].view(n, conv_width)
    from_state_view = views[12].view(n, conv_width).bool() if from_state.any() else None
    return PrefillSnapshots(*views[:11], num_chunks, window_view, from_state_view)
