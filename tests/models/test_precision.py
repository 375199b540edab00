"""The zero-centred RMSNorm kept exact in float32, and loaded as the checkpoint stores it (bf16
accuracy against transformers: tests/engine/test_engine_parity.py)."""

from __future__ import annotations

import torch
from safetensors import safe_open

from oracle import DEMO, checkpoint
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


def test_loaded_norm_weights_are_the_checkpoints_zero_centred_values():
    path = checkpoint(DEMO["qwen3_5_moe"], torch.bfloat16)
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu")
    model = llm.runtime.engine.model
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.language_model.layers.0.input_layernorm.weight")
    assert torch.equal(model.layers[0].input_layernorm.weight, stored)
