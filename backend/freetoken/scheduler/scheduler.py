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

from freetoken.scheduler.cache import PagePool, SlotPool
from freetoken.scheduler.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)  # single-token entries first
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each request
    fresh_slots: list[int] = field(default_factory=list)  # state slots to zero before the step
    # Whether each request reaches its last known token this step, and so samples the next one.
    samples: list[bool] = field(default_factory=list)

    @property
    def sampling_requests(self) -> list[Request]:
        return [req for req, samples in zip(self.requests, self.samples) if samples]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


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
        """Take a request out of the queues and give its pages and slot back."""
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

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_prefill_length
        singles: list[tuple[Request, int]] = []
        chunks: list[tuple[Request, int]] = []
        fresh: list[int] = []
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = 1 if req.num_uncomputed == 1 else min(req.num_uncomputed, budget)
            if num_tokens == 0:
                continue
            num_tokens = self._make_room(req, num_tokens)
            if num_tokens == 0:
                continue
            req.pages += self.pages.allocate(self._pages_needed(req, num_tokens))
            (singles if num_tokens == 1 else chunks).append((req, num_tokens))
            if req.num_uncomputed > 1:
                budget -= num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self.slots.num_free:
            req = self.waiting[0]
            if self.pages.pages_for(len(req.token_ids)) > self.pages.num_free - self._pages_promised():
                break
            self.waiting.popleft()
            num_tokens = min(req.num_uncomputed, budget)
            req.slot = self.slots.allocate()
            req.pages = self.pages.allocate(self._pages_needed(req, num_tokens))
            req.status = RequestStatus.RUNNING
            req.times.scheduled = req.times.scheduled or time.monotonic()
            self.running.append(req)
            fresh.append(req.slot)
            (singles if num_tokens == 1 else chunks).append((req, num_tokens))
            budget -= num_tokens
        entries = singles + chunks
        if not entries:
            return None
        return ScheduledBatch(
            requests=[r for r, _ in entries],
            num_tokens=[n for _, n in entries],
            fresh_slots=fresh,
            samples=[r.num_computed + n == len(r.token_ids) for r, n in entries],
        )

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

    def after_step(self, batch: ScheduledBatch) -> None:
        """Record that the step's tokens are now in the cache."""
        for req, num_tokens in zip(batch.requests, batch.num_tokens):
            req.num_computed += num_tokens
