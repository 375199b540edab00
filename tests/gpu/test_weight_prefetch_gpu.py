"""The L2 prefetches of issue 9 on the GPU: ``kernels.l2_prefetch`` at the Qwen3.6-35B-A3B weights'
sizes, chained under programmatic dependent launch and on a side stream, in CUDA graphs; the decode
MoE block with its gate/up launch prefetching the down rows (``moe_decode.PREFETCH_DOWN``); and
float32 greedy parity with transformers with every site on (graphs replayed), both ways of queueing."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM
from freetoken.kernels.moe_decode import sparse_moe_decode_reference
from freetoken.layers import weight_prefetch
from gpu_checks import CUDA, capture_graph, randn, replay, triton_module
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, checkpoint

pytestmark = pytest.mark.gpu

HIDDEN, VALUE_DIM, GATE_ROWS, SHARED_INTER, EXPERTS, TOP_K, INTER = 2048, 4096, 264, 512, 256, 8, 512


def test_lanes_cover_real_size_weights(rng):
    """The split of out_proj, the router, the shared expert's gate/up and down (24 MB) over the
    programs, as the GPU computes it: every byte once."""
    tensors = [randn(rng, *s, dtype=torch.bfloat16) for s in
               ((HIDDEN, VALUE_DIM), (GATE_ROWS, HIDDEN), (2 * SHARED_INTER, HIDDEN), (HIDDEN, SHARED_INTER))]
    lanes = triton_module("l2_prefetch").l2_prefetch_lanes(*tensors).cpu()
    for index, t in enumerate(tensors):
        rows = lanes[(lanes[:, 0] == index) & (lanes[:, 2] > 0)]
        assert int(rows[:, 2].sum()) == t.numel() * 2
        order = rows[:, 1].argsort()
        starts, sizes = rows[order, 1], rows[order, 2]
        assert int(starts[0]) == 0 and torch.equal(starts[1:], starts[:-1] + sizes[:-1])


@pytest.mark.parametrize("chained", [False, True], ids=["branch", "chained"])
def test_prefetch_beside_gemvs_in_a_graph(rng, chained):
    """A GEMV, the prefetch of the next GEMV's weight (chained after it, or on a side stream joined
    at the end), the next GEMV: the replayed outputs are the eager ones without any prefetch."""
    from freetoken.kernels.triton import gemv, l2_prefetch

    x = randn(rng, 1, HIDDEN, dtype=torch.bfloat16)
    w_in = randn(rng, VALUE_DIM, HIDDEN, dtype=torch.bfloat16, scale=HIDDEN**-0.5)
    w_out = randn(rng, HIDDEN, VALUE_DIM, dtype=torch.bfloat16, scale=VALUE_DIM**-0.5)
    want = gemv.gemv(gemv.gemv(x, w_in), w_out)
    side = torch.cuda.Stream()

    def launches():
        h = gemv.gemv(x, w_in)
        if chained:
            l2_prefetch.l2_prefetch(w_out, chained=True)
        else:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                l2_prefetch.l2_prefetch(w_out)
        out = gemv.gemv(h, w_out)
        torch.cuda.current_stream().wait_stream(side)
        return out

    assert torch.equal(launches(), want)
    graph, out = capture_graph(launches)
    replay(graph, [out])
    assert torch.equal(out, want)


@pytest.mark.parametrize("tokens", [1, 4])
def test_moe_block_prefetching_down_rows(rng, monkeypatch, tokens):
    """The decode block at the real sizes with the down rows prefetched by the gate/up launch: the
    same bits as without, eagerly and replayed from a graph; within bf16 of the reference."""
    from freetoken.kernels.triton import moe_decode

    bf16 = torch.bfloat16
    x = randn(rng, tokens, HIDDEN, dtype=bf16)
    logits = randn(rng, tokens, EXPERTS + 1, dtype=bf16)
    w13 = randn(rng, EXPERTS, 2 * INTER, HIDDEN, dtype=bf16, scale=HIDDEN**-0.5)
    w2 = randn(rng, EXPERTS, HIDDEN, INTER, dtype=bf16, scale=INTER**-0.5)
    sgu = randn(rng, 2 * SHARED_INTER, HIDDEN, dtype=bf16, scale=HIDDEN**-0.5)
    sd = randn(rng, HIDDEN, SHARED_INTER, dtype=bf16, scale=SHARED_INTER**-0.5)
    args = (x, logits, w13, w2, sgu, sd, TOP_K, True)
    monkeypatch.setattr(moe_decode, "PREFETCH_DOWN", False)
    want = moe_decode.sparse_moe_decode(*args)
    monkeypatch.setattr(moe_decode, "PREFETCH_DOWN", True)
    assert torch.equal(moe_decode.sparse_moe_decode(*args), want)
    graph, out = capture_graph(lambda: moe_decode.sparse_moe_decode(*args))
    replay(graph, [out])
    assert torch.equal(out, want)
    ref = sparse_moe_decode_reference(*args).float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("chained", [False, True], ids=["branch", "chained"])
def test_float32_greedy_with_every_prefetch_equals_transformers(monkeypatch, chained):
    """Every site on (and the down rows' prefetch), decode steps replayed from graphs: the tokens
    are transformers'."""
    from freetoken.kernels.triton import moe_decode

    for site in ("OUT_PROJ", "ROUTER", "SHARED"):
        monkeypatch.setattr(weight_prefetch, site, True)
    monkeypatch.setattr(weight_prefetch, "CHAINED", chained)
    monkeypatch.setattr(moe_decode, "PREFETCH_DOWN", True)
    case = DEMO["qwen3_5_moe"]
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cuda", max_prefill_length=16,
              page_size=PAGE_SIZE, cuda_graph_max_bs=weight_prefetch.MAX_ROWS)
    assert llm.runtime.engine.graph_runner.graphs
    assert_greedy_batch(llm, case)
