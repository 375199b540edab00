"""Timing a chain of launches as a decode step runs it: captured once in a CUDA graph, replayed."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_us(run: Callable[[], object], calls: int, replays: int = 20) -> float:
    """Median replay time, in us per call, of ``run`` (``calls`` calls) captured in one CUDA graph;
    ``run`` is called once before the capture, on a side stream (compiles, warms up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
