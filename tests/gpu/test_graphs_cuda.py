"""CUDA graphs for decode (the default on CUDA): float32 greedy tokens equal transformers' with
decode steps replayed from graphs, for both families, batched and chunked (a capture fails on any
host sync in the decode forward)."""

from __future__ import annotations

import pytest

from freetoken import LLM
from oracle import CASES, DEMO, PAGE_SIZE, assert_greedy_batch, batch_prompts, checkpoint, random_prompts

pytestmark = pytest.mark.gpu


def _record_replays(llm: LLM) -> list[tuple[int, int]]:
    """(requests, padded size) of every step the engine replays from a graph."""
    runner = llm.runtime.engine.graph_runner
    assert runner is not None and runner.use_graphs and runner.graphs, "graphs must be on by default on CUDA"
    runs: list[tuple[int, int]] = []
    replay = runner.run

    def recording(batch):
        runs.append((batch.num_requests, runner.padded_size(batch.num_requests)))
        return replay(batch)

    runner.run = recording
    return runs


def _check_replays(runs: list[tuple[int, int]], max_bs: int) -> None:
    assert runs, "no decode step was replayed"
    assert all(n <= size <= max_bs for n, size in runs)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("max_prefill_length", [16, 8192], ids=["chunked16", "unchunked"])
def test_float32_greedy_with_graphs_equals_transformers(case, max_prefill_length):
    """The family's batch; its decode steps pad to a captured size (max bs: one more than the batch)."""
    max_bs = len(batch_prompts(case)) + 1
    llm = LLM(
        model=str(checkpoint(case)),
        dtype="float32",
        device="cuda",
        max_prefill_length=max_prefill_length,
        page_size=PAGE_SIZE,
        cuda_graph_max_bs=max_bs,
    )
    runs = _record_replays(llm)
    assert_greedy_batch(llm, case)
    _check_replays(runs, max_bs)


def test_decode_steps_above_max_bs_run_eagerly():
    """With max bs 2, steps of more decodes run eagerly beside the replayed ones; tokens unchanged."""
    case = DEMO["qwen3_5_moe"]
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cuda", max_prefill_length=16,
              page_size=PAGE_SIZE, cuda_graph_max_bs=2)
    runs = _record_replays(llm)
    assert_greedy_batch(llm, case)
    _check_replays(runs, 2)


def test_enforce_eager_and_torch_kernels_capture_nothing():
    demo_checkpoint = checkpoint(DEMO["qwen3_5_moe"])
    assert LLM(model=str(demo_checkpoint), device="cuda", enforce_eager=True).runtime.engine.graph_runner is None
    assert LLM(model=str(demo_checkpoint), device="cuda", kernel_backend="torch").runtime.engine.graph_runner is None


@pytest.mark.parametrize("shape", ["two_layers", "demo"])
def test_float32_greedy_with_graphs_past_the_fused_decode_block(shape, monkeypatch):
    """12 requests decode together: past ``DECODE_MAX_TOKENS`` the MoE block takes the grouped path
    inside the graph, handing its output on in parts to the next norm (``COMBINE_IN_NEXT_NORM``);
    ``two_layers``' shared expert is as wide as a routed one, so it runs as tiles of the grouped
    GEMMs, the demo's through its own GEMMs. Tokens equal transformers'."""
    from freetoken import kernels

    case = next(c for c in CASES if c.family == "qwen3_5_moe" and c.shape == shape)
    called = {"shared_pairs": 0}
    fused = kernels.fused_experts_shared_pairs

    def counted(*args, **kwargs):
        called["shared_pairs"] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(kernels, "fused_experts_shared_pairs", counted)
    prompts = random_prompts(12, seed=5)
    llm = LLM(model=str(checkpoint(case)), dtype="float32", device="cuda", max_prefill_length=8192,
              page_size=PAGE_SIZE, cuda_graph_max_bs=16)
    runs = _record_replays(llm)
    assert_greedy_batch(llm, case, prompts, max_tokens=8)
    _check_replays(runs, 16)
    assert any(n > 8 for n, _ in runs), "no replayed step took the grouped path"
    assert (called["shared_pairs"] > 0) == (shape == "two_layers")
