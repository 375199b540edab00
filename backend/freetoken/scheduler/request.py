"""A request as the scheduler and engine see it: its tokens, how many are in the cache, its memory."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from freetoken.core import FinishReason, RequestTimes, ResolvedSampling, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from freetoken.scheduler.prefix_cache import PageHashChain


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Its text (detokenized, stop strings cut, how much was streamed) is not here: it lives in the
    runtime's request table, as an ``output.OutputText``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: ResolvedSampling
    eos_token_ids: set[int]
    stop_token_ids: set[int]  # eos ids (unless ignore_eos) and the request's stop_token_ids
    max_total_tokens: int  # prompt + output may not pass this (the context limit)
    token_ids: list[int] = field(init=False)  # prompt, then output
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed: int = 0  # tokens whose KV / state are in the cache
    # Tokens sampled on the device whose ids the host has not read yet (overlap scheduling).
    num_in_flight: int = 0
    # len(token_ids) when the request took its slot: later tokens were sampled into the slot's
    # last-token pool, so a decode of one of them reads it from there.
    num_admitted_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Prefix caching. What besides the tokens changes the KV (seeds the page hashes).
    prefix_namespace: bytes = b""
    page_hashes: PageHashChain | None = None  # of the prompt's full pages, each computed when first asked for
    num_cached_tokens: int = 0  # prompt tokens the first admission found cached (vLLM's name)
    num_indexed_pages: int = 0  # of its pages, those the prefix index names already
    snapshot_at: list[int] = field(default_factory=list)  # boundaries still to snapshot, ascending
    # A sibling of parallel sampling (n > 1) is admitted once this one computed the shared prompt,
    # so it hits that prompt's pages and snapshot instead of prefilling it again.
    prefill_after: Request | None = None
    times: RequestTimes = field(default_factory=RequestTimes)
    # The prompt as a read-only int64 array, built once (by the runtime's validation, or here): its
    # page hashes, its chunks' staging and the sampler's prompt set read it with no per-token
    # Python work.
    prompt_array: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.prompt_array is None:
            self.prompt_array = np.array(self.prompt_token_ids, dtype=np.int64)
        elif self.prompt_array.dtype != np.int64 or len(self.prompt_array) != len(self.prompt_token_ids):
            raise ValueError(f"request {self.request_id}: prompt_array must be the prompt's {len(self.prompt_token_ids)} int64 ids")
        self.prompt_array.flags.writeable = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known(self) -> int:
        """Tokens that exist, on the host or in flight."""
        return len(self.token_ids) + self.num_in_flight

    @property
    def num_uncomputed(self) -> int:
        return self.num_known - self.num_computed

    @property
    def in_flight_finishes(self) -> bool:
        """The tokens in flight reach max_tokens or the context limit: nothing more to schedule."""
        return self.num_in_flight > 0 and (
            self.num_output_tokens + self.num_in_flight >= self.params.max_tokens
            or self.num_known >= self.max_total_tokens
        )

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
