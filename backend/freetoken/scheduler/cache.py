"""Allocators of the two kinds of per-request memory: KV pages and recurrent-state slots.

Index 0 of each pool is reserved as a scratch entry that padded batches (CUDA graphs) can point at,
so ``capacity`` is one less than the pool's size. Pages are reference-counted so that a prefix
cache can hand the same page to several requests; a page returns to the free list when its last
holder releases it.
"""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low page ids first
        self._refs = [0] * num_pages

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV pages, {len(self._free)} free")
        free, refs = self._free, self._refs
        pages = free[len(free) - count :][::-1]  # as ``count`` pops would hand them out
        del free[len(free) - count :]
        for page in pages:
            refs[page] = 1
        return pages

    def refs(self, page: int) -> int:
        """How many holders (requests, the prefix index) the page has."""
        return self._refs[page]

    def share(self, pages: list[int]) -> None:
        """Add a holder to pages already in use (a prefix-cache hit)."""
        refs = self._refs
        for page in pages:
            assert refs[page] > 0, f"page {page} is free"
            refs[page] += 1

    def release(self, pages: list[int]) -> None:
        refs, free = self._refs, self._free
        for page in pages:
            assert refs[page] > 0, f"page {page} released twice"
            refs[page] -= 1
            if refs[page] == 0:
                free.append(page)


class SlotPool:
    """Fixed-size recurrent-state slots (Gated DeltaNet conv + SSM state), one per running request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"a slot pool needs at least 2 slots (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free state slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert 0 < slot < self.num_slots and slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)
