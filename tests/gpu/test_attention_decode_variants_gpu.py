"""The decode attention's launch variants that ``benchmarks/attention_decode_sweep.py --focus`` times
(``prefetch_pages``, 32- and 64-key blocks, 3 and 4 stages, split axes 1 to 8 and the split
policies), at Qwen3.6-35B-A3B's shape (16 query / 2 KV heads of 256, pages of 16) on the GPU, each
against the torch reference, so whichever the sweep picks is checked at the real sizes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from freetoken.kernels import attention as ref

pytestmark = pytest.mark.gpu

HQ, HKV, HEAD_DIM, PAGE_SIZE = 16, 2, 256, 16
CUDA = torch.device("cuda")
VARIANTS = [  # (block_n, warps, stages, prefetch_pages)
    (64, 4, 3, False), (64, 4, 3, True), (64, 8, 3, True), (32, 4, 3, True), (32, 4, 4, True), (32, 8, 4, True),
]


def _inputs(rng, contexts: list[int], dtype: torch.dtype) -> tuple:
    pages_per_row = -(-max(contexts) // PAGE_SIZE)
    num_pages = len(contexts) * pages_per_row + 1
    shape = (num_pages, PAGE_SIZE, HKV, HEAD_DIM)
    k_cache = torch.randn(shape, generator=rng, device=CUDA).to(dtype)
    v_cache = torch.randn(shape, generator=rng, device=CUDA).to(dtype)
    perm = torch.randperm(num_pages - 1, generator=rng, device=CUDA)[: len(contexts) * pages_per_row] + 1
    table = perm.view(len(contexts), pages_per_row).int()
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=CUDA)
    cu = torch.arange(len(contexts) + 1, dtype=torch.int32, device=CUDA)
    q_gate = torch.randn(len(contexts), HQ, 2 * HEAD_DIM, generator=rng, device=CUDA).to(dtype)
    return (q_gate[..., :HEAD_DIM], k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1), q_gate[..., HEAD_DIM:]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"bn{v[0]}-w{v[1]}-s{v[2]}-{'pf' if v[3] else 'inloop'}")
@pytest.mark.parametrize("max_splits", [1, 2, 4, 8])
def test_decode_variants_batch64(rng, check, variant, max_splits):
    """64 requests of 1k-ish and odd contexts (ones shorter than a block, one a block past 1k), bf16."""
    from freetoken.kernels.triton.attention_decode import DecodeTiles, paged_decode_attention

    block_n, warps, stages, prefetch = variant
    contexts = [1024] * 56 + [1, 15, 17, 1000, 1025, 1088, 333, 2047]
    args, gate = _inputs(rng, contexts, torch.bfloat16)
    tiles = DecodeTiles(block_n=block_n, num_warps=warps, num_stages=stages, prefetch_pages=prefetch)
    got = paged_decode_attention(*args, gate=gate, max_splits=max_splits, tiles=tiles)
    check(f"decode_variant_{variant}_{max_splits}", got, ref.paged_attention_reference(*args, gate=gate),
          torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("down", [False, True])
def test_decode_prefetch_and_split_policy_graph_replay(rng, check, dtype, down):
    """``prefetch_pages`` with each split policy, captured at short contexts and replayed at 32k:
    the reference's result, and bitwise equal across two replays."""
    from freetoken.kernels.triton.attention_decode import TILES, paged_decode_attention

    contexts = [32768, 4097, 1, 1024]
    args, gate = _inputs(rng, contexts, dtype)
    seq_lens = args[5]
    tiles = replace(TILES, prefetch_pages=True, round_splits_down=down)
    final = seq_lens.clone()
    seq_lens.fill_(1)
    graph = torch.cuda.CUDAGraph()
    paged_decode_attention(*args, gate=gate, tiles=tiles)  # compiles, sizes the counters
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*args, gate=gate, tiles=tiles)
    seq_lens.copy_(final)
    graph.replay()
    torch.cuda.synchronize()
    check(f"decode_prefetch_graph_{down}", out, ref.paged_attention_reference(*args, gate=gate), dtype)
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
