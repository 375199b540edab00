from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE
from freetoken.kernels import sampling as ref


def _between(sorted_values: torch.Tensor, rank: int) -> float:
    """A value strictly between entries ``rank`` and ``rank + 1``: no float32 rounding can put the
    boundary on the other side of a token (the reference and the kernel sum masses in different orders)."""
    return float((sorted_values[rank] + sorted_values[rank + 1]) / 2)


def test_sample_tokens_matches_reference(rng):
    from freetoken.kernels.triton.sampling import sample_tokens

    vocab, temperature_ = 997, 0.8
    rows = ["greedy", "plain", "top_k", "top_p", "min_p", "all", "top_k_off", "top_p_one"]
    batch = len(rows)
    logits = torch.randn(batch, vocab, generator=rng) * 3
    temperature = torch.full((batch,), temperature_)
    temperature[0] = 0.0
    top_k = torch.zeros(batch, dtype=torch.int32)
    top_p = torch.ones(batch)
    min_p = torch.zeros(batch)
    probs = torch.softmax(logits / temperature_, dim=-1).sort(dim=-1, descending=True).values
    mass_before = probs.cumsum(-1) - probs
    pick = lambda: int(torch.randint(1, 40, (1,), generator=rng))  # noqa: E731
    top_k[2] = pick()
    top_p[3] = _between(mass_before[3], pick())
    min_p[4] = _between(probs[4] / probs[4, 0], pick())
    top_k[5], top_p[5], min_p[5] = 30, _between(mass_before[5], pick()), _between(probs[5] / probs[5, 0], pick())
    top_k[6] = vocab + 5  # larger than the vocabulary: off
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=rng)
    logits = logits.to(DEVICE)
    columns = [c.to(DEVICE) for c in (temperature, top_k, top_p, min_p, seeds)]
    for step in range(4):
        steps = torch.full((batch,), step, dtype=torch.int64, device=DEVICE) + torch.arange(batch, device=DEVICE)
        got = sample_tokens(logits, *columns, steps)
        want = ref.sample_tokens_reference(logits, *columns, steps)
        assert got.dtype == torch.int64
        assert got.tolist() == want.tolist(), f"step {step}: rows {[r for r, a, b in zip(rows, got, want) if a != b]}"


def test_sample_tokens_keeps_only_the_filtered_set(rng):
    """With top-k = 3 every draw, over many steps, is one of the 3 most likely tokens and all 3 occur."""
    from freetoken.kernels.triton.sampling import sample_tokens

    # 96 draws: each of the three has p >= 0.2 unless the noise passes 3 sigma, so one is missed
    # with probability under 1e-9 (at 24 draws about 1e-3 at worst, which a CI run hit)
    vocab, draws = 64, 96
    row = torch.randn(vocab, generator=rng) * 0.1
    row[torch.randperm(vocab, generator=rng)[:3]] += 3.0  # three likely tokens, each about 1/3
    logits = row.expand(draws, vocab).contiguous().to(DEVICE)
    ones = torch.ones(draws, device=DEVICE)
    got = sample_tokens(
        logits,
        ones,
        torch.full((draws,), 3, dtype=torch.int32, device=DEVICE),
        ones,
        torch.zeros(draws, device=DEVICE),
        torch.full((draws,), 1234, dtype=torch.int64, device=DEVICE),
        torch.arange(draws, device=DEVICE),
    )
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(got.tolist()) == top3


def _slot_tables(num_slots: int, vocab: int, rng):
    last = torch.randint(0, vocab, (num_slots,), generator=rng)
    counts = torch.randint(0, 3, (num_slots, vocab), generator=rng, dtype=torch.int32)
    params = torch.randint(0, 9, (num_slots, 3), generator=rng)  # num_outputs: a strided column, as the sampler's
    return last.to(DEVICE), counts.to(DEVICE), params.to(DEVICE)


@pytest.mark.parametrize("split", [256, 1024, 4096], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_greedy_sample_into_slots_matches_reference(rng, split, slot_dtype):
    """The split argmax and its bookkeeping against the reference: ties (to the lower id), a
    maximum in the last, partial split, and repeated slots (padding rows) accumulating."""
    from freetoken.kernels.triton.sampling import greedy_sample_into_slots_tiled

    vocab, num_slots = 1999, 5
    logits = torch.randn(4, vocab, generator=rng)
    logits[1, [7, 1500]] = 50.0  # a tie across splits: the lower id wins
    logits[2, vocab - 1] = 50.0  # the last split, partial
    logits[3] = float("-inf")  # no finite logit: token 0, as argmax
    logits = logits.to(DEVICE)
    slots = torch.tensor([3, 0, 0, 4], dtype=slot_dtype, device=DEVICE)
    got_tables = _slot_tables(num_slots, vocab, rng)
    want_tables = tuple(t.clone() for t in got_tables)
    got = greedy_sample_into_slots_tiled(logits, slots, got_tables[0], got_tables[1], got_tables[2][:, 2], split)
    want = ref.greedy_sample_into_slots_reference(logits, slots, want_tables[0], want_tables[1], want_tables[2][:, 2])
    assert torch.equal(got, want) and got[1] == 7 and got[2] == vocab - 1 and got[3] == 0
    assert torch.equal(want, ref.sample_tokens_reference(logits, *_greedy_params(4)))
    assert torch.equal(got_tables[1], want_tables[1]) and torch.equal(got_tables[2], want_tables[2])
    # Repeated slot 0: which row's token it keeps is unspecified (as for the reference's scatter).
    assert got_tables[0][0] in (got[1], got[2]) and torch.equal(got_tables[0][1:], want_tables[0][1:])


def _greedy_params(batch: int):
    zeros = torch.zeros(batch)
    return (zeros.to(DEVICE), torch.zeros(batch, dtype=torch.int32, device=DEVICE), torch.ones(batch, device=DEVICE),
            zeros.to(DEVICE), torch.zeros(batch, dtype=torch.int64, device=DEVICE),
            torch.zeros(batch, dtype=torch.int64, device=DEVICE))


def test_greedy_sample_into_slots_rejects_bad_tables(rng):
    from freetoken.kernels.triton.sampling import greedy_sample_into_slots

    last, counts, params = _slot_tables(3, 64, rng)
    logits = torch.randn(2, 64, generator=rng).to(DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        greedy_sample_into_slots(logits.double(), slots, last, counts, params[:, 2])
    with pytest.raises(ValueError, match="slots"):
        greedy_sample_into_slots(logits, slots.float(), last, counts, params[:, 2])
    with pytest.raises(ValueError, match="output_counts"):
        greedy_sample_into_slots(logits, slots, last, counts[:, :32], params[:, 2])
    with pytest.raises(ValueError, match="int64"):
        greedy_sample_into_slots(logits, slots, last.int(), counts, params[:, 2])
