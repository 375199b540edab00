"""The decode graph runner without capture: its padded static batch, run eagerly on the CPU, gives
transformers' float32 greedy tokens; padding rows touch only the scratch page and slot."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM
from freetoken.batch import ForwardBatch
from freetoken.engine.graph_runner import DecodeGraphRunner, capture_sizes
from graph_padding import with_padded_decode
from oracle import DEMO, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def _decode_batch(rows: list[tuple[int, int, int, list[int]]]) -> ForwardBatch:
    """Rows of (token, position, state slot, pages) with page size 4."""
    def column(values, dtype):
        return torch.tensor(values, dtype=dtype)

    width = max(len(r[3]) for r in rows)
    return ForwardBatch(
        input_ids=column([r[0] for r in rows], torch.int64),
        positions=column([r[1] for r in rows], torch.int64),
        cu_seqlens=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=column([r[1] + 1 for r in rows], torch.int32),
        page_table=column([r[3] + [0] * (width - len(r[3])) for r in rows], torch.int32),
        kv_locations=column([r[3][r[1] // 4] * 4 + r[1] % 4 for r in rows], torch.int64),
        state_slots=column([r[2] for r in rows], torch.int32),
        logits_indices=torch.arange(len(rows)),
        num_decodes=len(rows),
        max_query_len=1,
        query_lens=[1] * len(rows),
        max_seq_len=max(r[1] + 1 for r in rows),
    )


def test_padding_rows_point_at_the_scratch_page_and_slot():
    runner = DecodeGraphRunner(None, torch.device("cpu"), 8, 5, 20, use_graphs=False)
    runner.load(_decode_batch([(7, 9, 1, [3, 4, 5]), (8, 2, 2, [6]), (9, 5, 3, [7, 8]), (5, 17, 4, [1, 2, 9, 10, 11])]), 4)
    runner.load(_decode_batch([(11, 6, 5, [12, 13]), (12, 0, 6, [14])]), 4)  # smaller: rows 2-3 become padding
    batch = runner.static_batch(4)
    assert batch.input_ids.tolist() == [11, 12, 0, 0]
    assert batch.positions.tolist() == [6, 0, 0, 0]
    assert batch.kv_locations.tolist() == [13 * 4 + 2, 14 * 4, 0, 0]
    assert batch.seq_lens.tolist() == [7, 1, 1, 1]
    assert batch.state_slots.tolist() == [5, 6, 0, 0]
    assert batch.page_table.tolist() == [[12, 13, 0, 0, 0], [14, 0, 0, 0, 0], [0] * 5, [0] * 5]
    assert batch.cu_seqlens.tolist() == [0, 1, 2, 3, 4] and batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert batch.max_seq_len == 20 and batch.num_decodes == 4 and not batch.has_prefill
    assert runner.supports(_decode_batch([(1, 0, 1, [1])] * 8))
    assert not runner.supports(_decode_batch([(1, 0, 1, [1])] * 9))  # above max_batch_size: eager


@pytest.mark.parametrize("case", DEMO.values(), ids=str)
def test_padded_decode_greedy_equals_transformers(case):
    """The family's batch (prompts longer than the 16-token chunks, so decodes share steps with
    prefill chunks: split into a padded decode forward and an eager chunk forward); padding rows
    run on the scratch page and slot only, and Qwen4-Exp's static QSA width selects the same blocks."""
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cpu", max_prefill_length=16, page_size=PAGE_SIZE)
    runner = with_padded_decode(llm, max_batch_size=len(batch_prompts(case)) + 1)
    assert_greedy_batch(llm, case)
    assert any(size > n for n, size in runner.runs), runner.runs  # padding rows were run
