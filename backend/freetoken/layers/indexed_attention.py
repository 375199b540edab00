"""Qwen4-Exp indexed attention: Qwen3.5's gated attention, restricted per query to the blocks its
QSA indexer selects (plus the query's incomplete block)."""

from __future__ import annotations

import torch

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.layers.attention import AttentionSizes, GatedAttention
from freetoken.layers.qsa_indexer import QSAIndexer, QSASizes
from freetoken.layers.weights import WeightTarget


class IndexedAttention(GatedAttention):
    """The indexer's ``index_qk_proj`` reads the same input as q/k/v, so it is packed into the same
    GEMM after them. Then the shared prologue (q/k norms, rotary, KV store), QSA block selection,
    sparse GQA over the selected tokens, ``· sigmoid(gate)``, ``o_proj``.
    """

    def __init__(self, sizes: AttentionSizes, qsa: QSASizes, rotary_cache: torch.Tensor) -> None:
        super().__init__(sizes, rotary_cache, extra_projections=(("indexer.index_qk_proj.weight", qsa.proj_rows),))
        self.indexer = QSAIndexer(qsa, sizes.eps, rotary_cache, sizes.rotary_dim)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = super().weight_targets(prefix)
        targets.update(self.indexer.weight_targets(f"{prefix}indexer."))
        return targets

    def kv_bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        return super().kv_bytes_per_page(page_size, dtype) + self.indexer.bytes_per_page(page_size, dtype)

    def allocate_kv(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().allocate_kv(num_pages, page_size, dtype, device)
        self.indexer.allocate(num_pages, page_size, dtype, device)

    def forward(  # type: ignore[override]  # the QSA step values come with the batch
        self, x: torch.Tensor, batch: ForwardBatch, token_request: torch.Tensor, max_blocks: int
    ) -> torch.Tensor:
        q, gate, (index_qk,) = self.project(x, batch)
        selected = self.indexer.select(index_qk, batch, token_request, max_blocks)
        out = kernels.qsa_sparse_attention(
            q,
            self.k_cache,
            self.v_cache,
            batch.page_table,
            token_request,
            batch.positions,
            selected,
            self.indexer.compress_ratio,
            self.head_dim**-0.5,
            gate=gate,
        )
        return self.output(out)
