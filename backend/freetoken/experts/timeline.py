"""A streamed prompt chunk's per-layer timeline on its two CUDA streams, from timing events.

Off unless a caller sets ``ExpertOffload.timeline`` (the bench does, for its timed run): each
streamed eager forward (``ExpertOffload.start_forward``) then records, on the compute stream, its
start, each layer's routing sync (``routed``), the layer's wait for its copies (``wait``: before,
after) and the end of its experts (``computed``); on the copy stream, each batch of copies
(``DeviceSlots.fill``: start once the copy stream reached it, end), tagged with the layer whose
experts it brings and whether it was streamed ahead. A batch's start event fires once the copies
queued before it are done and the compute stream reached the point it waits for, so the time
between one batch's end and the next one's start is the copy stream idle (PCIe unused): the host had
not queued the batch yet, or it waited for compute. ``summary`` reads the events (a sync) into
the figures the bench prints. Keeps the last ``KEEP`` forwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

KEEP = 4  # forwards kept
LARGEST = 4  # gaps and waits named in the summary


@dataclass
class _Copy:
    layer: int
    ahead: bool
    start: torch.cuda.Event
    end: torch.cuda.Event


@dataclass
class _Forward:
    start: torch.cuda.Event
    copies: list[_Copy] = field(default_factory=list)
    routed: dict[int, torch.cuda.Event] = field(default_factory=dict)
    waits: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=dict)
    computed: dict[int, torch.cuda.Event] = field(default_factory=dict)


class PrefillTimeline:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.forwards: deque[_Forward] = deque(maxlen=KEEP)
        self._open: _Forward | None = None

    def start(self, stream: torch.cuda.Stream) -> None:
        """A streamed forward starts (its first copies are queued next)."""
        self._open = _Forward(_record(stream))
        self.forwards.append(self._open)

    def copy(self, layer: int, ahead: bool, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        if self._open is not None:
            self._open.copies.append(_Copy(layer, ahead, start, end))

    def routed(self, layer: int, stream: torch.cuda.Stream) -> None:
        if self._open is not None:
            self._open.routed[layer] = _record(stream)

    def wait(self, layer: int, before: torch.cuda.Event, after: torch.cuda.Event) -> None:
        if self._open is not None:
            self._open.waits[layer] = (before, after)

    def computed(self, layer: int, stream: torch.cuda.Stream) -> None:
        """Layer ``layer``'s experts are queued; the last layer's close the forward."""
        if self._open is None:
            return
        self._open.computed[layer] = _record(stream)
        if layer == self.num_layers - 1:
            self._open = None

    def summary(self) -> list[dict[str, Any]]:
        """Each kept forward that reached its last layer, oldest first (synchronizes the device)."""
        torch.cuda.synchronize()
        return [_summarize(f) for f in self.forwards if f is not self._open and f.computed]


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _summarize(forward: _Forward) -> dict[str, Any]:
    """Milliseconds from the forward's start: per layer and the copy stream's idle gaps."""
    def at(event: torch.cuda.Event) -> float:
        return forward.start.elapsed_time(event)

    end = max(at(e) for e in forward.computed.values())
    spans = [(at(c.start), at(c.end), c) for c in forward.copies]
    runs = {layer: (at(forward.waits[layer][1]) if layer in forward.waits else at(forward.routed[layer]), at(e))
            for layer, e in forward.computed.items() if layer in forward.routed or layer in forward.waits}
    head = spans[0][0] if spans else end
    between = []  # the copy stream's idle stretches between two batches
    previous_end = head
    for start, stop, copy in spans:
        if start > previous_end:
            between.append(_gap(previous_end, start, copy, runs))
        previous_end = max(previous_end, stop)
    tail = max(0.0, end - previous_end) if spans else 0.0
    busy = sum(stop - start for start, stop, _ in spans)
    layers = []
    for layer in sorted(set(forward.routed) | set(forward.computed) | {c.layer for c in forward.copies}):
        mine = [(start, stop) for start, stop, copy in spans if copy.layer == layer]
        wait = forward.waits.get(layer)
        run = runs.get(layer)
        layers.append({
            "layer": layer,
            "routed_at": at(forward.routed[layer]) if layer in forward.routed else None,
            "copy_start": min(s for s, _ in mine) if mine else None,
            "copy_end": max(e for _, e in mine) if mine else None,
            "copy_ms": sum(e - s for s, e in mine),
            "wait_ms": wait[0].elapsed_time(wait[1]) if wait else 0.0,
            "experts_start": run[0] if run else None,
            "experts_end": run[1] if run else None,
        })
    return {
        "span_ms": end,
        "copy_busy_ms": busy,
        "copy_idle_ms": max(0.0, end - busy),
        "idle_before_first_copy_ms": head,
        "idle_between_copies_ms": sum(g["ms"] for g in between),
        "gaps": len(between),
        "largest_gaps": sorted(between, key=lambda g: -g["ms"])[:LARGEST],
        "idle_after_last_copy_ms": tail,
        "compute_wait_ms": sum(row["wait_ms"] for row in layers),
        "experts_ms": sum(row["experts_end"] - row["experts_start"] for row in layers if row["experts_end"] is not None),
        **layer_phases(layers),
        "layers": layers,
    }


def layer_phases(layers: list[dict[str, Any]]) -> dict[str, float]:
    """Of a summary's ``layers`` (ms, summed over them): from each layer's routing to its experts'
    start (``routing_to_experts_ms``: the host's bookkeeping after the routing sync, the copies'
    wait, and what the compute stream was given before the sync), and from its experts' end to the
    next layer's routing (``experts_to_next_routing_ms``: that layer's attention or GDN and router)."""
    to_experts = to_routing = 0.0
    for row, following in zip(layers, layers[1:] + [None]):
        if row["routed_at"] is not None and row["experts_start"] is not None:
            to_experts += row["experts_start"] - row["routed_at"]
        if following is not None and row["experts_end"] is not None and following["routed_at"] is not None:
            to_routing += following["routed_at"] - row["experts_end"]
    return {"routing_to_experts_ms": to_experts, "experts_to_next_routing_ms": to_routing}


def _gap(start: float, stop: float, copy: _Copy, runs: dict[int, tuple[float, float]]) -> dict[str, Any]:
    """An idle stretch of the copy stream before ``copy``, with the layer whose experts ran most of it."""
    overlap = {layer: min(stop, b) - max(start, a) for layer, (a, b) in runs.items()}
    busy = max(overlap, key=overlap.get, default=None)
    return {
        "ms": stop - start,
        "at_ms": start,
        "before_layer": copy.layer,
        "ahead": copy.ahead,
        "experts_running": busy if busy is not None and overlap[busy] > 0 else None,
    }
