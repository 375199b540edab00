"""Qwen4-Exp indexed attention: Qwen3.5's gated attention, restricted per query to the blocks its
QSA indexer selects (plus the query's incomplete block)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.attention.qsa_sparse import QSAIndexer
from freetoken.batch import ForwardBatch
from freetoken.layers.norm import RMSNorm
from freetoken.layers.linear import linear
from freetoken.layers.weights import WeightTarget, new_param, packed_targets


class IndexedAttention(nn.Module):
    """``q_proj`` (query + output gate per head), ``k_proj``, ``v_proj`` and the indexer's
    ``index_qk_proj`` read the same input: one GEMM over the packed ``qkv_proj``. Then q/k RMSNorm
    (zero-centred), partial NeoX rotary, QSA block selection, sparse GQA over the selected tokens,
    ``· sigmoid(gate)``, ``o_proj``.
    """

    def __init__(self, config, rotary_cache: torch.Tensor, rotary_dim: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.rotary_cache, self.rotary_dim = rotary_cache, rotary_dim
        self.indexer = QSAIndexer(
            config.indexer_n_heads,
            config.indexer_head_dim,
            config.indexer_compress_ratio,
            config.indexer_budget,
            eps,
            rotary_cache,
            rotary_dim,
        )
        self.q_rows = self.num_heads * self.head_dim * 2
        self.kv_rows = self.num_kv_heads * self.head_dim
        self.qkv_proj = new_param(self.q_rows + 2 * self.kv_rows + self.indexer.proj_rows, config.hidden_size)
        self.o_proj = new_param(config.hidden_size, self.num_heads * self.head_dim)
        self.q_norm = RMSNorm(self.head_dim, eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, eps, zero_centered=True)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = packed_targets(
            self.qkv_proj,
            prefix,
            [
                ("q_proj.weight", self.q_rows),
                ("k_proj.weight", self.kv_rows),
                ("v_proj.weight", self.kv_rows),
                ("indexer.index_qk_proj.weight", self.indexer.proj_rows),
            ],
        )
        targets[f"{prefix}o_proj.weight"] = WeightTarget(self.o_proj)
        targets.update(self.q_norm.weight_targets(f"{prefix}q_norm."))
        targets.update(self.k_norm.weight_targets(f"{prefix}k_norm."))
        targets.update(self.indexer.weight_targets(f"{prefix}indexer."))
        return targets

    def kv_bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        kv = 2 * page_size * self.num_kv_heads * self.head_dim * dtype.itemsize
        return kv + self.indexer.bytes_per_page(page_size, dtype)

    def allocate_kv(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages, page_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.indexer.allocate(num_pages, page_size, dtype, device)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, token_request: torch.Tensor, max_blocks: int
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_gate, k, v, index_qk = linear(x, self.qkv_proj).split(
            [self.q_rows, self.kv_rows, self.kv_rows, self.indexer.proj_rows], dim=-1
        )
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = kernels.apply_rotary(q, k, batch.positions, self.rotary_cache, self.rotary_dim)
        kernels.store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
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
        return linear(out.reshape(num_tokens, -1), self.o_proj)
