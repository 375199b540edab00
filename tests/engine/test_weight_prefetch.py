"""The L2 prefetch sites (``layers.weight_prefetch``): with every site on, each decoder layer of a
decode step asks, right after its input projection, for its mixer's output projection, its router
and its shared expert; prefill steps and wide decode steps ask for nothing; tokens are unchanged
(the CPU has no L2 to fill, so the asks are recorded, not issued)."""

from __future__ import annotations

import pytest

from freetoken import LLM
from freetoken.layers import weight_prefetch
from freetoken.layers.gated_deltanet import GatedDeltaNet
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, checkpoint


@pytest.fixture
def asks(monkeypatch):
    """Every site on; each ``issue`` call's weights, by identity, in order."""
    for site in ("OUT_PROJ", "ROUTER", "SHARED"):
        monkeypatch.setattr(weight_prefetch, site, True)
    recorded: list[list[int]] = []
    issue = weight_prefetch.WeightPrefetch.issue
    monkeypatch.setattr(weight_prefetch.WeightPrefetch, "issue",
                        lambda self, weights: recorded.append([id(w) for w in weights]) or issue(self, weights))
    return recorded


def test_decode_layers_ask_for_the_weights_after_their_input(asks):
    case = DEMO["qwen3_5_moe"]
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cpu", max_prefill_length=16, page_size=PAGE_SIZE,
              max_running_requests=weight_prefetch.MAX_ROWS)
    assert_greedy_batch(llm, case)
    layers = llm.runtime.engine.model.layers
    expected = []
    for layer in layers:
        mixer_out = layer.mixer.out_proj if isinstance(layer.mixer, GatedDeltaNet) else layer.mixer.o_proj
        expected.append([id(w) for w in (mixer_out, layer.mlp.gate_weight, layer.mlp.shared_gate_up,
                                         layer.mlp.shared_down)])
    assert asks and len(asks) % len(layers) == 0
    # One ask a layer a decode step, in layer order (prefill and mixed steps ask nothing).
    assert asks == expected * (len(asks) // len(layers))


def test_no_ask_past_max_rows_or_with_every_site_off(asks, monkeypatch):
    case = DEMO["qwen3_5_moe"]
    monkeypatch.setattr(weight_prefetch, "MAX_ROWS", 0)
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cpu", max_prefill_length=16, page_size=PAGE_SIZE)
    assert_greedy_batch(llm, case)
    monkeypatch.setattr(weight_prefetch, "MAX_ROWS", 8)
    for site in ("OUT_PROJ", "ROUTER", "SHARED"):
        monkeypatch.setattr(weight_prefetch, site, False)
    assert_greedy_batch(llm, case)
    assert asks == []
