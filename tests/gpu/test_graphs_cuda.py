"""CUDA graphs for decode (the default on CUDA): float32 greedy tokens equal transformers' with
decode steps replayed from graphs, for both families, batched and chunked; the eager forward of
either family needs no device->host sync, prefill included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.engine.engine import BatchEntry
from oracle import PROMPTS, reference_greedy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))  # qwen4_cases
import qwen4_cases  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16


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


@pytest.mark.parametrize(
    "shape, max_prefill_length, max_bs",
    [("demo", 16, 4), ("demo", 8192, 4), ("odd_heads_padded_vocab", 16, 4), ("odd_heads_padded_vocab", 8192, 4),
     ("demo", 16, 2)],
    ids=["demo-chunked16", "demo-unchunked", "odd_heads-chunked16", "odd_heads-unchunked", "demo-large_steps_eager"],
)
def test_qwen3_5_float32_greedy_with_graphs_equals_transformers(checkpoint_factory, shape, max_prefill_length, max_bs):
    """4 prompts: 3 decodes pad to 4 (max_bs 4); with max_bs 2, steps of 3-4 decodes run eagerly."""
    path = checkpoint_factory(shape)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        max_prefill_length=max_prefill_length,
        page_size=4,
        cuda_graph_max_bs=max_bs,
    )
    runs = _record_replays(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.error is None, output.error
        assert output.token_ids == reference_greedy(path, llm.runtime.tokenize(prompt), MAX_TOKENS), (shape, prompt)
    _check_replays(runs, max_bs)
    stats = llm.runtime.stats()
    assert stats.pages_used == 0 and stats.slots_used == 0


@pytest.mark.parametrize("shape", list(qwen4_cases.SHAPES))
@pytest.mark.parametrize("max_prefill_length", [16, 8192], ids=["chunked16", "unchunked"])
def test_qwen4_exp_float32_greedy_with_graphs_equals_transformers(shape, max_prefill_length):
    llm = LLM(
        model=str(qwen4_cases.checkpoint(shape)),
        dtype="float32",
        device="cuda",
        max_prefill_length=max_prefill_length,
        page_size=qwen4_cases.PAGE_SIZE,
        cuda_graph_max_bs=4,
    )
    runs = _record_replays(llm)
    batch = qwen4_cases.prompts(4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, output in zip(batch, outputs):
        assert output.error is None, output.error
        assert output.token_ids == qwen4_cases.reference_greedy(shape, prompt, MAX_TOKENS), (shape, len(prompt))
    _check_replays(runs, 4)


def test_enforce_eager_and_torch_kernels_capture_nothing(demo_checkpoint):
    assert LLM(model=str(demo_checkpoint), device="cuda", enforce_eager=True).runtime.engine.graph_runner is None
    assert LLM(model=str(demo_checkpoint), device="cuda", kernel_backend="torch").runtime.engine.graph_runner is None


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen4_exp"])
def test_eager_forward_has_no_host_sync(demo_checkpoint, family):
    """A mixed step (a decode and a prefill chunk) of either family runs without one device->host
    sync (torch raises on any under sync debug mode "error"); so does the graphs' decode path."""
    path = demo_checkpoint if family == "qwen3_5_moe" else qwen4_cases.checkpoint("blocks_of_a_page")
    llm = LLM(model=str(path), dtype="float32", device="cuda", page_size=4, enforce_eager=True)
    engine = llm.runtime.engine
    tokens = list(range(3, 40))
    entries = [
        BatchEntry(tokens, 20, 1, [1, 2, 3, 4, 5, 6], 1, "last"),  # a decode at position 20
        BatchEntry(tokens, 8, 16, [7, 8, 9, 10, 11, 12], 2, "last"),  # a chunk of 16 after 8 tokens
    ]
    batch = engine.build_forward_batch(entries)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            logits = engine.model(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (2, engine.vocab_size) and torch.isfinite(logits).all()
