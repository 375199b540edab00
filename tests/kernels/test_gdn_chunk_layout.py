"""The gated delta rule prefill's chunk layout kernel against the torch ops it replaces: chunk
offsets per request and the request of every chunk (``searchsorted``, right), at more requests and
chunks than one block of either holds, with empty requests first, inside and last."""

from __future__ import annotations

import torch
import triton

from kernel_checks import DEVICE


def test_chunk_layout_matches_searchsorted(rng):
    from freetoken.kernels.triton import gated_delta_rule as gdn

    lens = torch.randint(0, 200, (97,), generator=rng)
    lens[[0, 40, 96]] = 0
    lens[5] = 64  # exactly one chunk
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int().to(DEVICE)
    num_requests, num_tokens = lens.numel(), int(lens.sum())
    max_chunks = triton.cdiv(num_tokens, gdn.CHUNK) + num_requests
    cu_chunks = torch.full((num_requests + 1,), -1, dtype=torch.int32, device=DEVICE)
    chunk_request = torch.full((max_chunks,), -1, dtype=torch.int32, device=DEVICE)
    gdn._chunk_layout_kernel[(1,)](cu, cu_chunks, chunk_request, num_requests, max_chunks,
                                   CHUNK_SIZE=gdn.CHUNK, BLOCK_R=64, BLOCK_C=128)
    want_cu = torch.nn.functional.pad(torch.cumsum((lens + gdn.CHUNK - 1) // gdn.CHUNK, 0), (1, 0)).int()
    want_request = torch.searchsorted(want_cu[1:].contiguous(), torch.arange(max_chunks, dtype=torch.int32),
                                      right=True, out_int32=True)
    assert torch.equal(cu_chunks.cpu(), want_cu)
    assert torch.equal(chunk_request.cpu(), want_request)
