"""The streamed prefill's per-layer timeline (``experts.timeline``) and its bench lines, from stand-in
events with known times (CUDA timing events need a GPU; the summary only reads ``elapsed_time``)."""

from __future__ import annotations

import pytest

from freetoken.bench.offload_stats import print_timeline
from freetoken.experts import timeline as timeline_module
from freetoken.experts.timeline import PrefillTimeline


class _Event:
    """A timing event that fired at ``ms``."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: "_Event") -> float:
        return other.ms - self.ms


def _two_layer_forward(monkeypatch) -> PrefillTimeline:
    """Layer 0's copies 1-5 ms (streamed from the start) and a demand batch 5-6; layer 1's streamed
    batch 8-12 (2 ms idle before it, while layer 0's experts run 6.5-9); layer 1 waits 11-12 and
    its experts run 12-14."""
    times = {"start": 0.0, "routed0": 0.5, "computed0": 9.0, "routed1": 10.0, "computed1": 14.0}
    order = iter(["start", "routed0", "computed0", "routed1", "computed1"])  # the events ``_record`` makes
    monkeypatch.setattr(timeline_module, "_record", lambda stream: _Event(times[next(order)]))
    t = PrefillTimeline(num_layers=2)
    t.start(None)
    t.copy(0, True, _Event(1.0), _Event(5.0))
    t.routed(0, None)
    t.copy(0, False, _Event(5.0), _Event(6.0))
    t.wait(0, _Event(6.0), _Event(6.5))
    t.computed(0, None)
    t.copy(1, True, _Event(8.0), _Event(12.0))
    t.routed(1, None)
    t.wait(1, _Event(11.0), _Event(12.0))
    t.computed(1, None)  # the last layer: the forward is closed
    t.copy(1, True, _Event(20.0), _Event(21.0))  # after it: not recorded
    return t


def test_summary_finds_the_copy_streams_gaps_and_the_layers_waits(monkeypatch, capsys):
    t = _two_layer_forward(monkeypatch)
    monkeypatch.setattr(timeline_module.torch.cuda, "synchronize", lambda: None)
    (s,) = t.summary()
    assert s["span_ms"] == pytest.approx(14.0)
    assert s["copy_busy_ms"] == pytest.approx(9.0)
    assert s["copy_idle_ms"] == pytest.approx(5.0)
    assert s["idle_before_first_copy_ms"] == pytest.approx(1.0)
    assert (s["gaps"], s["idle_between_copies_ms"]) == (1, pytest.approx(2.0))
    assert s["idle_after_last_copy_ms"] == pytest.approx(2.0)
    (gap,) = s["largest_gaps"]
    assert (gap["before_layer"], gap["ahead"], gap["experts_running"]) == (1, True, 0)
    assert gap["at_ms"] == pytest.approx(6.0)
    first, second = s["layers"]
    assert (first["copy_start"], first["copy_end"], first["copy_ms"]) == (1.0, 6.0, pytest.approx(5.0))
    assert (first["experts_start"], first["experts_end"]) == (6.5, 9.0)
    assert (second["wait_ms"], second["experts_start"], second["experts_end"]) == (1.0, 12.0, 14.0)
    assert s["compute_wait_ms"] == pytest.approx(1.5)
    assert s["experts_ms"] == pytest.approx(4.5)
    assert s["routing_to_experts_ms"] == pytest.approx(6.0 + 2.0)  # routed 0.5 -> 6.5, 10 -> 12
    assert s["experts_to_next_routing_ms"] == pytest.approx(1.0)  # layer 0's experts end 9, layer 1 routes 10

    print_timeline(1, s, 1)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "copy stream busy 9.0 ms (64%), idle 5.0 ms = 1.0 before the first copy + 2.0 in 1 gaps + 2.0" in lines[0]
    assert "2.00 at 6.0 before L1's streamed copies, L0's experts running" in lines[0]
    assert "compute waited 1.5 ms for copies in 2 layers (largest, ms: L1 1.00, L0 0.50)" in lines[1]
    assert "from each layer's routing to its experts 8.0 ms (the host's work after the sync)" in lines[1]
    assert lines[1].endswith("from its experts to the next routing 1.0 ms")
    assert lines[2].endswith("0:5.0/0.5/2.5 1:4.0/1.0/2.0")


def test_an_unfinished_forward_is_not_summarized(monkeypatch):
    monkeypatch.setattr(timeline_module, "_record", lambda stream: _Event(0.0))
    monkeypatch.setattr(timeline_module.torch.cuda, "synchronize", lambda: None)
    t = PrefillTimeline(num_layers=2)
    t.copy(0, True, _Event(1.0), _Event(2.0))  # before any forward started: ignored
    t.start(None)
    t.computed(0, None)
    assert t.summary() == []
    assert t.forwards[0].copies == []
