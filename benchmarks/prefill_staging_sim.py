"""Where an offloaded prefill's expert copies should go, on the CPU (issue 11, deliverable 5):

    python benchmarks/prefill_staging_sim.py [--requests 3] [--prompt 8192] [--decode 256] [--json FILE]

Two designs for the copies a prompt chunk makes (``freetoken.bench.offload_sim``, the engine's own
cache bookkeeping at the Qwen3.6-35B-A3B shape, half of the experts cached):

- ``insert``: into cache slots (what the engine does: the victims are the chunk's passed layers'
  experts once it routes half of its layers' experts, ``SlotTable.passed``, else the policy's):
  the chunk's experts stay cached for its decode, and evict what the cache held (an earlier or a
  running request's);
- ``staged``: into a staging area of two layers' experts taken out of the cache (512 slots): the
  cache keeps its content, so every chunk copies all its misses again, and its decode starts from
  the cache as the chunk found it.

Scenarios, per request after the first (which starts from an empty cache): ``sequential`` (batch 1:
prompt, then its decode), where the figure is the PCIe traffic of a whole request (the chunk's
copies + its decode's misses, each read or copied once with read-through fills); and ``foreign``
(a request's decode interrupted halfway by another prompt's chunk, as a batch of two sees when a
request is admitted), where it is the running decode's misses after the foreign chunk.

Prompt routings: ``trace``, the routing model's tokens (per-token noise of unit variance: an 8k
chunk routes about 235 of a layer's 256 experts), and ``bench``, the bench's ``--routing trace``
prefill (the request's logits over a third of the noise: about 77 of 256). Decode follows the
routing model, sharing the request's skew with its prompt.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from freetoken.bench.offload_sim import OffloadReplay
from freetoken.bench.routing_trace import QWEN3_ROUTING, TRACE_LOGIT_SCALE, generate_trace
from freetoken.experts.eviction import DEFAULT_POLICY, make_policy

LAYERS, EXPERTS, TOP_K = 40, 256, 8  # Qwen3.6-35B-A3B
SLOTS = LAYERS * EXPERTS // 2
STAGING = 2 * EXPERTS  # two layers' experts: the one computing and the one being copied
EXPERT_MS = 6.3e6 / 55e9 * 1e3  # one bf16 expert over PCIe
# The bench's prefill routing (``TraceRouting``): TRACE_LOGIT_SCALE x (G + S) + the random router's
# unit noise, i.e. G + S + noise / TRACE_LOGIT_SCALE: in the model's units, skews scaled up.
BENCH_PROMPT = replace(QWEN3_ROUTING, global_skew=TRACE_LOGIT_SCALE * QWEN3_ROUTING.global_skew,
                       request_skew=TRACE_LOGIT_SCALE * QWEN3_ROUTING.request_skew, persistence=0.0,
                       drift_share=0.0)


def traces(requests: int, prompt: int, decode: int, routing: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request, its prompt and decode routed ids ``[tokens, layers, top_k]``. The two models
    draw the same normals (same seed, same draws), so a prompt and its decode share their request
    skew whatever the prompt's scales."""
    steps = requests * (prompt + decode)
    model = replace(QWEN3_ROUTING, request_tokens=prompt + decode)
    decoded = generate_trace(LAYERS, EXPERTS, TOP_K, steps, seed=seed, model=model)[:, 0]
    prompted = decoded
    if routing == "bench":
        prompted = generate_trace(LAYERS, EXPERTS, TOP_K, steps, seed=seed,
                                  model=replace(BENCH_PROMPT, request_tokens=prompt + decode))[:, 0]
    shape = (requests, prompt + decode, LAYERS, TOP_K)
    return prompted.reshape(shape)[:, :prompt], decoded.reshape(shape)[:, prompt:]


def run(scenario: str, routing: str, mode: str, requests: int, prompt: int, decode: int, seed: int) -> dict:
    staged = mode == "staged"
    # ``foreign`` needs a second prompt per request: the requests after ``requests`` lend theirs.
    prompts, decodes = traces(2 * requests if scenario == "foreign" else requests, prompt, decode, routing, seed)
    replay = OffloadReplay(SLOTS - (STAGING if staged else 0), make_policy(DEFAULT_POLICY), EXPERTS)
    chunk_copies, decode_misses, decode_uses = [], [], []
    for r in range(requests):
        copies = replay.prefill(prompts[r], staged)
        if scenario == "sequential":
            steps = replay.decode(decodes[r])
            misses, uses = sum(steps.misses), sum(steps.uses)
        else:
            replay.decode(decodes[r][: decode // 2])
            replay.prefill(prompts[requests + r], staged)  # another request's chunk
            steps = replay.decode(decodes[r][decode // 2 :])
            misses, uses = sum(steps.misses), sum(steps.uses)
        if r:
            chunk_copies.append(copies)
            decode_misses.append(misses)
            decode_uses.append(uses)
    n = len(chunk_copies)
    copies, misses = sum(chunk_copies) / n, sum(decode_misses) / n
    return dict(scenario=scenario, routing=routing, mode=mode, cache_slots=replay.table.num_slots,
                chunk_copies=copies, decode_misses=misses, decode_hit_rate=1 - sum(decode_misses) / sum(decode_uses),
                pcie_experts=copies + misses if scenario == "sequential" else misses,
                pcie_ms=(copies + misses if scenario == "sequential" else misses) * EXPERT_MS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be >= 2 (the first one starts from an empty cache)")
    rows = []
    print("| scenario | prompt routing | copies into | cache slots | chunk's copies | decode misses | decode hit rate | "
          "PCIe experts (ms) |\n|---|---|---|---:|---:|---:|---:|---:|")
    for scenario in ("sequential", "foreign"):
        for routing in ("trace", "bench"):
            for mode in ("insert", "staged"):
                row = run(scenario, routing, mode, args.requests, args.prompt, args.decode, args.seed)
                rows.append(row)
                print(f"| {scenario} | {routing} | {mode} | {row['cache_slots']:,} | {row['chunk_copies']:,.0f} | "
                      f"{row['decode_misses']:,.0f} | {100 * row['decode_hit_rate']:.1f}% | "
                      f"{row['pcie_experts']:,.0f} ({row['pcie_ms']:.0f}) |", flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
