"""From logits to tokens, on the device: min_tokens, penalties, the sampling kernel, logprobs (the
chosen token's, its rank and the top-k alternatives: vLLM's ``logprobs``, from the raw logits).

Sampling is split in two. ``SlotSampler.admit`` (host side, once per admission) stages a
request's parameters in per-slot device tables, with its prompt's token set and the counts of the
outputs it already has. ``SlotSampler.sample`` (device only) gathers the tables by the step's slots,
blocks stop tokens before ``min_tokens``, applies penalties from the per-slot counts, samples, and
writes each token back: into the last-token pool (the next decode's input), the counts, and the
slot's output counter (the sampling step of the counter-based randomness). Nothing waits for the
host; the tokens reach it through ``engine.outputs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken import kernels
from freetoken.plan import SlotSampling


def apply_penalties(
    logits: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_seen: torch.Tensor,
) -> None:
    """vLLM's penalties, in place on ``logits [N, V]``: repetition over prompt + output tokens
    (divide positive logits, multiply negative ones), presence and frequency over the output's
    token counts ``output_counts [N, V]``; ``prompt_seen [N, V]`` marks prompt tokens."""
    counts = output_counts.to(logits.dtype)
    seen = prompt_seen | (output_counts > 0)
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype)


@dataclass
class _HostSlot:
    """What the host needs to know of a slot to skip work no sampled row asks for."""

    uses_penalties: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # the alternatives it asks for; None: no logprobs


@dataclass
class SampledLogprobs:
    """On the device, per sampled row: the chosen token's raw logprob, its rank (the tokens at least
    as likely, itself included, as vLLM counts: 1 is the likeliest), and the ``k`` likeliest tokens
    (``k``: the most any row of the step asks for)."""

    chosen: torch.Tensor  # [N] float32
    ranks: torch.Tensor  # [N] int64
    top_ids: torch.Tensor  # [N, k] int64
    top_values: torch.Tensor  # [N, k] float32

    @classmethod
    def of(cls, raw_logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> "SampledLogprobs":
        chosen = raw_logprobs.gather(1, token_ids[:, None])
        top_values, top_ids = raw_logprobs.topk(k, dim=1)
        return cls(chosen[:, 0], (raw_logprobs >= chosen).sum(dim=1), top_ids, top_values)


class SlotSampler:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size

        def table(dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
            return torch.full((num_slots,), fill, dtype=dtype, device=device)

        self.temperature = table(torch.float32, 1.0)
        self.top_p = table(torch.float32, 1.0)
        self.top_k = table(torch.int32)
        self.min_p = table(torch.float32)
        self.repetition = table(torch.float32, 1.0)
        self.presence = table(torch.float32)
        self.frequency = table(torch.float32)
        self.seed = table(torch.int64)
        self.min_tokens = table(torch.int64)
        self.num_outputs = table(torch.int64)  # the sampling step of each slot
        self.last_token = table(torch.int64)  # the last-token pool: a decode row's input
        self.output_counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.stop_mask = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self._host = [_HostSlot() for _ in range(num_slots)]
        self.device = device

    @staticmethod
    def device_bytes(num_slots: int, vocab_size: int) -> int:
        """The bytes of the per-slot tables ``SlotSampler(num_slots, vocab_size, ...)`` allocates
        (``[slots, vocab]`` token counts and masks: ~100 MB at 65 slots of a 248k vocabulary),
        which the pool sizing sets aside. Measured on ``meta``: the constructor is the one spec."""
        tables = vars(SlotSampler(num_slots, vocab_size, torch.device("meta"))).values()
        return sum(t.nbytes for t in tables if isinstance(t, torch.Tensor))

    def admit(self, admissions: list[SlotSampling]) -> None:
        """Stage each admitted request's parameters and token history in its slot, without a host
        sync: every value goes up from pinned memory asynchronously, and rows are cleared and
        marked with ``index_fill_`` (``rows[index] = scalar`` copies the scalar up and waits)."""
        if not admissions:
            return
        vocab = self.vocab_size
        slots = self._up([a.slot for a in admissions], torch.int64)

        def put(table: torch.Tensor, values: list) -> None:
            table.index_copy_(0, slots, self._up(values, table.dtype))

        put(self.temperature, [a.temperature for a in admissions])
        put(self.top_p, [a.top_p for a in admissions])
        put(self.top_k, [a.top_k for a in admissions])
        put(self.min_p, [a.min_p for a in admissions])
        put(self.repetition, [a.repetition_penalty for a in admissions])
        put(self.presence, [a.presence_penalty for a in admissions])
        put(self.frequency, [a.frequency_penalty for a in admissions])
        put(self.seed, [a.seed for a in admissions])
        put(self.min_tokens, [a.min_tokens for a in admissions])
        put(self.num_outputs, [len(a.output_token_ids) for a in admissions])
        for rows in (self.output_counts, self.prompt_seen, self.stop_mask):
            rows.index_fill_(0, slots, 0)
        for a in admissions:
            self._host[a.slot] = _HostSlot(a.uses_penalties, a.min_tokens, a.logprobs)
            if a.uses_penalties:
                self.prompt_seen[a.slot].index_fill_(0, self._up([t for t in a.prompt_token_ids if t < vocab], torch.int64), True)
                outputs = torch.tensor([t for t in a.output_token_ids if t < vocab], dtype=torch.int64)
                self.output_counts[a.slot].copy_(self._up(torch.bincount(outputs, minlength=vocab), torch.int32))
            if a.min_tokens > 0 and a.stop_token_ids:
                self.stop_mask[a.slot].index_fill_(0, self._up([t for t in a.stop_token_ids if t < vocab], torch.int64), True)

    def _up(self, values: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``values`` on the device: from pinned memory, asynchronously, on CUDA. The pinned block
        stays allocated until its copy is done (torch's host allocator records the copy's event)."""
        pinned = self.device.type == "cuda"
        host = torch.as_tensor(values, dtype=dtype)
        return (host.pin_memory() if pinned else host).to(self.device, non_blocking=pinned)

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, host_slots: list[int]) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """``logits [N, V]`` float32 of the rows sampling into ``slots [N]`` (device; ``host_slots``
        is the same on the host). Returns token ids ``[N]`` int64 and, if any row asks, the raw
        model logprobs of the chosen tokens, their ranks and the top-k."""
        host = [self._host[s] for s in host_slots]
        slots = slots.long()
        wanted = [h.logprobs for h in host if h.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wanted else None
        num_outputs = self.num_outputs[slots]
        if any(h.min_tokens > 0 for h in host):
            blocked = self.stop_mask[slots] & (num_outputs < self.min_tokens[slots])[:, None]
            logits.masked_fill_(blocked, float("-inf"))
        if any(h.uses_penalties for h in host):
            apply_penalties(
                logits,
                self.repetition[slots],
                self.presence[slots],
                self.frequency[slots],
                self.output_counts[slots],
                self.prompt_seen[slots],
            )
        token_ids = kernels.sample_tokens(
            logits,
            self.temperature[slots],
            self.top_k[slots],
            self.top_p[slots],
            self.min_p[slots],
            self.seed[slots],
            num_outputs,
        ).long()
        # Scatters (atomic adds where slots repeat: padding rows all write scratch slot 0) never
        # wait for the device, unlike an accumulating index_put.
        self.last_token.scatter_(0, slots, token_ids)
        ones = torch.ones_like(token_ids)
        self.output_counts.view(-1).scatter_add_(0, slots * self.vocab_size + token_ids, ones.int())
        self.num_outputs.scatter_add_(0, slots, ones)
        logprobs = None if raw_logprobs is None else SampledLogprobs.of(raw_logprobs, token_ids, max(wanted))
        return token_ids, logprobs
