"""The HBM floor of one decode step: the bytes it must move over the memory bandwidth.

A decode step at batch ``B`` and context ``L`` must at least read

- every weight except the routed experts and the embedding table once (``lm_head`` included), and
  ``B`` embedding rows;
- the routed experts the batch touches: ``E · (1 - (1 - k/E)^B)`` distinct experts per MoE layer
  expected under uniform routing (each of ``B`` tokens picks ``k`` of ``E``), every one read once;
- the KV cache of every sequence (``L`` tokens per attention layer; a QSA layer reads only its
  selected blocks and the pooled block keys);
- the recurrent state of every sequence, read and written (Gated DeltaNet's float32 state and conv
  window, Qwen4-Exp's PLE windows): ``2 · state_bytes_per_slot``.

Weights count as stored: an NVFP4 linear reads its packed codes (half a byte a weight), its e4m3
block scales (one byte per 16 weights: 4.5 bits a weight in all) and one float32 scale per row.
Host-resident tables (Qwen4-Exp's n-gram embeddings, read over PCIe) are not HBM traffic and are
left out. Activations stay in L2 at decode sizes and are left out too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_HBM_BANDWIDTH = 4.3e12  # bytes/s: H200 HBM3e (4.8 TB/s peak; 4.27 measured device copy)


@dataclass(frozen=True)
class KVRead:
    """What one attention layer reads per sequence at context ``L``: ``bytes_per_token`` (K and V)
    for ``min(L, max_tokens)`` tokens, plus ``index_bytes_per_token · L`` (QSA block keys)."""

    bytes_per_token: int
    max_tokens: int | None = None
    index_bytes_per_token: float = 0.0

    def bytes(self, context_len: int) -> float:
        tokens = context_len if self.max_tokens is None else min(context_len, self.max_tokens)
        return tokens * self.bytes_per_token + self.index_bytes_per_token * context_len


@dataclass(frozen=True)
class DecodeTraffic:
    """A model's shapes as the floor needs them (``decode_traffic_of`` reads them off a model)."""

    dense_weight_bytes: int  # all weights on the device but routed experts and the embedding table
    embedding_row_bytes: int
    expert_bytes: int  # one routed expert (gate, up and down) of one layer
    num_experts: int
    top_k: int
    num_moe_layers: int
    kv_layers: tuple[KVRead, ...]
    state_bytes_per_sequence: int  # read + written per step


@dataclass(frozen=True)
class DecodeFloor:
    batch_size: int
    context_len: float
    non_expert_weight_bytes: float
    experts_per_layer: float
    expert_weight_bytes: float
    kv_bytes: float
    state_bytes: float
    bandwidth: float

    @property
    def total_bytes(self) -> float:
        return self.non_expert_weight_bytes + self.expert_weight_bytes + self.kv_bytes + self.state_bytes

    @property
    def seconds(self) -> float:
        return self.total_bytes / self.bandwidth

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_bytes": self.total_bytes, "ms": self.seconds * 1e3}


def expected_distinct_experts(num_experts: int, top_k: int, batch_size: int) -> float:
    """Distinct experts ``B`` tokens touch when each picks ``k`` of ``E`` uniformly:
    ``E · (1 - (1 - k/E)^B)`` (each expert is missed by one token with probability ``1 - k/E``)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch_size)


def decode_floor(
    traffic: DecodeTraffic, batch_size: int, context_len: float, bandwidth: float = DEFAULT_HBM_BANDWIDTH
) -> DecodeFloor:
    experts = expected_distinct_experts(traffic.num_experts, traffic.top_k, batch_size) if traffic.num_experts else 0.0
    return DecodeFloor(
        batch_size=batch_size,
        context_len=context_len,
        non_expert_weight_bytes=traffic.dense_weight_bytes + batch_size * traffic.embedding_row_bytes,
        experts_per_layer=experts,
        expert_weight_bytes=experts * traffic.expert_bytes * traffic.num_moe_layers,
        kv_bytes=batch_size * sum(layer.bytes(int(context_len)) for layer in traffic.kv_layers),
        state_bytes=batch_size * traffic.state_bytes_per_sequence,
        bandwidth=bandwidth,
    )


def _stored(weight) -> list:
    """The tensors a weight is stored as: itself, or an NVFP4 / split weight's parameters."""
    from torch import nn

    return list(weight.parameters()) if isinstance(weight, nn.Module) else [weight]


def parameter_count(model) -> int:
    """The model's weights in parameters (an NVFP4 weight counts its logical ``out x in``, not its bytes)."""
    from freetoken.layers.linear import NVFP4Weight

    packed = [m for m in model.modules() if isinstance(m, NVFP4Weight)]
    in_packed = {id(p) for m in packed for p in m.parameters()}
    return sum(m.shape.numel() for m in packed) + sum(p.numel() for p in model.parameters() if id(p) not in in_packed)


def decode_traffic_of(model) -> DecodeTraffic:
    """The ``DecodeTraffic`` of a FreeToken ``CausalLM`` (its pools need not be allocated)."""
    from freetoken.layers.attention import GatedAttention
    from freetoken.layers.indexed_attention import IndexedAttention
    from freetoken.layers.moe import SparseMoE
    from freetoken.layers.ple import NGramEmbedding

    dtype = model.embed_tokens.dtype
    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    excluded = {id(model.embed_tokens)}
    excluded |= {id(p) for m in moe for w in (m.w13, m.w2) for p in _stored(w)}
    excluded |= {id(m.table) for m in model.modules() if isinstance(m, NGramEmbedding)}
    dense = sum(p.nbytes for p in model.parameters() if id(p) not in excluded)
    kv_layers = []
    for m in model.modules():
        if isinstance(m, IndexedAttention):  # before GatedAttention, its base
            indexer = m.indexer
            ratio = indexer.compress_ratio
            kv_layers.append(
                KVRead(
                    2 * m.num_kv_heads * m.head_dim * dtype.itemsize,
                    max_tokens=(indexer.block_topk + 1) * ratio,
                    index_bytes_per_token=indexer.head_dim * dtype.itemsize / ratio,
                )
            )
        elif isinstance(m, GatedAttention):
            kv_layers.append(KVRead(2 * m.num_kv_heads * m.head_dim * dtype.itemsize))
    first = moe[0] if moe else None
    return DecodeTraffic(
        dense_weight_bytes=dense,
        embedding_row_bytes=model.embed_tokens.shape[1] * dtype.itemsize,
        expert_bytes=sum(p[0].nbytes for w in (first.w13, first.w2) for p in _stored(w)) if first else 0,
        num_experts=first.num_experts if first else 0,
        top_k=first.top_k if first else 0,
        num_moe_layers=len(moe),
        kv_layers=tuple(kv_layers),
        state_bytes_per_sequence=2 * model.state_bytes_per_slot(),
    )
