"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up.

A decode step (one new token per request) of ``n <= max_batch_size`` requests is copied into
static input buffers owned by the runner, padded to the next captured size with rows that write
only the reserved scratch page 0 and state slot 0, and replayed. Every captured forward computes
logits for all its rows; the caller's rows are picked afterwards. Graphs share one memory pool,
captured largest first so the smaller ones reuse its blocks.

``use_graphs=False`` runs the model eagerly on exactly the padded static batch a graph would
replay, so the padding is testable on the CPU.
"""

from __future__ import annotations

import logging
import time

import torch

from freetoken.batch import ForwardBatch
from freetoken.engine.buffers import copy_by_dtype
from freetoken.models.base import CausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 below ``max_batch_size``, then ``max_batch_size``."""
    sizes = {s for s in (1, 2, 4, *range(8, max_batch_size, 8)) if s < max_batch_size}
    return sorted(sizes | {max_batch_size})


class DecodeGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        max_batch_size: int,
        max_pages_per_request: int,
        max_seq_len: int,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.use_graphs = use_graphs

        def buffer(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buffer(max_batch_size, dtype=torch.int64)
        self.positions = buffer(max_batch_size, dtype=torch.int64)
        self.kv_locations = buffer(max_batch_size, dtype=torch.int64)
        self.seq_lens = buffer(max_batch_size, dtype=torch.int32)
        self.state_slots = buffer(max_batch_size, dtype=torch.int32)
        self.page_table = buffer(max_batch_size, max_pages_per_request, dtype=torch.int32)
        # One token per request: token offsets and logits rows are the row numbers, fixed.
        self.cu_seqlens = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch_size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: tuple | None = None  # the graphs' memory pool, which the prefill graphs share
        # Every graph leaves its logits here: one [max_batch_size, vocab] buffer, not one per size
        # (float32 rows of a 248k vocabulary are 1 MB each).
        self.logits = (
            torch.empty(max_batch_size, model.vocab_size, dtype=torch.float32, device=device) if use_graphs else None
        )

    def supports(self, batch: ForwardBatch) -> bool:
        """Decode-only steps of at most ``max_batch_size`` requests."""
        return not batch.has_prefill and 0 < batch.num_requests <= self.max_batch_size

    def padded_size(self, num_requests: int) -> int:
        return next(s for s in self.sizes if s >= num_requests)

    def static_batch(self, size: int) -> ForwardBatch:
        """The batch of the first ``size`` static rows, as captured."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            cu_seqlens=self.cu_seqlens[: size + 1],
            seq_lens=self.seq_lens[:size],
            page_table=self.page_table[:size],
            kv_locations=self.kv_locations[:size],
            state_slots=self.state_slots[:size],
            logits_indices=self.rows[:size],
            num_decodes=size,
            max_query_len=1,
            query_lens=[1] * size,
            max_seq_len=self.max_seq_len,
        )

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copy the step's ``n`` requests into rows ``[0, n)``; rows ``[n, size)`` become padding.
        Two launches where the step fills every row and page-table column (one fused copy per
        dtype), more with padding."""
        n, width = batch.num_requests, batch.page_table.shape[1]
        if width < self.page_table.shape[1]:
            self.page_table[:n].zero_()
        self.page_table[n:size].zero_()
        copy_by_dtype(
            [self.input_ids[:n], self.positions[:n], self.kv_locations[:n], self.seq_lens[:n], self.state_slots[:n],
             self.page_table[:n, :width]],
            [batch.input_ids, batch.positions, batch.kv_locations, batch.seq_lens, batch.state_slots, batch.page_table],
        )
        self._pad(n, size)

    def _pad(self, first: int, size: int) -> None:
        """Rows ``[first, size)``: token 0 at position 0 of a one-token context in page 0, state
        slot 0, so they write only the reserved scratch entries (their page-table rows are zero)."""
        for static in (self.input_ids, self.positions, self.kv_locations, self.state_slots):
            static[first:size].zero_()
        self.seq_lens[first:size].fill_(1)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits of ``batch.logits_indices``, from the graph of the padded size."""
        size = self.padded_size(batch.num_requests)
        self.load(batch, size)
        if self.use_graphs:
            self.graphs[size].replay()
            logits = self.logits[:size]
        else:
            logits = self.model(self.static_batch(size))
        if batch.logits_indices.shape[0] == size:  # every row, in order (increasing indices): no gather
            return logits
        return logits[batch.logits_indices]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, after one eager warm-up run each (which compiles the
        Triton kernels for that size: nothing may compile or allocate outside the pool mid-capture)."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self.page_table[:size].zero_()
            self._pad(0, size)
            batch = self.static_batch(size)
            self.model(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size].copy_(self.model(batch))
            pool = graph.pool()
            self.graphs[size] = graph
        self.pool = pool
        torch.cuda.synchronize()
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (%s) in %.1f s",
            len(self.sizes),
            ", ".join(map(str, self.sizes)),
            time.perf_counter() - start,
        )
