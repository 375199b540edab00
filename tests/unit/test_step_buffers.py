"""StepBuffers, the persistent step inputs: a step that maps more pages than its tokens need (a
prefix hit's cached pages) is staged, growing the staging buffers, and its page-table rows land."""

from __future__ import annotations

import torch

from freetoken.engine.buffers import StepBuffers
from freetoken.plan import PageUpdate, PlanRow, StepPlan


def test_a_prefix_hit_mapping_many_cached_pages_is_staged():
    page_size, max_pages = 4, 64
    buffers = StepBuffers(max_rows=2, max_tokens=8, num_slots=4, max_pages_per_slot=max_pages,
                          page_size=page_size, device=torch.device("cpu"))
    cached = tuple(range(10, 10 + 50))  # 200 cached tokens: far more pages than 8 new tokens add
    plan = StepPlan(
        rows=[PlanRow(slot=1, num_computed=200, num_new=8, samples=True, token_ids=tuple(range(8)))],
        page_updates=[PageUpdate(slot=1, start=0, pages=cached + (70, 71))],
    )
    staged = buffers.stage(plan, last_tokens=torch.zeros(4, dtype=torch.int64))
    assert buffers.page_table[1, :52].tolist() == list(cached) + [70, 71]
    assert staged.batch.kv_locations.tolist() == [70 * page_size + i for i in range(4)] + [71 * page_size + i for i in range(4)]
    small = StepPlan(rows=[PlanRow(slot=2, num_computed=0, num_new=3, samples=True, token_ids=(1, 2, 3))],
                     page_updates=[PageUpdate(slot=2, start=0, pages=(5,))])
    buffers.stage(small, last_tokens=torch.zeros(4, dtype=torch.int64))  # the grown buffers serve on
    assert buffers.page_table[2, 0].item() == 5 and buffers.page_table[1, 51].item() == 71


def test_decode_tokens_come_from_the_pool_and_given_ones_stay():
    """Decode rows without token ids take their slot's last sampled token (one gather when every
    decode row does); a decode row with its token given keeps it."""
    buffers = StepBuffers(max_rows=3, max_tokens=6, num_slots=5, max_pages_per_slot=4, page_size=4,
                          device=torch.device("cpu"))
    pool = torch.tensor([0, 11, 22, 33, 44])
    rows = [PlanRow(slot=3, num_computed=5, num_new=1, samples=True, token_ids=None),
            PlanRow(slot=1, num_computed=2, num_new=1, samples=True, token_ids=None)]
    assert buffers.stage(StepPlan(rows=rows), pool).batch.input_ids.tolist() == [33, 11]
    given = [rows[0], PlanRow(slot=2, num_computed=2, num_new=1, samples=True, token_ids=(7,)), rows[1]]
    assert buffers.stage(StepPlan(rows=given), pool).batch.input_ids.tolist() == [33, 7, 11]


def test_copy_by_dtype_copies_a_mixed_list():
    from freetoken.engine.buffers import copy_by_dtype

    src = [torch.arange(3), torch.arange(4, dtype=torch.int32) + 5, torch.ones(2, 2, dtype=torch.int32)]
    dst = [torch.zeros_like(t) for t in src]
    copy_by_dtype(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
