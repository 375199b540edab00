"""The expert cache on the device: one ``[S, ...]`` tensor per weight part (dense ``w13 [S, 2I, H]``
and ``w2 [S, H, I]``), or for NVFP4 experts one uint8 ``[S, span]`` whose rows hold each slot's six
parts (``experts.span``: ``tensors`` are strided views of it, as the host store's parts are of its
``[E, span]``), the map ``(layer, expert) -> slot``, and the copies that fill slots from host memory:
a slot's fill is one copy a block (the span: one copy of an NVFP4 expert, not six).

On CUDA the copies run on a stream of their own, so the compute stream overlaps them. Two ways
fill slots:

- **Eager** (``fill``; prefill and steps over ``layers.moe.DECODE_MAX_TOKENS`` tokens, which read
  the routed ids on the host): the copy stream first waits for the compute stream (a slot given up
  may still be read by a kernel queued there), the map is updated at once, and the compute stream
  waits for the copies' event (``wait``) before the layer's experts run, so the shared expert
  queued in between overlaps the transfer.
- **Deferred** (``fill_deferred`` then ``commit``; the zero-copy decode forwards, which may be CUDA
  graph replays): their kernels read a mapped expert from its slot and an unmapped one from pinned
  host memory, and the host learns their routed ids only after the step
  (``experts.decode_log``). Every map update is a small device op queued on the compute stream
  between two steps, never inside one.

Why the deferred updates are safe. Invariant: at every moment, in the order the compute stream
runs, ``slot_map[l, e] = s >= 0`` only while slot ``s`` holds all of expert ``(l, e)``'s weights
(and -1 always means: read host memory, which always holds them). Then every read any kernel makes
through the map is of the right weights, whichever value it finds, and since both copies hold the
same values, no result depends on when an update lands. The updates keep it:

1. Evicting ``V`` from slot ``s``: ``slot_map[V] = -1`` is queued on the compute stream, after
   every step already queued (those may still read ``s`` as ``V``: that is still true) and before
   any later one, which sees -1; then an event ``R`` is recorded there: once it completed, no
   kernel reads ``s`` as ``V``.
2. Copying ``X`` into ``s``: the copy stream first waits for ``s``'s ``R`` (none if ``s`` was never
   mapped), so it overwrites ``s`` only once every kernel that could read ``V`` there has
   finished; copies into one slot are in order on the one copy stream.
3. Mapping ``X`` to ``s``: ``commit`` queues on the compute stream a wait for the copy's event,
   then ``slot_map[X] = s``, so in the compute stream's order no kernel finds ``s`` before it holds
   ``X``; until then ``X`` is read from host memory.
4. An expert evicted while its copy is pending is dropped from the pending map writes before its
   slot is handed on (in ``fill`` as in ``fill_deferred``), so no stale ``slot_map[X] = s`` can
   land after ``s`` was given to another expert.

Latency. Step ``N``'s ids are settled while step ``N + 1`` runs (the overlapped loop resolves
``N`` after launching ``N + 1``), so ``N + 1`` misses again what ``N`` missed. The misses of
``N`` take slots evicted one settle earlier (``SlotTable.reserve`` keeps as many free as the last
settle filled), whose ``R`` is behind the step that was then in flight: their copies start at
once, during ``N + 1``, and ``commit`` maps them before ``N + 2`` (its wait costs nothing once the
copies are done, which they are unless they take longer than a step). A copy into a slot evicted
in the same settle waits for ``N + 1`` to end, and is mapped once done (``Event.query``), so
the step after does not stall on it. A miss is thus read from host memory by two steps, then
copied once.

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
        # Deferred fills whose map entry is not written yet: key -> (slot, the copy's event or None,
        # whether the copy started at once: ``commit``).
        self._pending: dict[ExpertKey, tuple[int, torch.cuda.Event | None, bool]] = {}
        self._mapped: dict[ExpertKey, int] = {}  # the host's copy of the map's entries >= 0
        # Slots unmapped by the deferred path: the event after which no step in flight reads them.
        self._released: dict[int, torch.cuda.Event | None] = {}
        self._waits: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # ``commit``'s timed waits
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
        for key in evicted:
            self._pending.pop(key, None)
        for _, slot in placed:  # the copy stream waits for all queued work: any release is covered
            self._released.pop(slot, None)
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

    def fill_deferred(self, fills: list[tuple[int, int, int]], evicted: list[ExpertKey]) -> None:
        """Between steps: unmap ``evicted`` now, copy ``fills`` ((layer, expert, slot)) from host
        memory on the copy stream; ``commit`` maps them (module docstring)."""
        released = [slot for slot in map(self._slot_held, evicted) if slot is not None]
        for key in evicted:
            self._pending.pop(key, None)
        if evicted:
            self._write_map(evicted, [-1] * len(evicted))
        release = None
        if self._stream is not None and released:
            release = torch.cuda.Event()
            release.record(torch.cuda.current_stream(self.device))  # after the -1 writes
        for slot in released:
            self._released[slot] = release
        if not fills:
            return
        if self._stream is None:
            self._copy(fills)
            for layer, expert, slot in fills:
                self._released.pop(slot, None)
                self._pending[(layer, expert)] = (slot, None, True)
            return
        # Slots no step in flight can read first (never mapped, or released by an event that has
        # completed), then those released later: the copy stream waits for their release events.
        events = {slot: self._released.pop(slot, None) for _, _, slot in fills}
        done = {slot: event is None or event.query() for slot, event in events.items()}  # asked once
        clean = [f for f in fills if done[f[2]]]
        later = [f for f in fills if not done[f[2]]]
        with torch.cuda.stream(self._stream):
            for group, is_clean in ((clean, True), (later, False)):
                if not group:
                    continue
                for event in {id(e): e for e in (events[f[2]] for f in group) if e is not None}.values():
                    self._stream.wait_event(event)
                self._copy(group)
                copied = torch.cuda.Event()
                copied.record(self._stream)
                for layer, expert, slot in group:
                    self._pending[(layer, expert)] = (slot, copied, is_clean)

    def _copy(self, fills: list[tuple[int, int, int]]) -> None:
        """Copy each ``(layer, expert, slot)``'s blocks from host memory into the slot, on the current
        stream (asynchronously on CUDA: the host weights are pinned), as one ``_foreach_copy_``:
        one call from Python for the batch instead of an indexing and a ``copy_`` per part (host
        time at a prompt chunk's routing sync, when the GPU waits for the layer's launch)."""
        dsts = [rows[slot] for _, _, slot in fills for rows in self._slot_rows]
        srcs = [rows[expert] for layer, expert, _ in fills for rows in self._host_rows[layer]]
        torch._foreach_copy_(dsts, srcs, non_blocking=self._stream is not None)

    def commit(self, wait: bool = False) -> int:
        """Map the deferred fills: on the compute stream, a wait for each copy's event, then the map
        writes. Taken: fills into clean slots (their copies started when queued and run during the
        step in flight: the next step would seldom wait for them) and the others once their copies
        are done (``Event.query``); all of them with ``wait``. Returns how many of those taken were
        still copying: the next step waits for them on the device (a stall unless they finish
        before the step in flight does)."""
        finished: dict[int, bool] = {}  # one query per event

        def copied(event: torch.cuda.Event | None) -> bool:
            if event is None:
                return True
            if id(event) not in finished:
                finished[id(event)] = event.query()
            return finished[id(event)]

        done = [(key, slot, event) for key, (slot, event, clean) in self._pending.items()
                if wait or clean or copied(event)]
        if not done:
            return 0
        running = sum(1 for _, _, event in done if not copied(event))
        stream = torch.cuda.current_stream(self.device) if self._stream is not None else None
        timed = stream is not None and running > 0
        if timed:  # how long the compute stream waits: timing events on either side of the waits
            before = torch.cuda.Event(enable_timing=True)
            before.record(stream)
        for event in {id(e): e for _, _, e in done if e is not None}.values():
            stream.wait_event(event)
        if timed:
            after = torch.cuda.Event(enable_timing=True)
            after.record(stream)
            self._waits.append((before, after))
        for key, _, _ in done:
            del self._pending[key]
        self._write_map([key for key, _, _ in done], [slot for _, slot, _ in done])
        return running

    def waited_seconds(self) -> float:
        """Device time the compute stream spent waiting for copies at the commits whose waits have
        completed since the last call (the copies on the critical path)."""
        return _drain(self._waits)

    def _slot_held(self, key: ExpertKey) -> int | None:
        """The slot ``key`` is mapped to or being copied into (None: neither)."""
        if key in self._pending:
            return self._pending[key][0]
        return self._mapped.get(key)

    def unmap(self, evicted: list[ExpertKey]) -> None:
        """``slot_map[key] = -1`` for each key evicted ahead of the read-through fill, queued on the
        compute stream: the forwards queued later claim their slots (``experts.lend``)."""
        for key in evicted:
            self._pending.pop(key, None)
        self._write_map(evicted, [-1] * len(evicted))

    def adopt(self, key: ExpertKey, slot: int) -> None:
        """A decode kernel filled ``slot`` with ``key`` and mapped it (the read-through fill): the
        host's copy of the map follows."""
        self._mapped[key] = slot

    def is_pending(self, key: ExpertKey) -> bool:
        """``key`` was given a slot whose copy is not mapped yet."""
        return key in self._pending

    def _write_map(self, keys: list[ExpertKey], values: list[int]) -> None:
        """``slot_map[key] = value`` for each pair, one device op on the compute stream (from pinned
        memory on CUDA: no host sync)."""
        if not keys:
            return
        rows = [layer for layer, _ in keys]
        cols = [expert for _, expert in keys]
        index = to_device([rows, cols, values], self.device)
        self.slot_map[index[0], index[1]] = index[2].to(torch.int32)
        for key, value in zip(keys, values):
            if value < 0:
                self._mapped.pop(key, None)
            else:
                self._mapped[key] = value

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
