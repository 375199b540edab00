"""Where the host time of one prompt's prefill goes, unprofiled: the part of the time to first token
that is not the forward on the GPU.

    python benchmarks/prefill_host_time.py [--preset qwen3.6-35b-a3b] [--input-len 8192]
                                           [--max-prefill-length 8192] [--repeats 5]

``LLM.generate`` of one prompt and one output token (a preset with random weights, as
benchmarks/profile_prefill.py runs it), after a warm-up prompt. The host phases are timed with
``time.perf_counter`` around the runtime's and the engine's own methods (tokenize and validate,
schedule, slot resets and sampling admission, staging, the forward's launches, sampling, landing
the token); the forward's GPU time with CUDA events around it. Until the forward's first launch the
GPU has nothing to do: that part of the host time is all on the time to first token. Prints the
median of ``--repeats`` prompts, in ms.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from freetoken.bench.presets import PRESETS, write_preset_dir
from freetoken.core import SamplingParams
from freetoken.llm import LLM


def timed(obj, name: str, label: str, times: dict[str, float]) -> None:
    """Wrap ``obj.name`` so each call adds its host seconds to ``times[label]``."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.6-35b-a3b")
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--max-prefill-length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_preset_dir(args.preset, scratch)
        pages = 2 * (args.input_len // 16 + 2) + 1
        llm = LLM(model=str(model_dir), load_format="dummy", max_prefill_length=args.max_prefill_length,
                  max_running_requests=1, num_pages=pages)
        runtime, engine = llm.runtime, llm.runtime.engine
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def prompt() -> list[dict]:
            return [{"prompt_token_ids": [rng.randrange(engine.vocab_size) for _ in range(args.input_len)]}]

        llm.generate(prompt(), params)  # compiles every kernel of the path
        times: dict[str, float] = defaultdict(float)
        for obj, name, label in [
            (runtime, "make_request", "make_request (tokenize, validate)"),
            (runtime, "submit", "submit (detokenizer)"),
            (runtime.scheduler, "schedule", "schedule (prefix hashes, pages)"),
            (engine, "_prepare", "prepare (slot resets, sampling admission)"),
            (engine.buffers, "stage", "stage (inputs to the device)"),
            (engine, "_forward", "forward: launches (host)"),
            (engine.sampler, "sample", "sample: launches (host)"),
            (runtime, "_land", "land (waits for the token, detokenizes)"),
        ]:
            timed(obj, name, label, times)
        forward = engine._forward
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def forward_with_events(*a, **k):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = forward(*a, **k)
            end.record()
            events.append((begin, end))
            return out

        engine._forward = forward_with_events
        rows: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeats):
            times.clear()
            events.clear()
            request = prompt()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(request, params)
            wall = time.perf_counter() - start
            torch.cuda.synchronize()
            gpu_forward = sum(b.elapsed_time(e) for b, e in events) * 1e-3
            rows["generate (wall)"].append(wall)
            rows["forward on the GPU (events)"].append(gpu_forward)
            rows["not the forward on the GPU"].append(wall - gpu_forward)
            for label, seconds in times.items():
                rows[label].append(seconds)
    print(f"{args.preset}, prompt {args.input_len}, --max-prefill-length {args.max_prefill_length}: "
          f"median of {args.repeats}, ms")
    for label, values in rows.items():
        print(f"  {label:>44}: {statistics.median(values) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
