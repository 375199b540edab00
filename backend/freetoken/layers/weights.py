"""Where each checkpoint tensor goes: parameters that pack several checkpoint tensors declare
one ``WeightTarget`` per tensor, naming the part of the parameter it fills."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightTarget:
    """The checkpoint tensor fills ``param[index][rows]`` (``index``: an expert, ``rows``: a packed slice),
    after ``convert`` if given (an NVFP4 per-tensor scale becomes one per row)."""

    param: nn.Parameter
    rows: slice | None = None
    index: int | None = None
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Rows no checkpoint holds (padding a GEMM's output to aligned rows): loading and random
    # weights zero them.
    zero: bool = False

    def destination(self) -> torch.Tensor:
        dst = self.param.data
        if self.index is not None:
            dst = dst[self.index]
        if self.rows is not None:
            dst = dst[self.rows]
        return dst


_PARAMETER_DEVICE: ContextVar[torch.device | None] = ContextVar("parameter_device", default=None)


@contextmanager
def parameters_on(device: torch.device | None) -> Iterator[None]:
    """Make ``new_param`` put parameters on ``device`` (``meta``: shapes only) while buffers computed
    at build time still go to the default device: an NVFP4 model is built with its parameters on
    ``meta``, so the linears it quantizes never exist in the activation dtype on the device."""
    token = _PARAMETER_DEVICE.set(device)
    try:
        yield
    finally:
        _PARAMETER_DEVICE.reset(token)


def new_param(*shape: int) -> nn.Parameter:
    """An uninitialised parameter in the current default dtype and device (set while the model is
    built), or on the device of an enclosing ``parameters_on``."""
    return nn.Parameter(torch.empty(*shape, device=_PARAMETER_DEVICE.get()), requires_grad=False)


def packed_targets(
    param: nn.Parameter, prefix: str, parts: list[tuple[str, int]], padding: str | None = None
) -> dict[str, WeightTarget]:
    """Targets for a parameter whose rows are the checkpoint tensors ``parts`` ((name, rows), in
    order); with ``padding``, the rows after them are zero rows under that name."""
    targets, start = {}, 0
    for name, rows in parts:
        targets[f"{prefix}{name}"] = WeightTarget(param, slice(start, start + rows))
        start += rows
    if padding is not None and start < param.shape[0]:
        targets[f"{prefix}{padding}"] = WeightTarget(param, slice(start, param.shape[0]), zero=True)
        start = param.shape[0]
    assert start == param.shape[0], f"packed rows {start} != {param.shape[0]} for {prefix}"
    return targets


def chunked_targets(param: nn.Parameter, name_pattern: str, parts: int) -> dict[str, WeightTarget]:
    """Targets for a parameter stored as ``parts`` row chunks named ``name_pattern.format(i)``.

    The chunks are ``torch.chunk(param, parts)``'s: ``ceil(rows / parts)`` rows each, the last one
    shorter (and fewer chunks when the rows run out), which is how transformers saves
    ``split_ngram_parts`` tables; loading them fills the parameter's rows in order.
    """
    rows = param.shape[0]
    size = -(-rows // parts)
    return {
        name_pattern.format(i): WeightTarget(param, slice(start, min(start + size, rows)))
        for i, start in enumerate(range(0, rows, size))
    }
