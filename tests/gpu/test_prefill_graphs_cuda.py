"""CUDA graphs for prefill (the default on CUDA, Qwen3.5 / 3.6): float32 greedy tokens equal
transformers' with prefill-only steps replayed from graphs, including prefix hits whose remainder
(and its in-forward snapshot) is replayed, unchunked and in chunks of 16 (a capture fails on any
host sync in the prefill forward)."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.prefill_graphs import GraphShape
from freetoken.plan import PageUpdate, PlanRow, RowSnapshot, StepPlan
from oracle import DEMO, EOS, PAGE_SIZE, checkpoint, reference_greedy
from prefix_prompts import WARM_HITS, shared_prefix_prompts

pytestmark = pytest.mark.gpu

CASE = DEMO["qwen3_5_moe"]
MAX_TOKENS = 8


def _record_replays(llm: LLM) -> list[tuple[GraphShape, int, int]]:
    """(shape, tokens, snapshots) of every prefill step the engine replays from a graph."""
    runner = llm.runtime.engine.prefill_runner
    assert runner is not None and runner.use_graphs, "prefill graphs must be on by default on CUDA"
    assert set(runner.graphs) == set(runner.shapes)
    runs: list[tuple[GraphShape, int, int]] = []
    replay = runner.run

    def recording(batch, snapshots):
        runs.append((runner.shape_of(batch), batch.num_tokens, len(snapshots)))
        return replay(batch, snapshots)

    runner.run = recording
    return runs


def _generate_exact(llm: LLM, prompts: list[list[int]]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        assert output.token_ids == reference_greedy(checkpoint(CASE), prompt, MAX_TOKENS)
    return outputs


@pytest.mark.parametrize("max_prefill_length", [16, 8192], ids=["chunked16", "unchunked"])
def test_prefix_hits_with_prefill_graphs_equal_transformers(max_prefill_length):
    """The shared-prefix prompts one after another (warm hits), then together; unchunked, a
    prompt extending A hits A's snapshot and snapshots inside its replayed remainder."""
    llm = LLM(model=str(checkpoint(CASE)), dtype="float32", device="cuda", page_size=PAGE_SIZE,
              max_prefill_length=max_prefill_length, max_running_requests=8, prefill_cuda_graph_max_seqs=2)
    runs = _record_replays(llm)
    prompts = shared_prefix_prompts()
    for name, prompt in prompts.items():
        (output,) = _generate_exact(llm, [prompt])
        assert output.num_cached_tokens == WARM_HITS[name], name
    _generate_exact(llm, list(prompts.values()))
    assert runs, "no prefill step was replayed"
    assert all(tokens <= shape.tokens for shape, tokens, _ in runs)
    if max_prefill_length == 16:
        assert any(tokens == 16 for _, tokens, _ in runs)  # a full bucket: an empty padding row
    else:
        extended = prompts["A"] + [random.Random(1).randrange(EOS - 3) for _ in range(30)]
        runs.clear()
        (output,) = _generate_exact(llm, [extended])
        assert output.num_cached_tokens == 32
        assert runs == [(GraphShape(1, 64), len(extended) - 32, 1)]  # the hit's remainder, its snapshot at 64
        (output,) = _generate_exact(llm, [extended])
        assert output.num_cached_tokens == 64
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0


def test_prefill_graphs_off():
    """Qwen4-Exp (no in-forward snapshots), enforce_eager, the torch kernels and a zero token cap
    capture no prefill graph."""
    demo = str(checkpoint(CASE))
    assert LLM(model=str(checkpoint(DEMO["qwen4_exp"])), device="cuda").runtime.engine.prefill_runner is None
    assert LLM(model=demo, device="cuda", enforce_eager=True).runtime.engine.prefill_runner is None
    assert LLM(model=demo, device="cuda", kernel_backend="torch").runtime.engine.prefill_runner is None
    off = LLM(model=demo, device="cuda", prefill_cuda_graph_max_tokens=0).runtime.engine
    assert off.prefill_runner is None and off.graph_runner is not None


def test_a_replay_does_not_synchronize_and_equals_the_eager_forward():
    """A 70-token prompt chunk with a snapshot at 64 (bucket 128): loading and replaying its graph
    never makes the host wait; its logits and the snapshot's states are the eager forward's."""
    llm = LLM(model=str(checkpoint(CASE)), dtype="float32", device="cuda", page_size=PAGE_SIZE)
    engine = llm.runtime.engine
    runner, snapshot = engine.prefill_runner, engine.pool_sizes.num_slots
    plan = StepPlan(rows=[PlanRow(1, 0, 70, True, tuple(range(70)))], page_updates=[PageUpdate(1, 0, tuple(range(1, 19)))],
                    snapshots=[RowSnapshot(0, 64, snapshot)])
    layers = [layer.mixer for layer in engine.model.layers if hasattr(layer.mixer, "recurrent_state")]

    def states() -> list[torch.Tensor]:
        return [t[[1, snapshot]].clone() for g in layers for t in (g.conv_state, g.recurrent_state)]

    staged = engine.buffers.stage(plan, engine.sampler.last_token)
    assert runner.supports(staged.batch, 1) and runner.shape_of(staged.batch) == GraphShape(1, 128)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replayed = runner.run(staged.batch, engine._snapshot_entries(plan)).clone()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    replayed_states = states()
    engine.model.reset_slots(torch.tensor([1, snapshot], device="cuda"))
    staged = engine.buffers.stage(StepPlan(rows=plan.rows, snapshots=plan.snapshots), engine.sampler.last_token)
    staged.batch.snapshots = engine._prefill_snapshots(plan)
    eager = engine.model(staged.batch)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(replayed_states, states()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
