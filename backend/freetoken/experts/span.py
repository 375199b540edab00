"""One expert's weight parts as one contiguous byte span.

An NVFP4 expert is six tensors (``w13``'s packed codes, e4m3 block scales and float32 row scales, the
same three of ``w2``). Copied part by part, each expert costs six ``cudaMemcpyAsync`` of ~8 us fixed
cost each: 21.6 GB/s over PCIe on the H200 against 50.7 GB/s for one copy of the whole expert
(``benchmarks/pcie_expert_copy.py --nvfp4``, docs/benchmarks.md). So the offloaded store (pinned host
memory, ``[E, span]``) and the device expert cache (``[S, span]``) each keep a layer's experts as one
uint8 tensor, one row an expert, and the parts are strided views of it: part ``i`` of expert ``e``
starts at byte ``e * span + offsets[i]``. Each part's inner dims stay contiguous (its rows as in a
tensor of its own); only its expert (dim 0) stride is ``span`` bytes, which the kernels take.

Every offset and the span are multiples of ``ALIGN`` bytes, so each part of each expert starts on a
128-byte boundary (a float32 view needs 4; vector loads and Triton's pointer specialisation want 16).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 128


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class SpanLayout:
    """Where each part of one expert lies in its span: ``shapes`` (a part's shape without the expert
    dim), ``dtypes``, byte ``offsets``, and ``nbytes`` (the span, padding included)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, parts: Sequence[torch.Tensor]) -> SpanLayout:
        """The layout of ``parts``, each ``[E, ...]`` (one layer's; only shapes and dtypes are read)."""
        if not parts:
            raise ValueError("SpanLayout.of: parts is empty (an expert needs at least one weight part)")
        shapes = tuple(tuple(p.shape[1:]) for p in parts)
        dtypes = tuple(p.dtype for p in parts)
        offsets, end = [], 0
        for shape, dtype in zip(shapes, dtypes):
            offsets.append(end)
            end += _aligned(math.prod(shape) * dtype.itemsize)
        return cls(shapes, dtypes, tuple(offsets), end)

    def empty(self, rows: int, device: torch.device | str, pin: bool = False) -> torch.Tensor:
        """An uninitialised ``[rows, nbytes]`` uint8 buffer (``pin``: page-locked host memory)."""
        return torch.empty((rows, self.nbytes), dtype=torch.uint8, device=device, pin_memory=pin)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The parts of ``buffer`` (``[N, nbytes]`` uint8, rows contiguous), each ``[N, *shape]`` in
        its dtype, expert stride ``nbytes / itemsize`` elements: views, no copy."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != self.nbytes or (
            buffer.shape[0] > 1 and buffer.stride() != (self.nbytes, 1)
        ):
            raise ValueError(
                f"SpanLayout.views: buffer {tuple(buffer.shape)} {buffer.dtype} strides {buffer.stride()} is not a "
                f"contiguous [N, {self.nbytes}] uint8 span buffer"
            )
        parts = []
        for shape, dtype, offset in zip(self.shapes, self.dtypes, self.offsets):
            size = math.prod(shape) * dtype.itemsize
            parts.append(buffer[:, offset : offset + size].view(dtype).unflatten(1, shape))
        return parts

    def holds(self, buffer: torch.Tensor, parts: Sequence[torch.Tensor]) -> bool:
        """``parts`` are ``views(buffer)`` (the same places, shapes, strides and dtypes)."""
        if buffer.dim() != 2 or buffer.shape[1] != self.nbytes or len(parts) != len(self.offsets):
            return False
        return all(
            p.data_ptr() == v.data_ptr() and p.shape == v.shape and p.stride() == v.stride() and p.dtype == v.dtype
            for p, v in zip(parts, self.views(buffer))
        )
