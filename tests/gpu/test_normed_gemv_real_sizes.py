"""The fused residual add + RMSNorm + GEMV at the projections after a norm in Qwen3.6-35B-A3B (GDN
in_proj 12352 x 2048, attention qkv 9216 x 2048, router + shared gate 264 x 2048, lm_head 248320 x
2048), in the launch shape the layers pick: against the reference, and the residual / normalized
rows against the Triton norm's; a chain of fused launches in a CUDA graph with programmatic
dependent launch (each reads the previous one's outputs after its wait); ``layers.normed_linear``
fusing exactly where ``gemv_configs.prefers_normed_gemv`` says."""

from __future__ import annotations

import pytest
import torch

from freetoken import kernels
from freetoken.kernels import gemv_configs
from freetoken.kernels.normed_gemv import add_rms_norm_gemv_reference
from freetoken.layers.norm import RMSNorm
from freetoken.layers.normed_linear import normed_linear
from gpu_checks import capture_graph, replay

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
SHAPES = [(12352, 2048), (9216, 2048), (264, 2048), (248320, 2048)]
EPS = 1e-6


def operands(rng, rows: int, n_out: int, k_in: int, dtype: torch.dtype):
    x, res = (torch.randn(rows, k_in, generator=rng, device=CUDA).to(dtype) for _ in range(2))
    nw = (torch.randn(k_in, generator=rng, device=CUDA) * 0.2).to(dtype)
    w = (torch.randn(n_out, k_in, generator=rng, device=CUDA) * k_in**-0.5).to(dtype)
    return x, res, nw, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, gemv_configs.NORMED_MAX_ROWS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_normed_gemv_real_sizes(rng, check, dtype, rows, shape):
    from freetoken.kernels.triton import norm, normed_gemv

    x, res, nw, w = operands(rng, rows, *shape, dtype)
    out, normed, summed = normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w, True)
    want_normed, want_summed = norm.add_rms_norm(x, res, nw, EPS, True)
    assert torch.equal(summed, want_summed)
    check(f"normed_gemv_normed_{shape[0]}_m{rows}", normed.float(), want_normed.float(), dtype)
    ref = add_rms_norm_gemv_reference(x.float(), res.float(), nw.float(), EPS, True, w.float())[0]
    check(f"normed_gemv_{shape[0]}x{shape[1]}_m{rows}", out.float(), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normed_gemv_chain_in_a_cuda_graph(rng, check, dtype):
    """A layer's two fused launches and the next layer's, the stream carried between them, replayed
    twice with new inputs: a launch that read its inputs before the previous one finished would
    read the last replay's values."""
    from freetoken.kernels.triton import normed_gemv

    x, res, nw, qkv = operands(rng, 1, 9216, 2048, dtype)
    router = operands(rng, 1, 264, 2048, dtype)[3]
    mix = (torch.randn(9216, 2048, generator=rng, device=CUDA) * 2048**-0.5).to(dtype)

    def chain() -> list[torch.Tensor]:
        a, _, s1 = normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, qkv)
        h = a[:, :2048]
        g, n2, s2 = normed_gemv.add_rms_norm_gemv(h, s1, nw, EPS, True, router, True)
        b, _, _ = normed_gemv.add_rms_norm_gemv(n2, s2, nw, EPS, True, mix)
        return [a, s1, g, n2, s2, b]

    graph, outs = capture_graph(chain)
    for n in range(2):
        x.copy_(torch.randn(x.shape, generator=rng, device=CUDA))
        res.copy_(torch.randn(res.shape, generator=rng, device=CUDA))
        replay(graph, outs)
        a, s1, g, n2, s2, b = (o.float() for o in outs)
        f = lambda t: t.float()  # noqa: E731
        # Each link against the reference on its own inputs (its rounding not compounded).
        check(f"normed_graph_a_{n}", a, add_rms_norm_gemv_reference(f(x), f(res), f(nw), EPS, True, f(qkv))[0], dtype)
        want_g, want_n2, _ = add_rms_norm_gemv_reference(a[:, :2048], s1, f(nw), EPS, True, f(router), True)
        check(f"normed_graph_g_{n}", g, want_g, dtype)
        check(f"normed_graph_n2_{n}", n2, want_n2, dtype)
        check(f"normed_graph_b_{n}", b, add_rms_norm_gemv_reference(n2, s2, f(nw), EPS, True, f(mix))[0], dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_normed_linear_fuses_where_the_table_says(rng, monkeypatch, shape):
    calls = []
    fused = kernels.add_rms_norm_gemv
    monkeypatch.setattr(kernels, "add_rms_norm_gemv", lambda x, *a: calls.append(x.shape[0]) or fused(x, *a))
    norm = RMSNorm(shape[1], EPS, zero_centered=True).to(CUDA, torch.bfloat16)
    norm.weight.data.normal_(0, 0.2)
    w = operands(rng, 1, *shape, torch.bfloat16)[3]
    for rows in (1, 2, 4, 8, 16):
        x, res = (torch.randn(rows, shape[1], generator=rng, device=CUDA).to(torch.bfloat16) for _ in range(2))
        got = normed_linear(norm, x, res, w, return_normed=True)
        want_normed, want_res = norm.add_forward(x, res)
        assert torch.equal(got.residual, want_res) and got.out.shape == (rows, shape[0])
        assert got.normed is not None and torch.equal(got.normed.isfinite(), want_normed.isfinite())
    assert calls == [r for r in (1, 2, 4, 8, 16) if gemv_configs.prefers_normed_gemv(r, *shape)]
