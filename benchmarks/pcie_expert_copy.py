"""How fast do expert-sized host-to-device copies run, as the expert cache issues them?

The offloaded 8k prefill is bound by its copies (issue 11). ``DeviceSlots.fill`` copies each
expert as its weight parts (bf16: ``w13`` 4.2 MB and ``w2`` 2.1 MB, two ``cudaMemcpyAsync``) from
pinned host memory into its slot, on one copy stream. This times the same batch of experts copied
(a) part by part, as the cache does, (b) as one contiguous span per expert, (c) part by part
alternating over two copy streams, (d) as one copy of the whole batch (the bandwidth ceiling), and
prints GB/s for each, so the per-copy cost is measured rather than guessed.

    python benchmarks/pcie_expert_copy.py [--experts 400] [--nvfp4]
"""

from __future__ import annotations

import argparse

import torch

HIDDEN, INTERMEDIATE, EXPERTS = 2048, 512, 256  # Qwen3.6-35B-A3B's expert shape


def _parts(nvfp4: bool) -> list[tuple[int, ...]]:
    """Byte shapes of one expert's parts (``[E, ...]`` uint8), as the cache stores them."""
    if not nvfp4:
        return [(2 * INTERMEDIATE, HIDDEN * 2), (HIDDEN, INTERMEDIATE * 2)]
    # NVFP4: packed codes, one e4m3 scale per 16 weights, one float32 row scale, per weight.
    return [(2 * INTERMEDIATE, HIDDEN // 2), (2 * INTERMEDIATE, HIDDEN // 16), (2 * INTERMEDIATE, 4),
            (HIDDEN, INTERMEDIATE // 2), (HIDDEN, INTERMEDIATE // 16), (HIDDEN, 4)]


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
    shapes = _parts(args.nvfp4)
    expert_bytes = sum(r * c for r, c in shapes)
    n = args.experts
    gen = torch.Generator().manual_seed(0)
    host_parts = [torch.empty((EXPERTS, *s), dtype=torch.uint8, pin_memory=True) for s in shapes]
    dev_parts = [torch.empty((n, *s), dtype=torch.uint8, device="cuda") for s in shapes]
    host_flat = torch.empty((EXPERTS, expert_bytes), dtype=torch.uint8, pin_memory=True)
    dev_flat = torch.empty((n, expert_bytes), dtype=torch.uint8, device="cuda")
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
    print(f"{n} {kind} experts of {expert_bytes / 1e6:.2f} MB ({len(shapes)} parts), {total / 1e9:.2f} GB a batch")
    for name, fn, streams in (("part by part, one stream (the cache today)", by_part, [one]),
                              ("one span per expert, one stream", by_expert, [one]),
                              ("part by part, two streams alternating", two_streams, two),
                              ("the whole batch as one copy", whole, [one])):
        ms = _time(fn, streams, args.repeats)
        print(f"{name}: {ms:.2f} ms, {total / ms / 1e6:.1f} GB/s, {ms * 1e3 / n:.1f} us an expert")


if __name__ == "__main__":
    main()
