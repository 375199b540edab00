"""The prefix cache of a hybrid model: full KV pages by content, and state snapshots at page boundaries.

A full page is named by a chain hash: the hash of the previous page's hash and this page's token
ids, seeded with a namespace (anything besides the tokens that changes the KV: an adapter, images
later), so equal hashes mean equal prefixes. The index holds one reference on every page it names
(``PagePool.share``); a request that hits a prefix shares its pages and never writes them (it
computes from the page boundary on, into pages of its own).

The KV of a prefix is not all a hybrid model needs: its Gated DeltaNet recurrent and conv state
(and Qwen4-Exp's PLE conv state and n-gram context) describe the whole prefix at one position. So a
cached prefix is usable only up to a boundary where a *snapshot* of that state exists: a copy of a
request's slot, taken right after the step that computed up to that boundary, into one of a bounded
set of snapshot slots. A hit restores the snapshot into the request's slot and shares the pages
before it. Which boundaries are snapshotted is the scheduler's choice (``Scheduler``).

Eviction is LRU over what no request holds: pages only the index references, and snapshots. A page
evicted takes the snapshot that ends at it along (nothing could reach it), and a request's pages are
released tail first, so a prefix's later pages go before its earlier ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

import numpy as np

from freetoken.scheduler.cache import PagePool

PageHash = bytes


class PageHashChain(Sequence[PageHash]):
    """The chain hash of each full page of a prompt (a trailing partial page has none), computed on
    demand, in order, each once: blake2b-128 of the previous page's hash and the page's ids as
    native int64 bytes, seeded with the namespace's hash. The ids become bytes once, so a page
    costs one hash of 16 + 8 * page_size bytes and no per-token work (an 8k-token prompt: 512).

    On demand because the lookup before a prompt's first forward needs only the hashes up to its
    first miss (one, for a prompt nothing shares); the rest are needed when the computed pages join
    the index (``Scheduler.launched``), after the forward is queued, so they cost the host time the
    device spends on that forward rather than time to first token."""

    def __init__(self, token_ids: Sequence[int] | np.ndarray, page_size: int, namespace: bytes = b"") -> None:
        self._data = np.ascontiguousarray(token_ids, dtype=np.int64).tobytes()
        self._step = page_size * 8
        self._count = len(self._data) // self._step
        self._hashes: list[PageHash] = []
        self._last = blake2b(namespace, digest_size=16, person=b"freetoken-pc").digest()

    def __len__(self) -> int:
        return self._count

    @property
    def num_computed(self) -> int:
        return len(self._hashes)

    def computed(self, index: int) -> PageHash | None:
        """Page ``index``'s hash if it was computed already, else None (nothing is computed)."""
        return self._hashes[index] if 0 <= index < len(self._hashes) else None

    def _extend(self, count: int) -> None:
        data, step, hashes, previous = self._data, self._step, self._hashes, self._last
        for start in range(len(hashes) * step, min(count, self._count) * step, step):
            previous = blake2b(previous + data[start : start + step], digest_size=16).digest()
            hashes.append(previous)
        self._last = previous

    def __getitem__(self, index):
        if isinstance(index, slice):
            positions = range(self._count)[index]
            self._extend(max(positions, default=-1) + 1)
            return [self._hashes[i] for i in positions]
        position = range(self._count)[index]  # IndexError past either end
        self._extend(position + 1)
        return self._hashes[position]

    def __iter__(self):
        for index in range(self._count):
            yield self[index]


def page_hashes(token_ids: Sequence[int] | np.ndarray, page_size: int, namespace: bytes = b"") -> list[PageHash]:
    """Every full page's chain hash at once (``PageHashChain``)."""
    return list(PageHashChain(token_ids, page_size, namespace))


@dataclass(frozen=True)
class PrefixHit:
    """What a prompt finds cached."""

    pages: list[int] = field(default_factory=list)  # the usable prefix's pages, to share
    snapshot: int | None = None  # the snapshot slot holding the state at the prefix's end
    num_matched_pages: int = 0  # the longest run of cached pages (>= len(pages)): where the prompt leaves the cache

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass
class PrefixCacheCounters:
    queried_tokens: int = 0  # prompt tokens looked up at first admission
    hit_tokens: int = 0  # of those, found cached
    evicted_pages: int = 0


class PrefixCache:
    """The index of cached pages and snapshots over a ``PagePool``; every page a request allocates
    or releases goes through it while prefix caching is on (so evictable pages count as free)."""

    def __init__(self, pool: PagePool, snapshot_slots: Sequence[int], alignment: int) -> None:
        if alignment % pool.page_size:
            raise ValueError(f"prefix alignment {alignment} is not a multiple of page_size {pool.page_size}")
        self.pool = pool
        self.page_size = pool.page_size
        self.alignment = alignment  # a usable prefix's length is a multiple of this (the model's rule)
        self.num_snapshot_slots = len(snapshot_slots)
        self._pages: dict[PageHash, int] = {}  # hash -> page; the index holds one reference on each
        self._hash_of: dict[int, PageHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages only the index holds, LRU first
        self._snapshots: OrderedDict[PageHash, int] = OrderedDict()  # hash of a prefix's last page -> slot, LRU first
        self._free_snapshots = list(reversed(snapshot_slots))
        self.counters = PrefixCacheCounters()

    # ----- pages -----

    @property
    def num_cached_pages(self) -> int:
        return len(self._pages)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def num_available(self, hit_pages: Sequence[int] = ()) -> int:
        """Pages an allocation can get: the free ones and the evictable ones, less those of
        ``hit_pages`` (about to be shared, so no longer evictable)."""
        return self.pool.num_free + self.num_evictable - sum(1 for p in hit_pages if p in self._evictable)

    def allocate(self, count: int) -> list[int]:
        short = min(count - self.pool.num_free, len(self._evictable))
        if short > 0:
            self._evict_pages(short)
        return self.pool.allocate(count)

    def share(self, pages: Sequence[int]) -> None:
        self.pool.share(list(pages))
        evictable = self._evictable
        for page in pages:
            evictable.pop(page, None)

    def release(self, pages: Sequence[int]) -> None:
        """A request lets go of its pages; cached ones stay, evictable, the tail first in LRU order."""
        tail_first = list(reversed(pages))
        self.pool.release(tail_first)
        hash_of, refs, evictable = self._hash_of, self.pool.refs, self._evictable
        for page in tail_first:
            if page in hash_of and refs(page) == 1:
                evictable[page] = None

    def insert_page(self, page_hash: PageHash, page: int) -> None:
        """A request's full page, computed: the index names it (unless an equal page is named already)."""
        self.insert_pages([page_hash], [page])

    def insert_pages(self, hashes: Sequence[PageHash], pages: Sequence[int]) -> None:
        """``insert_page`` of each pair, in order, with one share of the newly named pages."""
        named, hash_of, new = self._pages, self._hash_of, []
        for page_hash, page in zip(hashes, pages):
            if page_hash in named:
                continue
            named[page_hash] = page
            hash_of[page] = page_hash
            new.append(page)
        self.pool.share(new)

    def _evict_pages(self, count: int) -> None:
        """The ``count`` least recently used evictable pages go back to the pool, with the
        snapshots that end at them."""
        evictable, hash_of, named, snapshots = self._evictable, self._hash_of, self._pages, self._snapshots
        freed = []
        for _ in range(count):
            page, _ = evictable.popitem(last=False)
            page_hash = hash_of.pop(page)
            del named[page_hash]
            slot = snapshots.pop(page_hash, None)
            if slot is not None:
                self._free_snapshots.append(slot)
            freed.append(page)
        self.counters.evicted_pages += count
        self.pool.release(freed)

    # ----- lookup -----

    def lookup(self, hashes: Sequence[PageHash], max_tokens: int) -> PrefixHit:
        """The longest usable cached prefix of a prompt with page hashes ``hashes``, at most
        ``max_tokens`` long: cached pages all the way, ending where a snapshot is and at a multiple
        of ``alignment``. Nothing is taken yet (``share`` the pages, restore the snapshot)."""
        limit = min(len(hashes), max_tokens // self.page_size)
        matched = 0
        while matched < limit and hashes[matched] in self._pages:
            matched += 1
        for count in range(matched, 0, -1):
            slot = self._snapshots.get(hashes[count - 1])
            if slot is not None and (count * self.page_size) % self.alignment == 0:
                self._snapshots.move_to_end(hashes[count - 1])
                return PrefixHit([self._pages[h] for h in hashes[:count]], slot, matched)
        return PrefixHit(num_matched_pages=matched)

    # ----- snapshots -----

    def has_snapshot(self, page_hash: PageHash) -> bool:
        return page_hash in self._snapshots

    def is_cached(self, page_hash: PageHash) -> bool:
        return page_hash in self._pages

    def allocate_snapshot(self) -> int | None:
        """A snapshot slot for a new snapshot, the least recently used one evicted if none is free."""
        if not self._free_snapshots and self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
            self._free_snapshots.append(slot)
        return self._free_snapshots.pop() if self._free_snapshots else None

    def insert_snapshot(self, page_hash: PageHash, slot: int) -> None:
        """The copy into ``slot`` is queued: a prefix ending at page ``page_hash`` can restore it. A
        snapshot whose page is gone (or that another request made meanwhile) goes back."""
        if page_hash in self._snapshots or page_hash not in self._pages:
            self._free_snapshots.append(slot)
            return
        self._snapshots[page_hash] = slot

    def free_snapshot(self, slot: int) -> None:
        """A snapshot slot whose copy never ran (its step failed to launch)."""
        self._free_snapshots.append(slot)

    def reset(self) -> None:
        """Forget everything: the index lets go of its pages (those no request holds become free)
        and of every snapshot."""
        for page in self._hash_of:
            self.pool.release([page])
        self._pages.clear()
        self._hash_of.clear()
        self._evictable.clear()
        self._free_snapshots.extend(self._snapshots.values())
        self._snapshots.clear()
