from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import moe_decode as ref


def _inputs(rng, dtype, tokens, experts, hidden, inter, shared_inter):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(dtype).to(DEVICE)

    x = randn(tokens, hidden)
    # Distinct router logits in every row (exact in bf16): torch.topk leaves the order of ties unspecified.
    router = torch.stack([torch.randperm(experts, generator=rng) for _ in range(tokens)]) * 0.25 - 1.5
    gate_logits = torch.cat([router, torch.randn(tokens, 1, generator=rng)], dim=1).to(dtype).to(DEVICE)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    shared_gate_up = randn(2 * shared_inter, hidden, scale=hidden**-0.5)
    shared_down = randn(hidden, shared_inter, scale=shared_inter**-0.5)
    return x, gate_logits, w13, w2, shared_gate_up, shared_down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,renormalize,shared_inter", [(1, True, 24), (5, False, 40), (3, True, 56)])
def test_sparse_moe_decode(rng, dtype, tokens, renormalize, shared_inter):
    from freetoken.kernels.triton.moe_decode import sparse_moe_decode

    experts, top_k, hidden, inter = 7, 3, 72, 40
    args = _inputs(rng, dtype, tokens, experts, hidden, inter, shared_inter)
    got = sparse_moe_decode(*args, top_k, renormalize)
    assert_close(got, ref.sparse_moe_decode_reference(*args, top_k, renormalize))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_moe_decode_tiles(rng, monkeypatch, dtype):
    """Every launch shape the tuner may pick gives the same result: small blocks that leave ragged
    edges in both passes."""
    from freetoken.kernels.triton import moe_decode

    tiles = moe_decode.DecodeTiles(gate_up_block_n=8, gate_up_block_k=32, gate_up_warps=2, down_block_n=16,
                                   down_block_k=16, down_warps=2)
    monkeypatch.setattr(moe_decode, "TILES", tiles)
    experts, top_k, hidden, inter, shared_inter = 6, 2, 40, 24, 40
    args = _inputs(rng, dtype, 3, experts, hidden, inter, shared_inter)
    got = moe_decode.sparse_moe_decode(*args, top_k, True)
    assert_close(got, ref.sparse_moe_decode_reference(*args, top_k, True))


def test_sparse_moe_decode_rejects_mismatched_shapes(rng):
    from freetoken.kernels.triton.moe_decode import sparse_moe_decode

    x, gate_logits, w13, w2, sgu, sd = _inputs(rng, torch.float32, 2, 5, 16, 8, 8)
    with pytest.raises(ValueError, match="gate_logits"):
        sparse_moe_decode(x, gate_logits[:, :-1], w13, w2, sgu, sd, 2, True)
