"""The offload bench's accounting (``bench.offload_stats``, ``StepRecorder``'s per-step counters):
the expert cache split between prefill and steady decode steps, the PCIe figures per decode step,
and the comparison with the all-resident engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from freetoken.bench.offload_stats import expert_cache_phases, print_phases, versus_resident
from freetoken.bench.timing import StepRecord, StepRecorder

EXPERT = 6_000_000  # bytes of one expert
BW = 50e9


def _record(first: int, **counters: float) -> StepRecord:
    return StepRecord(seconds=0.004, num_outputs=1, num_first_tokens=first, mean_output_len=1.0,
                      max_output_len=1, counters=counters)


def test_phases_split_prefill_from_zero_copy_decode_and_give_pcie_times_per_step(capsys):
    prefill = _record(1, hits=30, misses=70, bytes_copied=70 * EXPERT)
    decode = [
        _record(0, hits=6, misses=2, decode_hits=6, decode_misses=2, decode_forwards=1, read_through_fills=2,
                zero_copy_bytes=2 * EXPERT, settle_seconds=0.0005)
        for _ in range(3)
    ] + [_record(0, hits=8, misses=0, decode_hits=8, decode_forwards=1, settle_seconds=0.0001)]
    phases = expert_cache_phases([prefill, *decode], decode, decode, EXPERT, BW, resident_ms=3.0)

    p = phases["prefill"]
    assert (p["steps"], p["hits"], p["misses"]) == (1, 30, 70)
    assert p["hit_rate"] == pytest.approx(0.3)
    assert p["copy_floor_ms"] == pytest.approx(70 * EXPERT / BW * 1e3)

    d = phases["decode"]
    assert (d["forwards"], d["hits"], d["misses"]) == (4, 26, 6)
    assert d["hit_rate"] == pytest.approx(26 / 32)
    assert d["misses_per_step"] == pytest.approx(1.5) and d["read_through_per_step"] == pytest.approx(1.5)
    assert d["miss_floor_ms_per_step"] == pytest.approx(6 * EXPERT / BW / 4 * 1e3)
    assert d["zero_copy_ms_per_step"] == pytest.approx(d["miss_floor_ms_per_step"])
    assert d["read_through_fills"] == 6
    assert d["settle_ms_per_step"] == pytest.approx((3 * 0.5 + 0.1) / 4)

    late = phases["decode_late"]  # the second half: one step with misses, one without
    assert (late["forwards"], late["misses"], late["hit_rate"]) == (2, 2, pytest.approx(14 / 16))

    rows = phases["per_step"]
    assert [r["steady"] for r in rows] == [False, True, True, True, True]
    assert rows[1]["zero_copy_experts"] == pytest.approx(2) and rows[1]["read_through_fills"] == 2
    assert rows[1]["copied_experts"] == 0  # the read-through fill copies nothing

    v = phases["vs_resident"]
    assert v["offload_ms_per_step"] == pytest.approx(4.0) and v["tok_s_share"] == pytest.approx(0.75)
    assert v["added_ms_per_step"] == pytest.approx(1.0)
    assert v["added_over_miss_floor"] == pytest.approx(1.0 / d["miss_floor_ms_per_step"])

    assert p["pcie_busy_share"] is None and p["copy_wait_ms"] is None  # no copy stream timed (CPU)
    assert p["needed_floor_ms"] == pytest.approx(p["copy_floor_ms"])

    print_phases(1, phases)
    out = capsys.readouterr().out
    assert "zero-copy decode, 4 forwards: expert cache hit rate 81.2%" in out
    assert "prefill, 1 step(s)" in out and "75% of its tok/s" in out
    assert "overlap not timed (no copy stream: CPU)" in out


def test_prefill_stream_overlap_and_needed_floor(capsys):
    """A streamed prefill: 50 experts copied ahead (40 then used), 10 misses on demand; the copy
    stream busy 3 of the step's 4 ms, the compute stream waiting 0.6 of them."""
    prefill = _record(1, hits=50, misses=10, prefetched=50, prefetch_hits=40, bytes_copied=60 * EXPERT,
                      eager_copy_seconds=0.003, eager_wait_seconds=0.0006)
    p = expert_cache_phases([prefill], [], [], EXPERT, BW)["prefill"]
    assert (p["streamed"], p["streamed_used"]) == (50, 40)
    assert p["copy_floor_ms"] == pytest.approx(60 * EXPERT / BW * 1e3)  # what crossed PCIe
    assert p["needed_floor_ms"] == pytest.approx(50 * EXPERT / BW * 1e3)  # what the chunk needed
    assert p["over_needed_floor"] == pytest.approx(4.0 / p["needed_floor_ms"])
    assert p["pcie_busy_share"] == pytest.approx(0.75) and p["copy_hidden_share"] == pytest.approx(0.8)
    print_phases(1, {"decode": {"forwards": 0}, "decode_late": {}, "prefill": p})
    out = capsys.readouterr().out
    assert "streamed ahead 50, 40 used" in out and "PCIe busy 3.0 ms = 75% of the prefill" in out
    assert "compute waited 0.6 ms for copies (80% of the copy time hidden)" in out


def test_versus_resident_checks_its_input():
    with pytest.raises(ValueError, match="resident ms/step must be > 0"):
        versus_resident([4.0], 0.0, 1.0)
    assert versus_resident([4.0, 6.0, 5.0], 2.5, None)["added_over_miss_floor"] is None


class _CountingRuntime:
    """One request: the first call launches the prefill (no token), every later one yields a token;
    each call adds its index to a counter, as the expert cache's counters grow."""

    def __init__(self) -> None:
        self.calls = 0
        self.total = 0

    def step(self):
        self.calls += 1
        self.total += self.calls
        if self.calls == 1:
            return []
        return [SimpleNamespace(token_ids=[0] * (self.calls - 1), new_token_ids=[0])]


def test_recorder_keeps_each_steps_counter_changes_carried_calls_included():
    runtime = _CountingRuntime()
    with StepRecorder(runtime, 1, max_tokens=5, counters=lambda: {"total": runtime.total}) as recorder:
        for _ in range(5):
            runtime.step()
    # The first record holds the launch-only call too (1 + 2); then one call per record.
    assert [r.counters["total"] for r in recorder.records] == [3, 3, 4, 5]
    assert [r.num_first_tokens for r in recorder.records] == [1, 0, 0, 0]
