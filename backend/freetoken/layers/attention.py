"""Qwen3.5's gated full attention over the paged KV cache, and the prologue every attention layer
of the two families shares (``layers.indexed_attention`` builds on it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.layers.linear import linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.normed_linear import normed_linear
from freetoken.layers.weights import WeightTarget, new_param, packed_targets


@dataclass(frozen=True)
class AttentionSizes:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that are rotated (partial rotary)
    eps: float  # of the q/k RMSNorms


class GatedAttention(nn.Module):
    """``q_proj`` yields per head a query and an output gate; q/k RMSNorm (zero-centred); partial
    NeoX rotary; causal GQA over pages; output ``· sigmoid(gate)``; ``o_proj``.

    q, k and v projections run as one GEMM over the packed ``qkv_proj`` weight; a subclass may pack
    more projections of the same input after them (``extra_projections``: checkpoint name, rows).
    """

    def __init__(
        self,
        sizes: AttentionSizes,
        rotary_cache: torch.Tensor,
        extra_projections: tuple[tuple[str, int], ...] = (),
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = sizes.num_heads, sizes.num_kv_heads, sizes.head_dim
        self.rotary_dim = sizes.rotary_dim
        self.q_rows = sizes.num_heads * sizes.head_dim * 2
        self.kv_rows = sizes.num_kv_heads * sizes.head_dim
        self.packed_parts = [
            ("q_proj.weight", self.q_rows),
            ("k_proj.weight", self.kv_rows),
            ("v_proj.weight", self.kv_rows),
            *extra_projections,
        ]
        self.qkv_proj = new_param(sum(rows for _, rows in self.packed_parts), sizes.hidden_size)
        self.o_proj = new_param(sizes.hidden_size, sizes.num_heads * sizes.head_dim)
        self.q_norm = RMSNorm(sizes.head_dim, sizes.eps, zero_centered=True)
        self.k_norm = RMSNorm(sizes.head_dim, sizes.eps, zero_centered=True)
        self.rotary_cache = rotary_cache
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = packed_targets(self.qkv_proj, prefix, self.packed_parts)
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

    def project(
        self, x: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The prologue: one GEMM, then one launch for the q/k norms, rotary and this step's k/v
        stored at ``batch.kv_locations`` (``kernels.norm_rotary_store_kv``).

        Returns the rotated queries ``[T, Hq, D]``, the output gate ``[T, Hq, D]`` and the extra
        projections' outputs in ``extra_projections`` order.
        """
        return self.project_from(linear(x, self.qkv_proj), batch)

    def project_from(
        self, projected: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``project`` after its GEMM, from the packed projection's output ``[T, qkv rows]``."""
        num_tokens = projected.shape[0]
        q_gate, k, v, *extra = projected.split([rows for _, rows in self.packed_parts], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = kernels.norm_rotary_store_kv(
            q,
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            batch.positions,
            self.rotary_cache,
            self.rotary_dim,
            self.k_cache,
            self.v_cache,
            batch.kv_locations,
        )
        return q, gate, extra

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of the gated attention output ``[T, Hq, D]``."""
        return linear(attended.reshape(attended.shape[0], -1), self.o_proj)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_projected(linear(x, self.qkv_proj), batch)

    def forward_normed(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on ``norm(x + residual)`` (the norm run with the qkv GEMV:
        ``layers.normed_linear``), and the stream after the add."""
        mixer_in = normed_linear(norm, x, residual, self.qkv_proj)
        return self.forward_projected(mixer_in.out, batch), mixer_in.residual

    def forward_projected(self, projected: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layer after its packed q/k/v GEMM, from that GEMM's output."""
        q, gate, _ = self.project_from(projected, batch)
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
        return self.output(out)
