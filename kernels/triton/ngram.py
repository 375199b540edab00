"""Triton n-gram embedding: window, hash and table gather in one launch, and the context advance.

One program per (token, head): it rebuilds the token's window from the step's tokens and its
request's context slot, hashes the head's n-gram, and copies the table row to the output. The table
may be host memory registered with CUDA (pinned in place, mapped): the GPU then reads the needed rows
straight over PCIe (zero-copy), no host round trip, no device->host sync, so a step stays capturable
in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import new_empty, pow2


@triton.jit
def _ngram_embed_kernel(
    ids_ptr, ctx_ptr, ctx_st, slots_ptr, req_ptr, cu_ptr, mult_ptr, sizes_ptr, offsets_ptr, table_ptr, tbl_st,
    out_ptr, head_dim, num_heads, heads_per_ngram, eos,
    CONTEXT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    order = head // heads_per_ngram + 2  # tokens in this head's n-gram
    request = tl.load(req_ptr + t)
    local = t - tl.load(cu_ptr + request)
    slot = tl.load(slots_ptr + request).to(tl.int64)
    mixed = tl.load(ids_ptr + t).to(tl.int64) * tl.load(mult_ptr)
    boundary = tl.full([], 0, tl.int1)  # an EOS seen between the token and this window position
    for shift in tl.static_range(1, CONTEXT + 1):
        if local >= shift:
            raw = tl.load(ids_ptr + t - shift).to(tl.int64)
        else:
            raw = tl.load(ctx_ptr + slot * ctx_st + CONTEXT + local - shift)
        token = tl.where(boundary, eos, raw)
        if shift < order:
            mixed = mixed ^ (token * tl.load(mult_ptr + shift))
        boundary = boundary | (raw == eos)
    row = mixed % tl.load(sizes_ptr + head) + tl.load(offsets_ptr + head)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < head_dim
    values = tl.load(table_ptr + row * tbl_st + cols, mask=mask)
    tl.store(out_ptr + t * (num_heads * head_dim) + head * head_dim + cols, values, mask=mask)


def ngram_embed(
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
    num_tokens = input_ids.shape[0]
    context_len = context.shape[1]
    num_heads = head_vocab_sizes.shape[0]
    head_dim = table.shape[1]
    if num_heads != context_len * heads_per_ngram or multipliers.shape[0] != context_len + 1:
        raise ValueError(
            f"ngram_embed: {num_heads} heads, {multipliers.shape[0]} multipliers and a context of {context_len} "
            f"do not fit {heads_per_ngram} heads per n-gram"
        )
    if table.stride(-1) != 1 or context.stride(-1) != 1:
        raise ValueError("ngram_embed: table and context need a unit-stride last dim")
    out = new_empty((num_tokens, num_heads * head_dim), table.dtype, input_ids.device)
    if num_tokens:
        _ngram_embed_kernel[(num_tokens, num_heads)](
            input_ids, context, context.stride(0), state_slots, token_request, cu_seqlens,
            multipliers, head_vocab_sizes, head_offsets, table, table.stride(0),
            out, head_dim, num_heads, heads_per_ngram, eos_token_id,
            CONTEXT=context_len, BLOCK_D=pow2(head_dim),
        )
    return out


@triton.jit
def _update_context_kernel(ids_ptr, ctx_ptr, ctx_st, slots_ptr, cu_ptr, CONTEXT: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slots_ptr + b).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    source = length + rows  # index in context ++ new tokens
    ok = rows < CONTEXT
    old = tl.load(ctx_ptr + slot * ctx_st + source, mask=ok & (source < CONTEXT), other=0)
    new = tl.load(ids_ptr + start + source - CONTEXT, mask=ok & (source >= CONTEXT), other=0).to(tl.int64)
    tl.store(ctx_ptr + slot * ctx_st + rows, tl.where(source < CONTEXT, old, new), mask=ok)


def ngram_update_context(
    input_ids: torch.Tensor, context: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor
) -> None:
    context_len = context.shape[1]
    if context.stride(-1) != 1:
        raise ValueError("ngram_update_context: context needs a unit-stride last dim")
    if state_slots.shape[0]:
        _update_context_kernel[(state_slots.shape[0],)](
            input_ids, context, context.stride(0), state_slots, cu_seqlens,
            CONTEXT=context_len, BLOCK=pow2(context_len),
        )
