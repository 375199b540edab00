"""An eager forward that routes most of its layers' experts takes its later layers' slots from the
experts of the layers it has passed, least routed first (``SlotTable.passed``: evict behind),
not from the layers ahead that the policy's age-based victim would pick; the policies forget a
key the cache gives up so (``discard``)."""

from __future__ import annotations

import pytest

from freetoken.experts.cache import SlotTable
from freetoken.experts.eviction import POLICIES, make_policy

E = 4  # experts a layer


def _table_holding_layers_ahead() -> SlotTable:
    """Six slots: layer 2's experts 0-3 cached first (the oldest: the policy's victims)."""
    table = SlotTable(6, make_policy("lrfu"), expert_bytes=1)
    table.passes(2, [0, 1, 2, 3])
    table.admit(2, [0, 1, 2, 3])
    return table


def test_a_forward_routing_most_experts_evicts_behind_least_routed_first():
    table = _table_holding_layers_ahead()
    table.passes(0, [0, 1])
    table.admit(0, [0, 1])  # the two free slots
    table.passed(0, {0: 9, 1: 3}, E)  # half of layer 0's experts routed: evict behind from now on
    table.passes(1, [0])
    placed, evicted = table.admit(1, [0])
    assert evicted == [(0, 1)]  # layer 0's least routed expert, not layer 2's (needed further on)
    assert placed == [(0, table.slot_of((1, 0)))]
    placed, evicted = table.prefetch(2, [3], running={(1, 0)})  # cached: nothing to do
    assert (placed, evicted) == ([], [])
    # The last passed expert goes next, then the policy decides again (layer 2's oldest).
    assert table.admit(1, [1])[1] == [(0, 0)]
    assert table.admit(1, [2])[1][0][0] == 2


def test_a_forward_routing_few_experts_keeps_the_policy_victims():
    table = _table_holding_layers_ahead()
    table.admit(0, [0, 1])
    table.passed(0, {0: 9}, E)  # a quarter of layer 0's experts
    assert table.admit(1, [0])[1][0][0] == 2  # the policy's (oldest) victim


def test_a_new_forward_forgets_the_last_ones_layers():
    table = _table_holding_layers_ahead()
    table.admit(0, [0, 1])
    table.passed(0, {0: 9, 1: 3}, E)
    table.passed(0, {2: 1}, E)  # layer 0 again: a new forward, whose layer 0 routed one expert
    assert table.admit(1, [0])[1][0][0] == 2


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_discarded_key_is_never_evicted_and_can_come_back(name):
    policy = make_policy(name)
    keys = [(0, e) for e in range(4)]
    for key in keys:
        policy.insert(key)
    policy.access(keys)
    policy.discard(keys[0])
    evicted = [policy.evict(set()) for _ in range(3)]
    assert sorted(evicted) == keys[1:]
    policy.insert(keys[0])
    assert policy.evict(set()) == keys[0]
    with pytest.raises(MemoryError):
        policy.evict(set())


def test_the_next_forwards_first_layers_do_not_see_the_last_ones_pool():
    table = _table_holding_layers_ahead()
    table.admit(0, [0, 1])
    table.passed(0, {0: 9, 1: 3}, E)
    table.passed(1, {2: 1, 3: 1}, E)  # half again: evicting behind, layer 0's experts in the pool
    # The next forward's layer 0 starts before its first ``passed``: the policy's victim.
    assert table.admit(0, [2])[1][0][0] == 2

