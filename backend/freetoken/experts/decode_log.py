"""The routed ids of the zero-copy decode forwards (``kernels.sparse_moe_decode_offload``), on their
way to the host.

Each offloaded layer's decode kernel writes its (token, choice) experts into one persistent device
buffer ``[layers, max decode tokens, top_k]`` (a miss as ``-1 - e``), at addresses fixed for the
life of the engine, so CUDA graph replays write it too; with the read-through fill, also the slot
each (token, choice) claimed for its miss (-1: none) into a second such buffer. After each such
forward ``collect`` queues their copy into pinned host memory on the compute stream (so the next
forward cannot overwrite them first) with an event, then clears the claims (a forward writes only
its own rows: rows past them must not repeat an older forward's claims); ``ready`` hands the
records over in order once their copies landed, without waiting: by the time the overlapped loop
resolves a step, its records are there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.experts.eviction import ExpertKey


@dataclass
class RoutedRecord:
    ids: torch.Tensor  # host [layers, max tokens, top_k] int32; rows past num_tokens are stale
    num_tokens: int  # the forward's real tokens (a graph's padding rows are not uses)
    event: torch.cuda.Event | None
    fills: torch.Tensor | None = None  # host [layers, max tokens, top_k] int32: slots claimed, -1 elsewhere

    def uses(self) -> tuple[list[ExpertKey], np.ndarray]:
        """The forward's distinct routed ``(layer, expert)``, layer by layer and in routing order
        within a layer, and whether the kernel read each from a slot (a hit: its first read) or
        from host memory. Vectorised over every layer at once: the host settles a record every
        step, and a Python loop over 40 layers' ids cost most of a millisecond of it."""
        codes = self.ids[:, : self.num_tokens].numpy().reshape(self.ids.shape[0], -1)
        width = codes.shape[1]
        flat = codes.ravel()
        experts = np.where(flat >= 0, flat, -1 - flat)
        reads = np.arange(flat.size)
        if self.num_tokens > 1:  # a token's top-k are distinct, tokens share experts: the first read decides
            _, reads = np.unique(reads // width * (int(experts.max()) + 1) + experts, return_index=True)
            reads.sort()
        keys = list(zip((reads // width).tolist(), experts[reads].tolist()))
        return keys, flat[reads] >= 0

    def claims(self) -> list[tuple[int, int, int]]:
        """``(layer, expert, slot)`` of each read-through fill of the forward, padding rows' too
        (their kernels filled those slots alike), in (layer, row, choice) order."""
        if self.fills is None:
            return []
        fills = self.fills.numpy()
        where = np.nonzero(fills >= 0)
        experts = -1 - self.ids.numpy()[where]
        return list(zip(where[0].tolist(), experts.tolist(), fills[where].tolist()))

    def missed_pairs(self) -> int:
        """(layer, token, choice) entries read from host memory: each streamed its expert's rows
        over PCIe (the kernels read an expert once per (token, choice))."""
        return int(np.count_nonzero(self.ids[:, : self.num_tokens].numpy() < 0))


class RoutedLog:
    def __init__(self, num_layers: int, max_tokens: int, top_k: int, device: torch.device,
                 read_through: bool = False) -> None:
        self.max_tokens = max_tokens
        self.device = device
        # [0]: the routed ids; [1] (read-through fill only): the slots claimed.
        self._both = torch.full((2 if read_through else 1, num_layers, max_tokens, top_k), -1, dtype=torch.int32,
                                device=device)
        self.buffer = self._both[0]
        self.fills = self._both[1] if read_through else None
        self._records: deque[RoutedRecord] = deque()

    def out(self, layer: int, num_tokens: int) -> torch.Tensor:
        """Where layer ``layer``'s kernel writes the routed ids of a forward of ``num_tokens``."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"a zero-copy decode forward has at most {self.max_tokens} tokens, got {num_tokens}")
        return self.buffer[layer, :num_tokens]

    def fills_out(self, layer: int, num_tokens: int) -> torch.Tensor:
        """Where layer ``layer``'s kernel writes the slots its misses claimed (read-through fill)."""
        assert self.fills is not None, "the log was made without the read-through fill"
        self.out(layer, num_tokens)  # the same bound
        return self.fills[layer, :num_tokens]

    def collect(self, num_tokens: int) -> None:
        """After a forward that ran the decode kernels: queue its routed ids (the first
        ``num_tokens`` rows of every layer) to the host."""
        cuda = self.device.type == "cuda"
        host = torch.empty(self._both.shape, dtype=torch.int32, pin_memory=cuda)
        host.copy_(self._both, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        if self.fills is not None:
            self.fills.fill_(-1)  # after the copy, on the same stream
        self._records.append(RoutedRecord(host[0], num_tokens, event, host[1] if self.fills is not None else None))

    def ready(self, wait: bool = False) -> Iterator[RoutedRecord]:
        """The records whose copies landed, oldest first; stops at the first still in flight
        (``wait``: waits for every one instead)."""
        while self._records:
            record = self._records[0]
            if record.event is not None:
                if wait:
                    record.event.synchronize()
                elif not record.event.query():
                    return
            self._records.popleft()
            yield record
