"""The expert cache's Triton metric families: published only with moe_offload, counters following
RuntimeStats.expert_cache by their increments."""

from __future__ import annotations

from freetoken.runtime import ExpertCacheStats, RuntimeStats
from freetoken.serving.metrics import EXPERT_CACHE_FAMILIES, FAMILIES, Metrics


class _Metric:
    def __init__(self) -> None:
        self.value = 0.0

    def increment(self, v) -> None:
        self.value += v

    def set(self, v) -> None:
        self.value = v

    def observe(self, v) -> None:
        pass


class _PbUtils:
    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

        def __init__(self, name, description, kind) -> None:
            self.name, self.kind = name, kind
            _PbUtils.kinds[name] = kind

        def Metric(self, labels, buckets=None):
            metric = _Metric()
            _PbUtils.created[self.name] = metric
            return metric

    created: dict[str, _Metric] = {}
    kinds: dict[str, str] = {}


def _stats(cache: ExpertCacheStats | None) -> RuntimeStats:
    return RuntimeStats(0, 0, 0, 10, 0, 4, 0, expert_cache=cache)


def test_expert_cache_metrics_only_with_offload():
    _PbUtils.created.clear()
    metrics = Metrics(_PbUtils(), {}, lambda: _stats(None), 3600.0, 64)
    try:
        metrics.flush()
        assert set(_PbUtils.created) == set(FAMILIES)
    finally:
        metrics.close()


def test_expert_cache_counters_follow_the_stats():
    _PbUtils.created.clear()
    current = [ExpertCacheStats(hits=5, misses=3, bytes_copied=300, prefetched=0, prefetch_hits=0, slots=16)]
    metrics = Metrics(_PbUtils(), {}, lambda: _stats(current[0]), 3600.0, 64)  # no gauge sampling meanwhile
    try:
        assert set(_PbUtils.created) == set(FAMILIES)  # the cache's families come with its first stats
        metrics.flush()
        assert set(_PbUtils.created) == set(FAMILIES) | set(EXPERT_CACHE_FAMILIES)
        assert {n: _PbUtils.kinds[n] for n in EXPERT_CACHE_FAMILIES} == {
            n: kind for n, (kind, _, _) in EXPERT_CACHE_FAMILIES.items()
        }
        assert all(_PbUtils.kinds[n] == "COUNTER" for n in EXPERT_CACHE_FAMILIES if n.endswith("_total"))
        current[0] = ExpertCacheStats(hits=9, misses=4, bytes_copied=400, prefetched=2, prefetch_hits=1, slots=16,
                                      zero_copy_bytes=300, read_through_fills=3, eager_copy_seconds=0.5,
                                      eager_copy_wait_seconds=0.25)
        metrics.flush()
        values = {n: _PbUtils.created[n].value for n in EXPERT_CACHE_FAMILIES}
        assert values == {
            "freetoken_expert_cache_hits_total": 9,
            "freetoken_expert_cache_misses_total": 4,
            "freetoken_expert_cache_bytes_copied_total": 400,
            "freetoken_expert_cache_prefetched_total": 2,
            "freetoken_expert_cache_prefetch_hits_total": 1,
            "freetoken_expert_cache_zero_copy_bytes_total": 300,
            "freetoken_expert_cache_read_through_fills_total": 3,
            "freetoken_expert_cache_eager_copy_seconds_total": 0.5,
            "freetoken_expert_cache_eager_copy_wait_seconds_total": 0.25,
            "freetoken_expert_cache_slots": 16,
        }
    finally:
        metrics.close()
