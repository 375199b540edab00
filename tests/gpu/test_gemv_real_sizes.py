"""The few-row GEMV at the dense projections of Qwen3.6-35B-A3B (GDN in_proj 12352 x 2048, out_proj
and o_proj 2048 x 4096, router + shared gate 264 x 2048 (257 rows padded), attention qkv 9216 x 2048, lm_head
248320 x 2048), as the table picks its launch, against float32 ``F.linear``; a chain of them in a
CUDA graph with programmatic dependent launch (each reads the previous one's output after its
wait); and ``layers.linear`` taking it exactly where ``gemv_configs.prefers_gemv`` says."""

from __future__ import annotations

import pytest
import torch

from freetoken import kernels
from freetoken.kernels import gemv_configs
from freetoken.kernels.gemv import gemv_reference
from freetoken.kernels.gemv_configs import GemvConfig
from freetoken.layers.linear import linear
from gpu_checks import capture_graph, replay

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
SHAPES = [(12352, 2048), (2048, 4096), (264, 2048), (9216, 2048), (248320, 2048)]


def _gemv():
    from freetoken.kernels.triton import gemv

    return gemv


def operands(rng, rows: int, n_out: int, k_in: int, dtype: torch.dtype):
    x = torch.randn(rows, k_in, generator=rng, device=CUDA).to(dtype)
    w = (torch.randn(n_out, k_in, generator=rng, device=CUDA) * k_in**-0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])  # each bucket of the table (1, 2, 4, 8)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gemv_real_sizes(rng, check, dtype, rows, shape):
    x, w = operands(rng, rows, *shape, dtype)
    got = _gemv().gemv(x, w)
    assert got.dtype == dtype
    check(f"gemv_{shape[0]}x{shape[1]}_m{rows}", got.float(), gemv_reference(x.float(), w.float()), dtype)


@pytest.mark.parametrize("config", [GemvConfig(8, 2048, 8), GemvConfig(16, 512, 4), GemvConfig(1, 2048, 4),
                                    GemvConfig(64, 256, 4, 3, dot=True)], ids=lambda c: c.label())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_gemv_chain_in_a_cuda_graph(rng, check, config, dtype, rows):
    """up (4096 x 2048) then down (2048 x 4096) then up again, replayed twice with new inputs: a
    launch that read ``x`` before the previous one finished would read the last replay's values."""
    gemv = _gemv()
    x, up = operands(rng, rows, 4096, 2048, dtype)
    down = operands(rng, 1, 2048, 4096, dtype)[1]

    def chain() -> list[torch.Tensor]:
        h = gemv.gemv_tiled(x, up, config)
        y = gemv.gemv_tiled(h, down, config)
        return [h, y, gemv.gemv_tiled(y, up, config)]

    graph, outs = capture_graph(chain)
    for n in range(2):
        x.copy_(torch.randn(x.shape, generator=rng, device=CUDA))
        replay(graph, outs)
        h, y, z = outs
        # Each link against the reference on the kernel's own input (its rounding not compounded).
        check(f"gemv_graph_h_{n}", h.float(), gemv_reference(x.float(), up.float()), dtype)
        check(f"gemv_graph_y_{n}", y.float(), gemv_reference(h.float(), down.float()), dtype)
        check(f"gemv_graph_z_{n}", z.float(), gemv_reference(y.float(), up.float()), dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_linear_takes_the_gemv_where_the_table_says(rng, monkeypatch, shape):
    calls = []
    gemv = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda x, w: calls.append(x.shape[0]) or gemv(x, w))
    w = operands(rng, 1, *shape, torch.bfloat16)[1]
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, shape[1], generator=rng, device=CUDA).to(torch.bfloat16)
        assert linear(x, w).shape == (rows, shape[0])
    assert calls == [r for r in (1, 2, 4, 8, 16) if gemv_configs.prefers_gemv(r, *shape)]
    assert 16 not in calls
