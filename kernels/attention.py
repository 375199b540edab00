"""Paged causal attention over a request batch laid out as one flat token dimension.

Layout: ``q [T, Hq, D]`` holds the new tokens of every request back to back (``cu_seqlens_q``
splits them); the key/value cache of a layer is ``[num_pages, page_size, Hkv, D]`` and request
``b`` owns pages ``page_table[b, :ceil(seq_lens[b] / page_size)]``. ``seq_lens[b]`` counts every
token of request ``b`` in the cache after this step's tokens were stored, so its new tokens sit at
positions ``seq_lens[b] - q_len .. seq_lens[b] - 1`` and each attends to every earlier position.
A decode step is the case ``q_len == 1``.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_locations: torch.Tensor
) -> None:
    """Write ``k, v [T, Hkv, D]`` to the flat KV locations ``kv_locations [T]`` (page * page_size + offset)."""
    num_pages, page_size = k_cache.shape[:2]
    k_cache.view(num_pages * page_size, *k_cache.shape[2:])[kv_locations] = k.to(k_cache.dtype)
    v_cache.view(num_pages * page_size, *v_cache.shape[2:])[kv_locations] = v.to(v_cache.dtype)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens stored in ``pages`` of ``cache``, as ``[length, H, D]``."""
    return cache[pages].flatten(0, 1)[:length]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of the new tokens over their requests' pages, float32 softmax.

    ``gate [T, Hq, D]`` (optional) multiplies the output by ``sigmoid(gate)``: the output gate of
    Qwen3.5's full attention. ``max_seqlen_q`` bounds the tokens of one request (kernels size
    their grid with it).
    """
    page_size = k_cache.shape[1]
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, context_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        num_pages = -(-context_len // page_size)
        keys = gather_pages(k_cache, page_table[b, :num_pages].long(), context_len)
        values = gather_pages(v_cache, page_table[b, :num_pages].long(), context_len)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [Hq, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
        queries = q[start:end].transpose(0, 1)  # [Hq, L, D]
        scores = (queries.float() @ keys.transpose(1, 2)) * scale
        query_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = (probs @ values).transpose(0, 1).to(q.dtype)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out


store_kv = op("attention")(store_kv_reference)
paged_attention = op("attention")(paged_attention_reference)
