"""bf16 accuracy against transformers, and the zero-centred RMSNorm kept exact in float32."""

from __future__ import annotations

import torch
from safetensors import safe_open

from oracle import PROMPTS, reference_logits
from freetoken import LLM
from freetoken.kernels import rms_norm


def test_zero_centred_norm_applies_one_plus_w_in_float32():
    torch.manual_seed(0)
    # Small w: 1 + w is not representable in bf16 (bf16 has 8 bits of mantissa), so folding the
    # +1 into a bf16 weight at load time would change the multiplier.
    w = (torch.randn(256) * 2e-3).to(torch.bfloat16)
    assert ((1 + w.float()).to(torch.bfloat16).float() != 1 + w.float()).float().mean() > 0.9
    x = torch.randn(8, 256).to(torch.bfloat16)
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (x_hat * (1 + w.float())).to(torch.bfloat16)
    folded = (x_hat * (1 + w.float()).to(torch.bfloat16).float()).to(torch.bfloat16)
    got = rms_norm(x, w, 1e-6, True)
    assert torch.equal(got, expected)
    assert not torch.equal(got, folded)


def test_loaded_norm_weights_are_the_checkpoints_zero_centred_values(checkpoint_factory):
    path = checkpoint_factory("demo", torch.bfloat16)
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu")
    model = llm.runtime.engine.model
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.language_model.layers.0.input_layernorm.weight")
    assert torch.equal(model.layers[0].input_layernorm.weight, stored)


def test_bf16_logits_within_1e_2_of_transformers(checkpoint_factory):
    """Against transformers running the same bf16 checkpoint: relative L2 error <= 1e-2, in prefill
    chunks of 16. Against the exact logits (the same bf16 weights computed in float32) the engine is
    as accurate as transformers' own bf16 forward at a typical position (the median over positions:
    a router near a tie may send one position to another expert in either implementation, which
    moves that position's logits by a few percent)."""
    path = checkpoint_factory("demo", torch.bfloat16)
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu", max_prefill_length=16, page_size=4)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    def typical_error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).median().item()

    for prompt in PROMPTS:
        ids = llm.runtime.tokenize(prompt)
        ours = llm.prompt_logits(ids)
        hf_bf16 = reference_logits(path, ids, torch.bfloat16)
        exact = reference_logits(path, ids, torch.float32)
        assert error(ours, hf_bf16) <= 1e-2
        assert typical_error(ours, exact) <= 1.25 * typical_error(hf_bf16, exact)
