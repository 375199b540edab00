"""The step plan: what the scheduler asks the engine to run, as plain data.

The engine consumes only this (it never sees a scheduler ``Request``), so the plan names
everything by *state slot*: the slot is the request's row in every per-request device table (the
recurrent state, the page table, the sampling parameters, the token counts, the last sampled
token). A plan says, per row, how far the slot's sequence is computed and how many tokens to add;
the engine derives positions, KV write locations and sequence lengths from that and the page table
it keeps on the device.

Token ids travel only where the host knows them (prompt chunks, recompute after preemption). A
decode row's input is the slot's last sampled token, which the sampler wrote into the device-side
last-token pool, so an overlapped loop can schedule step N+1 before step N's token reached the
host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SlotSampling:
    """A request's sampling parameters, staged once into the slot's device tables at admission
    (and again when a preempted request is readmitted, with the outputs it already has)."""

    slot: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int  # int64 range
    min_tokens: int
    stop_token_ids: tuple[int, ...]  # blocked while fewer than min_tokens outputs exist
    # Repetition penalty covers prompt + output. The scheduler passes the request's read-only int64
    # prompt array (no copy of an 8k-token prompt per admission).
    prompt_token_ids: Sequence[int] | np.ndarray
    output_token_ids: tuple[int, ...]  # outputs already sampled (non-empty after a preemption)
    logprobs: int | None  # None: no logprobs; k: each chosen token's logprob and rank, and the k likeliest

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class PlanRow:
    """One request's part of a step: tokens ``[num_computed, num_computed + num_new)`` of its slot."""

    slot: int
    num_computed: int  # tokens of the slot already in the KV cache / state
    num_new: int
    samples: bool  # the row reaches its last known token and samples the next one
    # The new tokens (from the scheduler an int64 array, a view of the prompt's for prompt chunks,
    # so staging copies them in one go); None: one decode token from the last-token pool.
    token_ids: Sequence[int] | np.ndarray | None

    def __post_init__(self) -> None:
        if self.token_ids is None and self.num_new != 1:
            raise ValueError(f"row of slot {self.slot}: only a single decode token may come from the pool")
        if self.token_ids is not None and len(self.token_ids) != self.num_new:
            raise ValueError(f"row of slot {self.slot}: {len(self.token_ids)} token ids for {self.num_new} new tokens")


@dataclass(frozen=True)
class PageUpdate:
    """``pages`` become entries ``[start, start + len(pages))`` of the slot's page-table row."""

    slot: int
    start: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class RowSnapshot:
    """A prefix-cache snapshot taken by the forward itself: the state of row ``row`` after its
    first ``offset`` new tokens (a boundary inside its chunk, ``0 < offset < num_new``) is written
    into snapshot slot ``slot``, so the chunk need not be cut there."""

    row: int
    offset: int
    slot: int


@dataclass
class StepPlan:
    """One forward step. Rows with one new token come first (``ForwardBatch`` order)."""

    rows: list[PlanRow] = field(default_factory=list)
    page_updates: list[PageUpdate] = field(default_factory=list)
    reset_slots: list[int] = field(default_factory=list)  # state slots zeroed before the step
    admissions: list[SlotSampling] = field(default_factory=list)  # staged before the step
    # (source, destination) slot pairs whose whole recurrent state is copied before the step (and
    # before reset_slots), all pairs reading the state the previous step left: prefix-cache
    # snapshots (request slot -> snapshot slot) and restores (snapshot slot -> request slot).
    # Destinations are distinct; snapshot slots (ids >= the request slots) appear only here.
    copy_slots: list[tuple[int, int]] = field(default_factory=list)
    # Snapshots inside prefill rows, taken during the forward (models with ``snapshots_in_forward``).
    snapshots: list[RowSnapshot] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(row.num_new for row in self.rows)

    @property
    def num_decodes(self) -> int:
        count = 0
        while count < len(self.rows) and self.rows[count].num_new == 1:
            count += 1
        return count

    @property
    def sampling_rows(self) -> list[PlanRow]:
        return [row for row in self.rows if row.samples]
