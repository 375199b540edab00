"""The prefix index on its own: page hash chains, the longest usable hit, LRU eviction and reset."""

from __future__ import annotations

from freetoken.scheduler.cache import PagePool
from freetoken.scheduler.prefix_cache import PrefixCache, page_hashes

PAGE = 4


def _cache(num_pages: int = 17, snapshot_slots: range = range(10, 13), alignment: int = PAGE) -> PrefixCache:
    return PrefixCache(PagePool(num_pages, PAGE), snapshot_slots, alignment)


def _cached_prompt(cache: PrefixCache, tokens: list[int], snapshot_at: list[int]) -> list[int]:
    """A request that computed ``tokens``, indexed its full pages, snapshotted at those boundaries
    (in tokens) and finished: the pages it used."""
    hashes = page_hashes(tokens, PAGE)
    pages = cache.allocate(cache.pool.pages_for(len(tokens)))
    for page_hash, page in zip(hashes, pages):
        cache.insert_page(page_hash, page)
    for boundary in snapshot_at:
        slot = cache.allocate_snapshot()
        assert slot is not None
        cache.insert_snapshot(hashes[boundary // PAGE - 1], slot)
    cache.release(pages)
    return pages


def test_page_hashes_chain_over_full_pages_and_namespace():
    tokens = list(range(11))
    hashes = page_hashes(tokens, PAGE)
    assert len(hashes) == 2  # the partial third page has no hash
    assert page_hashes(tokens[:8], PAGE) == hashes
    assert page_hashes([0, 1, 2, 3, 9, 5, 6, 7], PAGE)[1] != hashes[1]  # the chain: a page names its prefix
    assert page_hashes(tokens[4:8], PAGE)[0] != hashes[1]  # the same tokens after another prefix
    assert page_hashes(tokens, PAGE, namespace=b"adapter-1") != hashes
    assert len(set(hashes)) == 2


def test_lookup_ends_at_the_longest_snapshotted_aligned_boundary():
    cache = _cache()
    prompt = list(range(100, 125))  # 6 full pages
    pages = _cached_prompt(cache, prompt, snapshot_at=[8, 20])
    hashes = page_hashes(prompt, PAGE)
    hit = cache.lookup(hashes, max_tokens=len(prompt) - 1)
    assert (hit.pages, hit.snapshot, hit.num_matched_pages) == (pages[:5], 11, 6)
    # at most max_tokens: the snapshot at 20 is past 19
    hit = cache.lookup(hashes, max_tokens=19)
    assert (hit.pages, hit.snapshot, hit.num_matched_pages) == (pages[:2], 10, 4)
    # a prompt leaving the cached ones after page 3 hits the snapshot at 8
    other = prompt[:12] + [7] * 13
    hit = cache.lookup(page_hashes(other, PAGE), max_tokens=24)
    assert (hit.pages, hit.snapshot, hit.num_matched_pages) == (pages[:2], 10, 3)
    # cached pages without a snapshot before them: no usable hit, but the match is reported
    hit = cache.lookup(page_hashes(prompt[:4] + [1] * 10, PAGE), max_tokens=13)
    assert (hit.pages, hit.snapshot, hit.num_matched_pages) == ([], None, 1)


def test_alignment_skips_snapshots_inside_a_block():
    cache = _cache(alignment=2 * PAGE)
    prompt = list(range(40, 65))
    pages = _cached_prompt(cache, prompt, snapshot_at=[8, 12])
    hit = cache.lookup(page_hashes(prompt, PAGE), max_tokens=24)
    assert (hit.pages, hit.snapshot) == (pages[:2], 10)  # 12 is not a multiple of 8


def test_shared_pages_are_not_evictable_and_release_makes_them_so_tail_first():
    cache = _cache(num_pages=9)  # 8 usable pages
    prompt = list(range(16))
    pages = _cached_prompt(cache, prompt, snapshot_at=[8])
    assert cache.num_evictable == 4 and cache.pool.num_free == 4 and cache.num_available() == 8
    hit = cache.lookup(page_hashes(prompt, PAGE), max_tokens=15)
    assert cache.num_available(hit.pages) == 6
    cache.share(hit.pages)
    assert cache.num_evictable == 2
    # allocating everything evicts the unshared tail pages (and nothing that is shared)
    new = cache.allocate(6)
    assert cache.num_evictable == 0 and cache.num_cached_pages == 2 and set(pages[2:]) <= set(new)
    cache.release(hit.pages)
    cache.release(new)
    assert cache.num_available() == 8
    # the snapshot at 8 survived with its pages; evicting page 1 (the tail) takes it along
    assert cache.lookup(page_hashes(prompt, PAGE), max_tokens=15).snapshot == 10
    cache.allocate(7)
    assert cache.num_cached_pages == 1 and cache.num_snapshots == 0


def test_snapshots_evict_least_recently_used_and_a_stale_one_goes_back():
    cache = _cache(snapshot_slots=range(20, 22))
    a, b = list(range(8)), list(range(50, 58))
    _cached_prompt(cache, a, snapshot_at=[4])
    _cached_prompt(cache, b, snapshot_at=[4])
    assert cache.lookup(page_hashes(a, PAGE), max_tokens=7).snapshot is not None  # a is the newest now
    slot = cache.allocate_snapshot()  # evicts b's
    assert slot is not None and cache.num_snapshots == 1
    assert cache.lookup(page_hashes(b, PAGE), max_tokens=7).snapshot is None
    # a snapshot of a page the index does not name (evicted meanwhile) is given back
    cache.insert_snapshot(page_hashes(list(range(90, 94)), PAGE)[0], slot)
    assert cache.num_snapshots == 1 and cache.allocate_snapshot() == slot


def test_reset_returns_every_page_and_snapshot():
    cache = _cache()
    held = cache.allocate(2)
    prompt = list(range(30))
    _cached_prompt(cache, prompt, snapshot_at=[8, 28])
    hashes = page_hashes(prompt, PAGE)
    cache.insert_page(page_hashes(list(range(200, 208)), PAGE)[0], held[0])  # a page a request still holds
    cache.reset()
    assert cache.num_cached_pages == cache.num_snapshots == cache.num_evictable == 0
    assert cache.lookup(hashes, max_tokens=29).snapshot is None
    assert cache.pool.num_free == cache.pool.capacity - 2 and cache.pool.refs(held[0]) == 1
    cache.release(held)
    assert cache.pool.num_free == cache.pool.capacity
    assert sorted(cache.allocate_snapshot() for _ in range(3)) == [10, 11, 12]
