"""CUDA graphs for small prefill steps: one graph per (rows, padded token bucket), captured at start-up.

A prefix-cache hit leaves a few hundred tokens to prefill; run eagerly, their 40-layer forward is
~1,100 kernel launches from Python (40-90 ms on the H200 host) for ~10 ms of GPU work. A
prefill-only step of ``r <= max_rows`` requests and ``T`` tokens is instead copied into static
buffers owned by the runner and replayed from the graph of the smallest bucket ``N >= T``
(``prefill_capture_sizes``; vLLM calls them cudagraph capture sizes).

Every grid of the Triton prefill path is sized from host integers only (the token count,
``max_query_len`` for the attention tiles, the delta rule's chunk count, the MoE's (token, expert)
pairs), so a graph over fixed shapes replays any step that fits:

* **Padding is a row of its own**: row ``r`` takes the ``N - T`` padding tokens (possibly none), in
  the scratch slot 0 and scratch page 0 (token 0 at position 0, its page-table row zeros), as
  decode padding does. Padding tokens on a real row would advance its delta-rule state and write
  its KV.
* ``max_query_len`` is ``N``: attention tiles past a row's tokens exit at once.
* **Snapshots always take the segmented path with fixed sizes**: room for ``MAX_SNAPSHOTS_PER_ROW``
  per real row (dummies: empty segments of the padding row, into slot 0), the delta rule's chunk
  tables sized to their bound with the unused chunks belonging to no segment, the conv windows
  through the general path (``window_from_state`` always a tensor). The tables are host-built
  (``snapshot_tables``) and copied into the graph's static buffers before each replay.
* Logits are computed for ``r + 1`` rows: the step's sampling rows first, in order, then rows of
  no interest; the caller gets the first ones.

A prefix hit's restore (``copy_slots``) runs before, outside the graph. ``use_graphs=False`` runs
the model eagerly on exactly the static batch a graph would replay, so the padding is testable on
the CPU (``tests/engine/test_prefill_graphs.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.batch import ForwardBatch
from freetoken.kernels.prefill_snapshots import DELTA_RULE_CHUNK, PrefillSnapshots, snapshot_tables
from freetoken.models.base import CausalLM

logger = logging.getLogger(__name__)

# The scheduler snapshots a request at up to two boundaries (where it leaves the cached pages, and
# its last full page), both possibly inside one chunk.
MAX_SNAPSHOTS_PER_ROW = 2


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """64, 128, 256, 512, then every multiple of 128 below ``max_tokens``, then ``max_tokens``
    (none for 0). A prefix hit's remainder is a few hundred tokens past a page boundary (528 in
    the shared-prefix benchmark, whose bucket is 640): above 512 the padding a bucket adds is
    what the forward costs beyond the routed experts' weights, so the steps are finer there."""
    if max_tokens <= 0:
        return []
    sizes = {s for s in (64, 128, 256, *range(512, max_tokens, 128)) if s < max_tokens}
    return sorted(sizes | {max_tokens})


@dataclass(frozen=True)
class GraphShape:
    """A captured step: ``rows`` real rows and one padding row, ``tokens`` tokens in all."""

    rows: int
    tokens: int

    @property
    def snapshots(self) -> int:
        return MAX_SNAPSHOTS_PER_ROW * self.rows

    @property
    def chunks(self) -> int:
        """Bound on the delta rule's chunks: every segment (rows and snapshot splits) adds at most
        one partial chunk."""
        segments = self.rows + 1 + self.snapshots
        return -(-self.tokens // DELTA_RULE_CHUNK) + segments


class _StaticSnapshots:
    """A shape's snapshot tables at fixed addresses: one packed int64 buffer, as
    ``snapshot_tables`` orders them, viewed as a ``PrefillSnapshots``."""

    def __init__(self, shape: GraphShape, conv_width: int, device: torch.device) -> None:
        k, c, segments = shape.snapshots, shape.chunks, shape.rows + 1 + shape.snapshots
        self.lengths = [k, k, k, k, segments + 1, segments + 1, c, shape.rows + 2, c, c, c, k * conv_width,
                        k * conv_width]
        self.packed = torch.zeros(sum(self.lengths), dtype=torch.int64, device=device)
        views = list(self.packed.split(self.lengths))
        self.from_state_ints = views[12].view(k, conv_width)
        self.from_state = torch.zeros(k, conv_width, dtype=torch.bool, device=device)
        self.view = PrefillSnapshots(*views[:11], c, views[11].view(k, conv_width), self.from_state)
        self.capacity = (k, c)
        self.conv_width = conv_width
        self.pinned = device.type == "cuda"

    def load(self, query_lens: Sequence[int], snapshots: Sequence[tuple[int, int, int]]) -> None:
        """``query_lens``: every row's, the padding row's last; ``snapshots``: the real ones."""
        parts, _ = snapshot_tables(query_lens, snapshots, self.conv_width, self.capacity)
        host = torch.from_numpy(np.concatenate(parts))
        if self.pinned:
            host = host.pin_memory()
        self.packed.copy_(host, non_blocking=self.pinned)
        self.from_state.copy_(self.from_state_ints)


class PrefillGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        sizes: Sequence[int],
        max_rows: int,
        max_pages_per_request: int,
        max_seq_len: int,
        use_graphs: bool,
    ) -> None:
        if not sizes or max_rows < 1:
            raise ValueError(f"prefill graphs: sizes {list(sizes)} and max_rows {max_rows} leave nothing to capture")
        self.model = model
        self.sizes = sorted(sizes)
        self.max_rows = max_rows
        self.max_seq_len = max_seq_len
        self.use_graphs = use_graphs
        self.device = device
        max_tokens, rows = self.sizes[-1], max_rows + 1

        def buffer(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buffer(max_tokens, dtype=torch.int64)
        self.positions = buffer(max_tokens, dtype=torch.int64)
        self.kv_locations = buffer(max_tokens, dtype=torch.int64)
        self.cu_seqlens = buffer(rows + 1, dtype=torch.int32)
        self.seq_lens = buffer(rows, dtype=torch.int32)
        self.state_slots = buffer(rows, dtype=torch.int32)
        self.page_table = buffer(rows, max_pages_per_request, dtype=torch.int32)
        self.logits_indices = buffer(rows, dtype=torch.int64)
        conv_width = model.snapshot_conv_width()
        self.shapes = [GraphShape(r, n) for n in self.sizes for r in range(1, max_rows + 1)]
        self.snapshots = {shape: _StaticSnapshots(shape, conv_width, device) for shape in self.shapes}
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        # Every graph leaves its logits here (float32 rows of a 248k vocabulary are 1 MB each).
        self.logits = buffer(rows, model.vocab_size, dtype=torch.float32) if use_graphs else None

    def supports(self, batch: ForwardBatch, num_snapshots: int) -> bool:
        """Prefill-only steps of at most ``max_rows`` requests, the largest bucket of tokens and
        ``MAX_SNAPSHOTS_PER_ROW`` snapshots a row."""
        rows = batch.num_requests
        return (
            batch.num_decodes == 0
            and 0 < rows <= self.max_rows
            and batch.num_tokens <= self.sizes[-1]
            and num_snapshots <= MAX_SNAPSHOTS_PER_ROW * rows
        )

    def shape_of(self, batch: ForwardBatch) -> GraphShape:
        return GraphShape(batch.num_requests, next(s for s in self.sizes if s >= batch.num_tokens))

    def static_batch(self, shape: GraphShape) -> ForwardBatch:
        """The batch a graph of ``shape`` captures: its rows and the padding row, bounds static."""
        rows, tokens = shape.rows + 1, shape.tokens
        return ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            cu_seqlens=self.cu_seqlens[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            page_table=self.page_table[:rows],
            kv_locations=self.kv_locations[:tokens],
            state_slots=self.state_slots[:rows],
            logits_indices=self.logits_indices[:rows],
            num_decodes=0,
            max_query_len=tokens,
            query_lens=[tokens] * rows,  # host bounds: the rows' lengths are on the device only
            max_seq_len=self.max_seq_len,
            snapshots=self.snapshots[shape].view,
        )

    def load(self, batch: ForwardBatch, shape: GraphShape, snapshots: Sequence[tuple[int, int, int]]) -> None:
        """Copy the step's rows into rows ``[0, r)``, the padding into row ``r``, its sampling rows'
        logits indices to the front, and its snapshots (``(row, offset, slot)``) into the tables."""
        t, r, n = batch.num_tokens, batch.num_requests, shape.tokens
        wanted = batch.logits_indices.shape[0]
        given = (batch.input_ids, batch.positions, batch.kv_locations, batch.cu_seqlens, batch.seq_lens,
                 batch.state_slots, batch.page_table, batch.logits_indices)
        static = (self.input_ids[:t], self.positions[:t], self.kv_locations[:t], self.cu_seqlens[: r + 1],
                  self.seq_lens[:r], self.state_slots[:r], self.page_table[:r], self.logits_indices[:wanted])
        torch._foreach_copy_(list(static), list(given))  # one launch for the rows
        padding = [self.input_ids[t:n], self.positions[t:n], self.kv_locations[t:n], self.state_slots[r : r + 1],
                   self.page_table[r], self.logits_indices[wanted : r + 1]]
        torch._foreach_zero_([p for p in padding if p.numel()])
        self.cu_seqlens[r + 1].fill_(n)
        self.seq_lens[r].fill_(n - t)
        self.snapshots[shape].load([*batch.query_lens, n - t], snapshots)

    def run(self, batch: ForwardBatch, snapshots: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """float32 logits of ``batch.logits_indices``, from the graph of the step's shape."""
        shape = self.shape_of(batch)
        self.load(batch, shape, snapshots)
        if self.use_graphs:
            self.graphs[shape].replay()
            logits = self.logits
        else:
            logits = self.model(self.static_batch(shape))
        return logits[: batch.logits_indices.shape[0]]

    def _load_idle(self, shape: GraphShape) -> None:
        """A step of ``shape`` on the scratch page and slot only: its rows one token each."""
        rows = shape.rows
        zeros = torch.zeros(rows, dtype=torch.int64, device=self.device)
        idle = ForwardBatch(
            input_ids=zeros,
            positions=zeros,
            cu_seqlens=torch.arange(rows + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(rows, dtype=torch.int32, device=self.device),
            page_table=torch.zeros_like(self.page_table[:rows]),
            kv_locations=zeros,
            state_slots=zeros.int(),
            logits_indices=torch.arange(rows, device=self.device),
            num_decodes=0,
            max_query_len=1,
            query_lens=[1] * rows,
            max_seq_len=1,
        )
        self.load(idle, shape, [])

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> None:
        """Capture every shape, largest first, into ``pool`` (the decode graphs'), after one eager
        warm-up run each (which compiles the Triton kernels for it)."""
        start = time.perf_counter()
        for shape in reversed(self.shapes):
            self._load_idle(shape)
            batch = self.static_batch(shape)
            self.model(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[: shape.rows + 1].copy_(self.model(batch))
            pool = graph.pool()
            self.graphs[shape] = graph
        torch.cuda.synchronize()
        logger.info(
            "CUDA graphs: captured %d prefill shapes (%s tokens, 1-%d requests) in %.1f s",
            len(self.shapes),
            ", ".join(map(str, self.sizes)),
            self.max_rows,
            time.perf_counter() - start,
        )
