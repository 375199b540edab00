"""From logits to tokens: min_tokens, penalties, then the sampling kernel; logprobs of the choice,
its rank and the top-k alternatives (vLLM's ``logprobs``), all from the raw logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken import kernels
from freetoken.core import TokenLogprobs
from freetoken.scheduler.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """vLLM's penalties, in place: repetition over prompt + output (divide positive logits, multiply
    negative ones), presence and frequency over the output's token counts."""
    vocab = logits.shape[-1]
    for row, req in enumerate(requests):
        sampling = req.sampling
        if not sampling.uses_penalties:
            continue
        if sampling.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in req.token_ids if t < vocab}), dtype=torch.int64)
            seen = seen.to(logits.device)
            values = logits[row, seen]
            penalized = torch.where(
                values > 0, values / sampling.repetition_penalty, values * sampling.repetition_penalty
            )
            logits[row].index_copy_(0, seen, penalized)
        if sampling.presence_penalty or sampling.frequency_penalty:
            output = torch.tensor([t for t in req.output_token_ids if t < vocab], dtype=torch.int64)
            counts = torch.bincount(output.to(logits.device), minlength=vocab).to(logits.dtype)
            logits[row] -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0)


def _block_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Before ``min_tokens`` outputs, stop tokens cannot be chosen."""
    for row, req in enumerate(requests):
        if req.num_output_tokens < req.params.min_tokens and req.stop_token_ids:
            ids = [t for t in req.stop_token_ids if t < logits.shape[-1]]
            logits[row, ids] = float("-inf")


def sample(logits: torch.Tensor, requests: list[Request]) -> SampleResult:
    """``logits [N, V]`` float32, one row per request that samples this step."""
    raw_logprobs = None
    if any(req.params.logprobs is not None for req in requests):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    _block_stop_tokens(logits, requests)
    apply_penalties(logits, requests)
    device = logits.device

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    token_ids = kernels.sample_tokens(
        logits,
        column([r.sampling.temperature for r in requests], torch.float32),
        column([r.sampling.top_k for r in requests], torch.int32),
        column([r.sampling.top_p for r in requests], torch.float32),
        column([r.sampling.min_p for r in requests], torch.float32),
        column([r.sampling.seed for r in requests], torch.int64),
        column([r.num_output_tokens for r in requests], torch.int64),
    )
    logprobs: list[TokenLogprobs | None] = [None] * len(requests)
    if raw_logprobs is not None:
        logprobs = _token_logprobs(raw_logprobs, token_ids, requests)
    return SampleResult(token_ids.tolist(), logprobs)


def _token_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, requests: list[Request]) -> list[TokenLogprobs | None]:
    """The chosen token's logprob and rank (1 + the tokens at least as likely besides it, as vLLM
    counts), and the ``logprobs`` likeliest tokens of each request that asked."""
    chosen = raw_logprobs.gather(1, token_ids[:, None].long())
    ranks = (raw_logprobs >= chosen).sum(dim=1).tolist()
    k = max(req.params.logprobs or 0 for req in requests)
    top_values, top_ids = raw_logprobs.topk(k, dim=1)
    chosen, top_values, top_ids = chosen[:, 0].tolist(), top_values.tolist(), top_ids.tolist()
    results: list[TokenLogprobs | None] = []
    for row, req in enumerate(requests):
        want = req.params.logprobs
        if want is None:
            results.append(None)
            continue
        top = list(zip(top_ids[row][:want], top_values[row][:want]))
        results.append(TokenLogprobs(chosen[row], ranks[row], top))
    return results
