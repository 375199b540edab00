"""Continuous batching with chunked prefill.

Every step each running request advances: a decode by one token, a prompt by a chunk; all chunks
of a step share ``max_prefill_length`` tokens. Waiting requests are admitted first come, first
served while a state slot is free and the KV pages for their whole prompt fit beside what the
running prompts still need. Pages are allocated as tokens arrive; when a decode finds none free,
the newest running request is preempted: its pages and slot go back, and it waits at the head of
the queue to be recomputed from its tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from freetoken.plan import PageUpdate, PlanRow, SlotSampling, StepPlan
from freetoken.scheduler.cache import PagePool, SlotPool
from freetoken.scheduler.request import Request, RequestStatus


@dataclass
class ScheduledStep:
    """A step plan and the request behind each of its rows."""

    plan: StepPlan
    requests: list[Request] = field(default_factory=list)  # one per plan row

    @property
    def sampling_requests(self) -> list[Request]:
        return [req for req, row in zip(self.requests, self.plan.rows) if row.samples]


def slot_sampling(req: Request) -> SlotSampling:
    """What the engine stages in the request's slot when it is (re)admitted."""
    s = req.sampling
    assert req.slot is not None and req.num_in_flight == 0
    return SlotSampling(
        slot=req.slot,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        min_tokens=req.params.min_tokens,
        stop_token_ids=tuple(sorted(req.stop_token_ids)),
        prompt_token_ids=tuple(req.prompt_token_ids),
        output_token_ids=tuple(req.output_token_ids),
        logprobs=req.params.logprobs,
    )


class Scheduler:
    def __init__(self, pages: PagePool, slots: SlotPool, max_prefill_length: int, max_running_requests: int) -> None:
        self.pages = pages
        self.slots = slots
        self.max_prefill_length = max_prefill_length
        self.max_running = min(max_running_requests, slots.capacity)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None

    def finish(self, req: Request) -> None:
        """Take a request out of the queues and give its pages and slot back.

        A step still in flight may use them: that is safe, since every later step that could
        reuse them runs after it on the device's one stream. Finishing twice is a no-op.
        """
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED

    def _release(self, req: Request) -> None:
        self.pages.release(req.pages)
        req.pages = []
        if req.slot is not None:
            self.slots.release(req.slot)
            req.slot = None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _pages_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, self.pages.pages_for(req.num_computed + num_tokens) - len(req.pages))

    def schedule(self) -> ScheduledStep | None:
        """The next step. A request whose latest tokens are still in flight is scheduled as if
        they were known (its decode input comes from the last-token pool), unless they already
        finish it by length; a waiting request with tokens in flight waits until they land."""
        budget = self.max_prefill_length
        singles: list[tuple[Request, int]] = []
        chunks: list[tuple[Request, int]] = []
        fresh: list[Request] = []
        new_pages: dict[int, PageUpdate] = {}
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.in_flight_finishes:
                continue  # preempted earlier in this loop, or done once its tokens land
            num_tokens = 1 if req.num_uncomputed == 1 else min(req.num_uncomputed, budget)
            if num_tokens == 0:
                continue
            num_tokens = self._make_room(req, num_tokens)
            if num_tokens == 0:
                continue
            self._add_pages(req, num_tokens, new_pages)
            (singles if num_tokens == 1 else chunks).append((req, num_tokens))
            if req.num_uncomputed > 1:
                budget -= num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self.slots.num_free:
            req = self.waiting[0]
            if req.num_in_flight or self.pages.pages_for(len(req.token_ids)) > self.pages.num_free - self._pages_promised():
                break
            self.waiting.popleft()
            num_tokens = min(req.num_uncomputed, budget)
            req.slot = self.slots.allocate()
            req.num_admitted_tokens = len(req.token_ids)
            self._add_pages(req, num_tokens, new_pages)
            req.status = RequestStatus.RUNNING
            req.times.scheduled = req.times.scheduled or time.monotonic()
            self.running.append(req)
            fresh.append(req)
            (singles if num_tokens == 1 else chunks).append((req, num_tokens))
            budget -= num_tokens
        entries = singles + chunks
        if not entries:
            return None
        plan = StepPlan(
            rows=[self._row(req, n) for req, n in entries],
            page_updates=list(new_pages.values()),
            reset_slots=[r.slot for r in fresh],
            admissions=[slot_sampling(r) for r in fresh],
        )
        return ScheduledStep(plan, [r for r, _ in entries])

    @staticmethod
    def _row(req: Request, num_tokens: int) -> PlanRow:
        start = req.num_computed
        from_pool = num_tokens == 1 and start >= req.num_admitted_tokens
        token_ids = None if from_pool else tuple(req.token_ids[start : start + num_tokens])
        return PlanRow(req.slot, start, num_tokens, start + num_tokens == req.num_known, token_ids)

    def _add_pages(self, req: Request, num_tokens: int, new_pages: dict[int, PageUpdate]) -> None:
        count = self._pages_needed(req, num_tokens)
        if count:
            start = len(req.pages)
            req.pages += self.pages.allocate(count)
            new_pages[req.slot] = PageUpdate(req.slot, start, tuple(req.pages[start:]))

    def _pages_promised(self) -> int:
        """Pages the running requests still need for the tokens they already have."""
        return sum(self._pages_needed(r, r.num_uncomputed) for r in self.running)

    def _make_room(self, req: Request, num_tokens: int) -> int:
        """Free pages for ``req`` by preempting newer requests; shrink a prompt chunk to what fits.

        Returns the tokens ``req`` can run this step (0 if it was preempted itself).
        """
        while self._pages_needed(req, num_tokens) > self.pages.num_free:
            newest = self.running[-1]
            if newest is req:
                break
            self._preempt(newest)
        if self._pages_needed(req, num_tokens) <= self.pages.num_free:
            return num_tokens
        fits = (len(req.pages) + self.pages.num_free) * self.pages.page_size - req.num_computed
        if req.num_uncomputed > 1 and fits > 0:
            return min(num_tokens, fits)
        self._preempt(req)
        return 0

    def launched(self, step: ScheduledStep) -> None:
        """The step is queued on the device: its tokens count as computed, its samples in flight."""
        for req, row in zip(step.requests, step.plan.rows):
            req.num_computed += row.num_new
            if row.samples:
                req.num_in_flight += 1

    def landed(self, step: ScheduledStep) -> None:
        """The step's sampled tokens reached the host (appended by the caller right after)."""
        for req in step.sampling_requests:
            req.num_in_flight -= 1
