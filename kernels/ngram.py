"""Hashed n-gram embeddings of Qwen4-Exp's PLE layers: window, hash, and the table gather.

Each token ``x_p`` looks at its window ``w_s = x_{p-s}`` for ``s = 0 .. N-1`` (``N = ngram_size``),
where a window position is replaced by EOS when it lies before the request's first token or when an
EOS occurs among ``x_{p-s} .. x_{p-1}`` (an n-gram never spans a document boundary). The n-gram of
order ``n`` hashes ``w_0 · m_0 xor ... xor w_{n-1} · m_{n-1}`` (int64, the per-layer odd multipliers
``m``); each of its ``heads_per_ngram`` heads takes that modulo its own prime and adds the head's row
offset in the layer's table. The embedding is the heads' rows concatenated.

Per request, the last ``N - 1`` tokens seen are kept in a slot pool ``context [num_slots, N - 1]``
(int64, oldest first, EOS for a fresh request); a step's tokens of request ``b`` are the flat rows
``cu_seqlens[b] : cu_seqlens[b + 1]``, ``token_request [T]`` names each token's request.

The table may live in host memory while the tokens live on the GPU: the gather reads only the rows
the step needs (see docs/qwen4_exp.md).
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op


def ngram_windows(
    input_ids: torch.Tensor,
    context: torch.Tensor,
    state_slots: torch.Tensor,
    token_request: torch.Tensor,
    cu_seqlens: torch.Tensor,
    eos_token_id: int,
) -> torch.Tensor:
    """``[T, N]`` int64: each token's window ``w_0 .. w_{N-1}``, EOS rules applied."""
    num_tokens, context_len = input_ids.shape[0], context.shape[1]
    flat = torch.arange(num_tokens, device=input_ids.device)
    request = token_request.long()
    local = flat - cu_seqlens.long()[request]
    slot = state_slots.long()[request]
    columns = [input_ids.long()]
    boundary = torch.zeros(num_tokens, dtype=torch.bool, device=input_ids.device)
    eos = torch.full_like(columns[0], eos_token_id)
    for shift in range(1, context_len + 1):
        in_chunk = local >= shift
        from_chunk = input_ids.long()[(flat - shift).clamp_min(0)]
        from_context = context[slot, (context_len + local - shift).clamp(0, context_len - 1)]
        raw = torch.where(in_chunk, from_chunk, from_context)
        columns.append(torch.where(boundary, eos, raw))
        boundary = boundary | (raw == eos_token_id)
    return torch.stack(columns, dim=1)


def ngram_ids(
    windows: torch.Tensor,
    multipliers: torch.Tensor,
    head_vocab_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    heads_per_ngram: int,
) -> torch.Tensor:
    """``[T, (N - 1) · heads_per_ngram]`` int64 table rows from the windows ``[T, N]``."""
    blocks = []
    mixed = windows[:, 0] * multipliers[0]
    for order in range(2, windows.shape[1] + 1):
        mixed = torch.bitwise_xor(mixed, windows[:, order - 1] * multipliers[order - 1])
        heads = slice((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mixed[:, None], head_vocab_sizes[heads]) + head_offsets[heads])
    return torch.cat(blocks, dim=1)


def ngram_embed_reference(
    input_ids: torch.Tensor,
    context: torch.Tensor,
    state_slots: torch.Tensor,
    token_request: torch.Tensor,
    cu_seqlens: torch.Tensor,
    multipliers: torch.Tensor,
    head_vocab_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    heads_per_ngram: int,
    eos_token_id: int,
    table: torch.Tensor,
) -> torch.Tensor:
    """``[T, heads · head_dim]`` in the table's dtype, on ``input_ids``' device.

    ``table [rows, head_dim]`` may sit on another device (host memory): only the needed rows move.
    Reads ``context``; :func:`ngram_update_context` advances it after every layer has read it.
    """
    windows = ngram_windows(input_ids, context, state_slots, token_request, cu_seqlens, eos_token_id)
    rows = ngram_ids(windows, multipliers, head_vocab_sizes, head_offsets, heads_per_ngram)
    gathered = table[rows.to(table.device)]
    return gathered.to(input_ids.device).flatten(1)


def ngram_update_context_reference(
    input_ids: torch.Tensor, context: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor
) -> None:
    """Each request's slot keeps the last ``N - 1`` tokens of (its old context ++ its new tokens)."""
    context_len = context.shape[1]
    starts = cu_seqlens.long()[:-1]
    lengths = cu_seqlens.long()[1:] - starts
    source = lengths[:, None] + torch.arange(context_len, device=context.device)[None, :]  # index in ext
    slots = state_slots.long()
    from_context = context[slots[:, None], source.clamp(max=context_len - 1)]
    from_chunk = input_ids.long()[(starts[:, None] + source - context_len).clamp(0, max(input_ids.shape[0] - 1, 0))]
    context[slots] = torch.where(source < context_len, from_context, from_chunk)


ngram_embed = op("ngram")(ngram_embed_reference)
ngram_update_context = op("ngram")(ngram_update_context_reference)
