"""``freetoken bench --routing fitted``: random routers biased to the fitted Qwen3 expert skew
(``bench.routing_trace.bias_routers``), so an expert cache benchmark sees realistic routing."""

from __future__ import annotations

import json

import torch

from freetoken import LLM
from freetoken.bench.routing_trace import bias_routers, router_logit_bias
from freetoken.cli import main
from freetoken.layers.moe import SparseMoE


def _share_of_favourites(block: SparseMoE, tokens: torch.Tensor, favourites: torch.Tensor) -> float:
    ids = block._route(tokens)
    return torch.isin(ids, favourites).float().mean().item()


def test_biased_routers_prefer_their_layers_popular_experts(demo_checkpoint):
    model = LLM(model=str(demo_checkpoint), load_format="dummy", dtype="float32", device="cpu",
                num_pages=16).runtime.engine.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(4096, blocks[0].gate_weight.shape[1], generator=gen)
    tokens = tokens / tokens.pow(2).mean(dim=1, keepdim=True).sqrt()  # unit RMS, as after a norm
    bias = router_logit_bias(len(blocks), blocks[0].num_experts, seed=3)
    favourites = [b.topk(3).indices for b in bias]  # each layer's three most popular experts
    before = [_share_of_favourites(block, tokens, fav) for block, fav in zip(blocks, favourites)]
    assert torch.equal(bias_routers(model, seed=3), bias)
    after = [_share_of_favourites(block, tokens, fav) for block, fav in zip(blocks, favourites)]
    uniform = 3 / blocks[0].num_experts
    assert all(abs(b - uniform) < 0.1 for b in before), before
    assert all(a > b + 0.05 for a, b in zip(after, before)), (before, after)


def test_bench_runs_with_fitted_routing(demo_checkpoint, tmp_path):
    out = tmp_path / "fitted.json"
    assert main(["bench", "--model", str(demo_checkpoint), "--load-format", "dummy", "--routing", "fitted",
                 "--batch-sizes", "2", "--input-len", "8", "--output-len", "3", "--dtype", "float32",
                 "--device", "cpu", "--profile-steps", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["routing"] == "fitted" and report["results"][0]["decode_tok_s"] > 0
