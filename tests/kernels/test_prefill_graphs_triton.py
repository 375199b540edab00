"""Prefill graphs' static batch through the Triton kernels (the interpreter on the CPU, run eagerly
by the runner; on a GPU the engine's own captured graphs replay it): the padding row (also an
empty one), attention tiles sized by the bucket, the delta rule over fixed-size chunk tables with
dummy snapshots and spare chunks, and the general conv-window path; float32 greedy tokens equal
transformers' for two rows in one bucket, a prefix hit whose remainder snapshots inside it, and a
prompt that fills its bucket."""

from __future__ import annotations

import random

from freetoken import LLM, SamplingParams
from freetoken.engine.prefill_graphs import GraphShape, PrefillGraphRunner
from kernel_checks import DEVICE
from oracle import EOS, PAGE_SIZE, Case, checkpoint, reference_greedy

CASE = Case("qwen3_5_moe", "two_layers")
MAX_TOKENS = 4


def test_prefill_graph_batches_through_triton_equal_transformers():
    llm = LLM(model=str(checkpoint(CASE)), dtype="float32", device=DEVICE.type, kernel_backend="triton",
              max_prefill_length=512, page_size=PAGE_SIZE, num_pages=256, max_running_requests=4,
              prefill_cuda_graph_max_tokens=64, prefill_cuda_graph_max_seqs=2, cuda_graph_max_bs=2)
    engine = llm.runtime.engine
    if engine.prefill_runner is None:  # the CPU: the runner's eager mode, on the interpreter
        engine.prefill_runner = PrefillGraphRunner(engine.model, engine.device, [64], 2, engine.max_pages_per_request,
                                                   engine.max_model_len, use_graphs=False)
    runner = engine.prefill_runner
    assert runner.sizes == [64] and runner.max_rows == 2
    runs: list[tuple[GraphShape, int, int]] = []
    run = runner.run
    runner.run = lambda batch, snapshots: runs.append((runner.shape_of(batch), batch.num_tokens, len(snapshots))) or run(
        batch, snapshots)
    rng = random.Random(0)
    p, q, r = ([rng.randrange(EOS - 3) for _ in range(n)] for n in (40, 20, 64))
    extended = p + [rng.randrange(EOS - 3) for _ in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # p and q together (snapshots at 36 and 16), the extension hits 36 (its 34 tokens snapshot 68
    # inside), r fills the bucket (the padding row is empty).
    steps = [([p, q], [0, 0], (GraphShape(2, 64), 60, 2)), ([extended], [36], (GraphShape(1, 64), 34, 1)),
             ([r], [0], (GraphShape(1, 64), 64, 1))]
    for prompts, hits, shape in steps:
        runs.clear()
        outputs = llm.generate([{"prompt_token_ids": x} for x in prompts], params)
        assert runs == [shape]
        for prompt, output, hit in zip(prompts, outputs, hits):
            assert output.error is None and output.num_cached_tokens == hit
            assert output.token_ids == reference_greedy(checkpoint(CASE), prompt, MAX_TOKENS)
