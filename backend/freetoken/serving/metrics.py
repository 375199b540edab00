"""The vLLM backend's metric families (``vllm:*``: names, labels, meanings and histogram buckets, so
its dashboards and CI checks read FreeToken unchanged), vLLM's own names for the scheduler's
queues, preemptions and KV-cache use, and ``freetoken_*`` only for what vLLM has no name for (the
expert cache's, ``EXPERT_CACHE_FAMILIES``, only with ``moe_offload``).

Every metric update is a round trip to the server (18-46 us), so nothing here runs on the engine or
response threads: they call ``record_*`` (a queue put) and one background thread aggregates the
counters and observes the histograms soon after (within ~10 ms, batching what arrives meanwhile, so
that a client reading /metrics after its response sees its request counted, as with the vLLM
backend), and samples the runtime's gauges every ``interval`` seconds.
Counts are per sample (an ``n`` > 1 request is ``n`` engine requests, as in vLLM), except
``vllm:request_params_n``, observed once per request.

Lifetime: every series carries an ``OWNER_LABEL`` unique to this stub process. Triton's core keeps
one Prometheus family per name and hands two instances that ask for the same name and labels the
*same* Prometheus series, but counts references per ``MetricFamily`` object: when a model is
reloaded (the new instance starts before the old one finalizes), the old instance's
``MetricFamily``/``Metric`` teardown deletes the series the new instance is writing to, and the
server crashes (segfault or heap corruption; reproduced on 2.51, unchanged in Triton's main). With
a label of its own per instance, each instance owns its series and removes only those.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from freetoken.runtime import ExpertCacheStats, PrefixCacheStats, RuntimeStats

logger = logging.getLogger(__name__)

# The vLLM backend's buckets (src/utils/metrics.py), and vLLM's for the queue time.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1, 2, 5, 10, 20]
QUEUE_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0]
TOKEN_COUNT_BUCKETS = "1-2-5"  # 1, 2, 5, 10, 20, 50, ... up to max_model_len, as vLLM's build_1_2_5_buckets


def one_two_five_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... while <= ``max_value``."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


# name -> (kind, description, buckets)
FAMILIES: dict[str, tuple[str, str, list[float] | str | None]] = {
    "vllm:prompt_tokens_total": ("COUNTER", "Number of prefill tokens processed.", None),
    "vllm:generation_tokens_total": ("COUNTER", "Number of generation tokens processed.", None),
    "vllm:time_to_first_token_seconds": ("HISTOGRAM", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("HISTOGRAM", "Histogram of time per output token in seconds.",
                                           TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("HISTOGRAM", "Histogram of end to end request latency in seconds.",
                                         E2E_BUCKETS),
    "vllm:request_prompt_tokens": ("HISTOGRAM", "Number of prefill tokens processed.", TOKEN_COUNT_BUCKETS),
    "vllm:request_generation_tokens": ("HISTOGRAM", "Number of generation tokens processed.", TOKEN_COUNT_BUCKETS),
    "vllm:request_params_n": ("HISTOGRAM", "Histogram of the n request parameter.", N_BUCKETS),
    "vllm:request_queue_time_seconds": ("HISTOGRAM", "Histogram of time spent in WAITING phase for request.",
                                        QUEUE_BUCKETS),
    "vllm:request_success_total": ("COUNTER", "Count of finished requests, by finished_reason.", None),
    "vllm:num_preemptions_total": ("COUNTER", "Cumulative number of preemption from the engine.", None),
    "vllm:num_requests_running": ("GAUGE", "Number of requests in model execution batches.", None),
    "vllm:num_requests_waiting": ("GAUGE", "Number of requests waiting to be processed.", None),
    "vllm:kv_cache_usage_perc": ("GAUGE", "KV-cache usage. 1 means 100 percent usage.", None),
    "freetoken_kv_cache_pages_total": ("GAUGE", "KV-cache pages in the pool.", None),
    "freetoken_state_slots_used": ("GAUGE", "Recurrent-state (Gated DeltaNet) slots in use.", None),
    "freetoken_state_slots_total": ("GAUGE", "Recurrent-state slots in the pool.", None),
}
# Published only when the engine caches prefixes (``RuntimeStats.prefix_cache`` not None): vLLM V1's
# counters (vllm/v1/metrics/loggers.py; hit rate = hits / queries, in tokens), then FreeToken's.
PREFIX_CACHE_FAMILIES: dict[str, tuple[str, str, None]] = {
    "vllm:prefix_cache_queries_total": ("COUNTER", "Prefix cache queries, in terms of number of queried tokens.",
                                        None),
    "vllm:prefix_cache_hits_total": ("COUNTER", "Prefix cache hits, in terms of number of cached tokens.", None),
    "freetoken_prefix_cache_pages": ("GAUGE", "KV-cache pages the prefix cache holds (shared with requests or not).",
                                     None),
    "freetoken_snapshot_slots_used": ("GAUGE", "Prefix-cache state snapshots (Gated DeltaNet, PLE) held.", None),
    "freetoken_snapshot_slots_total": ("GAUGE", "Prefix-cache state snapshot slots.", None),
}
# With moe_offload only: the expert cache's counters (RuntimeStats.expert_cache), as counters.
EXPERT_CACHE_FAMILIES: dict[str, tuple[str, str, None]] = {
    "freetoken_expert_cache_hits_total": ("COUNTER", "Routed expert uses found in the device expert cache.", None),
    "freetoken_expert_cache_misses_total": ("COUNTER", "Routed expert uses whose expert was not in the device "
                                                       "cache (copied in, or read from host memory by a decode "
                                                       "kernel).", None),
    "freetoken_expert_cache_zero_copy_bytes_total": ("COUNTER", "Expert bytes decode kernels read straight from "
                                                                "host memory (their misses).", None),
    "freetoken_expert_cache_read_through_fills_total": ("COUNTER", "Decode misses the kernel that read them wrote "
                                                                   "into a cache slot (no copy).", None),
    "freetoken_expert_cache_bytes_copied_total": ("COUNTER", "Expert bytes copied from host memory to the device.",
                                                  None),
    "freetoken_expert_cache_prefetched_total": ("COUNTER", "Experts copied ahead of their layer's routing.", None),
    "freetoken_expert_cache_prefetch_hits_total": ("COUNTER", "Prefetched experts their layer then used.", None),
    "freetoken_expert_cache_eager_copy_seconds_total": ("COUNTER", "Device seconds the copy stream spent copying "
                                                                   "experts in for prompt chunks (CUDA).", None),
    "freetoken_expert_cache_eager_copy_wait_seconds_total": ("COUNTER", "Device seconds prompt chunks waited for "
                                                                        "their expert copies (CUDA).", None),
    "freetoken_expert_cache_slots": ("GAUGE", "Expert slots of the device expert cache.", None),
}
# counter -> the ExpertCacheStats field it follows
EXPERT_CACHE_COUNTERS = {
    "freetoken_expert_cache_hits_total": "hits",
    "freetoken_expert_cache_misses_total": "misses",
    "freetoken_expert_cache_bytes_copied_total": "bytes_copied",
    "freetoken_expert_cache_prefetched_total": "prefetched",
    "freetoken_expert_cache_prefetch_hits_total": "prefetch_hits",
    "freetoken_expert_cache_zero_copy_bytes_total": "zero_copy_bytes",
    "freetoken_expert_cache_read_through_fills_total": "read_through_fills",
    "freetoken_expert_cache_eager_copy_seconds_total": "eager_copy_seconds",
    "freetoken_expert_cache_eager_copy_wait_seconds_total": "eager_copy_wait_seconds",
}
FINISH_REASONS = ("stop", "length", "abort", "error")
SUCCESS = "vllm:request_success_total"
BATCH_SECONDS = 0.01  # after a flush, events gather this long before the next one
OWNER_LABEL = "stub_pid"  # the stub process that owns a series (see the module docstring)


class Metrics:
    """Publishes the families above, or does nothing when the server runs with metrics off."""

    def __init__(self, pb_utils: Any | None, labels: dict[str, str], stats: Callable[[], RuntimeStats], interval: float,
                 max_model_len: int) -> None:
        """``pb_utils`` None: metrics off (the ``report_metrics`` parameter); ``max_model_len`` bounds
        the token-count buckets."""
        labels = {**labels, OWNER_LABEL: str(os.getpid())}
        self._pb = pb_utils
        self._labels = labels
        self._stats = stats
        self._interval = interval
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._urgent = threading.Event()  # a sync waits: no batching delay
        self._metrics: dict[str, Any] = {}
        self._finished: dict[str, Any] = {}
        self._families: list[Any] = []  # kept alive as long as their metrics
        self._last_preemptions = 0
        self._prefix_metrics: dict[str, Any] | None = None  # created at the first stats with a prefix cache
        self._last_prefix = (0, 0)  # queried, hit tokens already counted
        self._expert_metrics: dict[str, Any] | None = None  # created at the first stats with an expert cache
        self._last_expert_cache = dict.fromkeys(EXPERT_CACHE_COUNTERS, 0)
        families = FAMILIES.items() if pb_utils is not None else ()
        try:
            for name, (kind, description, buckets) in families:
                family = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
                self._families.append(family)
                if buckets == TOKEN_COUNT_BUCKETS:
                    buckets = one_two_five_buckets(max_model_len)
                if name == SUCCESS:
                    self._finished = {r: family.Metric(labels={**labels, "finished_reason": r}) for r in FINISH_REASONS}
                elif buckets is not None:
                    self._metrics[name] = family.Metric(labels=labels, buckets=buckets)
                else:
                    self._metrics[name] = family.Metric(labels=labels)
        except Exception as exc:  # pb_utils.TritonModelException("metrics not supported") when the server has them off
            logger.warning("custom metrics unavailable, the model's metrics are off: %s", exc)
            self._metrics, self._finished, self._families = {}, {}, []
        self.enabled = bool(self._metrics)
        self._thread = threading.Thread(target=self._loop, name="freetoken-metrics", daemon=True)
        if self.enabled:
            self._thread.start()

    # ----- called from the response threads (cheap) -----

    def record_first_token(self, num_prompt_tokens: int, ttft: float | None, queue_time: float | None) -> None:
        if self.enabled:
            self._events.put(("first", num_prompt_tokens, ttft, queue_time))
            self._wake.set()

    def record_tokens(self, count: int, gaps: list[float]) -> None:
        """``count`` new output tokens; ``gaps``: the time since the sample's previous token, once
        per engine output after its first (vLLM's time per output token)."""
        if self.enabled and count:
            self._events.put(("tokens", count, gaps))
            self._wake.set()

    def record_finished(self, reason: str, e2e: float, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """One sample finished (``reason``: stop, length, abort, error)."""
        if self.enabled:
            self._events.put(("finished", reason, e2e, num_prompt_tokens, num_generation_tokens))
            self._wake.set()

    def record_request(self, n: int) -> None:
        """A request of ``n`` samples closed."""
        if self.enabled:
            self._events.put(("request", n))
            self._wake.set()

    def sync(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the events recorded so far are on the metrics port."""
        if self.enabled:
            done = threading.Event()
            self._events.put(("sync", done))
            self._urgent.set()
            self._wake.set()
            done.wait(timeout)

    # ----- the metrics thread -----

    def _loop(self) -> None:
        next_gauges = 0.0
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            now = time.monotonic()
            try:
                self.flush(gauges=now >= next_gauges)
            except Exception:
                logger.exception("updating metrics failed")
            if now >= next_gauges:
                next_gauges = now + self._interval
            self._urgent.wait(BATCH_SECONDS)
            self._urgent.clear()

    def flush(self, gauges: bool = True) -> None:
        """Apply the queued events; with ``gauges``, also sample the runtime's pools and queues."""
        counts: Counter[str] = Counter()
        finished: Counter[str] = Counter()
        observations: list[tuple[str, float]] = []
        synced: list[threading.Event] = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] == "tokens":
                counts["vllm:generation_tokens_total"] += event[1]
                observations += [("vllm:time_per_output_token_seconds", gap) for gap in event[2]]
            elif event[0] == "first":
                _, prompt_tokens, ttft, queue_time = event
                counts["vllm:prompt_tokens_total"] += prompt_tokens
                if ttft is not None:
                    observations.append(("vllm:time_to_first_token_seconds", ttft))
                if queue_time is not None:
                    observations.append(("vllm:request_queue_time_seconds", queue_time))
            elif event[0] == "finished":
                _, reason, e2e, prompt_tokens, generation_tokens = event
                finished[reason] += 1
                observations += [("vllm:e2e_request_latency_seconds", e2e),
                                 ("vllm:request_prompt_tokens", prompt_tokens),
                                 ("vllm:request_generation_tokens", generation_tokens)]
            elif event[0] == "request":
                observations.append(("vllm:request_params_n", event[1]))
            else:
                synced.append(event[1])
        for name, count in counts.items():
            self._metrics[name].increment(count)
        for reason, count in finished.items():
            self._finished[reason].increment(count)
        for name, value in observations:
            self._metrics[name].observe(value)
        for done in synced:
            done.set()
        if not gauges:
            return
        stats = self._stats()
        gauges = {
            "vllm:num_requests_running": stats.num_running,
            "vllm:num_requests_waiting": stats.num_waiting,
            "vllm:kv_cache_usage_perc": stats.pages_used / stats.pages_total if stats.pages_total else 0.0,
            "freetoken_kv_cache_pages_total": stats.pages_total,
            "freetoken_state_slots_used": stats.slots_used,
            "freetoken_state_slots_total": stats.slots_total,
        }
        for name, value in gauges.items():
            self._metrics[name].set(value)
        if stats.num_preemptions > self._last_preemptions:
            self._metrics["vllm:num_preemptions_total"].increment(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
        if stats.prefix_cache is not None:
            self._publish_prefix_cache(stats.prefix_cache)
        if stats.expert_cache is not None:
            self._publish_expert_cache(stats.expert_cache)

    def _publish_prefix_cache(self, cache: PrefixCacheStats) -> None:
        """The prefix-cache families, created the first time there is a cache: with prefix caching
        off none of them appears. The counters grow by the runtime's cumulative counts' deltas."""
        if self._prefix_metrics is None:
            self._prefix_metrics = self._create_families(PREFIX_CACHE_FAMILIES, "prefix-cache")
        metrics = self._prefix_metrics
        if not metrics:
            return
        queried, hit = self._last_prefix
        if cache.queried_tokens > queried:
            metrics["vllm:prefix_cache_queries_total"].increment(cache.queried_tokens - queried)
        if cache.hit_tokens > hit:
            metrics["vllm:prefix_cache_hits_total"].increment(cache.hit_tokens - hit)
        self._last_prefix = (max(queried, cache.queried_tokens), max(hit, cache.hit_tokens))
        metrics["freetoken_prefix_cache_pages"].set(cache.cached_pages)
        metrics["freetoken_snapshot_slots_used"].set(cache.snapshot_slots_used)
        metrics["freetoken_snapshot_slots_total"].set(cache.snapshot_slots_total)

    def _publish_expert_cache(self, cache: ExpertCacheStats) -> None:
        """The expert-cache families (``moe_offload``), created the first time there is a cache; the
        counters grow by the runtime's cumulative counts' deltas."""
        if self._expert_metrics is None:
            self._expert_metrics = self._create_families(EXPERT_CACHE_FAMILIES, "expert-cache")
        metrics = self._expert_metrics
        if not metrics:
            return
        metrics["freetoken_expert_cache_slots"].set(cache.slots)
        for name, field in EXPERT_CACHE_COUNTERS.items():
            value = getattr(cache, field)
            if value > self._last_expert_cache[name]:
                metrics[name].increment(value - self._last_expert_cache[name])
                self._last_expert_cache[name] = value

    def _create_families(self, families: dict[str, tuple[str, str, None]], what: str) -> dict[str, Any]:
        """The series of ``families``, or none (logged once) if the server refuses them."""
        metrics: dict[str, Any] = {}
        try:
            for name, (kind, description, _) in families.items():
                family = self._pb.MetricFamily(name=name, description=description,
                                               kind=getattr(self._pb.MetricFamily, kind))
                self._families.append(family)
                metrics[name] = family.Metric(labels=self._labels)
        except Exception as exc:
            logger.warning("%s metrics unavailable: %s", what, exc)
            return {}
        return metrics

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._urgent.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._metrics, self._finished, self._prefix_metrics, self._families = {}, {}, None, []
        self.enabled = False
