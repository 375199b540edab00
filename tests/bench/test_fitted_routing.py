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


def _plan(*rows: tuple[int, int]):
    """A StepPlan-like object of ``(num_computed, num_new)`` rows (all ``TraceRouting`` reads)."""
    from types import SimpleNamespace

    return SimpleNamespace(rows=[SimpleNamespace(num_computed=c, num_new=n) for c, n in rows])


def test_trace_routing_drives_the_routers_step_by_step():
    from freetoken.bench.routing_trace import QWEN3_ROUTING, TRACE_LOGIT_SCALE, TraceRouting

    torch.manual_seed(0)
    model = torch.nn.ModuleList([SparseMoE(16, 64, 4, 8, 8) for _ in range(3)])
    driver = TraceRouting(model, seed=1)
    assert all(block.router_bias.data_ptr() == row.data_ptr() for block, row in zip(model, driver.buffer))
    driver.before(_plan((0, 32)))  # a new prompt: G + S, no token noise
    prompt = driver.buffer.clone()
    request = prompt / TRACE_LOGIT_SCALE - torch.from_numpy(driver.bias)
    assert abs(request.std().item() - QWEN3_ROUTING.request_skew) < 0.1
    steps = []
    for _ in range(200):
        driver.before(_plan((33, 1)))
        steps.append(driver.buffer.clone() - prompt)  # the token noise X, scaled
    noise = torch.stack(steps) / TRACE_LOGIT_SCALE
    assert abs(noise.std().item() - 1.0) < 0.1 and driver.steps == 200
    lag1 = torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1].item()
    assert lag1 > 0.4  # persistent from token to token (0.2 fast + 0.95 drift, 45% of the variance)
    driver.before(_plan((0, 8)))  # the next prompt: a new request skew
    assert not torch.allclose(driver.buffer, prompt)


def test_bench_runs_with_trace_routing(demo_checkpoint, tmp_path):
    out = tmp_path / "trace.json"
    assert main(["bench", "--model", str(demo_checkpoint), "--load-format", "dummy", "--routing", "trace",
                 "--batch-sizes", "1", "--input-len", "8", "--output-len", "3", "--dtype", "float32",
                 "--device", "cpu", "--profile-steps", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["routing"] == "trace" and report["results"][0]["decode_tok_s"] > 0
