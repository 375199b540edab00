"""The W4A16 kernels against their torch references at Qwen3.6-35B-A3B's sizes (hidden 2048, 256
experts top-8 of intermediate 512, the layer's dense projections), decode and prefill tiles, and
replayed from a CUDA graph as the engine runs them."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import moe as ref_moe
from freetoken.kernels import nvfp4 as ref
from gpu_checks import random_nvfp4
from kernel_checks import assert_close

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512


def _triton():
    from freetoken.kernels.triton import nvfp4

    return nvfp4


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
@pytest.mark.parametrize("rows,cols", [(9216, 2048), (2048, 4096)])
def test_nvfp4_linear_real_sizes(rng, dtype, tokens, rows, cols):
    w = random_nvfp4(rng, rows, cols)
    x = torch.randn(tokens, cols, generator=rng).to(dtype).to(CUDA)
    assert_close(_triton().nvfp4_linear(x, *w), ref.nvfp4_linear_reference(x, *w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fused_experts_nvfp4_real_sizes(rng, dtype, tokens):
    w13 = random_nvfp4(rng, EXPERTS, 2 * INTER, HIDDEN)
    w2 = random_nvfp4(rng, EXPERTS, HIDDEN, INTER)
    x = torch.randn(tokens, HIDDEN, generator=rng).to(dtype).to(CUDA)
    logits = torch.randn(tokens, EXPERTS, generator=rng).to(dtype).to(CUDA)
    weights, ids = ref_moe.moe_topk_softmax_reference(logits, TOP_K, True)
    got = _triton().fused_experts_nvfp4(x, *w13, *w2, weights, ids)
    assert_close(got, ref.fused_experts_nvfp4_reference(x, *w13, *w2, weights, ids))


def test_fused_experts_nvfp4_replays_from_a_cuda_graph(rng):
    """Captured once, replayed on new routing: the grid and every buffer are fixed by the shapes."""
    tokens = 16
    w13 = random_nvfp4(rng, EXPERTS, 2 * INTER, HIDDEN)
    w2 = random_nvfp4(rng, EXPERTS, HIDDEN, INTER)
    x = torch.randn(tokens, HIDDEN, generator=rng).to(torch.bfloat16).to(CUDA)
    logits = torch.randn(tokens, EXPERTS, device=CUDA).to(torch.bfloat16)
    weights, ids = ref_moe.moe_topk_softmax_reference(logits, TOP_K, True)
    kernel = _triton().fused_experts_nvfp4
    kernel(x, *w13, *w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(x, *w13, *w2, weights, ids)
    new_weights, new_ids = ref_moe.moe_topk_softmax_reference(torch.randn_like(logits), TOP_K, True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert_close(out, ref.fused_experts_nvfp4_reference(x, *w13, *w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8])
def test_sparse_moe_decode_nvfp4_real_sizes(rng, dtype, tokens):
    """The few-token MoE block (routed + shared NVFP4 experts) against the general ops it replaces."""
    from freetoken.kernels.triton import nvfp4_decode

    weights = (
        *random_nvfp4(rng, EXPERTS, 2 * INTER, HIDDEN), *random_nvfp4(rng, EXPERTS, HIDDEN, INTER),
        *random_nvfp4(rng, 2 * INTER, HIDDEN), *random_nvfp4(rng, HIDDEN, INTER),
    )
    x = torch.randn(tokens, HIDDEN, generator=rng).to(dtype).to(CUDA)
    logits = torch.randn(tokens, EXPERTS + 1, generator=rng).to(dtype).to(CUDA)
    got = nvfp4_decode.sparse_moe_decode_nvfp4(x, logits, *weights, TOP_K, True)
    assert_close(got, ref.sparse_moe_decode_nvfp4_reference(x, logits, *weights, TOP_K, True))


# The stream kernels (nvfp4_decode_stream.py) in shapes the tuner tries: one program-a-tile count
# per SM over the whole grid, without prefetch or PDL.
STREAM_TILES = [
    dict(gate_up_per_sm=2, down_per_sm=2, down_block_n=4, down_warps=8),
    dict(gate_up_per_sm=4, gate_up_block_n=4, gate_up_warps=4, down_per_sm=4, down_block_n=2),
    dict(gate_up_per_sm=3, gate_up_warps=4, down_per_sm=3, down_regs=168, prefetch=False, pdl=False),
    dict(gate_up_per_sm=4, gate_up_block_n=4, gate_up_warps=4, shared_first=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("tiles", STREAM_TILES, ids=lambda t: "-".join(f"{v}" for v in t.values()))
def test_sparse_moe_decode_nvfp4_stream_real_sizes(rng, dtype, tokens, tiles):
    """The stream kernels' block against the reference, eager and replayed from a CUDA graph with new
    activations and router logits (their routing read inside the graph)."""
    from freetoken.kernels.triton import nvfp4_decode

    weights = (
        *random_nvfp4(rng, EXPERTS, 2 * INTER, HIDDEN), *random_nvfp4(rng, EXPERTS, HIDDEN, INTER),
        *random_nvfp4(rng, 2 * INTER, HIDDEN), *random_nvfp4(rng, HIDDEN, INTER),
    )
    x = torch.randn(tokens, HIDDEN, generator=rng).to(dtype).to(CUDA)
    logits = torch.randn(tokens, EXPERTS + 1, generator=rng).to(dtype).to(CUDA)
    config = nvfp4_decode.NVFP4DecodeTiles(**tiles)

    def block():
        return nvfp4_decode.sparse_moe_decode_nvfp4_tiled(x, logits, *weights, TOP_K, True, config)

    assert_close(block(), ref.sparse_moe_decode_nvfp4_reference(x, logits, *weights, TOP_K, True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    x.copy_(torch.randn(tokens, HIDDEN, generator=rng).to(dtype))
    logits.copy_(torch.randn(tokens, EXPERTS + 1, generator=rng).to(dtype))
    graph.replay()
    assert_close(out, ref.sparse_moe_decode_nvfp4_reference(x, logits, *weights, TOP_K, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first"])
def test_normed_nvfp4_gemv_real_sizes(rng, dtype, rows, residual):
    """The attention layer's input norm + packed q/k/v NVFP4 GEMV (9216 x 2048) in one launch against
    the two launches it replaces (bit for bit) and the reference, eager and replayed from a CUDA graph
    on new activations."""
    from freetoken.kernels.normed_nvfp4_gemv import add_rms_norm_nvfp4_gemv_reference
    from freetoken.kernels.triton import norm, normed_nvfp4_gemv, nvfp4_rows

    w = random_nvfp4(rng, 9216, HIDDEN)
    nw = (torch.randn(HIDDEN, generator=rng) * 0.2).to(dtype).to(CUDA)
    x = torch.randn(rows, HIDDEN, generator=rng).to(dtype).to(CUDA)
    res = torch.randn(rows, HIDDEN, generator=rng).to(dtype).to(CUDA) if residual else None

    def fused():
        return normed_nvfp4_gemv.add_rms_norm_nvfp4_gemv(x, res, nw, 1e-6, True, *w, True)

    def check(out, normed, summed):
        want_normed, _ = norm.add_rms_norm(x, res, nw, 1e-6, True) if residual else (norm.rms_norm(x, nw, 1e-6, True), x)
        want = torch.empty_like(out)
        nvfp4_rows.nvfp4_gemv(want_normed, w[0], w[1].view(torch.uint8), w[2], want)
        assert torch.equal(normed, want_normed) and torch.equal(out, want)
        ref_out, _, ref_summed = add_rms_norm_nvfp4_gemv_reference(x, res, nw, 1e-6, True, *w)
        assert torch.equal(summed, ref_summed)
        assert_close(out, ref_out)

    check(*fused())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fused()
    x.copy_(torch.randn(rows, HIDDEN, generator=rng).to(dtype))
    graph.replay()
    check(*outs)
