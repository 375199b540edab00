"""Persistent device inputs of a step, filled from one pinned staging buffer by one copy.

Every per-token and per-row input of ``ForwardBatch`` lives at a fixed device address, sized for
the largest step (``max_rows`` requests, ``max_tokens`` tokens). A step of ``B`` rows and ``T``
tokens is the view of the first ``B`` rows / ``T`` tokens, so a CUDA graph captured over
``decode_view(B)`` replays any later decode step of ``B`` (padded) rows.

The host builds a step's inputs with numpy and packs what the step uses of each, back to back, in
a pinned staging buffer; one host->device copy moves those bytes (a few KB for a decode step) to a
device landing buffer, and one ``_foreach_copy_`` per dtype puts each array in its persistent buffer. Two
staging buffers alternate, so the CPU writes step N+1's while step N's copy may still be pending;
an event says when a staging buffer may be written again.

The page table lives on the device as ``[num_slots, max_pages_per_slot]`` int32, indexed by
state slot, and changes only where a plan adds pages (one scatter). ``ForwardBatch.page_table`` is
its rows gathered by the step's state slots into a persistent ``[max_rows, max_pages_per_slot]``
buffer (one ``index_select``), so attention kernels keep indexing by batch row. A host mirror of
the table gives the KV write location of each new token without reading the device.

Padding rows (``stage(plan, pad_to=...)``) point at the reserved scratch entries: state slot 0,
page 0 (slot 0's page-table row is all zeros and never written), position 0, one token each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from freetoken.batch import ForwardBatch
from freetoken.plan import StepPlan

# The persistent inputs: (name, dtype, capacity key), "T" max tokens, "B" max rows, "B1" max rows + 1.
_INPUTS = (
    ("input_ids", torch.int64, "T"),  # staged -1: take the slot's last sampled token
    ("positions", torch.int64, "T"),
    ("kv_locations", torch.int64, "T"),
    ("logits_indices", torch.int64, "T"),
    ("cu_seqlens", torch.int32, "B1"),
    ("seq_lens", torch.int32, "B"),
    ("state_slots", torch.int32, "B"),
    ("sample_slots", torch.int32, "T"),  # state slot of each logits row (0 where none samples)
)
_DTYPES = {name: dtype for name, dtype, _ in _INPUTS} | {"page_index": torch.int64, "page_values": torch.int32}
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


@dataclass
class StagedStep:
    """A step's device batch and, per logits row, the state slot to sample into."""

    batch: ForwardBatch
    sample_slots: torch.Tensor  # [N] int32 device view
    # For each logits row, the index of the plan's sampling row it is, or -1 (padding or a row
    # that does not sample).
    sampled_rows: list[int]


class StepBuffers:
    def __init__(
        self,
        max_rows: int,
        max_tokens: int,
        num_slots: int,
        max_pages_per_slot: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.max_rows, self.max_tokens, self.page_size = max_rows, max_tokens, page_size
        self.max_pages_per_slot = max_pages_per_slot
        self.device = device
        capacity = {"T": max_tokens, "B": max_rows, "B1": max_rows + 1}
        self.inputs = {
            name: torch.zeros(capacity[key], dtype=dtype, device=device) for name, dtype, key in _INPUTS
        }
        # One step's packed bytes: every input at capacity, and the page updates of rows that add
        # at most num_new / page_size + 1 pages each. A prefix hit adds its cached pages too (any
        # number, up to max_pages_per_slot a row): such a step grows the buffers (``_grow``).
        page_updates = max_tokens // page_size + max_rows + 1
        self._staging: list[torch.Tensor] = []
        self._staging_np: list[np.ndarray] = []
        self._staging_free: list[torch.cuda.Event | None] = []
        self._landing = torch.zeros(0, dtype=torch.uint8, device=device)
        self._grow(sum(t.numel() * t.element_size() + 8 for t in self.inputs.values()) + 12 * page_updates + 16)
        self._next = 0
        self.page_table = torch.zeros(num_slots, max_pages_per_slot, dtype=torch.int32, device=device)
        self._page_mirror = np.zeros((num_slots, max_pages_per_slot), dtype=np.int64)
        self.page_rows = torch.zeros(max_rows, max_pages_per_slot, dtype=torch.int32, device=device)

    # ----- views -----

    def decode_view(self, num_rows: int) -> ForwardBatch:
        """The fixed-shape batch of a decode step of ``num_rows`` rows (what a graph captures);
        its logits rows are all ``num_rows`` rows."""
        return self._view(num_rows, num_rows, num_rows, num_rows, [1] * num_rows)

    def _view(
        self, rows: int, tokens: int, logits: int, num_decodes: int, query_lens: list[int], max_seq_len: int | None = None
    ) -> ForwardBatch:
        """``max_seq_len`` defaults to the static bound (the page-table width), as a graph needs."""
        inputs = self.inputs
        return ForwardBatch(
            input_ids=inputs["input_ids"][:tokens],
            positions=inputs["positions"][:tokens],
            cu_seqlens=inputs["cu_seqlens"][: rows + 1],
            seq_lens=inputs["seq_lens"][:rows],
            page_table=self.page_rows[:rows],
            kv_locations=inputs["kv_locations"][:tokens],
            state_slots=inputs["state_slots"][:rows],
            logits_indices=inputs["logits_indices"][:logits],
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            query_lens=query_lens,
            max_seq_len=max_seq_len or self.max_pages_per_slot * self.page_size,
        )

    # ----- staging -----

    def stage(
        self,
        plan: StepPlan,
        last_tokens: torch.Tensor,
        pad_to: int | None = None,
        all_logits: bool = False,
    ) -> StagedStep:
        """Write ``plan``'s inputs to the device: one copy, then the page-table scatter, decode
        tokens from ``last_tokens`` (the per-slot last-token pool) and the page-row gather.

        ``pad_to`` pads a decode-only plan to that many rows (logits for every row);
        ``all_logits`` asks for logits at every token (prompt logits) instead of sampling rows.
        """
        rows = plan.rows
        num_rows = len(rows)
        if not 0 < num_rows <= self.max_rows:
            raise ValueError(f"a step has 1..{self.max_rows} rows, this plan has {num_rows}")
        table = np.array([(r.slot, r.num_computed, r.num_new, r.samples) for r in rows], dtype=np.int64)
        slots, computed, new, samples = table[:, 0], table[:, 1], table[:, 2], table[:, 3].astype(np.bool_)
        multi = np.flatnonzero(new != 1)
        num_decodes = int(multi[0]) if len(multi) else num_rows
        if pad_to is not None and (num_decodes != num_rows or not num_rows <= pad_to <= self.max_rows):
            raise ValueError(f"pad_to={pad_to}: only a decode-only plan of at most pad_to <= {self.max_rows} rows pads")
        page_index, page_values = self._page_updates(plan)

        total_rows = pad_to or num_rows
        if total_rows > num_rows:  # padding: scratch slot 0, one token at position 0 of page 0
            pad = total_rows - num_rows
            slots = np.concatenate([slots, np.zeros(pad, np.int64)])
            computed = np.concatenate([computed, np.zeros(pad, np.int64)])
            new = np.concatenate([new, np.ones(pad, np.int64)])
            samples = np.concatenate([samples, np.zeros(pad, np.bool_)])
        cu = np.zeros(total_rows + 1, np.int64)
        np.cumsum(new, out=cu[1:])
        num_tokens = int(cu[-1])
        if num_tokens > self.max_tokens:
            raise ValueError(f"a step has at most {self.max_tokens} tokens, this plan has {num_tokens}")
        if int((computed + new).max()) > self.max_pages_per_slot * self.page_size:
            raise ValueError(f"a row passes max_model_len ({self.max_pages_per_slot * self.page_size} tokens)")
        token_row = np.repeat(np.arange(total_rows), new)
        positions = computed[token_row] + np.arange(num_tokens) - cu[token_row]
        pages = self._page_mirror[slots[token_row], positions // self.page_size]
        input_ids = np.zeros(num_tokens, np.int64)
        input_ids[:num_decodes] = -1  # decode rows: one token each, from the pool unless given
        from_pool = False
        for index, row in enumerate(rows):
            if row.token_ids is not None:
                input_ids[cu[index] : cu[index + 1]] = row.token_ids
            else:
                from_pool = True
        sampling_index = np.cumsum(samples) - 1
        if all_logits:
            logits_rows = np.arange(num_tokens)
            sample_slots = np.zeros(num_tokens, np.int64)
            sampled_rows = [-1] * num_tokens
        elif pad_to is not None:
            logits_rows = cu[1:] - 1
            sample_slots = np.where(samples, slots, 0)
            sampled_rows = np.where(samples, sampling_index, -1).tolist()
        else:
            logits_rows = (cu[1:] - 1)[samples]
            sample_slots = slots[samples]
            sampled_rows = list(range(len(logits_rows)))
        arrays = {
            "input_ids": input_ids,
            "positions": positions,
            "kv_locations": pages * self.page_size + positions % self.page_size,
            "logits_indices": logits_rows,
            "cu_seqlens": cu,
            "seq_lens": computed + new,
            "state_slots": slots,
            "sample_slots": sample_slots,
            "page_index": page_index,
            "page_values": page_values,
        }
        landed = self._copy_in(arrays)
        inputs = self.inputs
        persistent = [name for name in inputs if name in landed]
        copy_by_dtype([inputs[n][: landed[n].numel()] for n in persistent], [landed[n] for n in persistent])
        if "page_index" in landed:
            self.page_table.view(-1).index_copy_(0, landed["page_index"], landed["page_values"])
        if from_pool:
            ids = inputs["input_ids"][:num_decodes]
            slots_of = inputs["state_slots"][:num_decodes]
            if all(row.token_ids is None for row in rows[:num_decodes]):  # every decode token from the pool
                torch.index_select(last_tokens, 0, slots_of, out=ids)
            else:
                ids.copy_(torch.where(ids < 0, last_tokens[slots_of], ids))
        torch.index_select(self.page_table, 0, inputs["state_slots"][:total_rows], out=self.page_rows[:total_rows])
        num_logits = len(logits_rows)
        max_seq_len = None if pad_to is not None else int((computed + new).max())
        batch = self._view(
            total_rows, num_tokens, num_logits, num_decodes + (total_rows - num_rows), new.tolist(), max_seq_len
        )
        return StagedStep(batch, inputs["sample_slots"][:num_logits], sampled_rows)

    def _page_updates(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """Record the plan's new pages in the host mirror; their flat page-table indices and values."""
        indices, values = [], []
        for update in plan.page_updates:
            end = update.start + len(update.pages)
            if update.slot == 0 or end > self.max_pages_per_slot:
                raise ValueError(f"page update of slot {update.slot} for entries [{update.start}, {end}) is out of range")
            pages = np.asarray(update.pages, np.int64)
            self._page_mirror[update.slot, update.start : end] = pages
            indices.append(update.slot * self.max_pages_per_slot + np.arange(update.start, end))
            values.append(pages)
        if not indices:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(indices), np.concatenate(values)

    def _grow(self, nbytes: int) -> None:
        """Staging and landing buffers of ``nbytes``. Buffers replaced while a copy from them is in
        flight stay valid: the pinned blocks are held by torch's host allocator until their copy's
        event, the landing block is reused only in stream order."""
        pin = self.device.type == "cuda"
        self._staging = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._staging_np = [s.numpy() for s in self._staging]
        self._staging_free = [None, None]
        self._landing = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def _copy_in(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Pack the non-empty arrays into the next staging buffer, copy the packed bytes to the
        device in one copy; returns each array's device view of the landing buffer."""
        needed = sum(-(-len(values) * _DTYPES[name].itemsize // 8) * 8 for name, values in arrays.items())
        if needed > self._landing.numel():
            self._grow(2 * needed)
        index = self._next
        event = self._staging_free[index]
        if event is not None:
            event.synchronize()  # its previous copy (two steps ago) has been read
        staging = self._staging_np[index]
        offsets, offset = {}, 0
        for name, values in arrays.items():
            if not len(values):
                continue
            dtype = _DTYPES[name]
            nbytes = len(values) * dtype.itemsize
            staging[offset : offset + nbytes].view(_NUMPY[dtype])[:] = values
            offsets[name] = (offset, len(values), dtype)
            offset += -(-nbytes // 8) * 8
        self._landing[:offset].copy_(self._staging[index][:offset], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._staging_free[index] = event
        self._next = 1 - index
        return {name: self._landing[o : o + n * d.itemsize].view(d) for name, (o, n, d) in offsets.items()}


def copy_by_dtype(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every pair, one ``_foreach_copy_`` per dtype: a list of one
    dtype takes the fused multi-tensor launch on CUDA, a mixed list falls back to one copy a tensor
    (eight device-to-device copies a decode step, where two launches do)."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        group = groups.setdefault(d.dtype, ([], []))
        group[0].append(d)
        group[1].append(s)
    for d, s in groups.values():
        torch._foreach_copy_(d, s)


def split_decodes(batch: ForwardBatch, num_decode_logits: int) -> tuple[ForwardBatch, ForwardBatch]:
    """A mixed step as its decode rows and its prefill chunks, each a batch of its own; the first
    ``num_decode_logits`` logits rows are the decodes'."""
    nd = batch.num_decodes
    _, cu_seqlens, state_slots = batch.prefill_part()
    decodes = ForwardBatch(
        input_ids=batch.input_ids[:nd],
        positions=batch.positions[:nd],
        cu_seqlens=batch.cu_seqlens[: nd + 1],
        seq_lens=batch.seq_lens[:nd],
        page_table=batch.page_table[:nd],
        kv_locations=batch.kv_locations[:nd],
        state_slots=batch.state_slots[:nd],
        logits_indices=batch.logits_indices[:num_decode_logits],
        num_decodes=nd,
        max_query_len=1,
        query_lens=batch.query_lens[:nd],
        max_seq_len=batch.max_seq_len,
    )
    chunks = ForwardBatch(
        input_ids=batch.input_ids[nd:],
        positions=batch.positions[nd:],
        cu_seqlens=cu_seqlens,
        seq_lens=batch.seq_lens[nd:],
        page_table=batch.page_table[nd:],
        kv_locations=batch.kv_locations[nd:],
        state_slots=state_slots,
        logits_indices=batch.logits_indices[num_decode_logits:] - nd,
        num_decodes=0,
        max_query_len=batch.max_query_len,
        query_lens=batch.query_lens[nd:],
        max_seq_len=batch.max_seq_len,
        snapshots=batch.snapshots,
    )
    return decodes, chunks
