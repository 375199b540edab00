"""The expert cache on the device: one ``[S, ...]`` tensor per weight part (dense ``w13 [S, 2I, H]``
and ``w2 [S, H, I]``), or for NVFP4 experts one uint8 ``[S, span]`` whose rows hold each slot's six
parts (``experts.span``: ``tensors`` are strided views of it, as the host store's parts are of its
``[E, span]``), the map ``(layer, expert) -> slot``, and the copies that fill slots from host memory:
a slot's fill is one copy a block (the span: one copy of an NVFP4 expert, not six).

On CUDA the copies run on a stream of their own, so the compute stream overlaps them. Two paths
change the map:

- **Eager** (``fill`` then ``wait``; prefill and steps over ``layers.moe.DECODE_MAX_TOKENS`` tokens,
  which read the routed ids on the host): the copy stream first waits for the compute stream (a
  slot given up may still be read by a kernel queued there), the map is updated at once, and the
  compute stream waits for the copies' event (``wait``) before the layer's experts run, so the
  shared expert queued in between overlaps the transfer.
- **Read-through** (the zero-copy decode forwards, which may be CUDA graph replays): their kernels
  read a mapped expert from its slot and an unmapped one from pinned host memory, and write each
  miss into a slot the host lent them before the step, mapping it there themselves
  (``experts.lend``). The host learns their routed ids and claims only after the step
  (``experts.decode_log``); its own map writes for them, the
  experts evicted to free the slots it lends (``unmap``), are small device ops queued on the
  compute stream between two steps, never inside one. No copy is made for them.

The invariant: at every moment, in the order the compute stream runs, ``slot_map[l, e] = s >= 0``
only while slot ``s`` holds all of expert ``(l, e)``'s weights (and -1 always means: read host
memory, which always holds them), for every kernel that reads through the map. Then every read is
of the right weights, whichever value it finds, and since both copies hold the same values, no
result depends on when an update lands. The read-through path keeps it:

1. Evicting ``V`` from slot ``s`` to lend ``s``: ``slot_map[V] = -1`` is queued on the compute
   stream (``unmap``) before the lend's own write (``SlotLender.give``): after every step already
   queued (those may still read ``s`` as ``V``: that is still true, and they finish before any
   later step starts) and before every forward that can claim ``s``, which sees -1.
2. Filling ``X`` into lent ``s``: the routing launch of ``X``'s layer claims ``s`` and writes
   ``slot_map[X] = s``; the same layer's gate/up and down programs go by the routing launch's
   codes (``X`` a miss: read from host memory, and stored into ``s``), not by the map, and the
   next reader of the entry, the same layer's routing launch in a later step, runs after those
   programs finished. The table hands ``s`` to nobody else until the claim is booked (``claim``)
   or the slot is taken back unclaimed (``SlotLender.revoke``), and no copy into ``s`` is
   pending (the eager path's copies complete before its own forward ends).

The eager path keeps the invariant for every kernel that can observe the map: its ``slot_map[X] =
s`` lands before the copy is done, but the only kernels queued between that write and ``wait``
are the layer's shared expert and prefetch bookkeeping, which do not read slots, and, for the next
layer's streamed experts (queued at this layer's routing, before its launch), this layer's experts,
which read only this layer's map entries and slots (never a victim of the stream: ``running``). A
layer streamed further ahead (``ExpertOffload.stream_depth`` > 1: at layer ``L``'s routing, layers
up to ``L + D``) has, queued between its map write and its wait, the layers in between too: each
reads only its own entries and slots, and none of those is a victim of the farther layer's copies
(``stream_ahead`` protects every expert of the pending layers nearer than the one it streams). The
other way round, a nearer layer's misses (``admit``) may take a farther layer's streamed expert's
slot: its -1 is written before the farther layer's wait, and the nearer copy into the slot runs after
the streamed one on the one copy stream, so the farther layer finds the expert uncached and copies
it in again (a wasted copy, never a wrong read). On the CPU the copies are plain copies and the
same updates run in the same order.
"""

from __future__ import annotations

from collections import deque

import torch

from freetoken.experts.eviction import ExpertKey
from freetoken.experts.span import SpanLayout
from freetoken.experts.timeline import PrefillTimeline


class DeviceSlots:
    def __init__(self, host_blocks: list[list[torch.Tensor]], num_slots: int, device: torch.device,
                 layout: SpanLayout | None = None) -> None:
        """``host_blocks[layer]``: what a fill of that layer copies, each ``[E, ...]`` (every layer's
        have the first layer's shapes): its weight parts, or with ``layout`` (NVFP4 experts) the one
        uint8 ``[E, span]`` the parts are views of, and the slots are laid out alike."""
        self.device = device
        blocks = host_blocks[0]
        num_experts, num_layers = blocks[0].shape[0], len(host_blocks)
        if layout is None:
            self._blocks = [torch.empty((num_slots, *p.shape[1:]), dtype=p.dtype, device=device) for p in blocks]
            self.tensors = self._blocks
        else:
            self._blocks = [layout.empty(num_slots, device)]
            self.tensors = layout.views(self._blocks[0])
        # Every slot's and every host expert's block as a view made once: a fill then indexes tuples
        # and queues its copies in one call (``_copy``), no tensor indexing per block.
        self._slot_rows = [t.unbind(0) for t in self._blocks]
        self._host_rows = [[p.unbind(0) for p in layer_blocks] for layer_blocks in host_blocks]
        self.slot_map = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: torch.cuda.Event | None = None
        self._ahead: dict[int, list[torch.cuda.Event]] = {}  # layer -> its prefetches' copies
        # The eager path's timing events (``eager_seconds``): each batch of copies on the copy
        # stream, and each wait of the compute stream for them.
        self._copy_spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._eager_waits: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.timeline: PrefillTimeline | None = None  # set by ``ExpertOffload.record_timeline`` (CUDA)

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        return self._stream

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._blocks)

    def fill(self, layer: int, placed: list[tuple[int, int]], evicted: list[ExpertKey], ahead: bool = False) -> None:
        """Copy ``layer``'s experts into their slots (``placed``: (expert, slot)) and update the map.
        ``ahead``: a prefetch for a later layer, which only that layer's ``wait`` waits for."""
        if not placed:
            return
        if self._stream is None:
            self._copy([(layer, expert, slot) for expert, slot in placed])
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record(self._stream)  # once the copies queued before are done: this batch alone
                self._copy([(layer, expert, slot) for expert, slot in placed])
                event = torch.cuda.Event(enable_timing=True)
                event.record(self._stream)
            self._copy_spans.append((start, event))
            if self.timeline is not None:
                self.timeline.copy(layer, ahead, start, event)
            if ahead:
                self._ahead.setdefault(layer, []).append(event)
            else:
                self._ready = event
        self._write_map(evicted + [(layer, e) for e, _ in placed], [-1] * len(evicted) + [s for _, s in placed])

    def _copy(self, fills: list[tuple[int, int, int]]) -> None:
        """Copy each ``(layer, expert, slot)``'s blocks from host memory into the slot, on the current
        stream (asynchronously on CUDA: the host weights are pinned), as one ``_foreach_copy_``:
        one call from Python for the batch instead of an indexing and a ``copy_`` per part (host
        time at a prompt chunk's routing sync, when the GPU waits for the layer's launch)."""
        dsts = [rows[slot] for _, _, slot in fills for rows in self._slot_rows]
        srcs = [rows[expert] for layer, expert, _ in fills for rows in self._host_rows[layer]]
        torch._foreach_copy_(dsts, srcs, non_blocking=self._stream is not None)

    def unmap(self, evicted: list[ExpertKey]) -> None:
        """``slot_map[key] = -1`` for each key evicted ahead of the read-through fill, queued on the
        compute stream: the forwards queued later claim their slots (``experts.lend``)."""
        self._write_map(evicted, [-1] * len(evicted))

    def _write_map(self, keys: list[ExpertKey], values: list[int]) -> None:
        """``slot_map[key] = value`` for each pair, one device op on the compute stream (from pinned
        memory on CUDA: no host sync)."""
        if not keys:
            return
        rows = [layer for layer, _ in keys]
        cols = [expert for _, expert in keys]
        index = to_device([rows, cols, values], self.device)
        self.slot_map[index[0], index[1]] = index[2].to(torch.int32)

    def wait(self, layer: int) -> None:
        """The compute stream waits for ``layer``'s copies queued so far (before it reads the slots)."""
        events = self._ahead.pop(layer, [])
        if self._ready is not None:
            events.append(self._ready)
            self._ready = None
        if not events:
            return
        stream = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event(enable_timing=True)
        before.record(stream)
        for event in events:
            stream.wait_event(event)
        after = torch.cuda.Event(enable_timing=True)
        after.record(stream)
        self._eager_waits.append((before, after))
        if self.timeline is not None:
            self.timeline.wait(layer, before, after)

    def eager_seconds(self) -> tuple[float, float]:
        """Of the eager path's copies whose events have completed since the last call: device time
        the copy stream spent copying (PCIe busy: each batch timed from the end of what the copy
        stream ran before it), and time the compute stream waited for them (the copies not hidden
        behind compute). Zero on the CPU, which has no copy stream."""
        return _drain(self._copy_spans), _drain(self._eager_waits)


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a tensor on ``device``, from pinned memory on CUDA: queued on the current
    stream without a host sync (a pageable ``.to(device)`` waits for the stream)."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


def _drain(spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    """Seconds between each pair of timing events, for the pairs completed (oldest first), removed."""
    seconds = 0.0
    while spans and spans[0][1].query():
        before, after = spans.popleft()
        seconds += before.elapsed_time(after) * 1e-3
    return seconds
