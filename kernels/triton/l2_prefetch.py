"""Triton ``l2_prefetch``: cache hints that pull weight bytes from HBM into L2, issued by a few
one-warp programs (``SPAN`` bytes each, a ``PIECE`` a lane), and ``prefetch_range``, the device
function that other kernels call to prefetch a slice of what a later launch reads
(``moe_decode._gate_up_kernel`` prefetches the down pass's expert rows: ``moe_decode.PREFETCH_DOWN``).

A lane issues one ``cp.async.bulk.prefetch.L2`` (sm_90: the SM's copy engine fetches the bytes
into L2, nothing comes back to the SM, no register is held and nothing is waited for) or, with
``BULK`` off, one ``prefetch.global.L2`` per 128-byte line of its piece. The bytes are spread over
many programs because one SM's copy engine issues its requests one after another. Only whole
16-byte units inside a tensor are prefetched (the bulk form's rule; the tail of a tensor whose size
is not a multiple of 16 is left out): nothing outside the tensor is touched.

Under programmatic dependent launch (``chained``) a program lets the next launch start at once and
waits for the previous launch before issuing: the prefetch does not compete with the previous
launch's stream, and the next launch, which waits for this one, still sees the previous one done.

Under the interpreter no hint is issued (inline assembly does not run there); ``RECORD`` stores
each lane's range instead, which is how the tests check that the lanes cover every byte once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.l2_prefetch import MAX_TENSORS
from freetoken.kernels.triton._common import INTERPRETED, device_function

LANES = 32  # one warp a program
PIECE = 4096  # bytes a lane: one bulk prefetch, or 32 line prefetches
SPAN = LANES * PIECE  # bytes a program
# One bulk prefetch a lane (True), or a line prefetch a 128-byte line (False): the A/B switch.
BULK = True
ISSUE: tl.constexpr = tl.constexpr(not INTERPRETED)


@device_function
def _issue(address, size, PIECE: tl.constexpr, BULK: tl.constexpr):
    """Prefetch ``size`` bytes (at most ``PIECE``) at each of ``address`` (int64 tensors; ``size`` a
    multiple of 16, nothing where it is not positive)."""
    if BULK:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [address, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )
    else:
        for line in tl.static_range(0, PIECE, 128):
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [address + line, (size - line).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
            )


@device_function
def prefetch_range(address, start, end, LANES: tl.constexpr, PIECE: tl.constexpr, BULK: tl.constexpr):
    """Prefetch bytes ``[start, end)`` past ``address`` (int64, 16-byte aligned; ``start`` a
    multiple of 16), lane ``i`` of ``LANES`` the ``PIECE`` bytes from ``start + i · PIECE`` (a
    multiple of 16; bytes past ``start + LANES · PIECE`` are left out). Returns each lane's offset
    and size (size <= 0: nothing)."""
    lo = start + tl.arange(0, LANES).to(tl.int64) * PIECE
    size = tl.minimum(end - lo, PIECE) // 16 * 16
    if ISSUE:
        _issue(address + lo, size, PIECE, BULK)
    return lo, size


@triton.jit
def _l2_prefetch_kernel(
    a0, n0, a1, n1, a2, n2, a3, n3, c1, c2, c3, record_ptr,
    LANES: tl.constexpr, PIECE: tl.constexpr, BULK: tl.constexpr, PDL: tl.constexpr, RECORD: tl.constexpr,
):
    if PDL:  # the next launch may start; the bytes are fetched once the previous launch is done
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # Programs [0, c1) take tensor 0, [c1, c2) tensor 1, ...: SPAN bytes each, in order.
    pid = tl.program_id(0)
    r1, r2, r3 = pid >= c1, pid >= c2, pid >= c3
    address = tl.where(r3, a3, tl.where(r2, a2, tl.where(r1, a1, a0)))
    nbytes = tl.where(r3, n3, tl.where(r2, n2, tl.where(r1, n1, n0)))
    part = pid - tl.where(r3, c3, tl.where(r2, c2, tl.where(r1, c1, 0)))
    start = part.to(tl.int64) * (LANES * PIECE)
    lo, size = prefetch_range(address, start, tl.minimum(start + LANES * PIECE, nbytes), LANES, PIECE, BULK)
    if RECORD:
        tensor = tl.where(r3, 3, tl.where(r2, 2, tl.where(r1, 1, 0)))
        lane = pid * LANES + tl.arange(0, LANES)
        tl.store(record_ptr + lane * 3, tensor + 0 * lo)
        tl.store(record_ptr + lane * 3 + 1, lo)
        tl.store(record_ptr + lane * 3 + 2, tl.maximum(size, 0))


def _ranges(tensors: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor, rounded down to whole 16-byte units; a tensor that is not
    contiguous or not 16-byte aligned is left out (a hint: nothing depends on it)."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"l2_prefetch takes at most {MAX_TENSORS} tensors, got {len(tensors)}")
    ranges = []
    for t in tensors:
        nbytes = t.numel() * t.element_size() // 16 * 16
        if t.is_contiguous() and t.data_ptr() % 16 == 0 and nbytes:
            ranges.append((t.data_ptr(), nbytes))
    return ranges


def _launch(tensors: tuple[torch.Tensor, ...], chained: bool, record: torch.Tensor | None) -> int:
    """Launches the prefetch of ``tensors``; returns its program count (0: nothing to fetch)."""
    ranges = _ranges(tensors)
    if not ranges:
        return 0
    counts = [triton.cdiv(nbytes, SPAN) for _, nbytes in ranges]
    bounds = [sum(counts[: i + 1]) for i in range(len(counts))]
    total = bounds[-1]
    # Unused slots: empty ranges after the last program (never selected).
    ranges += [(ranges[-1][0], 0)] * (MAX_TENSORS - len(ranges))
    bounds += [total] * (MAX_TENSORS - len(bounds))
    from freetoken.kernels.triton.moe_decode import _pdl_available  # moe_decode imports this module

    pdl = chained and _pdl_available()
    args = [value for address, nbytes in ranges for value in (address, nbytes)]
    _l2_prefetch_kernel[(total,)](
        *args, bounds[0], bounds[1], bounds[2], record if record is not None else tensors[0],
        LANES=LANES, PIECE=PIECE, BULK=BULK, PDL=pdl, RECORD=record is not None,
        num_warps=1, launch_pdl=pdl,
    )
    return total


def l2_prefetch(first: torch.Tensor, *more: torch.Tensor, chained: bool = False) -> None:
    _launch((first, *more), chained, None)


def l2_prefetch_lanes(first: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """The launch's lane ranges, ``[lanes, 3]`` int64 rows of (tensor index among those
    prefetched, byte offset, bytes), as its programs compute them (the tests' view of the split)."""
    tensors = (first, *more)
    programs = sum(triton.cdiv(nbytes, SPAN) for _, nbytes in _ranges(tensors))
    record = torch.full((max(programs, 1) * LANES, 3), -1, dtype=torch.int64, device=first.device)
    _launch(tensors, False, record)
    return record[: programs * LANES]
