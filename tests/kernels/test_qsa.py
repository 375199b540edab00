from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import qsa as ref
from freetoken.kernels.rotary import build_rotary_cache

INDEX_DIM, ROTARY_DIM = 20, 12


def _layout(rng, context_lens: list[int], query_lens: list[int], page_size: int):
    """Distinct shuffled pages per request; each request's new tokens are its last ``query_lens``."""
    pages_needed = [-(-c // page_size) for c in context_lens]
    num_pages = sum(pages_needed) + 3
    perm = torch.randperm(num_pages - 1, generator=rng) + 1
    table = torch.zeros(len(context_lens), max(pages_needed) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = perm[used : used + n].int()
        used += n
    requests = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(context_lens, query_lens)])
    kv_locations = table[requests, positions // page_size].long() * page_size + positions % page_size
    return num_pages, table.to(DEVICE), requests.to(DEVICE), positions.to(DEVICE), kv_locations.to(DEVICE)


CASES = {
    # name: (context lens, query lens, page size, compress ratio)
    "decode_block_is_page": ([37, 8, 1, 64], [1, 1, 1, 1], 4, 4),
    "mixed_blocks_in_pages": ([23, 9, 30, 7], [1, 1, 13, 7], 8, 2),
    "prefill_blocks_across_pages": ([61], [29], 2, 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_qsa_update_index(rng, dtype, case):
    from freetoken.kernels.triton.qsa import qsa_update_index

    context_lens, query_lens, page_size, ratio = CASES[case]
    num_pages, table, requests, positions, kv_locations = _layout(rng, context_lens, query_lens, page_size)
    per_page = ref.blocks_per_page(page_size, ratio)
    index_cache = torch.randn(num_pages, page_size, INDEX_DIM, generator=rng).to(dtype).to(DEVICE)
    block_cache = torch.randn(num_pages, per_page, INDEX_DIM, generator=rng).to(dtype).to(DEVICE)
    keys = torch.randn(len(positions), INDEX_DIM + 3, generator=rng).to(dtype).to(DEVICE)[:, 3:]
    weight = (torch.randn(INDEX_DIM, generator=rng) * 0.3).to(dtype).to(DEVICE)
    rotary = build_rotary_cache(ROTARY_DIM, 128, 10000.0, DEVICE)
    want_index, want_blocks = index_cache.clone(), block_cache.clone()
    args = (kv_locations, table, requests, positions, weight, 1e-6, rotary, ROTARY_DIM, ratio)
    ref.qsa_update_index_reference(keys, want_index, want_blocks, *args)
    qsa_update_index(keys, index_cache, block_cache, *args)
    assert torch.equal(index_cache, want_index)
    assert_close(block_cache, want_blocks)


def _block_cache_and_queries(rng, num_pages, per_page, num_tokens, heads):
    block_cache = torch.randn(num_pages, per_page, INDEX_DIM, generator=rng).to(DEVICE)
    q = torch.randn(num_tokens, heads, INDEX_DIM, generator=rng).to(DEVICE)
    return block_cache, q


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("topk", [1, 3])
def test_qsa_select_blocks(rng, case, topk):
    from freetoken.kernels.triton.qsa import qsa_select_blocks

    context_lens, query_lens, page_size, ratio = CASES[case]
    num_pages, table, requests, positions, _ = _layout(rng, context_lens, query_lens, page_size)
    block_cache, q = _block_cache_and_queries(rng, num_pages, ref.blocks_per_page(page_size, ratio), len(positions), 5)
    args = (q, block_cache, table, requests, positions, page_size, ratio, topk, max(context_lens) // ratio + 2)
    got = qsa_select_blocks(*args)
    want = ref.qsa_select_blocks_reference(*args)
    assert torch.equal(got, want)
    assert (want[positions + 1 >= (topk + 1) * ratio] >= 0).all(), "queries past the budget keep topk blocks"


def test_qsa_select_blocks_ties_and_many_blocks(rng):
    """Hundreds of blocks (several radix tiles), many scoring exactly 0 (every head negative) or
    exactly equal (repeated keys, integer-valued scores): ties go to the lower block index in both
    implementations."""
    from freetoken.kernels.triton.qsa import qsa_select_blocks

    page_size, ratio, topk = 4, 2, 9
    context_lens, query_lens = [701, 300, 40], [1, 3, 1]
    num_pages, table, requests, positions, _ = _layout(rng, context_lens, query_lens, page_size)
    block_cache, q = _block_cache_and_queries(rng, num_pages, ref.blocks_per_page(page_size, ratio), 5, 3)
    # Small integers make every score exact in any summation order, so identical keys score exactly
    # alike (random floats left them an ulp apart under the interpreter's BLAS on about a third of seeds).
    block_cache, q = (block_cache * 1.5).round(), (q * 1.5).round()
    block_cache[::3] = block_cache[1]  # many identical keys
    q[1] = -q[1].abs()
    block_cache[block_cache.shape[0] // 2 :] = block_cache[block_cache.shape[0] // 2 :].abs()  # zero scores for q[1]
    args = (q, block_cache, table, requests, positions, page_size, ratio, topk, 400)
    got = qsa_select_blocks(*args)
    assert torch.equal(got, ref.qsa_select_blocks_reference(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_gate", [False, True])
def test_qsa_sparse_attention(rng, dtype, case, with_gate):
    from freetoken.kernels.triton.qsa import qsa_sparse_attention

    context_lens, query_lens, page_size, ratio = CASES[case]
    num_pages, table, requests, positions, _ = _layout(rng, context_lens, query_lens, page_size)
    q_heads, kv_heads, head_dim, topk = 6, 2, 24, 2
    q = torch.randn(len(positions), q_heads, head_dim, generator=rng).to(dtype).to(DEVICE)
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=rng).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=rng).to(dtype).to(DEVICE)
    gate = torch.randn(q.shape, generator=rng).to(dtype).to(DEVICE) if with_gate else None
    scores = torch.rand(len(positions), max(context_lens), generator=rng)
    complete = ((positions.cpu() + 1) // ratio)[:, None]
    scores[torch.arange(scores.shape[1])[None, :] >= complete] = -1
    chosen = scores.topk(topk, dim=1)
    selected = torch.where(chosen.values >= 0, chosen.indices, -1).int().to(DEVICE)
    args = (q, k_cache, v_cache, table, requests, positions, selected, ratio, head_dim**-0.5)
    got = qsa_sparse_attention(*args, gate=gate)
    assert_close(got, ref.qsa_sparse_attention_reference(*args, gate=gate))
