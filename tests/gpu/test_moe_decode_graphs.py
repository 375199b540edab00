"""The fused MoE decode block as the engine runs it: several layers in turn inside one CUDA graph,
replayed twice, so every layer's routing, intermediate and output buffers reuse the previous layer's
addresses. With programmatic dependent launch (``DecodeTiles.pdl``) each launch starts while the
previous one finishes and the down pass reads the routing before its wait: a read of a stale buffer
(an earlier layer's expert ids at the same address) would give that layer's experts, not these."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken.kernels import moe_decode as ref_moe_decode
from gpu_checks import capture_graph, replay

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HIDDEN, EXPERTS, TOP_K, INTER, LAYERS = 2048, 256, 8, 512, 3


def _layer(rng: torch.Generator, dtype: torch.dtype, tokens: int) -> tuple[torch.Tensor, ...]:
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng, device=CUDA) * scale).to(dtype)

    distinct = torch.stack([torch.randperm(EXPERTS, generator=rng, device=CUDA) for _ in range(tokens)])
    gate_logits = torch.cat([(distinct - 128) / 32.0, torch.randn(tokens, 1, generator=rng, device=CUDA)], 1).to(dtype)
    return (
        randn(tokens, HIDDEN), gate_logits,
        randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5), randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5),
        randn(2 * INTER, HIDDEN, scale=HIDDEN**-0.5), randn(HIDDEN, INTER, scale=INTER**-0.5),
    )


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8])
def test_sparse_moe_decode_layers_in_a_cuda_graph(rng, check, pdl, dtype, tokens):
    from freetoken.kernels.triton import moe_decode

    tiles = dataclasses.replace(moe_decode.TILES, pdl=pdl)
    layers = [_layer(rng, dtype, tokens) for _ in range(LAYERS)]
    wants = [ref_moe_decode.sparse_moe_decode_reference(*layer, TOP_K, True) for layer in layers]

    def step() -> list[torch.Tensor]:
        return [moe_decode.sparse_moe_decode_tiled(*layer, TOP_K, True, tiles) for layer in layers]

    graph, outs = capture_graph(step)
    for n in range(2):
        replay(graph, outs)
        for i, (got, want) in enumerate(zip(outs, wants)):
            check(f"sparse_moe_decode_graph_{tokens}_layer{i}_replay{n}", got, want, dtype)
