"""Device time per kernel of one prompt's prefill through ``LLM.generate`` (a preset architecture with
random weights on the GPU), grouped by op: where a prefill chunk's time goes, and which launches
cost more than 5% of it (issue 10, item 4).

    python benchmarks/profile_prefill.py [--preset qwen3.6-35b-a3b] [--input-len 8192]
                                         [--max-prefill-length 8192] [--num-layers N] [--top 25]

A warm-up prompt first (kernels compile), then one prompt of ``--input-len`` random tokens and one
output token under ``torch.profiler`` (CUDA activity only). Prints the wall time, the device time
per group (the table below: kernel-name patterns, first match wins) and the largest kernels.
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken.bench.presets import PRESETS, write_preset_dir
from freetoken.core import SamplingParams
from freetoken.llm import LLM

GROUPS = (
    ("GDN chunked prefill", r"_intra_chunk|_state_pass|_output_kernel|_chunk_inverse|_wy_kernel|_chunk_scan"),
    ("attention", r"_attention_kernel|_merge_splits|_store_kv"),
    ("MoE expert GEMMs", r"_gate_up_kernel|_down_kernel"),
    ("MoE routing, sort, sum", r"_topk_softmax|_block_counts|_block_prefix|_place_kernel|_count_kernel|_scatter_kernel"
     r"|_sum_choices|_shared_combine|_silu_and_mul"),
    ("norms", r"_rms_norm"),
    ("rotary", r"_rotary"),
    ("conv1d", r"_conv_"),
    ("dense GEMMs (cuBLAS)", r"gemm|cutlass|sm90_xmma|nvjet|Kernel2"),
    ("sampling", r"_sample"),
)


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name)), "other")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.6-35b-a3b")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--max-prefill-length", type=int, default=8192)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_preset_dir(args.preset, scratch, args.num_layers)
        pages = 2 * (args.input_len // 16 + 2) + 1
        llm = LLM(model=str(model_dir), load_format="dummy", max_prefill_length=args.max_prefill_length,
                  max_running_requests=1, num_pages=pages)
        vocab = llm.runtime.engine.vocab_size
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def prompt() -> list[dict]:
            return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}]

        llm.generate(prompt(), params)  # compiles every kernel of the path
        request = prompt()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(request, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time * 1e-3  # ms
    total = max(sum(kernels.values()), 1e-9)
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms
    print(f"{args.preset}, {args.num_layers or 'all'} layers, prompt {args.input_len}, "
          f"--max-prefill-length {args.max_prefill_length}: wall {wall * 1e3:.1f} ms, device {total:.1f} ms")
    print("| group | ms | share |\n|---|---:|---:|")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {group} | {ms:.2f} | {100 * ms / total:.1f}% |")
    print("| kernel | ms | share |\n|---|---:|---:|")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {name[:80]} | {ms:.2f} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    main()
