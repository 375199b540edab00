"""The offloaded decode's expert cache on requests with a prefill, on the CPU (issue 11):

    python benchmarks/expert_offload_sim.py [--requests 4] [--prompt 256] [--decode 512] [--json FILE]

Each request prefills a ``--prompt``-token chunk, then decodes ``--decode`` tokens at batch 1,
through the engine's own cache bookkeeping (``freetoken.bench.offload_sim``: the eager path's
passes for the chunk; for the zero-copy decode, the slots lent before each step from the misses of
the steps settled, a step late, and the read-through fill of the misses into them). Routing: the
trace of ``freetoken.bench.routing_trace`` (fitted to Qwen3 MoE statistics; a request's prompt and
decode share its request skew, the prompt's tokens come first), and the bench's ``--routing
fitted`` (the corpus skew alone on a random router: no request skew, no token persistence). Printed
per routing, residency and policy: the decode hit rate of the first 32 steps after each prefill and
of the rest (requests after the first), misses (reads from host memory) and read-through fills (the
misses written into a lent slot; the others are missed again when routed again) per step, and the
missed experts' PCIe ms per step (bf16, 6.3 MB at 55 GB/s).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from freetoken.bench.offload_sim import OffloadReplay
from freetoken.bench.routing_trace import QWEN3_ROUTING, generate_trace
from freetoken.experts.eviction import DEFAULT_POLICY, make_policy

LAYERS, EXPERTS, TOP_K = 40, 256, 8  # Qwen3.6-35B-A3B
EXPERT_MS = 6.3e6 / 55e9 * 1e3  # one bf16 expert over PCIe
AFTER_PREFILL = 32
# The bench's --routing fitted: G rescaled to the random router's unit logit spread, nothing else.
BENCH_ROUTING = replace(QWEN3_ROUTING, global_skew=QWEN3_ROUTING.global_skew / (1 + QWEN3_ROUTING.request_skew**2) ** 0.5,
                        request_skew=0.0, persistence=0.0, drift_share=0.0)
ROUTINGS = {"trace": QWEN3_ROUTING, "bench-fitted": BENCH_ROUTING}


def run(routing: str, residency: float, policy: str, requests: int, prompt: int, decode: int, seed: int) -> dict:
    model = replace(ROUTINGS[routing], request_tokens=prompt + decode)
    trace = generate_trace(LAYERS, EXPERTS, TOP_K, requests * (prompt + decode), seed=seed, model=model)[:, 0]
    replay = OffloadReplay(round(residency * LAYERS * EXPERTS), make_policy(policy), EXPERTS)
    early, late = [], []
    for r in range(requests):
        start = r * (prompt + decode)
        replay.prefill(trace[start : start + prompt])
        steps = replay.decode(trace[start + prompt : start + prompt + decode])
        if r:  # the first request starts from an empty cache
            early.append(steps.hit_rate(0, AFTER_PREFILL))
            late.append((steps.hit_rate(AFTER_PREFILL), steps.per_step(steps.misses, AFTER_PREFILL),
                         steps.per_step(steps.read_through_fills, AFTER_PREFILL)))
    n = len(late)
    misses = sum(m for _, m, _ in late) / n
    return dict(routing=routing, residency=residency, policy=policy,
                hit_rate_after_prefill=sum(early) / n, hit_rate_steady=sum(h for h, _, _ in late) / n,
                misses_per_step=misses, read_through_fills_per_step=sum(f for _, _, f in late) / n,
                miss_floor_ms_per_step=misses * EXPERT_MS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=512)
    parser.add_argument("--residencies", type=float, nargs="+", default=[0.5])
    parser.add_argument("--routings", nargs="+", choices=sorted(ROUTINGS), default=sorted(ROUTINGS))
    parser.add_argument("--policies", nargs="+", default=[DEFAULT_POLICY])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be >= 2 (the first one starts from an empty cache)")
    rows = []
    print(f"| routing | resident | policy | hit rate, {AFTER_PREFILL} steps after prefill | hit rate after | "
          "misses / step | read-through fills / step | missed experts' PCIe ms / step |\n|---|---:|---|---:|---:|---:|---:|---:|")
    for routing in args.routings:
        for residency in args.residencies:
            for policy in args.policies:
                start = time.perf_counter()
                row = run(routing, residency, policy, args.requests, args.prompt, args.decode, args.seed)
                row["seconds"] = time.perf_counter() - start
                rows.append(row)
                print(f"| {routing} | {100 * residency:.0f}% | {policy} | {100 * row['hit_rate_after_prefill']:.1f}% | "
                      f"{100 * row['hit_rate_steady']:.1f}% | {row['misses_per_step']:.1f} | {row['read_through_fills_per_step']:.1f} | "
                      f"{row['miss_floor_ms_per_step']:.2f} |", flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
