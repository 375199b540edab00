"""Sampling in the engine: seeded requests reproduce whatever they are batched with, and logprobs
equal transformers' (the sampler on its own: tests/unit/test_sampler.py)."""

from __future__ import annotations

import math

import torch

from oracle import PROMPTS, reference_logits
from freetoken import LLM, SamplingParams


def test_seeded_requests_reproduce_whatever_they_are_batched_with(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[3]], [others, seeded, others])
    assert mixed[1].token_ids == alone
    reseeded = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True))
    assert reseeded[0].token_ids != alone


def test_logprobs_of_chosen_tokens(demo_checkpoint):
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, logprobs=0))[0]
    ids = llm.runtime.tokenize(PROMPTS[0]) + out.token_ids
    reference = torch.log_softmax(reference_logits(demo_checkpoint, ids, torch.float32), dim=-1)
    prompt_len = len(ids) - len(out.token_ids)
    for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        assert math.isclose(logprob.logprob, reference[prompt_len - 1 + i, token].item(), abs_tol=1e-4)
        assert logprob.rank == 1 and logprob.top == []  # greedy: the likeliest; logprobs=0: no alternatives
    assert math.isclose(out.cumulative_logprob, sum(t.logprob for t in out.logprobs))


def test_top_k_logprobs_and_ranks_of_sampled_tokens(demo_checkpoint):
    """``logprobs: k``: the k likeliest tokens of the raw distribution, best first, and the sampled
    token's rank in it (1 + the tokens at least as likely), as vLLM reports them."""
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=1.5, max_tokens=6, logprobs=5, seed=3))[0]
    ids = llm.runtime.tokenize(PROMPTS[1]) + out.token_ids
    reference = torch.log_softmax(reference_logits(demo_checkpoint, ids, torch.float32), dim=-1)
    prompt_len = len(ids) - len(out.token_ids)
    for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[prompt_len - 1 + i]
        values, top_ids = row.topk(5)
        assert [t for t, _ in logprob.top] == top_ids.tolist()
        assert all(math.isclose(lp, v, abs_tol=1e-4) for (_, lp), v in zip(logprob.top, values.tolist()))
        assert logprob.rank == int((row >= row[token] - 1e-6).sum())
