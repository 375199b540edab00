"""The one-launch split-KV decode attention at Qwen3.6-35B-A3B's shape (16 query / 2 KV heads of 256,
pages of 16) on the GPU: against the torch reference at batch 1 to 64 and contexts up to 32k, and
inside a CUDA graph captured once and replayed for contexts that change between replays (the split
plan is derived on the device), bitwise equal across replays of the same inputs."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import attention as ref

pytestmark = pytest.mark.gpu

HQ, HKV, HEAD_DIM, PAGE_SIZE = 16, 2, 256, 16
CUDA = torch.device("cuda")


def _caches(rng, num_pages: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_pages, PAGE_SIZE, HKV, HEAD_DIM)
    return (torch.randn(shape, generator=rng, device=CUDA).to(dtype),
            torch.randn(shape, generator=rng, device=CUDA).to(dtype))


def _table(rng, num_rows: int, pages_per_row: int, num_pages: int) -> torch.Tensor:
    """Distinct shuffled pages per row (page 0, the scratch page, left out)."""
    perm = torch.randperm(num_pages - 1, generator=rng, device=CUDA)[: num_rows * pages_per_row] + 1
    return perm.view(num_rows, pages_per_row).int()


def _queries(rng, num_rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q_gate = torch.randn(num_rows, HQ, 2 * HEAD_DIM, generator=rng, device=CUDA).to(dtype)
    return q_gate[..., :HEAD_DIM], q_gate[..., HEAD_DIM:]


CASES = {
    "batch1_1k": [1000],
    "batch1_8k": [8191],
    "batch1_32k": [32768],
    "batch8_odd": [1, 17, 1024, 4097, 15, 2049, 333, 8000],
    "batch64": [int(x) for x in torch.randint(1, 8192, (64,), generator=torch.Generator().manual_seed(1))],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention_real_sizes(rng, check, dtype, case):
    from freetoken.kernels.triton.attention import paged_attention

    contexts = CASES[case]
    pages_per_row = -(-max(contexts) // PAGE_SIZE)
    num_pages = len(contexts) * pages_per_row + 1
    k_cache, v_cache = _caches(rng, num_pages, dtype)
    table = _table(rng, len(contexts), pages_per_row, num_pages)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=CUDA)
    cu = torch.arange(len(contexts) + 1, dtype=torch.int32, device=CUDA)
    q, gate = _queries(rng, len(contexts), dtype)
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1)
    got = paged_attention(*args, gate=gate)
    check(f"decode_attention_{case}", got, ref.paged_attention_reference(*args, gate=gate), dtype)
    assert torch.equal(got, paged_attention(*args, gate=gate)), "not deterministic"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_attention_graph_replays(rng, check, dtype, batch):
    """Captured at short contexts, replayed at others: each replay matches the reference and a
    second replay of the same inputs is bitwise equal (fixed merge order). The last rows are
    padding rows as the graph runner writes them (one-token context, page-table row zero)."""
    from freetoken.kernels.triton.attention import paged_attention

    max_context = 16384
    pages_per_row = max_context // PAGE_SIZE
    num_pages = batch * pages_per_row + 1
    k_cache, v_cache = _caches(rng, num_pages, dtype)
    rows = batch + 1  # one padding row
    table = torch.zeros(rows, pages_per_row, dtype=torch.int32, device=CUDA)
    table[:batch] = _table(rng, batch, pages_per_row, num_pages)
    seq_lens = torch.ones(rows, dtype=torch.int32, device=CUDA)
    cu = torch.arange(rows + 1, dtype=torch.int32, device=CUDA)
    q, gate = _queries(rng, rows, dtype)
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1)
    paged_attention(*args, gate=gate)  # compiles, and sizes the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(*args, gate=gate)
    for contexts in ([5] * batch, [1000] * batch, [max_context - 3] + [777] * (batch - 1), [17] * batch):
        seq_lens[:batch].copy_(torch.tensor(contexts, dtype=torch.int32))
        graph.replay()
        first = out.clone()
        graph.replay()
        assert torch.equal(first, out), f"replays differ at contexts {contexts[:2]}"
        check(f"decode_graph_{contexts[0]}", first, ref.paged_attention_reference(*args, gate=gate), dtype)
