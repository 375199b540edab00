"""freetoken_* metric families through the Python backend's custom metrics API.

Every metric update is a round trip to the server (18-46 us), so nothing here runs on the engine or
response threads: they call ``record_*`` (a queue put) and one background thread aggregates the
counters, observes the histograms and samples the runtime's gauges every ``interval`` seconds.

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
from collections import Counter
from collections.abc import Callable
from typing import Any

from freetoken.runtime import RuntimeStats

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
REQUEST_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0]
TOKEN_GAP_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5]

# name -> (kind, description, buckets)
FAMILIES: dict[str, tuple[str, str, list[float] | None]] = {
    "freetoken_time_to_first_token_seconds": ("HISTOGRAM", "Time from arrival to the first output token.", LATENCY_BUCKETS),
    "freetoken_inter_token_latency_seconds": (
        "HISTOGRAM",
        "Mean time between consecutive output tokens of a request, observed once per request.",
        TOKEN_GAP_BUCKETS,
    ),
    "freetoken_request_queue_time_seconds": ("HISTOGRAM", "Time a request waited before its first step.", LATENCY_BUCKETS),
    "freetoken_e2e_request_latency_seconds": ("HISTOGRAM", "Time from execute() to the final response.", REQUEST_BUCKETS),
    "freetoken_prompt_tokens_total": ("COUNTER", "Prompt tokens prefilled.", None),
    "freetoken_generation_tokens_total": ("COUNTER", "Output tokens generated.", None),
    "freetoken_requests_finished_total": ("COUNTER", "Requests finished, by finish_reason.", None),
    "freetoken_num_preemptions_total": ("COUNTER", "Requests preempted for lack of KV pages.", None),
    "freetoken_num_requests_running": ("GAUGE", "Requests in the running batch.", None),
    "freetoken_num_requests_waiting": ("GAUGE", "Requests waiting to be scheduled.", None),
    "freetoken_kv_cache_pages_used": ("GAUGE", "KV-cache pages in use.", None),
    "freetoken_kv_cache_pages_total": ("GAUGE", "KV-cache pages in the pool.", None),
    "freetoken_state_slots_used": ("GAUGE", "Recurrent-state (Gated DeltaNet) slots in use.", None),
    "freetoken_state_slots_total": ("GAUGE", "Recurrent-state slots in the pool.", None),
}
FINISH_REASONS = ("stop", "length", "abort", "error")
OWNER_LABEL = "stub_pid"  # the stub process that owns a series (see the module docstring)


class Metrics:
    """Publishes the families above, or does nothing when the server runs with metrics off."""

    def __init__(self, pb_utils: Any | None, labels: dict[str, str], stats: Callable[[], RuntimeStats], interval: float) -> None:
        """``pb_utils`` None: metrics off (the ``report_metrics`` parameter)."""
        labels = {**labels, OWNER_LABEL: str(os.getpid())}
        self._stats = stats
        self._interval = interval
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._metrics: dict[str, Any] = {}
        self._finished: dict[str, Any] = {}
        self._families: list[Any] = []  # kept alive as long as their metrics
        self._last_preemptions = 0
        families = FAMILIES.items() if pb_utils is not None else ()
        try:
            for name, (kind, description, buckets) in families:
                family = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
                self._families.append(family)
                if name == "freetoken_requests_finished_total":
                    self._finished = {r: family.Metric(labels={**labels, "finish_reason": r}) for r in FINISH_REASONS}
                elif buckets is not None:
                    self._metrics[name] = family.Metric(labels=labels, buckets=buckets)
                else:
                    self._metrics[name] = family.Metric(labels=labels)
        except Exception as exc:  # pb_utils.TritonModelException("metrics not supported") when the server has them off
            logger.warning("custom metrics unavailable, freetoken_* metrics are off: %s", exc)
            self._metrics, self._finished, self._families = {}, {}, []
        self.enabled = bool(self._metrics)
        self._thread = threading.Thread(target=self._loop, name="freetoken-metrics", daemon=True)
        if self.enabled:
            self._thread.start()

    # ----- called from the response threads (cheap) -----

    def record_first_token(self, num_prompt_tokens: int, ttft: float | None, queue_time: float | None) -> None:
        if self.enabled:
            self._events.put(("first", num_prompt_tokens, ttft, queue_time))

    def record_tokens(self, count: int) -> None:
        if self.enabled and count:
            self._events.put(("tokens", count))

    def record_finished(self, reason: str, e2e: float, inter_token: float | None) -> None:
        if self.enabled:
            self._events.put(("finished", reason, e2e, inter_token))

    # ----- the metrics thread -----

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except Exception:
                logger.exception("updating metrics failed")

    def flush(self) -> None:
        counts: Counter[str] = Counter()
        observations: list[tuple[str, float]] = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] == "tokens":
                counts["freetoken_generation_tokens_total"] += event[1]
            elif event[0] == "first":
                _, prompt_tokens, ttft, queue_time = event
                counts["freetoken_prompt_tokens_total"] += prompt_tokens
                if ttft is not None:
                    observations.append(("freetoken_time_to_first_token_seconds", ttft))
                if queue_time is not None:
                    observations.append(("freetoken_request_queue_time_seconds", queue_time))
            else:
                _, reason, e2e, inter_token = event
                counts[reason] += 1
                observations.append(("freetoken_e2e_request_latency_seconds", e2e))
                if inter_token is not None:
                    observations.append(("freetoken_inter_token_latency_seconds", inter_token))
        for name, count in counts.items():
            metric = self._finished.get(name) or self._metrics[name]
            metric.increment(count)
        for name, value in observations:
            self._metrics[name].observe(value)
        stats = self._stats()
        gauges = {
            "freetoken_num_requests_running": stats.num_running,
            "freetoken_num_requests_waiting": stats.num_waiting,
            "freetoken_kv_cache_pages_used": stats.pages_used,
            "freetoken_kv_cache_pages_total": stats.pages_total,
            "freetoken_state_slots_used": stats.slots_used,
            "freetoken_state_slots_total": stats.slots_total,
        }
        for name, value in gauges.items():
            self._metrics[name].set(value)
        if stats.num_preemptions > self._last_preemptions:
            self._metrics["freetoken_num_preemptions_total"].increment(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._metrics, self._finished, self._families = {}, {}, []
        self.enabled = False
