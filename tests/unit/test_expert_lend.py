"""The read-through fill's lending (``experts.lend``) and the table's bookkeeping of its claims."""

from __future__ import annotations

import pytest
import torch

from freetoken.experts.cache import SlotTable
from freetoken.experts.eviction import LRUPolicy
from freetoken.experts.lend import SlotLender
from freetoken.kernels.moe_decode_offload import _claim


def test_the_ring_hands_out_lent_slots_in_order_and_wraps():
    lender = SlotLender(capacity=2, device=torch.device("cpu"))
    lender.give([5, 7])
    assert lender.lend.tolist()[:2] == [0, 2] and lender.outstanding == 2
    with pytest.raises(ValueError, match="outstanding"):
        lender.give([9])
    routed = torch.tensor([[-4, 1], [-4, -3]], dtype=torch.int32)  # expert 3 missed twice, 2 once
    fills = torch.empty_like(routed)
    assert _claim(routed, fills, lender.lend) == [(3, 5), (2, 7)]
    assert fills.tolist() == [[5, -1], [-1, 7]] and int(lender.lend[0]) == 2
    lender.claimed(2)
    assert lender.outstanding == 0 and lender.lent() == set()
    lender.give([1, 4])  # positions 2 and 3 of a ring of 4
    assert lender.lend.tolist() == [2, 4, 5, 7, 1, 4] and lender.lent() == {1, 4}
    assert _claim(torch.tensor([[-1, -2]], dtype=torch.int32), fills[:1], lender.lend) == [(0, 1), (1, 4)]
    lender.claimed(2)
    lender.give([9, 6])  # positions 4 and 5: the ring's 0 and 1 again
    assert lender.lend.tolist() == [4, 6, 9, 6, 1, 4]
    assert _claim(torch.tensor([[-3]], dtype=torch.int32), fills[:1, :1], lender.lend) == [(2, 9)]


def test_claims_past_the_lent_slots_stay_in_host_memory():
    lender = SlotLender(capacity=3, device=torch.device("cpu"))
    lender.give([2])
    fills = torch.empty(1, 3, dtype=torch.int32)
    assert _claim(torch.tensor([[-1, -2, 5]], dtype=torch.int32), fills, lender.lend) == [(0, 2)]
    assert fills.tolist() == [[2, -1, -1]] and lender.lend.tolist()[:2] == [1, 1]


def test_revoke_takes_back_what_no_forward_claimed():
    lender = SlotLender(capacity=3, device=torch.device("cpu"))
    lender.give([4, 6, 8])
    _claim(torch.tensor([[-1]], dtype=torch.int32), torch.empty(1, 1, dtype=torch.int32), lender.lend)
    lender.claimed(1)
    assert lender.revoke() == [6, 8]
    assert lender.outstanding == 0 and lender.lend.tolist()[:2] == [1, 1]
    assert lender.revoke() == []


def test_table_lends_free_slots_then_evicts_and_books_claims():
    table = SlotTable(16, LRUPolicy(), expert_bytes=10)
    placed, _ = table.admit(0, list(range(15)))
    assert len(placed) == 15
    slots, evicted = table.lend(2)
    assert slots == [15, placed[0][1]] and evicted == [(0, 0)]
    assert table.claim((1, 3), slots[0]) and table.slot_of((1, 3)) == 15
    assert table.counters.bytes_copied == 15 * 10  # a claim copies nothing
    # an eager forward cached (1, 4) meanwhile: the claimed slot is free again
    table.admit(1, [4])
    assert not table.claim((1, 4), slots[1]) and table.slot_of((1, 4)) != slots[1]
    assert table.lend(1) == ([slots[1]], [])


def test_a_small_cache_lends_only_free_slots():
    table = SlotTable(3, LRUPolicy(), expert_bytes=10)
    table.admit(0, [0, 1])
    assert table.lend(2) == ([2], [])
    assert table.lend(1) == ([], [])
