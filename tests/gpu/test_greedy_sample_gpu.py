"""The greedy step's one launch (``kernels.greedy_sample_into_slots``: a split argmax whose last
program books the token in its slot) at Qwen3.6's 248,320-token vocabulary: against the reference
and ``sample_tokens`` at temperature 0, eagerly and replayed from a CUDA graph (the arrival
counters left at zero between replays)."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.sampling import greedy_sample_into_slots_reference

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
VOCAB, SLOTS = 248320, 70


def _tables(rng):
    last = torch.randint(0, VOCAB, (SLOTS,), generator=rng, device=CUDA)
    counts = torch.randint(0, 3, (SLOTS, VOCAB), generator=rng, device=CUDA, dtype=torch.int32)
    params = torch.randint(0, 9, (SLOTS, 3), generator=rng, device=CUDA)
    return last, counts, params


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_greedy_sample_into_slots_real_vocab(rng, batch):
    from freetoken.kernels.triton import _common, sampling

    logits = torch.randn(batch, VOCAB, generator=rng, device=CUDA) * 4
    logits[0, [11, VOCAB - 5]] = 100.0  # a tie across splits: the lower id
    slots = torch.randperm(SLOTS, generator=rng, device=CUDA)[:batch].to(torch.int32)
    got_t = _tables(rng)
    want_t = tuple(t.clone() for t in got_t)
    got = sampling.greedy_sample_into_slots(logits, slots, got_t[0], got_t[1], got_t[2][:, 2])
    want = greedy_sample_into_slots_reference(logits, slots, want_t[0], want_t[1], want_t[2][:, 2])
    assert torch.equal(got, want) and got[0] == 11
    zeros = torch.zeros(batch, device=CUDA)
    plain = sampling.sample_tokens(logits, zeros, zeros.int(), zeros + 1, zeros, zeros.long(), zeros.long())
    assert torch.equal(got, plain)
    for g, w in zip(got_t, want_t):
        assert torch.equal(g, w)
    torch.cuda.synchronize()
    assert all(int(b.count_nonzero()) == 0 for owned in _common._counter_buffers.values() for b in owned)


def test_greedy_sample_into_slots_in_a_cuda_graph(rng):
    from freetoken.kernels.triton import sampling

    batch = 4
    logits = torch.randn(batch, VOCAB, generator=rng, device=CUDA)
    slots = torch.tensor([5, 0, 0, 9], dtype=torch.int32, device=CUDA)  # repeated: padding rows
    last, counts, params = _tables(rng)
    sampling.greedy_sample_into_slots(logits, slots, last, counts, params[:, 2])  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling.greedy_sample_into_slots(logits, slots, last, counts, params[:, 2])
    for _ in range(2):
        logits.copy_(torch.randn(batch, VOCAB, generator=rng, device=CUDA))
        want_t = tuple(t.clone() for t in (last, counts, params))
        want = greedy_sample_into_slots_reference(logits, slots, want_t[0], want_t[1], want_t[2][:, 2])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(counts, want_t[1]) and torch.equal(params, want_t[2])
        assert last[5] == want[0] and last[9] == want[3] and last[0] in (want[1], want[2])
