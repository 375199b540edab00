"""Continuous batching with chunked prefill.

Every step each running request advances: a decode by one token, a prompt by a chunk; all chunks
of a step share ``max_prefill_length`` tokens. Waiting requests are admitted first come, first
served while a state slot is free and the KV pages for their whole prompt fit beside what the
running prompts still need. Pages are allocated as tokens arrive; when a decode finds none free,
the newest running request is preempted: its pages and slot go back, and it waits at the head of
the queue to be recomputed from its tokens (from its cached prefix, with prefix caching).

With a ``PrefixCache``, an admitted request first takes the longest usable cached prefix of its
prompt (shared pages, and a snapshot restored into its slot by the step's ``copy_slots``) and
computes only the rest. It then snapshots its state at up to two page boundaries, so later prompts
hit: where its prompt leaves the longest cached run of pages (a shared system text: the second
prompt with it snapshots there, the third and later hit it), and at the prompt's last full page
before its last token (an exact repeat, or a follow-up turn extending the prompt, hits there). Both
boundaries are multiples of the model's ``prefix_alignment``, each at least
``MIN_SNAPSHOT_GAIN_PAGES`` past the hit or the boundary before. A boundary where a chunk ends is
snapshotted by a copy (request slot -> snapshot slot) in the next step's plan, before its forward.
A boundary inside a chunk is snapshotted by the forward itself (``StepPlan.snapshots``) when the
model can (``CausalLM.snapshots_in_forward``: Qwen3.5 / 3.6); otherwise (Qwen4-Exp, whose PLE
windows and n-gram context have no in-forward snapshot) the chunk is cut at the boundary.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from freetoken.plan import PageUpdate, PlanRow, RowSnapshot, SlotSampling, StepPlan
from freetoken.scheduler.cache import PagePool, SlotPool
from freetoken.scheduler.prefix_cache import PageHash, PageHashChain, PrefixCache, PrefixHit
from freetoken.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class PageRef:
    """Page ``index`` of a prompt, whose chain hash is computed when it is asked for: a snapshot's
    page is named at ``Scheduler.launched``, after the forward is queued, not while the plan is built."""

    hashes: PageHashChain
    index: int

    @property
    def hash(self) -> PageHash:
        return self.hashes[self.index]


@dataclass
class ScheduledStep:
    """A step plan and the request behind each of its rows."""

    plan: StepPlan
    requests: list[Request] = field(default_factory=list)  # one per plan row
    snapshots: list[tuple[PageRef, int]] = field(default_factory=list)  # written into these slots by the plan

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
        prompt_token_ids=req.prompt_array,
        output_token_ids=tuple(req.output_token_ids),
        logprobs=req.params.logprobs,
    )


# A boundary is snapshotted only this many pages past the request's hit (or its previous
# boundary): a snapshot costs a state slot (~63 MB at the Qwen3.6-35B-A3B shape) and a copy of
# it, and where the model cannot take it inside a forward, a cut chunk (one more forward now),
# which a later hit must make up for; one a few tokens deeper than another saves that hit little.
MIN_SNAPSHOT_GAIN_PAGES = 4


def _prefilled(req: Request) -> bool:
    """Its prompt is computed (so its snapshot is hittable), or it never will be."""
    return req.finished or req.num_computed >= req.num_prompt_tokens


class Scheduler:
    def __init__(
        self,
        pages: PagePool,
        slots: SlotPool,
        max_prefill_length: int,
        max_running_requests: int,
        prefix_cache: PrefixCache | None = None,
        snapshots_in_forward: bool = False,
    ) -> None:
        self.pages = pages
        # The model writes a snapshot at a boundary inside a chunk during the forward: no cut.
        self.snapshots_in_forward = snapshots_in_forward
        self.slots = slots
        self.prefix_cache = prefix_cache
        self.max_prefill_length = max_prefill_length
        self.max_running = min(max_running_requests, slots.capacity)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # (request slot, page hash) of boundaries reached by the last launched step, to snapshot
        # in the next plan (before anything else touches the slot).
        self._pending_snapshots: list[tuple[int, PageRef]] = []

    # ----- pages, through the prefix cache when there is one -----

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation can get (free, or cached but held by no request)."""
        return self.pages.num_free if self.prefix_cache is None else self.prefix_cache.num_available()

    def allocate_pages(self, count: int) -> list[int]:
        return self.pages.allocate(count) if self.prefix_cache is None else self.prefix_cache.allocate(count)

    def release_pages(self, pages: list[int]) -> None:
        if self.prefix_cache is None:
            self.pages.release(pages)
        else:
            self.prefix_cache.release(pages)

    def reset_prefix_cache(self) -> None:
        """Drop every cached page and snapshot (pages requests hold stay theirs)."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

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
        if self.prefix_cache is not None and req.page_hashes is not None:
            # Its computed prompt pages the index lost meanwhile (evicted while this request held
            # an equal page of its own) are named again, so the chain stays whole.
            count = req.num_indexed_pages
            self.prefix_cache.insert_pages(req.page_hashes[:count], req.pages[:count])
        self.release_pages(req.pages)
        req.pages = []
        req.num_indexed_pages = 0
        req.snapshot_at = []
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
        copies, snapshots = self._snapshot_copies()
        inside: dict[Request, list[tuple[int, int]]] = {}  # (offset, slot) snapshots inside a request's chunk
        new_pages: dict[int, PageUpdate] = {}
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.in_flight_finishes:
                continue  # preempted earlier in this loop, or done once its tokens land
            num_tokens = 1 if req.num_uncomputed == 1 else self._cut(req, min(req.num_uncomputed, budget))
            if num_tokens == 0:
                continue
            num_tokens = self._make_room(req, num_tokens)
            if num_tokens == 0:
                continue
            self._add_pages(req, num_tokens, new_pages)
            self._snapshot_inside(req, num_tokens, inside, snapshots)
            (singles if num_tokens == 1 else chunks).append((req, num_tokens))
            if req.num_uncomputed > 1:
                budget -= num_tokens
        restored: set[int] = set()
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self.slots.num_free:
            req = self.waiting[0]
            if req.num_in_flight or (req.prefill_after is not None and not _prefilled(req.prefill_after)):
                break
            hit = self._lookup(req)
            available = self.pages.num_free if self.prefix_cache is None else self.prefix_cache.num_available(hit.pages)
            if self.pages.pages_for(len(req.token_ids)) - hit.num_pages > available - self._pages_promised():
                break
            self.waiting.popleft()
            req.prefill_after = None
            req.slot = self.slots.allocate()
            req.num_admitted_tokens = len(req.token_ids)
            if self.prefix_cache is not None:
                self._take_hit(req, hit)
                if hit.snapshot is not None:
                    copies.append((hit.snapshot, req.slot))
                    restored.add(req.slot)
            num_tokens = self._cut(req, min(req.num_uncomputed, budget))
            self._add_pages(req, num_tokens, new_pages, start=0)
            self._snapshot_inside(req, num_tokens, inside, snapshots)
            req.status = RequestStatus.RUNNING
            req.times.scheduled = req.times.scheduled or time.monotonic()
            self.running.append(req)
            fresh.append(req)
            (singles if num_tokens == 1 else chunks).append((req, num_tokens))
            budget -= num_tokens
        entries = singles + chunks
        if not entries:  # no step to carry the copies: they wait for the next (no forward runs before it)
            for _, snapshot in snapshots:
                self.prefix_cache.free_snapshot(snapshot)
            return None
        self._pending_snapshots = []
        plan = StepPlan(
            rows=[self._row(req, n) for req, n in entries],
            page_updates=list(new_pages.values()),
            reset_slots=[r.slot for r in fresh if r.slot not in restored],
            admissions=[slot_sampling(r) for r in fresh],
            copy_slots=copies,
            snapshots=[
                RowSnapshot(row, offset, slot)
                for row, (req, _) in enumerate(entries)
                for offset, slot in inside.get(req, [])
            ],
        )
        return ScheduledStep(plan, [r for r, _ in entries], snapshots)

    # ----- prefix caching -----

    def _lookup(self, req: Request) -> PrefixHit:
        """The longest usable cached prefix of ``req``'s prompt, leaving at least one token to compute."""
        if self.prefix_cache is None:
            return PrefixHit()
        if req.page_hashes is None:
            req.page_hashes = PageHashChain(req.prompt_array, self.pages.page_size, req.prefix_namespace)
        return self.prefix_cache.lookup(req.page_hashes, len(req.token_ids) - 1)

    def _take_hit(self, req: Request, hit: PrefixHit) -> None:
        """Share the hit's pages, count its tokens computed, and choose the boundaries to snapshot."""
        cache = self.prefix_cache
        assert cache is not None and req.page_hashes is not None
        cache.share(hit.pages)
        req.pages = list(hit.pages)
        req.num_indexed_pages = hit.num_pages
        page_size = self.pages.page_size
        req.num_computed = hit.num_pages * page_size
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed
            cache.counters.queried_tokens += req.num_prompt_tokens
            cache.counters.hit_tokens += req.num_computed
        align = cache.alignment
        leaves = hit.num_matched_pages * page_size // align * align  # where the prompt leaves the cached pages
        last = (req.num_prompt_tokens - 1) // page_size * page_size // align * align
        if cache.num_snapshot_slots:
            req.snapshot_at = []
            for boundary in sorted({leaves, last}):
                since = req.snapshot_at[-1] if req.snapshot_at else req.num_computed
                if boundary - since >= MIN_SNAPSHOT_GAIN_PAGES * page_size:
                    req.snapshot_at.append(boundary)

    def _cut(self, req: Request, num_tokens: int) -> int:
        """A prefill chunk ends at the request's next snapshot boundary, if it would pass it,
        unless the model snapshots inside the forward."""
        if self.snapshots_in_forward:
            return num_tokens
        for boundary in req.snapshot_at:
            if boundary > req.num_computed:
                return min(num_tokens, boundary - req.num_computed)
        return num_tokens

    def _snapshot_inside(
        self,
        req: Request,
        num_tokens: int,
        inside: dict[Request, list[tuple[int, int]]],
        snapshots: list[tuple[PageRef, int]],
    ) -> None:
        """The boundaries strictly inside ``req``'s chunk of ``num_tokens``, each into a snapshot
        slot the forward writes (the least recently used snapshot evicted if none is free; it may
        be one this plan restores: the restore's copy runs before the forward). A boundary that
        ends the chunk is left to the next plan's copy (``launched``).

        Whether the boundary is snapshotted already is asked only where the lookup hashed its page:
        a page past the prompt's first miss is not cached (bar a chain the index broke), so hashing
        the prompt up to it here would put that work before the forward for nothing; should the
        snapshot exist after all, ``PrefixCache.insert_snapshot`` gives the new slot back."""
        cache = self.prefix_cache
        end = req.num_computed + num_tokens
        while req.snapshot_at and req.snapshot_at[0] < end:
            boundary = req.snapshot_at.pop(0)
            assert self.snapshots_in_forward and boundary > req.num_computed, "a chunk passed a snapshot boundary"
            page = PageRef(req.page_hashes, boundary // self.pages.page_size - 1)
            known = req.page_hashes.computed(page.index)
            if known is not None and cache.has_snapshot(known):
                continue
            snapshot = cache.allocate_snapshot()
            if snapshot is None:
                continue
            inside.setdefault(req, []).append((boundary - req.num_computed, snapshot))
            snapshots.append((page, snapshot))

    def _snapshot_copies(self) -> tuple[list[tuple[int, int]], list[tuple[PageRef, int]]]:
        """The copies of the boundaries the last launched step reached, each into a snapshot slot
        (the least recently used snapshot evicted if none is free); they run before this plan's
        forward and resets, so a slot freed meanwhile is still read as that step left it."""
        copies: list[tuple[int, int]] = []
        snapshots: list[tuple[PageRef, int]] = []
        cache = self.prefix_cache
        for slot, page in self._pending_snapshots:
            if cache is None or cache.has_snapshot(page.hash) or not cache.is_cached(page.hash):
                continue
            snapshot = cache.allocate_snapshot()
            if snapshot is None:
                continue
            copies.append((slot, snapshot))
            snapshots.append((page, snapshot))
        return copies, snapshots

    def failed(self, step: ScheduledStep) -> None:
        """The step never launched: its snapshot slots go back."""
        for _, snapshot in step.snapshots:
            self.prefix_cache.free_snapshot(snapshot)

    @staticmethod
    def _row(req: Request, num_tokens: int) -> PlanRow:
        """A prompt chunk's ids are a view of the request's prompt array (staged by one copy)."""
        start, end = req.num_computed, req.num_computed + num_tokens
        if num_tokens == 1 and start >= req.num_admitted_tokens:
            token_ids = None
        elif end <= req.num_prompt_tokens:
            token_ids = req.prompt_array[start:end]
        else:
            token_ids = np.array(req.token_ids[start:end], dtype=np.int64)
        return PlanRow(req.slot, start, num_tokens, end == req.num_known, token_ids)

    def _add_pages(
        self, req: Request, num_tokens: int, new_pages: dict[int, PageUpdate], start: int | None = None
    ) -> None:
        """Pages for ``num_tokens`` more tokens; the page-table update covers entries from ``start``
        on (default: the new pages; an admission's covers the pages of its prefix hit too)."""
        count = self._pages_needed(req, num_tokens)
        first = len(req.pages) if start is None else start
        if count:
            req.pages += self.allocate_pages(count)
        if len(req.pages) > first:
            new_pages[req.slot] = PageUpdate(req.slot, first, tuple(req.pages[first:]))

    def _pages_promised(self) -> int:
        """Pages the running requests still need for the tokens they already have."""
        return sum(self._pages_needed(r, r.num_uncomputed) for r in self.running)

    def _make_room(self, req: Request, num_tokens: int) -> int:
        """Free pages for ``req`` by preempting newer requests; shrink a prompt chunk to what fits.

        Returns the tokens ``req`` can run this step (0 if it was preempted itself).
        """
        while self._pages_needed(req, num_tokens) > self.num_available_pages:
            newest = self.running[-1]
            if newest is req:
                break
            self._preempt(newest)
        if self._pages_needed(req, num_tokens) <= self.num_available_pages:
            return num_tokens
        fits = (len(req.pages) + self.num_available_pages) * self.pages.page_size - req.num_computed
        if req.num_uncomputed > 1 and fits > 0:
            return min(num_tokens, fits)
        self._preempt(req)
        return 0

    def launched(self, step: ScheduledStep) -> None:
        """The step is queued on the device: its tokens count as computed, its samples in flight.
        With prefix caching, the prompt pages it completed join the index, then the snapshots it
        copies or writes become hittable, and the boundaries its chunks end at are snapshotted by
        the next plan."""
        cache = self.prefix_cache
        for req, row in zip(step.requests, step.plan.rows):
            req.num_computed += row.num_new
            if row.samples:
                req.num_in_flight += 1
            if cache is None or req.page_hashes is None:
                continue
            full = min(req.num_computed, req.num_prompt_tokens) // self.pages.page_size
            if full > req.num_indexed_pages:
                first = req.num_indexed_pages
                cache.insert_pages(req.page_hashes[first:full], req.pages[first:full])
            req.num_indexed_pages = max(req.num_indexed_pages, full)
            if req.snapshot_at and req.snapshot_at[0] == req.num_computed:
                boundary = req.snapshot_at.pop(0)
                self._pending_snapshots.append((req.slot, PageRef(req.page_hashes, boundary // self.pages.page_size - 1)))
        if cache is not None:  # after the pages: a snapshot taken inside this step ends at one of them
            for page, snapshot in step.snapshots:
                cache.insert_snapshot(page.hash, snapshot)

    def landed(self, step: ScheduledStep) -> None:
        """The step's sampled tokens reached the host (appended by the caller right after)."""
        for req in step.sampling_requests:
            req.num_in_flight -= 1
