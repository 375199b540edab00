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


def _admission(slot: int, temperature: float, **kw):
    from freetoken.plan import SlotSampling

    fields = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                  seed=slot, min_tokens=0, stop_token_ids=(), prompt_token_ids=(1, 2), output_token_ids=(),
                  logprobs=None)
    fields.update(kw)
    return SlotSampling(slot=slot, temperature=temperature, **fields)


@pytest.mark.parametrize(
    "others,fused",
    [([], True), ([dict(temperature=0.7)], False), ([dict(temperature=0.0, logprobs=2)], False),
     ([dict(temperature=0.0, repetition_penalty=1.3)], False)],
    ids=["all-greedy", "one-sampled", "logprobs", "penalties"],
)
def test_greedy_steps_sample_in_one_op(monkeypatch, others, fused):
    """A step of plain greedy rows takes ``kernels.greedy_sample_into_slots`` (one launch on CUDA);
    its tokens and the slot tables (last token, counts, output counter) are the general path's."""
    from freetoken import kernels
    from freetoken.engine import sample

    vocab = 40
    logits = torch.randn(3 + len(others), vocab, generator=torch.Generator().manual_seed(3))
    admissions = [_admission(s, 0.0) for s in (1, 4, 2)]
    admissions += [_admission(5 + i, **kw) for i, kw in enumerate(others)]
    slots = torch.tensor([a.slot for a in admissions], dtype=torch.int32)
    calls = []
    op = kernels.greedy_sample_into_slots
    monkeypatch.setattr(kernels, "greedy_sample_into_slots", lambda *a: calls.append(1) or op(*a))
    results = []
    for on in (True, False):
        monkeypatch.setattr(sample, "FUSED_GREEDY", on)
        sampler = sample.SlotSampler(8, vocab, torch.device("cpu"))
        sampler.admit(admissions)
        tokens, _ = sampler.sample(logits.clone(), slots, slots.tolist())
        results.append((tokens, sampler.last_token, sampler.output_counts, sampler.int_params))
    assert len(calls) == fused
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert torch.equal(results[0][0][:3], logits[:3].argmax(-1))
