"""Start-up objects are frozen out of the garbage collector's scans (``runtime.freeze_startup_objects``)."""

from __future__ import annotations

import gc

from freetoken import LLM, SamplingParams


def test_runtime_freezes_what_start_up_built_and_still_generates(demo_checkpoint):
    gc.unfreeze()  # tests/conftest.py unfreezes after each test too
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")
    frozen = gc.get_freeze_count()
    # a full collection scans only what is not frozen: far fewer objects than start-up built
    assert frozen > 10 * len(gc.get_objects())
    (out,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3
