"""Shared by the GPU tests: capturing launches into a CUDA graph and replaying it with the outputs
poisoned, so a launch that skipped an element, or read its input before the launch it depends on
finished, fails on replay; random inputs and NVFP4 weights on the device; the Triton modules
imported when a test runs (never at collection, where there may be no GPU)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TypeVar

import torch

T = TypeVar("T")
CUDA = torch.device("cuda")


def randn(rng: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=rng, device=CUDA) * scale).to(dtype)


def triton_module(module: str) -> ModuleType:
    """``freetoken.kernels.triton.<module>``."""
    return importlib.import_module(f"freetoken.kernels.triton.{module}")


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


def random_nvfp4(rng: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 weights of ``shape`` (``..., rows, cols``) drawn from the CPU generator ``rng`` and moved
    to the GPU: codes of every byte value, normal e4m3 scales (1/8 to 3.75), row scales near
    ``0.1 / sqrt(cols)``."""
    *lead, rows, cols = shape
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), generator=rng, dtype=torch.uint8)
    scales = torch.randint(0x20, 0x48, (*lead, rows, cols // 16), generator=rng, dtype=torch.uint8).view(torch.float8_e4m3fn)
    row_scales = torch.rand(*lead, rows, generator=rng) * cols**-0.5 * 0.1 + 1e-3
    return packed.to(CUDA), scales.to(CUDA), row_scales.to(CUDA)
