"""The grouped MoE path's output in parts at the Qwen3.6-35B-A3B sizes: the shared expert as row
tiles of the grouped expert GEMMs (``fused_experts_shared_pairs``) and the sum + shared term +
residual add + norm in one launch (``moe_combine_add_rms_norm``), against their torch references and
against the unfused chain (cuBLAS shared expert, ``fused_experts``, ``shared_expert_combine``,
``add_rms_norm``); then several layers of it in one CUDA graph, replayed twice, so each layer's
buffers reuse the addresses of the layer before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernels import moe as ref
from freetoken.kernels.norm import add_rms_norm_reference

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HIDDEN, EXPERTS, TOP_K, INTER, LAYERS, EPS = 2048, 256, 8, 512, 3, 1e-6


def _layer(rng: torch.Generator, dtype: torch.dtype, tokens: int) -> dict[str, torch.Tensor]:
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng, device=CUDA) * scale).to(dtype)

    distinct = torch.stack([torch.randperm(EXPERTS + 1, generator=rng, device=CUDA) for _ in range(tokens)])
    logits = ((distinct - 128) / 32.0).to(dtype)  # distinct router logits, the shared gate's last
    weights, ids = ref.moe_topk_softmax_reference(logits[:, :EXPERTS], TOP_K, True)
    return dict(
        x=randn(tokens, HIDDEN), w13=randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
        w2=randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5), weights=weights, ids=ids,
        shared_gate_up=randn(2 * INTER, HIDDEN, scale=HIDDEN**-0.5), shared_down=randn(HIDDEN, INTER, scale=INTER**-0.5),
        gate=logits[:, EXPERTS:], residual=randn(tokens, HIDDEN), norm=randn(HIDDEN, scale=0.1),
    )


def _shared_args(layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(layer[k] for k in ("x", "w13", "w2", "weights", "ids", "shared_gate_up", "shared_down", "gate"))


def _fused(moe, layer: dict[str, torch.Tensor], rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    pairs, shared = moe.fused_experts_shared_pairs(*_shared_args(layer))
    return moe.moe_combine_add_rms_norm(pairs, shared, None, layer["residual"], layer["norm"], EPS, True, rows)


def _unfused_chain(moe, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the layer ran before: the cuBLAS shared expert, the summed experts, the combine, the norm."""
    x = layer["x"]
    shared = F.linear(moe.silu_and_mul(F.linear(x, layer["shared_gate_up"])), layer["shared_down"])
    routed = moe.fused_experts(x, layer["w13"], layer["w2"], layer["weights"], layer["ids"])
    out = moe.shared_expert_combine(routed, shared, layer["gate"])
    return add_rms_norm_reference(out, layer["residual"], layer["norm"], EPS, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [9, 64, 128])
def test_moe_parts_at_real_sizes(rng, check, dtype, tokens):
    from freetoken.kernels.triton import moe

    layer = _layer(rng, dtype, tokens)
    pairs, shared = moe.fused_experts_shared_pairs(*_shared_args(layer))
    want_pairs, want_shared = ref.fused_experts_shared_pairs_reference(*_shared_args(layer))
    check(f"shared_pairs_{tokens}", pairs, want_pairs, dtype)
    check(f"shared_gated_{tokens}", shared, want_shared, dtype)
    normed, summed = moe.moe_combine_add_rms_norm(pairs, shared, None, layer["residual"], layer["norm"], EPS, True)
    want = ref.moe_combine_add_rms_norm_reference(
        want_pairs, want_shared, None, layer["residual"], layer["norm"], EPS, True
    )
    check(f"combine_norm_{tokens}", normed, want[0], dtype)
    check(f"combine_sum_{tokens}", summed, want[1], dtype)
    chain = _unfused_chain(moe, layer)
    check(f"against_chain_normed_{tokens}", normed, chain[0], dtype)
    check(f"against_chain_sum_{tokens}", summed, chain[1], dtype)
    # Unfused shared expert (prefill's form): the gate applied in the combine launch.
    routed_pairs = moe.fused_experts_pairs(*_shared_args(layer)[:5])
    check(f"routed_pairs_{tokens}", routed_pairs, want_pairs, dtype)
    cublas_shared = F.linear(moe.silu_and_mul(F.linear(layer["x"], layer["shared_gate_up"])), layer["shared_down"])
    gated = moe.moe_combine_add_rms_norm(
        routed_pairs, cublas_shared, layer["gate"], layer["residual"], layer["norm"], EPS, True
    )
    check(f"gated_in_combine_{tokens}", gated[0], chain[0], dtype)
    last = torch.tensor([tokens - 1, 0], device=CUDA)
    picked = moe.moe_combine_add_rms_norm(pairs, shared, None, layer["residual"], layer["norm"], EPS, True, last)
    check(f"rows_{tokens}", picked[0], normed[last], dtype)


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [16, 64])
def test_moe_parts_layers_in_a_cuda_graph(rng, check, monkeypatch, pdl, dtype, tokens):
    """With programmatic dependent launch (``COMBINE_PDL``) the combine starts while the down pass
    drains: a read before its wait would see the previous layer's pair outputs (same addresses)."""
    from freetoken.kernels.triton import moe

    monkeypatch.setattr(moe, "COMBINE_PDL", pdl)

    layers = [_layer(rng, dtype, tokens) for _ in range(LAYERS)]
    wants = [_fused(moe, layer) for layer in layers]

    def step() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [_fused(moe, layer) for layer in layers]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for replay in range(2):
        for normed, summed in outs:
            normed.fill_(float("nan"))
            summed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, ((normed, summed), (want_normed, want_summed)) in enumerate(zip(outs, wants)):
            check(f"moe_parts_graph_{tokens}_layer{i}_replay{replay}_normed", normed, want_normed, dtype)
            check(f"moe_parts_graph_{tokens}_layer{i}_replay{replay}_sum", summed, want_summed, dtype)
