"""The GEMV with the Gated DeltaNet output norm in its prologue at Qwen3.6-35B-A3B's out_proj (32
value heads of 128, 2048 x 4096), in the launch shape the layer picks: against the reference and the
two launches it replaces; a chain of GDN output launches in a CUDA graph with programmatic dependent
launch (each reads the previous one's output after its wait); ``GatedDeltaNet`` taking it exactly
where ``gemv_configs.prefers_gated_normed_gemv`` says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken.kernels import gemv_configs
from freetoken.kernels.gated_norm_gemv import gated_rms_norm_gemv_reference
from gpu_checks import capture_graph, replay

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HEADS, HEAD_DIM, HIDDEN = 32, 128, 2048
EPS = 1e-6


def operands(rng, rows: int, dtype: torch.dtype):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng, device=CUDA) * scale).to(dtype)

    core = randn(rows, HEADS, HEAD_DIM)
    z = randn(rows, 12352)[:, 8192 : 8192 + HEADS * HEAD_DIM].reshape(rows, HEADS, HEAD_DIM)  # in_proj's z part
    return core, z, randn(HEAD_DIM, scale=0.2) + 1, randn(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, gemv_configs.NORMED_MAX_ROWS])
def test_gated_norm_gemv_real_sizes(rng, check, dtype, rows):
    from freetoken.kernels.triton import gated_norm_gemv, gemv, norm

    core, z, nw, w = operands(rng, rows, dtype)
    got = gated_norm_gemv.gated_rms_norm_gemv(core, z, nw, EPS, "silu", w)
    f = lambda t: t.float()  # noqa: E731
    check(f"gated_norm_gemv_m{rows}", f(got), gated_rms_norm_gemv_reference(f(core), f(z), f(nw), EPS, "silu", f(w)), dtype)
    two = gemv.gemv(norm.gated_rms_norm(core, z, nw, EPS, "silu").reshape(rows, -1), w)
    check(f"gated_norm_gemv_vs_two_launches_m{rows}", f(got), f(two), dtype, scale=0.1)


@pytest.mark.parametrize("pdl", [True, False])
def test_gated_norm_gemv_chain_in_a_cuda_graph(rng, check, pdl):
    """Three layers' fused launches, each one's output the next one's core (through a fixed
    projection), replayed twice with new inputs."""
    from freetoken.kernels.triton import gated_norm_gemv

    dtype = torch.bfloat16
    core, z, nw, w = operands(rng, 1, dtype)
    lift = (torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=rng, device=CUDA) * HIDDEN**-0.5).to(dtype)
    config = dataclasses.replace(gemv_configs.gated_normed_gemv_config(1, HIDDEN, HEADS * HEAD_DIM), pdl=pdl)

    def chain() -> list[torch.Tensor]:
        outs, c = [], core
        for _ in range(3):
            out = gated_norm_gemv.gated_rms_norm_gemv_tiled(c, z, nw, EPS, "silu", w, config)
            outs.append(out)
            c = torch.nn.functional.linear(out, lift).reshape(1, HEADS, HEAD_DIM)
        return outs

    graph, outs = capture_graph(chain)
    for n in range(2):
        core.copy_(torch.randn(core.shape, generator=rng, device=CUDA))
        replay(graph, outs)
        c = core
        for i, out in enumerate(outs):
            want = gated_rms_norm_gemv_reference(c.float(), z.float(), nw.float(), EPS, "silu", w.float())
            check(f"gated_norm_graph_{i}_{n}", out.float(), want, dtype)
            c = torch.nn.functional.linear(out, lift).reshape(1, HEADS, HEAD_DIM)


def test_gated_deltanet_fuses_where_the_table_says(rng, monkeypatch):
    """The layer's choice (its forward runs in the engine's GPU parity tests)."""
    from freetoken.layers import gated_deltanet
    from freetoken.layers.gated_deltanet import DeltaNetSizes, GatedDeltaNet

    layer = GatedDeltaNet(DeltaNetSizes(HIDDEN, 16, HEADS, 128, HEAD_DIM, 4, EPS)).to(CUDA, torch.bfloat16)
    monkeypatch.setattr(gated_deltanet, "FUSED_OUTPUT_NORM", True)  # off by default (slower end to end)
    for rows in (1, 2, 4, 8):
        core = operands(rng, rows, torch.bfloat16)[0]
        assert layer._norm_in_out_proj(core) == gemv_configs.prefers_gated_normed_gemv(rows, HIDDEN, HEADS * HEAD_DIM)
    assert layer._norm_in_out_proj(operands(rng, 1, torch.bfloat16)[0])
    monkeypatch.setattr(gated_deltanet, "FUSED_OUTPUT_NORM", False)
    assert not layer._norm_in_out_proj(operands(rng, 1, torch.bfloat16)[0])
