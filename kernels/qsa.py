"""QSA (Qwen4-Exp's query-aware sparse attention) over the paged KV cache.

Every ``c = compress_ratio`` consecutive tokens of a request form a block. Beside the paged K/V, a
QSA layer keeps per page:

- ``index_cache [num_pages, page_size, Di]``: each token's raw index key (the indexer's key head
  before any norm), so a block can be pooled once its last token arrives, whichever step that is;
- ``block_cache [num_pages, blocks_per_page, Di]``: each complete block's pooled key
  ``rope(k_norm(mean of its raw keys), position of the block's first token)``. Block ``j`` of a
  request lives in the page of its first token ``j·c``, at index ``(j·c mod page_size) // c``
  (``blocks_per_page = max(1, page_size // c)``; one of ``page_size``, ``c`` divides the other).

The query at position ``p`` sees ``n = (p + 1) // c`` complete blocks. It scores them
``Σ_h relu(q_h · K_j) / sqrt(Di)`` over its ``Hi`` indexer heads, keeps the best
``min(block_topk, n)`` (ties: the lower block index), and attends to their tokens plus the
incomplete tail ``n·c .. p``: at most ``block_topk · c + c - 1`` tokens, whatever the context.

The flat batch layout is the engine's: ``token_request [T]`` names each token's request (its row
of ``page_table``), ``positions [T]`` its position, which is also its index in the request's cache.
"""

from __future__ import annotations

import math

import torch

from freetoken.kernels.dispatch import op


def blocks_per_page(page_size: int, compress_ratio: int) -> int:
    if page_size % compress_ratio and compress_ratio % page_size:
        raise ValueError(
            f"page_size ({page_size}) and indexer_compress_ratio ({compress_ratio}) must divide one another"
        )
    return max(1, page_size // compress_ratio)


def block_location(
    page_table: torch.Tensor, request: torch.Tensor, block: torch.Tensor, page_size: int, compress_ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page, index in page)`` of blocks ``block`` of requests ``request`` (same shapes)."""
    first = block * compress_ratio
    page = page_table[request, first // page_size].long()
    return page, (first % page_size) // compress_ratio


def _token_rows(cache: torch.Tensor, page_table: torch.Tensor, request: int, length: int) -> torch.Tensor:
    """The first ``length`` token rows of request ``request`` in a ``[num_pages, page_size, ...]`` cache."""
    page_size = cache.shape[1]
    pages = page_table[request, : -(-length // page_size)].long()
    return cache[pages].flatten(0, 1)[:length]


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary_cache: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """NeoX rotary of ``x [N, D]``'s first ``rotary_dim`` dims (cos/sin rounded to ``x``'s dtype first)."""
    cos, sin = rotary_cache[positions].to(x.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


def qsa_update_index_reference(
    keys: torch.Tensor,
    index_cache: torch.Tensor,
    block_cache: torch.Tensor,
    kv_locations: torch.Tensor,
    page_table: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rotary_cache: torch.Tensor,
    rotary_dim: int,
    compress_ratio: int,
) -> None:
    """Store the raw index keys ``keys [T, Di]``, then pool every block a token of this step completes.

    The pooled key is ``mean`` (float32, rounded) -> zero-centred RMSNorm ``k_norm`` (``norm_weight``)
    -> rotary at the block's first position, as the reference indexer computes it.
    """
    num_pages, page_size, dim = index_cache.shape
    index_cache.view(num_pages * page_size, dim)[kv_locations] = keys.to(index_cache.dtype)
    closing = torch.nonzero((positions + 1) % compress_ratio == 0).flatten()
    if closing.numel() == 0:
        return
    request = token_request.long()[closing]
    block = (positions[closing] + 1) // compress_ratio - 1
    members = block[:, None] * compress_ratio + torch.arange(compress_ratio, device=keys.device)[None, :]
    pages = page_table[request[:, None], members // page_size].long()
    raw = index_cache[pages, members % page_size]  # [N, c, Di]
    pooled = raw.float().mean(dim=1).to(index_cache.dtype)
    pf = pooled.float()
    normed = (pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + norm_weight.float())).to(pooled.dtype)
    rotated = _rope(normed, block * compress_ratio, rotary_cache, rotary_dim)
    page, index = block_location(page_table, request, block, page_size, compress_ratio)
    block_cache[page, index] = rotated.to(block_cache.dtype)


def qsa_select_blocks_reference(
    q: torch.Tensor,
    block_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    max_blocks: int,
) -> torch.Tensor:
    """The blocks each query ``q [T, Hi, Di]`` attends to: int32 ``[T, block_topk]``, ascending, -1 padded.

    ``max_blocks`` bounds the complete blocks of any query of the batch (kernels size their scratch
    with it, so a batch with a static bound can be captured in a CUDA graph). The reference checks
    the bound; a kernel cannot raise, it scores only the first ``max_blocks`` blocks.
    """
    num_tokens, _, dim = q.shape
    selected = torch.full((num_tokens, block_topk), -1, dtype=torch.int32, device=q.device)
    complete = (positions.long() + 1) // compress_ratio
    if num_tokens and int(complete.max()) > max_blocks:
        raise ValueError(f"a query sees {int(complete.max())} complete blocks, more than max_blocks={max_blocks}")
    for request in torch.unique(token_request).tolist():
        tokens = torch.nonzero(token_request == request).flatten()
        counts = complete[tokens]
        num_blocks = int(counts.max())
        if num_blocks == 0:
            continue
        blocks = torch.arange(num_blocks, device=q.device)
        page, index = block_location(page_table, torch.full_like(blocks, request), blocks, page_size, compress_ratio)
        keys = block_cache[page, index].float()  # [n, Di]
        scores = torch.relu(torch.einsum("thd,nd->tnh", q[tokens].float(), keys)).sum(-1) / math.sqrt(dim)
        scores = scores.masked_fill(blocks[None, :] >= counts[:, None], float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :block_topk]
        kept = torch.gather(scores, 1, order) > float("-inf")
        chosen = torch.where(kept, order, num_blocks).sort(dim=-1).values
        chosen = torch.where(chosen == num_blocks, -1, chosen)
        selected[tokens, : chosen.shape[1]] = chosen.to(torch.int32)
    return selected


def qsa_sparse_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    selected: torch.Tensor,
    compress_ratio: int,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """GQA attention of ``q [T, Hq, D]`` over the tokens of its ``selected`` blocks plus its tail.

    float32 softmax; ``gate [T, Hq, D]`` (optional) multiplies the output by ``sigmoid(gate)``.
    """
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    for request in torch.unique(token_request).tolist():
        tokens = torch.nonzero(token_request == request).flatten()
        pos = positions[tokens].long()
        length = int(pos.max()) + 1
        keys = _token_rows(k_cache, page_table, request, length).repeat_interleave(group, dim=1).transpose(0, 1)
        values = _token_rows(v_cache, page_table, request, length).repeat_interleave(group, dim=1).transpose(0, 1)
        key_pos = torch.arange(length, device=q.device)
        tail_start = (pos + 1) // compress_ratio * compress_ratio
        visible = (key_pos[None, :] >= tail_start[:, None]) & (key_pos[None, :] <= pos[:, None])
        num_blocks = -(-length // compress_ratio) + 1
        chosen = selected[tokens].long()
        block_mask = torch.zeros(len(tokens), num_blocks, dtype=torch.bool, device=q.device)
        block_mask.scatter_(1, torch.where(chosen >= 0, chosen, num_blocks - 1), True)
        block_mask[:, -1] = False
        visible |= block_mask[:, key_pos // compress_ratio]
        scores = (q[tokens].transpose(0, 1) @ keys.to(q.dtype).transpose(1, 2)).float() * scale  # [Hq, L, S]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[tokens] = (probs @ values.to(q.dtype)).transpose(0, 1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out


qsa_update_index = op("qsa")(qsa_update_index_reference)
qsa_select_blocks = op("qsa")(qsa_select_blocks_reference)
qsa_sparse_attention = op("qsa")(qsa_sparse_attention_reference)
