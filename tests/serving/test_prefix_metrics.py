"""The prefix-cache metric families, from a stand-in stats source (no server, no engine): absent
while the runtime reports no prefix cache, then vLLM's counters growing by the runtime's deltas
and FreeToken's gauges set to its values."""

from __future__ import annotations

import os

from freetoken.runtime import PrefixCacheStats, RuntimeStats
from freetoken.serving.metrics import FAMILIES, OWNER_LABEL, PREFIX_CACHE_FAMILIES, Metrics


class RecordingMetric:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels, self.value, self.increments = labels, 0.0, []

    def increment(self, value: float) -> None:
        self.increments.append(value)
        self.value += value

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        pass


class RecordingPbUtils:
    """``pb_utils.MetricFamily`` as the metrics object uses it, remembering every series by name."""

    def __init__(self) -> None:
        self.series: dict[str, RecordingMetric] = {}
        self.kinds: dict[str, str] = {}
        self.created: list[str] = []  # family names, once per MetricFamily made
        pb = self

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

            def __init__(self, name: str, description: str, kind: str) -> None:
                self.name = name
                pb.kinds[name] = kind
                pb.created.append(name)

            def Metric(self, labels: dict[str, str], buckets=None) -> RecordingMetric:
                metric = RecordingMetric(labels)
                pb.series.setdefault(self.name, metric)  # request_success: the first reason's is enough here
                return metric

        self.MetricFamily = MetricFamily


def _stats(prefix_cache: PrefixCacheStats | None) -> RuntimeStats:
    return RuntimeStats(num_running=0, num_waiting=0, pages_used=3, pages_total=64, slots_used=1, slots_total=8,
                        num_preemptions=0, prefix_cache=prefix_cache)


def test_prefix_cache_families_follow_the_runtime_stats():
    pb = RecordingPbUtils()
    current = {"stats": _stats(None)}
    # an hour between gauge samples: only the flushes below publish anything
    metrics = Metrics(pb, {"model": "m", "version": "1"}, lambda: current["stats"], interval=3600, max_model_len=256)
    try:
        metrics.flush()
        assert set(pb.series) == set(FAMILIES)  # prefix caching off: none of its families
        assert pb.series["freetoken_state_slots_used"].value == 1

        current["stats"] = _stats(PrefixCacheStats(queried_tokens=100, hit_tokens=48, cached_pages=7,
                                                   snapshot_slots_used=2, snapshot_slots_total=8))
        metrics.flush()
        assert set(pb.series) == set(FAMILIES) | set(PREFIX_CACHE_FAMILIES)
        assert {name: pb.kinds[name] for name in PREFIX_CACHE_FAMILIES} == {
            "vllm:prefix_cache_queries_total": "COUNTER", "vllm:prefix_cache_hits_total": "COUNTER",
            "freetoken_prefix_cache_pages": "GAUGE", "freetoken_snapshot_slots_used": "GAUGE",
            "freetoken_snapshot_slots_total": "GAUGE",
        }
        values = {name: pb.series[name].value for name in PREFIX_CACHE_FAMILIES}
        assert values == {"vllm:prefix_cache_queries_total": 100, "vllm:prefix_cache_hits_total": 48,
                          "freetoken_prefix_cache_pages": 7, "freetoken_snapshot_slots_used": 2,
                          "freetoken_snapshot_slots_total": 8}
        assert pb.series["vllm:prefix_cache_hits_total"].labels == {"model": "m", "version": "1",
                                                                    OWNER_LABEL: str(os.getpid())}

        current["stats"] = _stats(PrefixCacheStats(queried_tokens=260, hit_tokens=160, cached_pages=9,
                                                   snapshot_slots_used=3, snapshot_slots_total=8))
        metrics.flush()
        metrics.flush()  # nothing new: no increment
        queries, hits = pb.series["vllm:prefix_cache_queries_total"], pb.series["vllm:prefix_cache_hits_total"]
        assert queries.increments == [100, 160] and hits.increments == [48, 112]
        assert pb.series["freetoken_prefix_cache_pages"].value == 9
        assert pb.series["freetoken_snapshot_slots_used"].value == 3
        assert sorted(pb.created) == sorted([*FAMILIES, *PREFIX_CACHE_FAMILIES])  # each family made once
    finally:
        metrics.close()
