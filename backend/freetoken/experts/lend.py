"""The slots the host lends the zero-copy decode kernels for their read-through fills.

A decode forward reads each missed expert from pinned host memory; with the read-through fill
(``kernels.sparse_moe_decode_offload``'s ``fills``/``lend``) the kernel also writes the bytes it
read into a free slot and maps the expert there, so the miss crosses PCIe once and the next forward
hits. Which slot is the host's choice, made before the forward: it evicts ahead by its policy and
lends the freed slots here; the forward claims them in order, on the device.

The device tensor ``lend`` is ``[claimed, limit, ring...]``: ``claimed`` counts the slots every
forward so far took (the routing launch of each layer advances it, in launch order), ``limit`` the
slots lent so far; slot ``k`` lent is at ``ring[k % len(ring)]``. The host only appends (queued on
the compute stream between steps, so no forward sees a half-written update) and learns the claims
after each forward from its record (``experts.decode_log``): it knows a lower bound of
``claimed``, so it keeps at most ``capacity`` slots outstanding and the ring longer than that, and
never overwrites a position a forward may still claim.

Why a lent slot is safe to write: it was free in the host's table (never mapped, or unmapped by
an eviction queued on the compute stream before the lend, after every forward that may read the
evicted expert there), no copy is pending into it (the eager path's copies complete before its own
forward ends), and the table hands it to nobody else until the claim or ``revoke`` brings it back.
"""

from __future__ import annotations

import torch


class SlotLender:
    def __init__(self, capacity: int, device: torch.device) -> None:
        """``capacity``: the most slots lent and not known claimed."""
        if capacity < 1:
            raise ValueError(f"the read-through fill needs at least one slot to lend, got capacity {capacity}")
        self.capacity = capacity
        self.device = device
        self.lend = torch.zeros(2 + 2 * capacity, dtype=torch.int32, device=device)
        self._ring = 2 * capacity
        self._limit = 0  # slots lent so far (the device's ``limit``)
        self._settled = 0  # claims the host learnt of (<= the device's ``claimed``)
        self._lent: dict[int, int] = {}  # ring position (absolute) -> slot, not known claimed

    @property
    def outstanding(self) -> int:
        """Slots lent and not known claimed (an upper bound of those still free to claim)."""
        return self._limit - self._settled

    def lent(self) -> set[int]:
        """The slots lent and not known claimed (some may be claimed by forwards not settled yet)."""
        return set(self._lent.values())

    def give(self, slots: list[int]) -> None:
        """Lend ``slots`` (free in the host's table) to the next forwards, after those lent already."""
        if not slots:
            return
        if self.outstanding + len(slots) > self.capacity:
            raise ValueError(f"lending {len(slots)} slots would leave more than {self.capacity} outstanding")
        positions = list(range(self._limit, self._limit + len(slots)))
        self._lent.update(zip(positions, slots))
        self._limit += len(slots)
        self._write([2 + p % self._ring for p in positions] + [1], slots + [self._limit])

    def claimed(self, count: int) -> None:
        """A record showed ``count`` more claims (they take the oldest lent slots, in order)."""
        for position in range(self._settled, self._settled + count):
            self._lent.pop(position, None)
        self._settled += count

    def revoke(self) -> list[int]:
        """Take back every slot lent and not claimed, once no forward is in flight and every
        record is settled (reads the device's ``claimed``: a sync). Returns them."""
        if self._limit == self._settled:
            return []
        claimed = int(self.lend[0])
        back = [slot for position, slot in sorted(self._lent.items()) if position >= claimed]
        # Claims no record showed (a forward never collected) stay the device's: their slots hold
        # and map experts the table does not know, so they are not handed out again.
        self._lent.clear()
        self._limit = self._settled = claimed
        self._write([1], [claimed])
        return back

    def _write(self, positions: list[int], values: list[int]) -> None:
        """``lend[positions] = values``, one device op on the compute stream (from pinned memory on
        CUDA: no host sync)."""
        pinned = self.device.type == "cuda"
        index = torch.tensor([positions, values], dtype=torch.int64, pin_memory=pinned)
        index = index.to(self.device, non_blocking=pinned)
        self.lend[index[0]] = index[1].to(torch.int32)
