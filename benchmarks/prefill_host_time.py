"""Where the host time of one prompt's prefill goes, unprofiled: the part of the time to first token
that is not the forward on the device.

    python benchmarks/prefill_host_time.py [--preset qwen3.6-35b-a3b] [--input-len 8192]
                                           [--max-prefill-length 8192] [--repeats 5]
    # on a CPU: the preset's layers and vocabulary at the demo model's widths, forward skipped
    python benchmarks/prefill_host_time.py --tiny --no-forward --input-len 8192 --repeats 5

``LLM.generate`` of one prompt and one output token (a preset with random weights, as
benchmarks/profile_prefill.py runs it), after a warm-up prompt. The host phases are timed with
``time.perf_counter`` around the runtime's, the scheduler's, the engine's and the model's own
methods (tokenize and validate, schedule, slot copies and resets, sampling admission, staging, the
forward's launches, sampling, landing the token); the forward's device time with CUDA events around
it (on the CPU, its wall time). "host before the forward" is the time from ``generate`` to the
forward's first launch: until then the GPU has next to nothing to do, so all of it is on the time
to first token. Phases the engine queues after the forward's launch (sampling admission, since it
is staged behind the forward) overlap the forward on a GPU. Prints the median of ``--repeats``
prompts, in ms.

``--tiny`` keeps what the host work scales with (the preset's layers, so per-layer launches; its
vocabulary, so the sampling tables; pages and tokens) and shrinks the widths, so it runs on a CPU.
``--no-forward`` replaces the model's forward by zero logits (the host work does not read them): a
tiny model's 8k-token forward still takes ~20 s on a laptop-class CPU with the torch ops.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from freetoken.bench.presets import PRESETS, write_preset_dir
from freetoken.core import SamplingParams
from freetoken.llm import LLM

# The demo model's widths (freetoken.demo.DEMO_TEXT_CONFIG) over a preset's layers and vocabulary.
TINY_WIDTHS = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, hc_lowrank=16,
    indexer_n_heads=2, indexer_head_dim=16, heads_per_ngram=2,
)


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


def write_model_dir(preset: str, scratch: str, tiny: bool) -> Path:
    model_dir = write_preset_dir(preset, scratch)
    if tiny:
        path = model_dir / "config.json"
        config = json.loads(path.read_text())
        config.update({k: v for k, v in TINY_WIDTHS.items() if k in config}, dtype="float32")
        path.write_text(json.dumps(config))
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.6-35b-a3b")
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--max-prefill-length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the preset's layers and vocabulary, the demo's widths")
    parser.add_argument("--no-forward", action="store_true", help="the model's forward returns zero logits")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_model_dir(args.preset, scratch, args.tiny)
        pages = 2 * (args.input_len // 16 + 2) + 1
        llm = LLM(model=str(model_dir), load_format="dummy", max_prefill_length=args.max_prefill_length,
                  max_running_requests=1, num_pages=pages, device=args.device)
        runtime, engine = llm.runtime, llm.runtime.engine
        cuda = engine.device.type == "cuda"
        if not cuda:  # the host work is one thread's; intra-op threads would time OpenMP on a busy CPU
            torch.set_num_threads(1)
        if args.no_forward:
            def zero_logits(batch):
                return torch.zeros(len(batch.logits_indices), engine.vocab_size, device=engine.device)

            engine.model.forward = zero_logits
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
            (engine.model, "copy_slots", "slot copies (prefix snapshots)"),
            (engine.model, "reset_slots", "slot resets"),
            (engine.sampler, "admit", "sampling admission"),
            (engine.buffers, "stage", "stage (inputs to the device)"),
            (engine, "_prefill_snapshots", "in-forward snapshot tables"),
            (engine.sampler, "sample", "sample: launches (host)"),
            (runtime.scheduler, "launched", "launched (prefix index)"),
            (runtime, "_land", "land (waits for the token, detokenizes)"),
        ]:
            timed(obj, name, label, times)
        marks: dict[str, float] = {}
        device_seconds: list[float] = []
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def forward_timed(fn):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                marks.setdefault("forward", time.perf_counter())
                start = time.perf_counter()
                if cuda:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                out = fn(*a, **k)
                if cuda:
                    end.record()
                    events.append((begin, end))
                else:
                    device_seconds.append(time.perf_counter() - start)
                times["forward: launches (host)"] += time.perf_counter() - start
                return out

            return wrapper

        engine._forward = forward_timed(engine._forward)
        if engine.prefill_runner is not None:
            engine.prefill_runner.run = forward_timed(engine.prefill_runner.run)
        rows: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeats):
            times.clear()
            events.clear()
            device_seconds.clear()
            marks.clear()
            request = prompt()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(request, params)
            wall = time.perf_counter() - start
            if cuda:
                torch.cuda.synchronize()
                device_seconds.append(sum(b.elapsed_time(e) for b, e in events) * 1e-3)
            forward = sum(device_seconds)
            rows["generate (wall)"].append(wall)
            rows["forward on the device"].append(forward)
            rows["not the forward on the device"].append(wall - forward)
            rows["host before the forward"].append(marks["forward"] - start)
            for label, seconds in times.items():
                rows[label].append(seconds)
    print(f"{args.preset}{' (tiny)' if args.tiny else ''} on {engine.device.type}"
          f"{', no forward' if args.no_forward else ''}, prompt {args.input_len}, "
          f"--max-prefill-length {args.max_prefill_length}: median of {args.repeats}, ms")
    for label, values in rows.items():
        print(f"  {label:>44}: {statistics.median(values) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
