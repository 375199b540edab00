"""The whole engine through the Triton kernels (the interpreter on the CPU, compiled on a GPU):
float32 greedy tokens equal transformers' for a batch of prompts, with chunked prefill, paged KV
and a decode batch, for every model family."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM
from kernel_checks import DEVICE
from oracle import PAGE_SIZE, Case, assert_greedy_batch, checkpoint

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Numbers: 1024 3.14 café", "hi"]
CASES = [
    Case("qwen3_5_moe", "two_layers"),
    # Every Qwen4-Exp op through the interpreter takes a few minutes here.
    pytest.param(Case("qwen4_exp", "blocks_of_a_page"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_greedy_tokens_equal_transformers_through_triton(case, monkeypatch):
    """The defaults, the GDN output norm in the delta-rule decode step's launch among them
    (``layers.gated_deltanet.FUSED_DECODE_NORM``; both families' GDN layers), counted."""
    from freetoken import kernels

    calls = []
    fused = kernels.gated_delta_rule_decode_gated_norm
    monkeypatch.setattr(kernels, "gated_delta_rule_decode_gated_norm", lambda *a: calls.append(1) or fused(*a))
    llm = LLM(
        model=str(checkpoint(case)),
        dtype="float32",
        device=DEVICE.type,
        kernel_backend="triton",
        max_prefill_length=16,  # 22, 16 and 2 prompt tokens: chunked prefills next to decodes
        page_size=PAGE_SIZE,
        num_pages=64,
    )
    assert_greedy_batch(llm, case, [llm.runtime.tokenize(p) for p in PROMPTS], max_tokens=8)
    assert calls, "the decode step's normed launch never ran"


def test_float32_greedy_tokens_with_norms_fused_into_the_gemvs(monkeypatch):
    """The decode projections after a norm through the fused norm + GEMV kernel (on the CPU the
    layers keep them apart: the GEMV runs on CUDA only), still transformers' tokens."""
    from freetoken import kernels
    from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS
    from freetoken.layers import normed_linear

    calls = []
    fused = kernels.add_rms_norm_gemv

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fused(*args, **kwargs)

    monkeypatch.setattr(normed_linear, "fuses", lambda norm, x, weight: x.numel() // weight.shape[1] <= NORMED_MAX_ROWS)
    monkeypatch.setattr(kernels, "add_rms_norm_gemv", counted)
    case = Case("qwen3_5_moe", "two_layers")
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device=DEVICE.type, kernel_backend="triton",
              max_prefill_length=16, page_size=PAGE_SIZE, num_pages=64)
    assert_greedy_batch(llm, case, [llm.runtime.tokenize(p) for p in PROMPTS], max_tokens=8)
    assert calls, "the fused kernel never ran"


@pytest.mark.parametrize("shared_in_grouped", [True, False])
def test_float32_greedy_tokens_with_the_moe_output_summed_in_the_next_norm(monkeypatch, shared_in_grouped):
    """Past 8 tokens the MoE block hands its output on in parts, summed with the residual add in the
    next norm's launch (``layers.moe.COMBINE_IN_NEXT_NORM``), the shared expert inside the grouped
    GEMMs or (``SHARED_IN_GROUPED_MAX_TOKENS`` 0) apart: still transformers' tokens, and the parts
    really ran (the prompts' 16-token chunks)."""
    from freetoken import kernels
    from freetoken.layers import moe

    case = Case("qwen3_5_moe", "two_layers")
    if not shared_in_grouped:
        monkeypatch.setattr(moe, "SHARED_IN_GROUPED_MAX_TOKENS", 0)
    calls = {"pairs": 0, "shared_pairs": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(kernels, "fused_experts_pairs", counted("pairs", kernels.fused_experts_pairs))
    monkeypatch.setattr(kernels, "fused_experts_shared_pairs", counted("shared_pairs", kernels.fused_experts_shared_pairs))
    llm = LLM(
        model=str(checkpoint(case)), dtype="float32", device=DEVICE.type, kernel_backend="triton",
        max_prefill_length=16, page_size=PAGE_SIZE, num_pages=64,
    )
    assert_greedy_batch(llm, case, [llm.runtime.tokenize(p) for p in PROMPTS], max_tokens=4)
    assert calls["shared_pairs" if shared_in_grouped else "pairs"] > 0
    assert calls["pairs" if shared_in_grouped else "shared_pairs"] == 0


def test_float32_greedy_tokens_with_the_batch1_folds(monkeypatch):
    """Every decode fold of issue 9 forced on the CPU (the layers take the GEMV folds on CUDA only):
    the norms in the projections' GEMVs, the GDN conv step in its input launch, the gated output
    norm in the delta-rule step, and greedy steps sampled in one launch; still transformers' tokens."""
    from freetoken import kernels
    from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS
    from freetoken.layers import gated_deltanet, normed_linear

    def few_rows(norm, x, weight):
        return isinstance(x, torch.Tensor) and x.numel() // weight.shape[1] <= NORMED_MAX_ROWS

    for module in (normed_linear, gated_deltanet):
        monkeypatch.setattr(module, "fuses", few_rows)
    folds = ("add_rms_norm_gemv", "add_rms_norm_gemv_conv", "gated_delta_rule_decode_gated_norm", "greedy_sample_into_slots")
    calls: dict[str, int] = {}
    for name in folds:
        op = getattr(kernels, name)

        def counted(*args, op=op, name=name, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return op(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    case = Case("qwen3_5_moe", "two_layers")
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device=DEVICE.type, kernel_backend="triton",
              max_prefill_length=16, page_size=PAGE_SIZE, num_pages=64)
    assert_greedy_batch(llm, case, [llm.runtime.tokenize(p) for p in PROMPTS], max_tokens=8)
    assert set(calls) == set(folds), calls
