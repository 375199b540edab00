from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import attention as ref


def _layout(rng, context_lens: list[int], query_lens: list[int], page_size: int, num_pages: int):
    """A random page table for requests of the given lengths (distinct pages, shuffled)."""
    pages_needed = [-(-c // page_size) for c in context_lens]
    perm = torch.randperm(num_pages - 1, generator=rng) + 1
    table = torch.zeros(len(context_lens), max(pages_needed) + 2, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = perm[used : used + n].int()
        used += n
    cu = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int()
    return table.to(DEVICE), cu.to(DEVICE), torch.tensor(context_lens, dtype=torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_strided(rng, dtype):
    from freetoken.kernels.triton.attention import store_kv

    t, h, d, pages, page_size = 9, 3, 20, 6, 4
    packed = torch.randn(t, 2 * h * d + 3, generator=rng).to(dtype).to(DEVICE)
    k = packed[:, : h * d].reshape(t, h, d)
    v = packed[:, h * d + 3 :].reshape(t, h, d)
    k_cache = torch.randn(pages, page_size, h, d, generator=rng).to(dtype).to(DEVICE)
    v_cache = torch.randn(pages, page_size, h, d, generator=rng).to(dtype).to(DEVICE)
    kv_locations = (torch.randperm(pages * page_size, generator=rng)[:t]).to(DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv_reference(k, v, want_k, want_v, kv_locations)
    store_kv(k, v, k_cache, v_cache, kv_locations)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


CASES = {
    # name: (context lens, query lens): decodes first, then prefill chunks with cached prefixes.
    "decode": ([37, 5, 1, 64], [1, 1, 1, 1]),
    "decode_long": ([150], [1]),  # one request: its keys are split
    "mixed": ([23, 9, 30, 7], [1, 1, 13, 7]),
    "prefill_long": ([150], [75]),
    "prefill_batch": ([100, 40, 130], [100, 17, 66]),  # several prefills, one from an empty cache
}


@pytest.mark.parametrize(
    "dtype,case,heads,with_gate",
    [
        pytest.param(dtype, case, heads, gate, id=f"{str(dtype)[6:]}-{case}-{heads[0]}q{heads[1]}kv-{'gate' if gate else 'nogate'}")
        for dtype, case, heads, gate in [(torch.float32, c, (6, 2), True) for c in CASES]
        + [(torch.bfloat16, c, (3, 3), False) for c in CASES]
        + [(torch.bfloat16, "mixed", (6, 2), True), (torch.float32, "decode", (3, 3), False)]
        # 128-row prefill tiles (GQA group 4 x 32 tokens), full and causal key blocks
        + [(torch.bfloat16, c, (8, 2), True) for c in ("prefill_long", "prefill_batch")]
    ],
)
def test_paged_attention(rng, dtype, case, heads, with_gate):
    from freetoken.kernels.triton.attention import paged_attention

    context_lens, query_lens = CASES[case]
    (hq, hkv), d, page_size, num_pages = heads, 24, 4, 80
    table, cu, seq_lens = _layout(rng, context_lens, query_lens, page_size, num_pages)
    t = sum(query_lens)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=rng).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=rng).to(dtype).to(DEVICE)
    q_gate = torch.randn(t, hq, 2 * d, generator=rng).to(dtype).to(DEVICE)
    q, gate = q_gate[..., :d], q_gate[..., d:]  # strided views, as the layer passes them
    gate = gate if with_gate else None
    args = (q, k_cache, v_cache, table, cu, seq_lens, d**-0.5, max(query_lens))
    got = paged_attention(*args, gate=gate)
    assert_close(got, ref.paged_attention_reference(*args, gate=gate))


def test_decode_batches_split_the_keys():
    from freetoken.kernels.triton.attention_decode import num_splits

    q = torch.empty(1, 6, 24, device=DEVICE)
    assert num_splits(q, programs=1 * 2) > 1


@pytest.mark.parametrize(
    "dtype,case,registers",
    [(torch.float32, "prefill_batch", 0), (torch.bfloat16, "prefill_long", 0), (torch.bfloat16, "prefill_batch", 128)],
)
def test_paged_attention_prefill_tiles(rng, monkeypatch, dtype, case, registers):
    """The prefill kernel's softmax over full and causal key blocks, requests from an empty cache
    and with cached prefixes, 128-row GQA tiles in half precision, with the register cap
    (``PREFILL_MAX_REGISTERS``) or without."""
    from freetoken.kernels.triton import attention

    monkeypatch.setattr(attention, "PREFILL_MAX_REGISTERS", registers)
    context_lens, query_lens = CASES[case]
    hq, hkv, d, page_size, num_pages = 8, 2, 24, 4, 80
    table, cu, seq_lens = _layout(rng, context_lens, query_lens, page_size, num_pages)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=rng).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=rng).to(dtype).to(DEVICE)
    q_gate = torch.randn(sum(query_lens), hq, 2 * d, generator=rng).to(dtype).to(DEVICE)
    q, gate = q_gate[..., :d], q_gate[..., d:]
    args = (q, k_cache, v_cache, table, cu, seq_lens, d**-0.5, max(query_lens))
    assert_close(attention.paged_attention(*args, gate=gate), ref.paged_attention_reference(*args, gate=gate))
