"""Shared by the padded-decode tests of both families: an ``LLM`` whose engine replays decode steps
through a ``DecodeGraphRunner`` in its eager mode (the padded static batch a graph would capture,
run as plain calls), recording the padded sizes it ran."""

from __future__ import annotations

from freetoken import LLM
from freetoken.engine.graph_runner import DecodeGraphRunner


class RecordingRunner(DecodeGraphRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runs: list[tuple[int, int]] = []  # (requests, padded size) of each replayed step

    def run(self, batch):
        self.runs.append((batch.num_requests, self.padded_size(batch.num_requests)))
        return super().run(batch)


def with_padded_decode(llm: LLM, max_batch_size: int) -> RecordingRunner:
    """Attach an eager-mode runner to ``llm``'s engine (CPU: the engine makes none itself)."""
    engine = llm.runtime.engine
    assert engine.graph_runner is None
    runner = RecordingRunner(
        engine.model, engine.device, max_batch_size, engine.max_pages_per_request, engine.max_model_len, use_graphs=False
    )
    engine.graph_runner = runner
    return runner
