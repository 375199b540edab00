"""The data types every layer shares: sampling parameters, requests and their outputs."""

from __future__ import annotations

import enum
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any


MAX_LOGPROBS = 20  # the most alternatives ``logprobs`` may ask for (vLLM's default max_logprobs)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed this request


@dataclass
class SamplingParams:
    """How one request is decoded (vLLM's names and meanings): ``validate`` checks the ranges,
    ``resolve`` fills in the defaults.

    ``None`` for ``temperature, top_p, top_k, min_p, repetition_penalty`` means "the model's
    generation_config.json default, else the neutral value".
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: each chosen token's and the k likeliest
    prompt_logprobs: int | None = None  # accepted as vLLM does; no output carries them (see docs/serving.md)
    skip_special_tokens: bool = True
    n: int = 1  # samples per prompt; the serving layer runs them as sibling requests (Runtime.make_requests)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of its allowed range."""
        checks: list[tuple[str, bool, str]] = [
            ("temperature", self.temperature is None or self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p is None or 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k is None or self.top_k == -1 or self.top_k >= 0, "-1 (off), 0 (off) or >= 1"),
            ("min_p", self.min_p is None or 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty is None or self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"in [0, {MAX_LOGPROBS}]"),
            ("n", self.n >= 1, ">= 1"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**64, "a 64-bit integer"),
        ]
        for name, ok, allowed in checks:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                ok = False
            if not ok:
                raise ValueError(f"sampling parameter '{name}' must be {allowed}, got {value!r}")
        for stop in self.stop_strings:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"sampling parameter 'stop' must hold non-empty strings, got {stop!r}")
        for token_id in self.stop_token_ids or []:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"sampling parameter 'stop_token_ids' must hold token ids >= 0, got {token_id!r}")

    def resolve(self, defaults: Any | None, seed_source: random.Random) -> ResolvedSampling:
        """Every default filled in: unset fields from ``defaults`` (the model's ``GenerationConfig``,
        or None), else neutral; an unset seed drawn from ``seed_source``."""

        def pick(name: str, neutral: float) -> float:
            value = getattr(self, name)
            if value is None and defaults is not None:
                value = getattr(defaults, name, None)
            return neutral if value is None else value

        seed = self.seed if self.seed is not None else seed_source.getrandbits(63)
        return ResolvedSampling(
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=int(pick("top_k", 0)),
            min_p=float(pick("min_p", 0.0)),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=seed - (1 << 64) if seed >= (1 << 63) else seed,  # the device holds it as int64
        )


@dataclass
class ResolvedSampling:
    """Sampling parameters with every default filled in, ready for the device."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class TokenLogprobs:
    """One sampled token's log-probability (from the raw logits, before penalties and temperature,
    as vLLM reports them), its rank among the vocabulary (1 = likeliest; ties count against it, as
    in vLLM) and the ``logprobs`` likeliest tokens, best first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class RequestOutput:
    """What a request produced. Every output carries the delta since the last one in the ``new_*``
    fields; the whole output (``token_ids``, ``text``, ``logprobs``) is filled in the finished one
    only (empty before), so streaming stays linear in the output length. ``cumulative_logprob``
    is always the running sum."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens whose prefill a prefix-cache hit skipped (vLLM's name)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
