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
