"""Shared by the GPU tests: capturing launches into a CUDA graph and replaying it with the outputs
poisoned, so a launch that skipped an element, or read its input before the launch it depends on
finished, fails on replay."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture_graph(launches: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Runs ``launches`` once eagerly, so Triton compiles outside the capture, then captures them:
    the graph and what the captured call returned (the buffers every replay writes)."""
    launches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = launches()
    return graph, outs


def replay(graph: torch.cuda.CUDAGraph, poison: Iterable[torch.Tensor] = (), value: float = float("nan")) -> None:
    """Fills each of ``poison`` with ``value`` (NaN; -1 for integer outputs), replays and waits."""
    for t in poison:
        t.fill_(value)
    graph.replay()
    torch.cuda.synchronize()
