"""The sampler on its own: seeded noise, temperature and filters (the torch reference of the
sampling op), vLLM's penalties, and sampling parameters out of range."""

from __future__ import annotations

import pytest
import torch

from freetoken import SamplingParams
from freetoken.kernels.sampling import sample_tokens_reference, uniform_noise


def _draws(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """``n`` samples from one row of logits, each with its own seed."""
    rows = logits.expand(n, -1).contiguous()
    full = lambda v, dtype: torch.full((n,), v, dtype=dtype)  # noqa: E731
    return sample_tokens_reference(
        rows,
        full(kw.get("temperature", 1.0), torch.float32),
        full(kw.get("top_k", 0), torch.int32),
        full(kw.get("top_p", 1.0), torch.float32),
        full(kw.get("min_p", 0.0), torch.float32),
        torch.arange(n, dtype=torch.int64) * 7919 + 13,
        torch.zeros(n, dtype=torch.int64),
    )


def test_noise_is_uniform_and_decorrelated():
    u = uniform_noise(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 4096)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert abs(torch.corrcoef(u[:2])[0, 1].item()) < 0.05


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20000
    counts = torch.bincount(_draws(logits, n, temperature=0.7), minlength=5).float() / n
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    assert torch.allclose(counts, expected, atol=0.015), (counts, expected)


@pytest.mark.parametrize(
    "filters, allowed",
    [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.6), {0, 1}),  # probs ~ .47 .17 .17 .10 ...: .47 < .6, .47 + .17 reaches it
        (dict(min_p=0.3), {0, 1, 2}),
        (dict(top_k=3, top_p=0.5), {0, 1}),
    ],
)
def test_filters_keep_only_their_tokens(filters, allowed):
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.5, 0.0, -1.0]])
    drawn = set(_draws(logits, 4000, **filters).tolist())
    assert drawn <= allowed and len(drawn) == len(allowed)


def test_zero_temperature_is_greedy():
    logits = torch.randn(1, 50)
    assert set(_draws(logits, 100, temperature=0.0).tolist()) == {logits.argmax().item()}


def test_penalties_follow_vllm():
    from freetoken.engine.sample import apply_penalties

    # prompt (5, 6), outputs 6 once and 7 twice, as the per-slot counts hold them.
    counts = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 2]], dtype=torch.int32)
    prompt_seen = torch.zeros(1, 8, dtype=torch.bool)
    prompt_seen[0, [5, 6]] = True
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.0, 3.0, 4.0, -2.0, 6.0]])
    apply_penalties(logits, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]), counts, prompt_seen)
    # repetition over prompt + output (5, 6, 7): positive / 2, negative * 2; then presence and
    # frequency over the output counts (6: 1, 7: 2).
    expected = torch.tensor([[1.0, -1.0, 2.0, 0.0, 3.0, 2.0, -4.0 - 0.5 - 0.25, 3.0 - 0.5 - 0.5]])
    assert torch.allclose(logits, expected)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("min_p", 2.0), ("top_k", -3)],
)
def test_out_of_range_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
