"""``freetoken bench --workload shared-prefix``: time to first token of a prompt whose first tokens
are in the prefix cache, against the same-length prompt with nothing cached (issue 12).

Each round, one request at a time through ``LLM.generate`` (greedy, one output token: only the
first token's time matters):

1. *uncached*: ``input_len`` random tokens that no other prompt starts with: all of it is prefilled
   (with prefix caching on, this also pays the cache lookup, as a real miss does);
2. *priming*: the round's shared prefix of ``shared_prefix_len`` tokens, followed by
   ``prime_tail_len`` tokens of its own (default none: the prefix alone, so that a snapshot taken
   where a prompt's last full page ends, the least a hybrid model's cache must keep, lies at the
   prefix's end; a tail of its own asks the snapshot policy for the divergence point instead);
3. *cached*: the same prefix with another tail, ``input_len`` tokens in all: only the tail (and
   whatever the cache did not hold) is prefilled.

A first round is a warm-up (kernels compile for both prompt shapes) and is not reported; each
round draws new random tokens, so no round hits another's pages. Figures are medians over
``repeats`` rounds. With prefix caching off, both TTFTs are of full prefills and the ratio is ~1.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict
from typing import Any

DEFAULT_PROMPT_LEN = 8192
DEFAULT_SHARED_PREFIX_LEN = 7680


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]


def round_prompts(rng: random.Random, prompt_len: int, prefix_len: int, prime_tail_len: int,
                  vocab_size: int) -> dict[str, list[int]]:
    """One round's three prompts: uncached, priming and cached (see the module docstring)."""
    prefix = _tokens(rng, prefix_len, vocab_size)
    return {
        "uncached": _tokens(rng, prompt_len, vocab_size),
        "priming": prefix + _tokens(rng, prime_tail_len, vocab_size),
        "cached": prefix + _tokens(rng, prompt_len - prefix_len, vocab_size),
    }


def pages_needed(prompt_len: int, prefix_len: int, prime_tail_len: int, repeats: int, page_size: int) -> int:
    """Usable KV pages for every round's prompts, each with its output token, to stay cached at once:
    no eviction during the run, so each round's prefix is still there for its cached request."""
    def pages(tokens: int) -> int:
        return -(-(tokens + 1) // page_size)

    per_round = 2 * pages(prompt_len) + pages(prefix_len + prime_tail_len)
    return (repeats + 1) * per_round


def _ttft_and_cached(llm, prompt: list[int]) -> tuple[float, int]:
    from freetoken.core import SamplingParams

    (output,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                            ignore_eos=True))
    return output.metrics["time_to_first_token"], output.num_cached_tokens


def _round(llm, rng: random.Random, prompt_len: int, prefix_len: int, prime_tail_len: int) -> dict[str, Any]:
    prompts = round_prompts(rng, prompt_len, prefix_len, prime_tail_len, llm.runtime.engine.vocab_size)
    measured: dict[str, Any] = {}
    for kind in ("uncached", "priming", "cached"):
        ttft, cached = _ttft_and_cached(llm, prompts[kind])
        measured[f"ttft_ms_{kind}"], measured[f"num_cached_tokens_{kind}"] = ttft * 1e3, cached
    return measured


def bench_shared_prefix(llm, prompt_len: int, prefix_len: int, prime_tail_len: int, repeats: int, seed: int,
                        progress: Any = None) -> dict[str, Any]:
    """A warm-up round, then ``repeats`` timed rounds; the result's fields are listed in
    docs/benchmarks.md ("Prefix caching (issue 12)")."""
    runtime = llm.runtime
    rng = random.Random(seed)
    _round(llm, rng, prompt_len, prefix_len, prime_tail_len)  # warm-up
    if progress is not None:
        progress.update(1)
    before = runtime.stats().prefix_cache
    rounds: list[dict[str, Any]] = []
    for _ in range(repeats):
        rounds.append(_round(llm, rng, prompt_len, prefix_len, prime_tail_len))
        if progress is not None:
            progress.update(1)
    after = runtime.stats().prefix_cache

    def median(name: str) -> float:
        return statistics.median(r[name] for r in rounds)

    ttft_cached, ttft_uncached = median("ttft_ms_cached"), median("ttft_ms_uncached")
    num_cached = min(r["num_cached_tokens_cached"] for r in rounds)
    page_size = runtime.scheduler.pages.page_size
    return {
        "prompt_len": prompt_len,
        "shared_prefix_len": prefix_len,
        "prime_tail_len": prime_tail_len,
        "repeats": repeats,
        "page_size": page_size,
        "prefix_caching": after is not None,
        "ttft_ms_uncached": ttft_uncached,
        "ttft_ms_cached": ttft_cached,
        "ttft_ratio": ttft_cached / ttft_uncached,
        "num_cached_tokens": num_cached,  # the fewest any measured cached request had
        "cacheable_tokens": prefix_len // page_size * page_size,  # whole pages of the shared prefix
        "prefill_tok_s_uncached": prompt_len / ttft_uncached * 1e3,
        "prefill_tok_s_cached": (prompt_len - num_cached) / ttft_cached * 1e3,  # of the tokens it prefilled
        # the runtime's counters over the timed rounds
        "prefix_cache_hit_tokens": None if after is None else after.hit_tokens - before.hit_tokens,
        "prefix_cache_queried_tokens": None if after is None else after.queried_tokens - before.queried_tokens,
        "prefix_cache_after": None if after is None else asdict(after),
        "rounds": rounds,
    }
