"""Prefix caching through the Triton kernels (the interpreter on the CPU, compiled on a GPU) with
snapshots inside the prefill chunks: the delta-rule kernel writes them (two requests' in one
forward, then a hit's), and float32 greedy tokens equal transformers' on the hits they give."""

from __future__ import annotations

import random

from freetoken import LLM, SamplingParams
from kernel_checks import DEVICE
from oracle import EOS, PAGE_SIZE, Case, checkpoint, reference_greedy

CASE = Case("qwen3_5_moe", "two_layers")
MAX_TOKENS = 4


def test_snapshots_inside_chunks_through_triton_equal_transformers():
    llm = LLM(model=str(checkpoint(CASE)), dtype="float32", device=DEVICE.type, kernel_backend="triton",
              max_prefill_length=512, page_size=PAGE_SIZE, num_pages=256)
    engine = llm.runtime.engine
    offsets: list[list[int]] = []
    launch = engine.launch
    engine.launch = lambda plan: offsets.append([s.offset for s in plan.snapshots]) or launch(plan)
    rng = random.Random(0)
    p, q = ([rng.randrange(EOS - 3) for _ in range(n)] for n in (150, 101))
    extended = p + [rng.randrange(EOS - 3) for _ in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Together into an empty cache: both snapshot their last full page (148, 100) in one forward;
    # then the extension hits 148 and snapshots 176 inside its chunk; its repeat hits 176.
    runs = [([p, q], [0, 0], [148, 100]), ([extended], [148], [28]), ([extended], [176], [])]
    for prompts, hits, snapshot_offsets in runs:
        offsets.clear()
        outputs = llm.generate([{"prompt_token_ids": x} for x in prompts], params)
        assert offsets[0] == snapshot_offsets and not any(offsets[1:])
        for prompt, output, hit in zip(prompts, outputs, hits):
            assert output.error is None and output.num_cached_tokens == hit
            assert output.token_ids == reference_greedy(checkpoint(CASE), prompt, MAX_TOKENS)
