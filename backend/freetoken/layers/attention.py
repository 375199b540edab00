"""Qwen3.5's gated full attention over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.layers.norm import RMSNorm
from freetoken.layers.linear import linear
from freetoken.layers.weights import WeightTarget, new_param, packed_targets


class GatedAttention(nn.Module):
    """``q_proj`` yields per head a query and an output gate; q/k RMSNorm (zero-centred); partial
    NeoX rotary; causal GQA over pages; output ``· sigmoid(gate)``; ``o_proj``.

    q, k and v projections run as one GEMM over the packed ``qkv_proj`` weight.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        eps: float,
        rotary_cache: torch.Tensor,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim = rotary_dim
        self.q_rows = num_heads * head_dim * 2
        self.kv_rows = num_kv_heads * head_dim
        self.qkv_proj = new_param(self.q_rows + 2 * self.kv_rows, hidden_size)
        self.o_proj = new_param(hidden_size, num_heads * head_dim)
        self.q_norm = RMSNorm(head_dim, eps, zero_centered=True)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered=True)
        self.rotary_cache = rotary_cache
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = packed_targets(
            self.qkv_proj,
            prefix,
            [("q_proj.weight", self.q_rows), ("k_proj.weight", self.kv_rows), ("v_proj.weight", self.kv_rows)],
        )
        targets[f"{prefix}o_proj.weight"] = WeightTarget(self.o_proj)
        targets.update(self.q_norm.weight_targets(f"{prefix}q_norm."))
        targets.update(self.k_norm.weight_targets(f"{prefix}k_norm."))
        return targets

    def kv_bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        return 2 * page_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate_kv(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages, page_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = linear(x, self.qkv_proj)
        q_gate, k, v = qkv.split([self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = kernels.apply_rotary(q, k, batch.positions, self.rotary_cache, self.rotary_dim)
        kernels.store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        out = kernels.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            batch.page_table,
            batch.cu_seqlens,
            batch.seq_lens,
            self.head_dim**-0.5,
            batch.max_query_len,
            gate=gate,
        )
        return linear(out.reshape(num_tokens, -1), self.o_proj)
