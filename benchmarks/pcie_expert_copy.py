"""How fast do expert-sized host-to-device copies run, as the expert cache issues them?

The offloaded 8k prefill is bound by its copies (issue 11). The host store and the device cache
keep a layer's experts in the engine's layout (``experts.span``, imported here): bf16 experts as
their weight parts (``w13`` 4.2 MB and ``w2`` 2.1 MB), which ``DeviceSlots.fill`` copies part by
part (two ``cudaMemcpyAsync`` an expert); NVFP4 experts as one byte span an expert with the six
parts (codes, e4m3 block scales, float32 row scales of ``w13`` and ``w2``) strided views of it,
which the cache copies as one span (one ``cudaMemcpyAsync``; before session 25 it copied the six
parts). This times the same batch of experts, from pinned host memory into slots on one copy
stream, copied (a) part by part (the parts' views of the spans: the bf16 cache, and the NVFP4
cache before), (b) as one span per expert (the NVFP4 cache), (c) part by part alternating over
two copy streams, (d) as one copy of the whole batch (the bandwidth ceiling), and prints GB/s for
each, so the per-copy cost is measured rather than guessed.

    python benchmarks/pcie_expert_copy.py [--experts 400] [--nvfp4]
"""

from __future__ import annotations

import argparse

import torch

from freetoken.experts.span import SpanLayout

HIDDEN, INTERMEDIATE, EXPERTS = 2048, 512, 256  # Qwen3.6-35B-A3B's expert shape


def _layout(nvfp4: bool) -> SpanLayout:
    """One expert's parts as the engine lays them out (``experts.span``; shapes only)."""
    def part(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((EXPERTS, *shape), dtype=dtype, device="meta")

    if not nvfp4:
        return SpanLayout.of([part(2 * INTERMEDIATE, HIDDEN, dtype=torch.bfloat16),
                              part(HIDDEN, INTERMEDIATE, dtype=torch.bfloat16)])
    # NVFP4: packed codes, one e4m3 scale per 16 weights, one float32 row scale, per weight.
    parts = []
    for rows, cols in ((2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)):
        parts += [part(rows, cols // 2, dtype=torch.uint8), part(rows, cols // 16, dtype=torch.float8_e4m3fn),
                  part(rows, dtype=torch.float32)]
    return SpanLayout.of(parts)


def _time(fn, streams: list[torch.cuda.Stream], repeats: int) -> float:
    """Milliseconds of one ``fn()`` (which queues copies on ``streams``), from the first stream's
    start to the end of all of them, median over ``repeats``."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(streams[0])
        for s in streams[1:]:
            s.wait_event(start)
        fn()
        for s in streams[1:]:
            streams[0].wait_stream(s)
        end.record(streams[0])
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[1:])[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=400, help="experts copied per batch (400)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nvfp4", action="store_true", help="NVFP4 experts' parts instead of bf16")
    args = parser.parse_args()
    layout = _layout(args.nvfp4)
    expert_bytes = layout.nbytes
    n = args.experts
    gen = torch.Generator().manual_seed(0)
    host_flat = layout.empty(EXPERTS, "cpu", pin=True)
    dev_flat = layout.empty(n, "cuda")
    host_parts, dev_parts = layout.views(host_flat), layout.views(dev_flat)
    order = torch.randperm(EXPERTS, generator=gen)[: min(n, EXPERTS)].tolist()
    picks = [order[i % len(order)] for i in range(n)]  # host experts, in the cache's random order
    one, two = torch.cuda.Stream(), [torch.cuda.Stream(), torch.cuda.Stream()]

    def by_part() -> None:
        with torch.cuda.stream(one):
            for slot, e in enumerate(picks):
                for dst, src in zip(dev_parts, host_parts):
                    dst[slot].copy_(src[e], non_blocking=True)

    def by_expert() -> None:
        with torch.cuda.stream(one):
            for slot, e in enumerate(picks):
                dev_flat[slot].copy_(host_flat[e], non_blocking=True)

    def two_streams() -> None:
        for slot, e in enumerate(picks):
            with torch.cuda.stream(two[slot % 2]):
                for dst, src in zip(dev_parts, host_parts):
                    dst[slot].copy_(src[e], non_blocking=True)

    whole_host = torch.empty(n * expert_bytes, dtype=torch.uint8, pin_memory=True)
    whole_dev = torch.empty_like(whole_host, device="cuda")

    def whole() -> None:
        with torch.cuda.stream(one):
            whole_dev.copy_(whole_host, non_blocking=True)

    total = n * expert_bytes
    kind = "NVFP4" if args.nvfp4 else "bf16"
    print(f"{n} {kind} experts of {expert_bytes / 1e6:.2f} MB ({len(host_parts)} parts), {total / 1e9:.2f} GB a batch")
    cache = " (the cache)"
    for name, fn, streams in ((f"part by part, one stream{'' if args.nvfp4 else cache}", by_part, [one]),
                              (f"one span per expert, one stream{cache if args.nvfp4 else ''}", by_expert, [one]),
                              ("part by part, two streams alternating", two_streams, two),
                              ("the whole batch as one copy", whole, [one])):
        ms = _time(fn, streams, args.repeats)
        print(f"{name}: {ms:.2f} ms, {total / ms / 1e6:.1f} GB/s, {ms * 1e3 / n:.1f} us an expert")


if __name__ == "__main__":
    main()
