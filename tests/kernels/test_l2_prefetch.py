"""``l2_prefetch``: its lanes cover every whole 16-byte unit of each tensor once and nothing outside
it; the launch (hints only) changes no tensor."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE
from freetoken.kernels.l2_prefetch import MAX_TENSORS, l2_prefetch_reference


def _triton():
    from freetoken.kernels.triton import l2_prefetch

    return l2_prefetch


def _covered(lanes: torch.Tensor, index: int) -> list[tuple[int, int]]:
    """Tensor ``index``'s lane ranges, merged where they touch, sorted."""
    rows = lanes[(lanes[:, 0] == index) & (lanes[:, 2] > 0)].tolist()
    merged: list[list[int]] = []
    for _, start, size in sorted(rows, key=lambda r: r[1]):
        if merged and start < merged[-1][1]:
            raise AssertionError(f"tensor {index}: the byte at {start} is prefetched twice")
        if merged and start == merged[-1][1]:
            merged[-1][1] = start + size
        else:
            merged.append([start, start + size])
    return [tuple(m) for m in merged]


# Byte sizes: under one lane's piece, several programs with a partial last one, a tail that is not
# a whole 16 bytes, exactly one program.
@pytest.mark.parametrize("sizes", [(28,), (200_000, 28, 300_001), (131_072,), (4096, 12, 64, 5000)])
def test_lanes_cover_each_tensor_once(sizes):
    tensors = [torch.zeros(n, dtype=torch.uint8, device=DEVICE) for n in sizes]
    kept = [t for t in tensors if t.numel() >= 16]
    lanes = _triton().l2_prefetch_lanes(*tensors)
    for index, t in enumerate(kept):
        assert _covered(lanes, index) == [(0, t.numel() // 16 * 16)]
    assert set(lanes[lanes[:, 2] > 0, 0].tolist()) == set(range(len(kept)))


def test_lanes_skip_what_is_not_contiguous_or_aligned():
    t = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEVICE)
    flat = torch.zeros(1000, dtype=torch.uint8, device=DEVICE)
    lanes = _triton().l2_prefetch_lanes(t[:, :8], flat[1:], t)
    assert _covered(lanes, 0) == [(0, t.numel() * 2)] and len(set(lanes[:, 0].tolist()) - {0}) == 0


@pytest.mark.parametrize("chained", [False, True])
def test_prefetch_changes_nothing(rng, chained):
    tensors = [torch.randn(n, generator=rng).to(DEVICE) for n in (37, 70_000)]
    before = [t.clone() for t in tensors]
    _triton().l2_prefetch(*tensors, chained=chained)
    assert l2_prefetch_reference(*tensors, chained=chained) is None
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_at_most_four_tensors():
    tensors = [torch.zeros(16, device=DEVICE)] * (MAX_TENSORS + 1)
    with pytest.raises(ValueError):
        _triton().l2_prefetch(*tensors)
    with pytest.raises(ValueError):
        l2_prefetch_reference(*tensors)
