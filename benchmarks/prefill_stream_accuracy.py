"""How well the offloaded prefill stream predicts a chunk's experts on the bench's ``--routing
trace`` (random weights, routers driven by ``bench.routing_trace.TraceRouting``), on the CPU:

    python benchmarks/prefill_stream_accuracy.py [--layers 8] [--tokens 2048] [--requests 3] [--depth 1]

The Qwen3.6-35B-A3B preset's routing shape (256 experts, top-8, its layer pattern) on a shrunk
width (hidden 256, experts of 64), so a CPU runs it; half of the experts cached. Per request (one
chunk, then one decode step): the experts it needed that the cache did not hold, those streamed
in ahead of their layer, those of them used (``prefetch_hits``: a use of a streamed expert not used
since, which may be a later request's), and those copied on demand after the router (not
predicted). The first request starts from an empty cache. ``--depth``: the engine's
``prefill_stream_depth`` (how many layers ahead the stream predicts).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from freetoken import LLM, SamplingParams
from freetoken.bench.presets import preset_config
from freetoken.bench.routing_trace import TraceRouting
from freetoken.demo import build_tokenizer

VOCAB = 4096


def shrunk_preset(layers: int, out: Path) -> Path:
    """The preset's config with its routing shape and a CPU-sized width, and a tokenizer."""
    config = preset_config("qwen3.6-35b-a3b", layers)
    config.hidden_size, config.moe_intermediate_size, config.shared_expert_intermediate_size = 256, 64, 64
    config.vocab_size, config.eos_token_id = VOCAB, None
    config.num_attention_heads, config.head_dim = 4, 64
    config.linear_num_key_heads, config.linear_num_value_heads = 4, 8
    config.linear_key_head_dim = config.linear_value_head_dim = 32
    config.save_pretrained(str(out))
    build_tokenizer(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--depth", type=int, default=1, help="prefill_stream_depth (1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shrunk_preset(args.layers, Path(tmp))
        llm = LLM(model=str(model_dir), load_format="dummy", device="cpu", dtype="float32", moe_offload=True,
                  expert_cache_slots=args.layers * 256 // 2, max_prefill_length=args.tokens,
                  max_model_len=args.tokens + 64, max_running_requests=1,
                  prefill_stream_depth=args.depth)
        engine = llm.runtime.engine
        driver, launch = TraceRouting(engine.model, 0), engine.launch

        def driven(plan):
            driver.before(plan)
            return launch(plan)

        engine.launch = driven
        offload = engine.offload
        generator = torch.Generator().manual_seed(0)
        print("| request | needed (not cached) | streamed ahead | streamed and used | on demand |\n"
              "|---:|---:|---:|---:|---:|")
        for request in range(args.requests):
            before = dataclasses.asdict(offload.counters)
            prompt = torch.randint(0, VOCAB, (args.tokens,), generator=generator).tolist()
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            after = dataclasses.asdict(offload.counters)
            delta = {name: after[name] - before[name] for name in ("misses", "decode_misses", "prefetched", "prefetch_hits")}
            on_demand = delta["misses"] - delta["decode_misses"]
            used = delta["prefetch_hits"]
            print(f"| {request} | {on_demand + used:,} | {delta['prefetched']:,} | {used:,} | {on_demand:,} |", flush=True)


if __name__ == "__main__":
    main()
