"""QSA indexer state and selection: the per-page index keys and pooled block keys of one layer.

The indexer's projection is packed into its attention layer's GEMM; this module owns what comes
after it: the q/k norms, the caches beside the paged KV (layout in ``kernels.qsa``), and the
per-query block selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.kernels.qsa import blocks_per_page
from freetoken.layers.norm import RMSNorm
from freetoken.layers.weights import WeightTarget


@dataclass(frozen=True)
class QSASizes:
    num_heads: int  # index query heads (one index key head)
    head_dim: int
    compress_ratio: int  # tokens per block
    budget: int  # tokens each query may select (``budget // compress_ratio`` blocks)

    @property
    def proj_rows(self) -> int:
        """Rows of ``index_qk_proj``: ``num_heads`` query heads, then one key head."""
        return (self.num_heads + 1) * self.head_dim


class QSAIndexer(nn.Module):
    def __init__(self, sizes: QSASizes, eps: float, rotary_cache: torch.Tensor, rotary_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = sizes.num_heads, sizes.head_dim
        self.proj_rows = sizes.proj_rows
        self.compress_ratio = sizes.compress_ratio
        self.block_topk = sizes.budget // sizes.compress_ratio
        self.eps = eps
        self.rotary_cache, self.rotary_dim = rotary_cache, rotary_dim
        self.q_norm = RMSNorm(sizes.head_dim, eps, zero_centered=True)
        self.k_norm = RMSNorm(sizes.head_dim, eps, zero_centered=True)
        self.index_cache: torch.Tensor | None = None
        self.block_cache: torch.Tensor | None = None
        self.page_size = 0

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = self.q_norm.weight_targets(f"{prefix}q_layernorm.")
        targets.update(self.k_norm.weight_targets(f"{prefix}k_layernorm."))
        return targets

    def bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        return (page_size + blocks_per_page(page_size, self.compress_ratio)) * self.head_dim * dtype.itemsize

    def allocate(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.page_size = page_size
        per_page = blocks_per_page(page_size, self.compress_ratio)
        self.index_cache = torch.zeros(num_pages, page_size, self.head_dim, dtype=dtype, device=device)
        self.block_cache = torch.zeros(num_pages, per_page, self.head_dim, dtype=dtype, device=device)

    def select(
        self,
        projected: torch.Tensor,
        batch: ForwardBatch,
        token_request: torch.Tensor,
        max_blocks: int,
    ) -> torch.Tensor:
        """Record this step's index keys, then choose each query's blocks: int32 ``[T, block_topk]``.

        ``projected [T, proj_rows]`` is the ``index_qk_proj`` output of the step's tokens.
        """
        num_tokens = projected.shape[0]
        q, k = projected.split([self.num_heads * self.head_dim, self.head_dim], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        q, _ = kernels.apply_rotary(q, q[:, :1], batch.positions, self.rotary_cache, self.rotary_dim)
        kernels.qsa_update_index(
            k,
            self.index_cache,
            self.block_cache,
            batch.kv_locations,
            batch.page_table,
            token_request,
            batch.positions,
            self.k_norm.weight,
            self.eps,
            self.rotary_cache,
            self.rotary_dim,
            self.compress_ratio,
        )
        return kernels.qsa_select_blocks(
            q,
            self.block_cache,
            batch.page_table,
            token_request,
            batch.positions,
            self.page_size,
            self.compress_ratio,
            self.block_topk,
            max_blocks,
        )
