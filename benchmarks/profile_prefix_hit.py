"""Where a prefix hit's time to first token goes: ``freetoken bench --workload shared-prefix`` with
the timed round's uncached and cached requests each under ``torch.profiler`` (issue 12).

    python benchmarks/profile_prefix_hit.py --preset qwen3.6-35b-a3b --workload shared-prefix \\
        --input-len 8192 --shared-prefix-len 7680 --repeats 1 --max-running-requests 4 [--quantization nvfp4]

Arguments go to ``freetoken bench`` (``--repeats 1``: a warm-up round, then the profiled one). For
each profiled request it prints its TTFT and wall time, the GPU's busy time (the union of its
activities) against their span, the kernels by summed time, the host ops and the idle gaps over
0.2 ms on the GPU timeline. The profiler (CPU activity on) slows the host: the bench's own TTFT
figures of this run are not the unprofiled ones.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken import cli
from freetoken.bench import shared_prefix
from freetoken.bench.timing import busy_time, gpu_activities, kernel_table

# The bench's requests in order: a warm-up round (uncached, priming, cached), then the timed one.
PROFILED = {4: "uncached", 6: "cached"}
_unprofiled = shared_prefix._ttft_and_cached
_calls = 0


def _print_profile(kind: str, ttft: float, wall: float, cached: int, prof: profile) -> None:
    acts = sorted(gpu_activities(prof), key=lambda a: a[1])
    first, last = acts[0][1], max(a[2] for a in acts)
    busy = busy_time([(start, end) for _, start, end in acts])
    print(f"{kind}: TTFT {ttft * 1e3:.2f} ms, wall {wall * 1e3:.2f} ms, {cached} tokens cached, {len(acts)} GPU "
          f"activities, busy {busy / 1e6:.2f} ms of a {(last - first) / 1e6:.2f} ms span")
    for row in kernel_table(acts, 1)[:28]:
        print(f"  {row['name'][:90]:90s} {row['launches_per_step']:6.0f} {row['us_per_step']:10.1f} us "
              f"{100 * row['share']:5.1f}%")
    print("  host ops:")
    for op in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:12]:
        print(f"    {op.key[:70]:70s} {op.count:6d} {op.cpu_time_total / 1e3:9.2f} ms")
    reach, gaps = acts[0][2], []
    for name, start, end in acts[1:]:
        if start - reach > 2e5:
            gaps.append(f"+{(start - reach) / 1e6:.2f} ms at {(start - first) / 1e6:.1f} before {name[:40]}")
        reach = max(reach, end)
    print(f"  {len(gaps)} idle gaps over 0.2 ms: " + "; ".join(gaps[:20]))


def _profiled(llm, prompt: list[int]) -> tuple[float, int]:
    global _calls
    _calls += 1
    kind = PROFILED.get(_calls)
    if kind is None:
        return _unprofiled(llm, prompt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        ttft, cached = _unprofiled(llm, prompt)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    _print_profile(kind, ttft, wall, cached, prof)
    return ttft, cached


if __name__ == "__main__":
    shared_prefix._ttft_and_cached = _profiled
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
