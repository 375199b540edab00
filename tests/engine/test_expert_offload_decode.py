"""MoE expert offload's zero-copy decode path on the CPU (issue 11): forwards of at most
``DECODE_MAX_TOKENS`` tokens read each routed expert from its cache slot or from host memory in one
kernel, without a host sync, and write each miss into a slot lent for it (the read-through fill,
``experts.lend``); the routed ids and claims reach the host after the step. Checked: float32 greedy tokens equal transformers'
with a cache smaller than one layer's experts (also through a graph runner's padded batches), the
slot map's invariant at every kernel call, the counters, and the eviction ahead of the lend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken import LLM, kernels
from freetoken.experts.cache import RESERVE_DIVISOR, SlotTable
from freetoken.experts.decode_log import RoutedRecord
from freetoken.experts.eviction import LRUPolicy
from freetoken.layers.moe import SparseMoE
from expert_cache_checks import check_slot_map_invariant
from graph_padding import with_padded_decode
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint

# Demo models: 4 layers of 8 (Qwen3.5) / of 4 (Qwen4-Exp) experts, top-2. Caches smaller than one
# layer's experts (one slot: a prompt's layer evicts the one an earlier layer just took; a cache
# under 16 slots lends only free slots), and one of half the experts (16 of 32: it evicts ahead, ``SlotTable.reserve``), with
# LRFU and with ARC choosing the victims.
CASES = [("qwen3_5_moe", True, 3, "lrfu"), ("qwen3_5_moe", False, 16, "lrfu"), ("qwen4_exp", False, 1, "lrfu"),
         ("qwen3_5_moe", False, 16, "arc")]


@pytest.mark.parametrize("family,padded,slots,policy", CASES, ids=str)
def test_zero_copy_decode_greedy_equals_transformers(monkeypatch, family, padded, slots, policy):
    llm = LLM(model=str(checkpoint(DEMO[family])), dtype="float32", device="cpu", max_prefill_length=16,
              page_size=PAGE_SIZE, moe_offload=True, expert_cache_slots=slots, expert_cache_policy=policy)
    engine = llm.runtime.engine
    offload = engine.offload
    assert offload.zero_copy
    reserved: list[int] = []
    lend = offload.table.lend

    def counted_lend(count):
        slots, evicted = lend(count)
        reserved.append(len(evicted))
        return slots, evicted

    monkeypatch.setattr(offload.table, "lend", counted_lend)
    copies: list[int] = []  # experts copied into slots (the eager path's: the read-through fill copies none)
    fill = offload.slots.fill

    def counted_fill(layer, placed, evicted, ahead=False):
        copies.append(len(placed))
        fill(layer, placed, evicted, ahead)

    monkeypatch.setattr(offload.slots, "fill", counted_fill)
    runner = with_padded_decode(llm, 8) if padded else None
    codes: list[torch.Tensor] = []
    decode = kernels.sparse_moe_decode_offload

    def checked(*args, **kwargs):
        check_slot_map_invariant(offload)
        out = decode(*args, **kwargs)
        codes.append(args[-1].clone())
        return out

    monkeypatch.setattr(kernels, "sparse_moe_decode_offload", checked)
    # The uses each forward routes to, from the router apart from the cache: the distinct experts of
    # the forward's real tokens (a padded batch's padding rows are not uses).
    routed: list[torch.Tensor] = []
    forwards: list[int] = []

    def route(module: SparseMoE, inputs: tuple[torch.Tensor]) -> None:
        routed.append(module._route(inputs[0]))

    for m in engine.model.modules():
        if isinstance(m, SparseMoE):
            m.register_forward_pre_hook(route)
    collect = engine._collect_routing

    def logged(forward_tokens: int, real_tokens: int) -> None:
        forwards.append(real_tokens)
        collect(forward_tokens, real_tokens)

    monkeypatch.setattr(engine, "_collect_routing", logged)
    assert_greedy_batch(llm, DEMO[family], batch_prompts(DEMO[family])[:4])

    every = torch.cat([c.flatten() for c in codes])
    assert (every >= 0).any() and (every < 0).any(), "the decode kernels saw no hits or no misses"
    layers = len(offload.layers)
    assert len(routed) == layers * len(forwards)
    uses = sum(routed[f * layers + l][:real].unique().numel() for f, real in enumerate(forwards) for l in range(layers))
    stats = llm.runtime.stats().expert_cache
    assert stats.hits + stats.misses == uses
    assert stats.bytes_copied == sum(copies) * offload.expert_bytes
    assert 0 < stats.bytes_copied <= stats.misses * offload.expert_bytes
    if runner is not None:
        assert any(n < size for n, size in runner.runs), "no padded decode batch ran"
    if slots >= 16:
        assert sum(reserved) > 0, "no expert was evicted ahead"
        # The misses are filled by the kernels that read them (experts.lend), never copied again.
        assert offload.counters.read_through_fills > 0
    check_slot_map_invariant(offload)


def test_lend_evicts_ahead_least_recently_used_and_hands_out_the_oldest_free_first():
    table = SlotTable(RESERVE_DIVISOR, LRUPolicy(), expert_bytes=10)
    table.admit(0, list(range(RESERVE_DIVISOR)))  # full
    slots, evicted = table.lend(2)
    assert slots == [0, 1] and evicted == [(0, 0), (0, 1)]  # least recently used first
    table.give_back(slots)
    assert table.lend(2) == ([0, 1], [])  # two free already
    table.give_back([0, 1])
    placed, evicted = table.admit(1, [7, 8, 9])
    assert placed == [(7, 0), (8, 1), (9, 2)] and evicted == [(0, 2)]  # the lent-back slots, then a victim's


def test_routed_record_decodes_hits_and_misses_of_the_real_tokens():
    # 2 layers, 3 rows (the last one padding), top-2; the first read of an expert decides its hit.
    ids = torch.tensor([[[3, -1 - 5], [5, 2], [7, 7]], [[-1 - 9, 0], [0, -1 - 4], [1, 1]]], dtype=torch.int32)
    keys, hits = RoutedRecord(ids, 2, None).uses()
    assert keys == [(0, 3), (0, 5), (0, 2), (1, 9), (1, 0), (1, 4)]
    assert hits.tolist() == [True, False, True, False, True, False]
    assert RoutedRecord(ids, 2, None).missed_pairs() == 3


def test_routed_record_lists_the_claims_in_layer_row_choice_order():
    ids = torch.tensor([[[3, -1 - 5]], [[-1 - 9, -1 - 4]]], dtype=torch.int32)
    fills = torch.tensor([[[-1, 12]], [[7, 30]]], dtype=torch.int32)
    assert RoutedRecord(ids, 1, None, fills).claims() == [(0, 5, 12), (1, 9, 7), (1, 4, 30)]


def test_count_decode_counts_the_forward_and_its_prefetch_hits_as_one_access():
    table = SlotTable(2, LRUPolicy(), expert_bytes=10)
    lent, _ = table.lend(2)
    for key, slot in zip([(1, 2), (0, 1)], lent):  # inserted layer 1's first
        assert table.claim(key, slot)
    table._prefetched.add((1, 2))
    table.count_decode([(0, 1), (0, 3), (1, 2)], np.array([True, False, True]))
    c = table.counters
    assert (c.hits, c.misses, c.prefetch_hits) == (2, 1, 1) and not table._prefetched
    assert table.lend(1) == ([], [])  # under RESERVE_DIVISOR slots only free slots are lent
    assert table.policy.evict(()) == (0, 1)  # the forward's uses in layer order: layer 0's is oldest
