"""The prefill graph runner without capture: its padded static batch (the step's rows, then a
padding row in the scratch slot and page; fixed-size snapshot tables with dummies) run eagerly on
the CPU gives transformers' float32 greedy tokens, for prompts in every bucket and prefix hits
whose remainder (and its in-forward snapshot) runs through it."""

from __future__ import annotations

import random

import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.prefill_graphs import GraphShape, PrefillGraphRunner, prefill_capture_sizes
from freetoken.kernels.gated_delta_rule import gated_delta_rule_prefill_reference
from freetoken.kernels.prefill_snapshots import PrefillSnapshots, prefill_snapshots, snapshot_tables
from oracle import DEMO, EOS, PAGE_SIZE, checkpoint, reference_greedy
from prefix_prompts import shared_prefix_prompts

MAX_TOKENS = 6
SIZES = [8, 16, 32, 64]


class RecordingPrefillRunner(PrefillGraphRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runs: list[tuple[GraphShape, int, int]] = []  # (shape, tokens, snapshots) of each run

    def run(self, batch, snapshots):
        self.runs.append((self.shape_of(batch), batch.num_tokens, len(snapshots)))
        return super().run(batch, snapshots)


def _llm(max_prefill_length: int, max_rows: int = 2) -> tuple[LLM, RecordingPrefillRunner]:
    """An LLM whose engine runs prefill-only steps through an eager-mode runner (the CPU engine
    makes none itself)."""
    llm = LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), dtype="float32", device="cpu",
              max_prefill_length=max_prefill_length, page_size=PAGE_SIZE)
    engine = llm.runtime.engine
    assert engine.prefill_runner is None
    runner = RecordingPrefillRunner(engine.model, engine.device, SIZES, max_rows, engine.max_pages_per_request,
                                    engine.max_model_len, use_graphs=False)
    engine.prefill_runner = runner
    return llm, runner


def _generate_exact(llm: LLM, prompts: list[list[int]]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        assert output.token_ids == reference_greedy(checkpoint(DEMO["qwen3_5_moe"]), prompt, MAX_TOKENS)
    return outputs


def test_prefill_capture_sizes():
    assert prefill_capture_sizes(0) == []
    assert prefill_capture_sizes(48) == [48]
    assert prefill_capture_sizes(512) == [64, 128, 256, 512]
    assert prefill_capture_sizes(1024) == [64, 128, 256, 512, 640, 768, 896, 1024]
    assert prefill_capture_sizes(1000) == [64, 128, 256, 512, 640, 768, 896, 1000]


def test_padded_snapshot_tables_run_the_delta_rule_as_the_exact_ones():
    """Rows of 70 and 9 tokens with snapshots at 64 and 3, a padding row of 21: the padded tables
    (room for 4 snapshots, 12 chunks) give the real rows the outputs and states the exact layout
    gives, through the reference; the dummies are empty segments into slot 0, the spare chunks
    belong to no segment."""
    query_lens, real = [70, 9, 21], [(0, 64, 5), (1, 3, 6)]
    parts, num_chunks = snapshot_tables(query_lens, real, 3, capacity=(4, 12))
    assert num_chunks == 12
    tokens, _, requests, slots, segment_cu, _, chunk_segment, _, _, _, chunk_snapshot, _, from_state = parts
    assert tokens.tolist() == [64, 73, 79, 79] and requests.tolist() == [0, 1, 2, 2] and slots.tolist() == [5, 6, 0, 0]
    assert segment_cu.tolist() == [0, 64, 70, 73, 79, 79, 79, 100]
    assert chunk_segment.tolist()[-6:] == [7] * 6  # 6 real chunks, then none's
    assert sorted(chunk_snapshot[chunk_snapshot >= 0].tolist()) == [5, 6]
    assert from_state.reshape(4, 3)[2:].all()

    torch.manual_seed(0)
    t, hk, hv, dk, dv = 100, 1, 2, 8, 4
    q, k = torch.randn(t, hk, dk), torch.randn(t, hk, dk)
    v, g, beta = torch.randn(t, hv, dv), -torch.rand(t, hv), torch.rand(t, hv)
    cu = torch.tensor([0, 70, 79, 100], dtype=torch.int32)
    slots = torch.tensor([1, 2, 0], dtype=torch.int32)
    views = [torch.from_numpy(p) for p in parts]
    padded = PrefillSnapshots(*views[:11], num_chunks, views[11].view(4, 3), views[12].view(4, 3).bool())
    exact = prefill_snapshots(query_lens[:2], real, 3, torch.device("cpu"))
    initial = torch.randn(8, hv, dk, dv)
    state_padded, state_exact = initial.clone(), initial.clone()
    out_padded = gated_delta_rule_prefill_reference(q, k, v, g, beta, state_padded, slots, cu, padded)
    out_exact = gated_delta_rule_prefill_reference(q[:79], k[:79], v[:79], g[:79], beta[:79], state_exact, slots[:2],
                                                   cu[:3], exact)
    torch.testing.assert_close(out_padded[:79], out_exact, rtol=0, atol=0)
    torch.testing.assert_close(state_padded[1:], state_exact[1:], rtol=0, atol=0)


def test_padding_row_points_at_the_scratch_slot_and_page():
    llm, runner = _llm(8192)
    prompt = shared_prefix_prompts()["A"]  # 35 tokens: bucket 64, 29 padding tokens
    captured = []
    forward = runner.model.forward
    runner.model.forward = lambda batch: captured.append(batch) or forward(batch)
    _generate_exact(llm, [prompt])
    batch = captured[0]
    assert runner.runs[0] == (GraphShape(1, 64), 35, 1)  # and its snapshot at its last full page, 32
    assert batch.num_tokens == 64 and batch.num_requests == 2 and batch.max_query_len == 64
    assert batch.cu_seqlens.tolist() == [0, 35, 64] and batch.seq_lens.tolist() == [35, 29]
    assert batch.state_slots.tolist()[1] == 0 and batch.page_table[1].tolist() == [0] * batch.page_table.shape[1]
    assert batch.input_ids[35:].tolist() == [0] * 29 and batch.kv_locations[35:].tolist() == [0] * 29
    assert batch.logits_indices.tolist() == [34, 0]  # the sampling row first
    snapshots = batch.snapshots
    assert snapshots.num_snapshots == 2 and snapshots.tokens.tolist() == [32, 35]  # the real one, a dummy
    assert snapshots.slots[0] > 0 and snapshots.slots[1] == 0 and snapshots.window_from_state[1].all()


def test_each_bucket_with_prefix_hits_equals_transformers():
    """Chunks of 16 (a full bucket: an empty padding row), last chunks in buckets 8 and 16, then
    whole prompts in 32 and 64, one after another and two at a time, into a warm prefix cache:
    hits run their remainder, with a snapshot inside it, through the runner."""
    llm, runner = _llm(16)
    prompts = list(shared_prefix_prompts().values())
    for prompt in prompts[:2]:  # 35 = 16 + 16 + 3 and 33 = 16 + 16 + 1 (a decode row)
        _generate_exact(llm, [prompt])
    llm16_runs = list(runner.runs)
    assert {shape.tokens for shape, _, _ in llm16_runs} == {8, 16}
    assert any(tokens == shape.tokens for shape, tokens, _ in llm16_runs)  # no padding token

    llm, runner = _llm(8192)
    rng = random.Random(3)
    a = shared_prefix_prompts()["A"]
    extended = a + [rng.randrange(EOS - 3) for _ in range(30)]  # 65: hits 32, snapshots 64 inside
    outputs = [_generate_exact(llm, [p])[0] for p in (a, extended, extended)]
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 64]
    assert (GraphShape(1, 64), 33, 1) in runner.runs  # the hit's 33 tokens and its snapshot at 64
    short = [rng.randrange(EOS - 3) for _ in range(20)]
    pair = _generate_exact(llm, [short, a + [rng.randrange(EOS - 3) for _ in range(5)]])  # 20 + 8 together
    assert pair[1].num_cached_tokens == 32
    assert (GraphShape(2, 32), 28, 1) in runner.runs  # and the short one snapshots at 16
    assert {shape.tokens for shape, _, _ in runner.runs} == {32, 64}
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0


def test_steps_beyond_the_runner_run_eagerly():
    """Three prompts at once (more rows than the runner's 2) and a 100-token prompt (more tokens
    than the largest bucket) prefill eagerly, exactly."""
    llm, runner = _llm(8192)
    rng = random.Random(5)
    prompts = [[rng.randrange(EOS - 3) for _ in range(n)] for n in (12, 13, 14)]
    _generate_exact(llm, prompts)
    _generate_exact(llm, [[rng.randrange(EOS - 3) for _ in range(100)]])
    assert runner.runs == []


def test_qwen4_exp_prefills_eagerly():
    """Its static batch would need in-forward snapshots, which Qwen4-Exp's PLE windows and n-gram
    context do not have: no prefill graphs."""
    llm = LLM(model=str(checkpoint(DEMO["qwen4_exp"])), dtype="float32", device="cpu", page_size=PAGE_SIZE)
    assert llm.runtime.engine._prefill_graph_sizes() == []
    qwen35 = LLM(model=str(checkpoint(DEMO["qwen3_5_moe"])), dtype="float32", device="cpu", page_size=PAGE_SIZE,
                 max_prefill_length=600)
    assert qwen35.runtime.engine._prefill_graph_sizes() == [64, 128, 256, 512, 600]


def test_no_prefill_graphs_with_expert_offload():
    """An offloaded prefill reads its routed ids on the host (a sync no graph can hold): no buckets,
    whatever the caps (decode graphs stay on: they hold the zero-copy kernels)."""
    from types import SimpleNamespace

    from freetoken.engine.engine import Engine

    config = SimpleNamespace(prefill_cuda_graph_max_tokens=1024, max_prefill_length=8192)
    model = SimpleNamespace(snapshots_in_forward=True)
    assert Engine._prefill_graph_sizes(SimpleNamespace(config=config, offload=object(), model=model)) == []
    assert Engine._prefill_graph_sizes(SimpleNamespace(config=config, offload=None, model=model))
