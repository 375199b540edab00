"""Logprobs on CUDA with the defaults (decode graphs and the overlapped loop on): the sampled token's
logprob and rank, and the top-k alternatives, equal transformers' float32 log-softmax, for greedy
and seeded sampling in one batch (the CPU counterpart: tests/engine/test_engine_sampling.py)."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken import LLM, SamplingParams
from oracle import DEMO, PROMPTS, checkpoint, reference_logits

pytestmark = pytest.mark.gpu


def test_top_k_logprobs_and_ranks_equal_transformers_with_graphs_and_overlap():
    path = checkpoint(DEMO["qwen3_5_moe"])
    llm = LLM(model=str(path), dtype="float32", device="cuda")
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=5),
        SamplingParams(temperature=1.5, max_tokens=6, logprobs=5, seed=3),
        SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=7),
    ]
    runner = llm.runtime.engine.graph_runner
    assert runner is not None and runner.graphs, "graphs must be on by default on CUDA"
    replays = []
    replay = runner.run
    runner.run = lambda batch: replays.append(batch.num_requests) or replay(batch)
    outputs = llm.generate(PROMPTS[:3], params)
    assert replays, "no decode step was replayed from a graph"
    for prompt, param, out in zip(PROMPTS, params, outputs):
        ids = llm.runtime.tokenize(prompt) + out.token_ids
        reference = torch.log_softmax(reference_logits(path, ids, torch.float32), dim=-1)
        prompt_len = len(ids) - len(out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 6
        for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
            row = reference[prompt_len - 1 + i]
            assert math.isclose(logprob.logprob, row[token].item(), abs_tol=1e-4)
            assert logprob.rank == int((row >= row[token] - 1e-6).sum())
            values, top_ids = row.topk(param.logprobs) if param.logprobs else (row[:0], row[:0].long())
            assert [t for t, _ in logprob.top] == top_ids.tolist()
            assert all(math.isclose(lp, v, abs_tol=1e-4) for (_, lp), v in zip(logprob.top, values.tolist()))
        assert math.isclose(out.cumulative_logprob, sum(t.logprob for t in out.logprobs), abs_tol=1e-4)
