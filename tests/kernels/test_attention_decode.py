"""The one-launch split-KV decode attention against the torch reference, at small odd sizes.

Small key blocks (``block_n`` 16) and splits of one block make short contexts take many splits, so
the device-side split plan, the partials, the last program's merge and the counters run on the CPU
(through the interpreter) for contexts that are and are not multiples of the page (4) and split
sizes, with batches that end in padded graph rows (one-token contexts on the scratch page 0).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import attention as ref

PAGE_SIZE, HEAD_DIM = 4, 24
SMALL_BLOCKS = dict(block_n=16, split_keys=16)  # the smallest blocks tl.dot takes
PREFETCH = pytest.mark.parametrize("prefetch", [False, True], ids=["in-loop-pages", "prefetched-pages"])
CONTEXTS = [37, 1, 150, 16, 211, 9, 64]


def _batch(rng, contexts: list[int], query_lens: list[int], padded_rows: int, heads: tuple[int, int], dtype,
           head_dim: int = HEAD_DIM, page_size: int = PAGE_SIZE):
    """Inputs of ``paged_attention`` for the requests, then ``padded_rows`` rows laid out as the
    graph runner pads: one query token of a one-token context, page-table row all zeros."""
    hq, hkv = heads
    contexts = contexts + [1] * padded_rows
    query_lens = query_lens + [1] * padded_rows
    pages = [-(-c // page_size) for c in contexts[: len(contexts) - padded_rows]]
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages - 1, generator=rng) + 1  # page 0 is the scratch page
    table = torch.zeros(len(contexts), max(pages) + 3, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n].int()
        used += n
    cu = torch.tensor([0] + query_lens).cumsum(0).int()
    t = sum(query_lens)
    k_cache = torch.randn(num_pages, page_size, hkv, head_dim, generator=rng).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, head_dim, generator=rng).to(dtype)
    q_gate = torch.randn(t, hq, 2 * head_dim, generator=rng).to(dtype)
    q, gate = q_gate[..., :head_dim], q_gate[..., head_dim:]  # strided views, as the layer passes them
    on = lambda x: x.to(DEVICE)  # noqa: E731
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    return on(q), on(k_cache), on(v_cache), on(table), on(cu), on(seq_lens), on(gate)


def _counters_zero() -> bool:
    """Every arrival counter buffer is zero again (of any kernel, on any device)."""
    from freetoken.kernels.triton import _common

    buffers = [b for owned in _common._counter_buffers.values() for b in owned]
    return all(int(b.count_nonzero()) == 0 for b in buffers)


@pytest.mark.parametrize(
    "dtype,heads,with_gate,max_splits",
    [
        pytest.param(dtype, heads, gate, splits, id=f"{name}-{splits}splits")
        for name, dtype, heads, gate, all_splits in [
            ("f32-6q2kv-gate", torch.float32, (6, 2), True, (1, 3, 32)),
            ("bf16-8q2kv-gate", torch.bfloat16, (8, 2), True, (1, 3, 32)),
            ("bf16-3q3kv", torch.bfloat16, (3, 3), False, (3,)),  # no GQA: one query head a KV head
        ]
        for splits in all_splits
    ],
)
@PREFETCH
def test_decode_splits(rng, dtype, heads, with_gate, max_splits, prefetch):
    from freetoken.kernels.triton.attention_decode import DecodeTiles, paged_decode_attention

    q, k_cache, v_cache, table, cu, seq_lens, gate = _batch(rng, CONTEXTS, [1] * len(CONTEXTS), 3, heads, dtype)
    gate = gate if with_gate else None
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1)
    tiles = DecodeTiles(**SMALL_BLOCKS, prefetch_pages=prefetch)
    got = paged_decode_attention(*args, gate=gate, max_splits=max_splits, tiles=tiles)
    assert_close(got, ref.paged_attention_reference(*args, gate=gate))
    assert _counters_zero()


@PREFETCH
def test_most_splits(rng, prefetch):
    """``MAX_SPLITS`` splits of a long context: the second merge level's widest read."""
    from freetoken.kernels.triton.attention_decode import MAX_SPLITS, DecodeTiles, paged_decode_attention

    q, k_cache, v_cache, table, cu, seq_lens, gate = _batch(rng, [16 * MAX_SPLITS + 37], [1], 1, (6, 2), torch.float32)
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1)
    tiles = DecodeTiles(**SMALL_BLOCKS, prefetch_pages=prefetch)
    got = paged_decode_attention(*args, gate=gate, max_splits=MAX_SPLITS, tiles=tiles)
    assert_close(got, ref.paged_attention_reference(*args, gate=gate))
    assert _counters_zero()


@PREFETCH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_shape_default_tiles(rng, dtype, prefetch):
    """Qwen3.6-35B-A3B's heads (16 query / 2 KV of 256, pages of 16) with the default tiles, so the
    compile check (``FREETOKEN_COMPILE_CHECK``) compiles the variants the model launches; a 300-key
    context takes both merge levels (5 or 10 splits, at most 8); with ``prefetch_pages`` too, the
    sweep's other candidate."""
    from freetoken.kernels.triton.attention_decode import TILES, paged_decode_attention

    q, k_cache, v_cache, table, cu, seq_lens, gate = _batch(
        rng, [300, 1, 45], [1, 1, 1], 1, (16, 2), dtype, head_dim=256, page_size=16
    )
    args = (q, k_cache, v_cache, table, cu, seq_lens, 256**-0.5, 1)
    got = paged_decode_attention(*args, gate=gate, max_splits=8, tiles=replace(TILES, prefetch_pages=prefetch))
    assert_close(got, ref.paged_attention_reference(*args, gate=gate))
    assert _counters_zero()


def test_many_request_tiles(rng):
    """Launches of MANY_PROGRAMS (request, KV head) pairs and more take MANY_TILES (8 warps, page
    numbers prefetched, 2,048 keys a split): the Qwen shape's compiled variant at batch 64, and a
    2,100-key context that still splits in two, against the reference."""
    from freetoken.kernels.triton.attention_decode import MANY_PROGRAMS, MANY_TILES, TILES, decode_tiles
    from freetoken.kernels.triton.attention_decode import paged_decode_attention

    assert decode_tiles(MANY_PROGRAMS) is MANY_TILES and decode_tiles(MANY_PROGRAMS - 1) is TILES
    q, k_cache, v_cache, table, cu, seq_lens, gate = _batch(
        rng, [2100, 1, 45], [1, 1, 1], 1, (16, 2), torch.bfloat16, head_dim=256, page_size=16
    )
    args = (q, k_cache, v_cache, table, cu, seq_lens, 256**-0.5, 1)
    got = paged_decode_attention(*args, gate=gate, max_splits=4, tiles=MANY_TILES)
    assert_close(got, ref.paged_attention_reference(*args, gate=gate))
    assert _counters_zero()


@PREFETCH
def test_multi_token_steps(rng, prefetch):
    """Requests of 0, 1 and 2 new tokens (a verify step): causal masks inside the splits, and rows
    whose keys all lie past their position in the last split (log-sum-exp -inf)."""
    from freetoken.kernels.triton.attention_decode import DecodeTiles, paged_decode_attention

    q, k_cache, v_cache, table, cu, seq_lens, gate = _batch(
        rng, [37, 2, 150, 9, 17], [2, 2, 1, 0, 2], 1, (8, 2), torch.float32
    )
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 2)
    tiles = DecodeTiles(**SMALL_BLOCKS, prefetch_pages=prefetch)
    got = paged_decode_attention(*args, gate=gate, max_splits=8, tiles=tiles)
    assert_close(got, ref.paged_attention_reference(*args, gate=gate))
    assert _counters_zero()


def test_replay_with_longer_contexts(rng):
    """One set of static buffers, as a captured graph replays them: the contexts grow between calls
    (so does each request's split count) and every call matches the reference."""
    from freetoken.kernels.triton.attention_decode import DecodeTiles, paged_decode_attention

    q, k_cache, v_cache, table, cu, seq_lens, gate = _batch(rng, [150, 211, 64], [1, 1, 1], 2, (6, 2), torch.float32)
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1)
    for contexts in ([3, 5, 8, 1, 1], [40, 77, 9, 1, 1], [150, 211, 64, 1, 1]):
        seq_lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        got = paged_decode_attention(*args, gate=gate, max_splits=16, tiles=DecodeTiles(**SMALL_BLOCKS))
        assert_close(got, ref.paged_attention_reference(*args, gate=gate))
        assert _counters_zero()


@pytest.mark.parametrize("programs,down,want", [(3, False, 4), (3, True, 2), (8, False, 1), (9, True, 1),
                                                (1, False, 8)])
def test_split_axis_policy(programs, down, want):
    """The grid's split axis under the interpreter's 4 multiprocessors, 2 programs each: the power
    of two at or above the share of 8 slots, or the largest one that fits them."""
    from freetoken.kernels.triton.attention_decode import DecodeTiles, num_splits

    q = torch.empty(1, 1, 1)
    assert num_splits(q, programs, DecodeTiles(round_splits_down=down)) == want


def test_paged_attention_routes_decode_steps(rng):
    """``paged_attention`` of a decode step (the default tiles and split axis) is the decode launch's result."""
    from freetoken.kernels.triton.attention import paged_attention
    from freetoken.kernels.triton.attention_decode import paged_decode_attention

    q, k_cache, v_cache, table, cu, seq_lens, gate = _batch(rng, [211], [1], 0, (6, 2), torch.float32)
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1)
    got = paged_attention(*args, gate=gate)
    assert torch.equal(got, paged_decode_attention(*args, gate=gate))
    assert_close(got, ref.paged_attention_reference(*args, gate=gate))


def test_split_axis_is_bounded():
    from freetoken.kernels.triton.attention_decode import MAX_SPLITS, num_splits, paged_decode_attention

    q = torch.empty(1, 6, HEAD_DIM, device=DEVICE)
    assert 1 < num_splits(q, programs=2) <= MAX_SPLITS
    assert num_splits(q, programs=10**6) == 1
    cache = torch.empty(4, PAGE_SIZE, 2, HEAD_DIM, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="max_splits"):
        paged_decode_attention(q, cache, cache, one[None], torch.tensor([0, 1], device=DEVICE).int(), one, 1.0, 1,
                               max_splits=MAX_SPLITS + 1)
