"""Shared by the kernel tests: NVFP4 experts laid out as the offloaded store and the expert cache
hold them (``experts.span``), one byte span an expert, the parts strided views of it."""

from __future__ import annotations

import torch

from freetoken.experts.span import SpanLayout


def in_span(parts: list[torch.Tensor], pin: bool = False) -> list[torch.Tensor]:
    """``parts`` (each ``[E, ...]``, one layer's experts) copied into one ``[E, span]`` uint8 buffer
    on their device: the same values, as strided views (expert stride the span)."""
    layout = SpanLayout.of(parts)
    buffer = layout.empty(parts[0].shape[0], parts[0].device, pin=pin)
    buffer.fill_(0xFF)  # the padding between parts is never read: poison it
    views = layout.views(buffer)
    for view, part in zip(views, parts):
        view.copy_(part)
    assert all(not v.is_contiguous() for v in views if v.shape[0] > 1), "the views must be strided"
    return views
