"""The expert cache on the device: one ``[S, ...]`` tensor per weight part (``w13 [S, 2I, H]`` and
``w2 [S, H, I]``, or NVFP4's packed codes and scales of each), the map ``(layer, expert) -> slot``,
and the copies that fill slots from host memory.

On CUDA the copies run on a stream of their own: it first waits for the compute stream (a slot
given up may still be read by a kernel queued there), and the compute stream waits for the copies'
event before the experts run, so whatever the compute stream queued in between (the shared expert)
overlaps the transfer. On the CPU the copies are plain copies.
"""

from __future__ import annotations

import torch

from freetoken.experts.eviction import ExpertKey


class DeviceSlots:
    def __init__(self, parts: list[torch.Tensor], num_slots: int, num_layers: int, device: torch.device) -> None:
        """``parts``: one layer's host weight parts, each ``[E, ...]`` (every layer's have these shapes)."""
        self.device = device
        num_experts = parts[0].shape[0]
        self.tensors = [torch.empty((num_slots, *p.shape[1:]), dtype=p.dtype, device=device) for p in parts]
        # A cache larger than one layer's experts scatters a layer over more slots than it has
        # experts; ``gather`` then packs them here (see ``span``).
        staging_rows = num_experts if num_slots > num_experts else 0
        self.staging = [torch.empty((staging_rows, *p.shape[1:]), dtype=p.dtype, device=device) for p in parts]
        self.slot_map = torch.full((num_layers, parts[0].shape[0]), -1, dtype=torch.int32, device=device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: torch.cuda.Event | None = None
        self._ahead: dict[int, list[torch.cuda.Event]] = {}  # layer -> its prefetches' copies

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + sum(t.nbytes for t in self.staging)

    def gather(self, slots: list[int]) -> list[torch.Tensor]:
        """The staging rows (one layer's experts) with row ``i`` holding slot ``slots[i]`` (at most one
        layer's experts; device-to-device copies); the rows after are stale."""
        index = torch.tensor(slots, dtype=torch.int64).to(self.device)
        rows = len(slots)
        for t, s in zip(self.tensors, self.staging):
            torch.index_select(t, 0, index, out=s[:rows])
        return self.staging  # all rows: the kernels always see one layer's experts

    def fill(self, layer: int, host_parts: list[torch.Tensor], placed: list[tuple[int, int]],
             evicted: list[ExpertKey], ahead: bool = False) -> None:
        """Copy ``layer``'s experts into their slots (``placed``: (expert, slot)) and update the map.
        ``ahead``: a prefetch for a later layer, which only that layer's ``wait`` waits for."""
        if not placed:
            return
        if self._stream is None:
            for expert, slot in placed:
                for dst, src in zip(self.tensors, host_parts):
                    dst[slot].copy_(src[expert])
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for expert, slot in placed:
                    for dst, src in zip(self.tensors, host_parts):
                        dst[slot].copy_(src[expert], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            if ahead:
                self._ahead.setdefault(layer, []).append(event)
            else:
                self._ready = event
        rows = [k[0] for k in evicted] + [layer] * len(placed)
        cols = [k[1] for k in evicted] + [e for e, _ in placed]
        values = [-1] * len(evicted) + [s for _, s in placed]
        index = torch.tensor([rows, cols, values], dtype=torch.int64).to(self.device)
        self.slot_map[index[0], index[1]] = index[2].to(torch.int32)

    def wait(self, layer: int) -> None:
        """The compute stream waits for ``layer``'s copies queued so far (before it reads the slots)."""
        events = self._ahead.pop(layer, [])
        if self._ready is not None:
            events.append(self._ready)
            self._ready = None
        for event in events:
            torch.cuda.current_stream(self.device).wait_event(event)

    def slot_ids(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """``expert_ids`` (any shape) of ``layer`` -> their slots, int32, on the device."""
        return self.slot_map[layer][expert_ids.long()]
