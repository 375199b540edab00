"""``load_format="dummy"``: random weights made where the model lives, at unit activation scale,
and transformers' copy of them (``--compare-transformers``) computing the same logits."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.bench.offline import bench_transformers
from freetoken.bench.transformers_compare import transformers_model_of


@pytest.fixture(scope="module")
def dummy_llm(demo_checkpoint) -> LLM:
    return LLM(model=str(demo_checkpoint), load_format="dummy", dtype="float32", device="cpu", num_pages=64)


def test_every_weight_is_random_and_finite(dummy_llm, demo_checkpoint):
    loaded = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", num_pages=64).runtime.engine.model
    checkpoint = dict(loaded.named_parameters())
    for name, param in dummy_llm.runtime.engine.model.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.endswith("dt_bias"):  # ones, as transformers initialises it
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        assert param.std() > 0, f"{name} is constant"
        assert not torch.equal(param, checkpoint[name]), f"{name} came from the checkpoint"


def test_projections_keep_unit_scale_and_routing_spreads(dummy_llm):
    model = dummy_llm.runtime.engine.model
    moe = model.layers[0].mlp
    hidden = moe.w13.shape[-1]
    assert moe.w13.std().item() == pytest.approx(1 / math.sqrt(hidden), rel=0.1)
    rows = moe.num_experts + 1  # then the zero rows that align the router GEMM's output
    assert moe.gate_weight[:rows].std().item() == pytest.approx(1 / math.sqrt(hidden), rel=0.2)
    assert moe.gate_weight.shape[0] % 8 == 0 and not moe.gate_weight[rows:].any()
    # Unit-RMS tokens get router logits of about N(0, 1): every expert is someone's top-k.
    tokens = torch.randn(256, hidden, generator=torch.Generator().manual_seed(0))
    chosen = (tokens @ moe.gate_weight[: moe.num_experts].T).topk(moe.top_k).indices
    assert chosen.unique().numel() == moe.num_experts


def test_same_seed_same_weights(dummy_llm, demo_checkpoint):
    again = LLM(model=str(demo_checkpoint), load_format="dummy", dtype="float32", device="cpu", num_pages=64)
    other = LLM(model=str(demo_checkpoint), load_format="dummy", dtype="float32", device="cpu", num_pages=64, seed=1)
    first = dummy_llm.runtime.engine.model.layers[0].mlp.w13
    assert torch.equal(first, again.runtime.engine.model.layers[0].mlp.w13)
    assert not torch.equal(first, other.runtime.engine.model.layers[0].mlp.w13)


@pytest.fixture(scope="module")
def hf_model(dummy_llm):
    engine = dummy_llm.runtime.engine
    return transformers_model_of(engine.model, engine.loaded.config, torch.float32)


def test_transformers_copy_computes_the_same_logits(dummy_llm, hf_model):
    prompt = [5, 17, 230, 3, 99, 41, 8, 300, 12, 7]
    ours = dummy_llm.prompt_logits(prompt)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    greedy = dummy_llm.generate({"prompt_token_ids": prompt}, params)
    with torch.no_grad():
        reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert greedy[0].token_ids == reference[0, len(prompt):].tolist()


def test_transformers_timing_of_a_batch(hf_model):
    args = argparse.Namespace(input_len=6, output_len=3, seed=0)
    result = bench_transformers(hf_model, 2, args, vocab_size=400, floor_ms=0.5)
    assert result["decode_ms_per_step"] > 0 and result["ttft_ms"] > 0
    assert result["decode_tok_s"] == pytest.approx(2 / result["decode_ms_per_step"] * 1e3)
    assert result["prefill_tok_s"] == pytest.approx(2 * 6 / result["ttft_ms"] * 1e3)
    assert result["ratio_to_floor"] == pytest.approx(result["decode_ms_per_step"] / 0.5)
