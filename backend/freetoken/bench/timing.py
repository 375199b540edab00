"""Timing the engine's steps from outside: ``StepRecorder`` wraps ``Runtime.step`` of an ``LLM`` while
``LLM.generate`` runs, so what is timed is the real path (schedule, forward, sample, detokenize,
outputs), and measures the GPU's idle share over a few steady decode steps.

Steady decode: a step that produced one token for each of the ``B`` requests and no request's first
token, i.e. every request is decoding and none is still in prefill.

GPU busy time per step: the union of the intervals of every GPU activity (kernels, copies, memsets)
that CUPTI recorded over ``profile_steps`` consecutive steady steps (``torch.profiler`` with only the
CUDA activity), divided by their number. The overlapped loop launches step N + 1 in the call that
resolves step N, so the calls' wall time is not their own steps' GPU time: the window starts after
a device sync (the step in flight finishes outside it) and ends after one (the last step launched
in it finishes inside it), so it holds the GPU work of exactly the ``profile_steps`` steps its calls
launched, and none of another step's; only durations and overlaps of GPU intervals are used, so
the GPU and host clocks need not be aligned. GPU idle share: ``1 - busy / step`` against the median
*unprofiled* steady step (``bench.offline``). Not ``1 - busy / wall`` of the profiled window
(kept as ``profiled_idle_share``): CUPTI slows the launches of a CUDA graph's kernels, so the
profiled steps last longer than the others (batch 1 on the H200: 4.15 ms against 3.03 ms) while
the kernels' own durations do not change; the window's idle share then counts the profiler's own
cost (31% there, against 1.3% of the real step), and the drain before the window's first launch.
The profiled steps are left out of the step-time statistics.

Kernel table: the same window's GPU activities grouped by name (launches and µs per step, share of
the summed time: activities of two streams that overlap are both counted, so the sum can exceed
the wall), the profile that decides which kernels to fuse next.

Per-step counters: given ``counters`` (a callable returning cumulative counters, such as the
expert cache's), each record keeps their change over its calls (``StepRecord.counters``), so a
benchmark can split them between prefill and steady decode steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Steady steps seen before the profiled window starts (the first ones can still compile kernels).
PROFILE_AFTER_STEADY_STEPS = 2


@dataclass
class StepRecord:
    seconds: float
    num_outputs: int
    num_first_tokens: int
    mean_output_len: float  # output tokens of the step's requests after it, averaged
    max_output_len: int
    profiled: bool = False
    counters: dict[str, float] | None = None  # the recorder's ``counters`` changed by this much over it


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy


def gpu_activities(prof: torch.profiler.profile) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` in ns of every GPU activity a stopped profiler recorded."""
    return [
        (e.name(), e.start_ns(), e.end_ns())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA
    ]


def kernel_table(activities: list[tuple[str, float, float]], steps: int) -> list[dict[str, Any]]:
    """Per GPU activity name: launches and µs per step and share of the summed time, largest first."""
    launches: dict[str, int] = {}
    total_ns: dict[str, float] = {}
    for name, start, end in activities:
        launches[name] = launches.get(name, 0) + 1
        total_ns[name] = total_ns.get(name, 0.0) + (end - start)
    grand = sum(total_ns.values()) or 1.0
    return [
        {
            "name": name,
            "launches_per_step": launches[name] / steps,
            "us_per_step": total_ns[name] / steps * 1e-3,
            "share": total_ns[name] / grand,
        }
        for name in sorted(total_ns, key=total_ns.get, reverse=True)
    ]


class StepRecorder:
    """Use as ``with StepRecorder(llm.runtime, B, max_tokens) as rec: llm.generate(...)``.

    ``profile_steps`` > 0 (CUDA only) measures ``busy_per_step`` (and ``profiled_idle_share``) once, over that many steady steps
    after ``PROFILE_AFTER_STEADY_STEPS`` of them, while every request still has tokens to go.
    ``progress`` (a tqdm bar) advances by the tokens each step yields. ``profiler_activities``: what
    the profiler records (CUDA; the CPU tests record CPU ops, none of which counts as busy).
    ``counters``: cumulative numbers read after each record (``StepRecord.counters``).
    """

    def __init__(
        self,
        runtime: Any,
        batch_size: int,
        max_tokens: int,
        profile_steps: int = 0,
        progress: Any = None,
        profiler_activities: tuple[torch.profiler.ProfilerActivity, ...] = (torch.profiler.ProfilerActivity.CUDA,),
        counters: Callable[[], dict[str, float]] | None = None,
    ):
        self.runtime = runtime
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.profile_steps = profile_steps
        self.progress = progress
        self.profiler_activities = list(profiler_activities)
        self.records: list[StepRecord] = []
        self._carried = 0.0  # seconds of calls that yielded no tokens
        self.profiled_idle_share: float | None = None
        self.busy_per_step: float | None = None  # seconds
        self.kernel_table: list[dict[str, Any]] | None = None
        self.profiled_wall: float | None = None
        self._profiler: torch.profiler.profile | None = None
        self._profile_tried = False
        self._window: list[float] = []
        self._counters = counters
        self._last_counters = counters() if counters is not None else None

    def __enter__(self) -> StepRecorder:
        self._step = self.runtime.step
        self.runtime.step = self._timed_step
        return self

    def __exit__(self, *exc) -> None:
        del self.runtime.step  # the instance attribute: the class's method shows again
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def _steady(self, record: StepRecord) -> bool:
        return record.num_outputs == self.batch_size and record.num_first_tokens == 0

    def _should_profile(self) -> bool:
        if self.profile_steps <= 0 or self._profile_tried:
            return False
        recent = self.records[-PROFILE_AFTER_STEADY_STEPS:]
        if len(recent) < PROFILE_AFTER_STEADY_STEPS or not all(self._steady(r) for r in recent):
            return False
        # Every request must keep running through the window: the one furthest along ends first.
        return self.max_tokens - recent[-1].max_output_len > self.profile_steps

    def _timed_step(self):
        if self._should_profile():
            self._profile_tried = True
            _sync()  # the step in flight finishes outside the window
            self._profiler = torch.profiler.profile(activities=self.profiler_activities)
            self._profiler.start()
        profiling = self._profiler is not None
        start = time.perf_counter()
        outputs = self._step()
        end = time.perf_counter()
        # Outputs are deltas: a request's length so far is in its metrics. An overlapped call that
        # only launched a step (no tokens yet) adds its time to the next record.
        tokens = [len(o.token_ids) or o.metrics["num_output_tokens"] for o in outputs if o.new_token_ids]
        if not tokens and not profiling:
            self._carried += end - start
            return outputs
        start -= self._carried
        self._carried = 0.0
        self.records.append(
            StepRecord(
                seconds=end - start,
                num_outputs=len(tokens),
                num_first_tokens=sum(1 for t in tokens if t == 1),
                mean_output_len=statistics.fmean(tokens) if tokens else 0.0,
                max_output_len=max(tokens, default=0),
                profiled=profiling,
                counters=self._counter_delta(),
            )
        )
        if profiling:
            self._window += [start, end]
            if len(self._window) == 2 * self.profile_steps:
                self._finish_profile()
        if self.progress is not None:
            self.progress.update(len(tokens))
        return outputs

    def _counter_delta(self) -> dict[str, float] | None:
        if self._counters is None:
            return None
        now = self._counters()
        delta = {name: value - self._last_counters.get(name, 0) for name, value in now.items()}
        self._last_counters = now
        return delta

    def _finish_profile(self) -> None:
        _sync()  # the last step launched in the window finishes inside it
        end = time.perf_counter()
        self._profiler.stop()
        activities = gpu_activities(self._profiler)
        self._profiler = None
        wall = end - self._window[0]
        if all(self._steady(r) for r in self.records if r.profiled) and wall > 0:
            self.profiled_wall = wall
            busy = busy_time([(s, e) for _, s, e in activities]) * 1e-9
            self.busy_per_step = busy / self.profile_steps
            self.profiled_idle_share = max(0.0, 1.0 - busy / wall)
            self.kernel_table = kernel_table(activities, self.profile_steps)

    def steady_records(self, profiled: bool = False) -> list[StepRecord]:
        """The steady steps, without the profiled ones unless ``profiled`` (their times are off;
        their counters are not)."""
        return [r for r in self.records if self._steady(r) and (profiled or not r.profiled)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
