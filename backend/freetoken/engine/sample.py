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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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


# A step whose every sampled row is plain greedy (temperature 0; no penalties, min_tokens or logprobs)
# samples and books its tokens in one launch (``kernels.greedy_sample_into_slots``: a split argmax)
# instead of the parameter gathers, the sampling kernel (one program streaming a row) and the scatters
# (about 15 launches at batch 1). False: every step takes the general path (the A/B switch).
FUSED_GREEDY = True


@dataclass
class _HostSlot:
    """What the host needs to know of a slot to skip work no sampled row asks for."""

    uses_penalties: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # the alternatives it asks for; None: no logprobs
    greedy: bool = False  # temperature 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to apply or report: the fused greedy launch's rows."""
        return self.greedy and not self.uses_penalties and self.min_tokens <= 0 and self.logprobs is None


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


# The per-slot parameters live in three tables by dtype, so an admission stages them with one
# upload and three row copies: float32 (these SlotSampling fields, in column order, and their
# defaults), int64 (seed, min_tokens, num_outputs) and int32 top_k.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_FLOAT_DEFAULTS = (1.0, 1.0, 0.0, 1.0, 0.0, 0.0)


def _column(table: str, index: int) -> property:
    """Column ``index`` of a parameter table, as a view (written in place, gathered by slots)."""
    return property(lambda self: getattr(self, table)[:, index])


class SlotSampler:
    temperature, top_p, min_p, repetition, presence, frequency = (_column("float_params", i) for i in range(6))
    seed, min_tokens, num_outputs = (_column("int_params", i) for i in range(3))  # num_outputs: the sampling step

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.float_params = torch.tensor(_FLOAT_DEFAULTS, dtype=torch.float32, device=device).repeat(num_slots, 1)
        self.int_params = torch.zeros(num_slots, 3, dtype=torch.int64, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int32, device=device)  # int32, as the kernel reads it
        self.last_token = torch.zeros(num_slots, dtype=torch.int64, device=device)  # the last-token pool: a decode row's input
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
        sync: the slots and every parameter go up in one copy from pinned memory (three row copies
        put them in the tables), rows are cleared and marked with ``index_fill_`` (``rows[index] =
        scalar`` copies the scalar up and waits); only requests with penalties or min_tokens stage
        their token sets, each from an int64 array."""
        if not admissions:
            return
        n, vocab = len(admissions), self.vocab_size
        packed = np.empty(60 * n, dtype=np.uint8)  # int64 slots, int64 [n, 3], float32 [n, 6], int32 top_k
        packed[: 8 * n].view(np.int64)[:] = [a.slot for a in admissions]
        packed[8 * n : 32 * n].view(np.int64).reshape(n, 3)[:] = [
            [a.seed, a.min_tokens, len(a.output_token_ids)] for a in admissions
        ]
        packed[32 * n : 56 * n].view(np.float32).reshape(n, 6)[:] = [
            [getattr(a, name) for name in _FLOAT_FIELDS] for a in admissions
        ]
        packed[56 * n :].view(np.int32)[:] = [a.top_k for a in admissions]
        up = self._up(packed, torch.uint8)
        slots = up[: 8 * n].view(torch.int64)
        self.int_params.index_copy_(0, slots, up[8 * n : 32 * n].view(torch.int64).view(n, 3))
        self.float_params.index_copy_(0, slots, up[32 * n : 56 * n].view(torch.float32).view(n, 6))
        self.top_k.index_copy_(0, slots, up[56 * n :].view(torch.int32))
        for rows in (self.output_counts, self.prompt_seen, self.stop_mask):
            rows.index_fill_(0, slots, 0)
        for a in admissions:
            self._host[a.slot] = _HostSlot(a.uses_penalties, a.min_tokens, a.logprobs, a.temperature <= 0)
            if a.uses_penalties:
                self.prompt_seen[a.slot].index_fill_(0, self._up(_in_vocab(a.prompt_token_ids, vocab), torch.int64), True)
                if a.output_token_ids:
                    outputs = self._up(_in_vocab(a.output_token_ids, vocab), torch.int64)
                    self.output_counts[a.slot].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))
            if a.min_tokens > 0 and a.stop_token_ids:
                self.stop_mask[a.slot].index_fill_(0, self._up(_in_vocab(a.stop_token_ids, vocab), torch.int64), True)

    def _up(self, values: np.ndarray | list, dtype: torch.dtype) -> torch.Tensor:
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
        if FUSED_GREEDY and all(h.plain_greedy for h in host):
            return kernels.greedy_sample_into_slots(logits, slots, self.last_token, self.output_counts,
                                                    self.num_outputs), None
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


def _in_vocab(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids below ``vocab_size`` (a tokenizer's added tokens may lie past the model's logits)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    return ids[ids < vocab_size]
