"""Host time of the zero-copy decode's expert-cache bookkeeping around each step, on the CPU:

    python benchmarks/decode_settle_host_time.py [--slots 5120] [--steps 400] [--warmup 100]

At the H200 bench's sizes (``freetoken bench --preset qwen3.6-35b-a3b --moe-offload
--expert-cache-slots 5120 --routing trace``, batch 1): 40 layers of 256 experts, top-8, routed
along the fitted trace (``bench.routing_trace.generate_trace``); the experts' widths are shrunk, so
what is timed is the host's bookkeeping. Each step does what the overlapped loop does around one
decode forward: ``between_steps`` (what arrived settled, slots lent for the read-through fill:
evicting ahead, the victims unmapped, the lend ring written), the forward (stood in for, untimed:
the routing launch's writes into the log, a hit where the slot map holds the expert, each distinct
miss claiming the next lent slot and mapping it), ``collect`` (the record queued to the host), and
the step's ``settle`` (counted, told to the policy, claims booked). Prints ms per step of each
part, mean over the steps after the warm-up. On the H200 the bench reports the settle as "settle
host ms/step"; this measures it, and the lending beside it, without a GPU.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from freetoken.bench.routing_trace import generate_trace
from freetoken.experts.offload import ExpertOffload
from freetoken.experts.store import OffloadedExperts
from offload_prefill_host_time import Timer

LAYERS, EXPERTS, TOP_K = 40, 256, 8
INTERMEDIATE, HIDDEN = 2, 4  # shrunk: no copy is made on this path, the weights are never read
PARTS = ("between_steps", "collect", "settle")


def build(slots: int) -> ExpertOffload:
    offload = ExpertOffload("lrfu", pin=False)
    for _ in range(LAYERS):
        layer = OffloadedExperts(EXPERTS, INTERMEDIATE, HIDDEN, TOP_K, offload)
        shared = (torch.zeros(2 * INTERMEDIATE, HIDDEN), torch.zeros(HIDDEN, INTERMEDIATE))
        layer.shared = lambda shared=shared: shared
    offload.allocate(slots, torch.device("cpu"), decode_tokens=1)
    assert offload.zero_copy
    return offload


def forward(offload: ExpertOffload, routed: np.ndarray) -> None:
    """The zero-copy decode forward's writes for one token's ``routed`` ``[layers, top_k]`` ids, as
    the routing launches make them (``kernels.moe_decode_offload``)."""
    assert offload.log is not None and offload.lender is not None and offload.slots is not None
    slot_map = offload.slots.slot_map.numpy()
    lend = offload.lender.lend.numpy()
    ids, fills = offload.log.buffer.numpy(), offload.log.fills.numpy()
    claimed, limit, ring = int(lend[0]), int(lend[1]), lend[2:]
    for layer, experts in enumerate(routed):
        for choice, expert in enumerate(experts):
            slot = slot_map[layer, expert]
            if slot >= 0:
                ids[layer, 0, choice] = expert
                continue
            ids[layer, 0, choice] = -1 - expert
            if claimed < limit:
                slot_map[layer, expert] = fills[layer, 0, choice] = ring[claimed % len(ring)]
                claimed += 1
    lend[0] = claimed


def run(slots: int, steps: int, warmup: int) -> dict[str, float]:
    offload = build(slots)
    trace = generate_trace(LAYERS, EXPERTS, TOP_K, warmup + steps)[:, 0]
    timer = Timer()  # offload_prefill_host_time's: each call of a wrapped method timed under a part
    for name in PARTS:
        timer.wrap(offload, name, name)
    for step, routed in enumerate(trace):
        if step == warmup:
            timer.seconds.clear()
        offload.between_steps()
        forward(offload, routed)
        offload.collect(1)
        offload.settle()
    counters = offload.counters
    result = {f"{name}_ms": timer.seconds[name] * 1e3 / steps for name in PARTS}
    result["total_ms"] = sum(result.values())
    result["hit_rate"] = counters.decode_hits / max(counters.decode_hits + counters.decode_misses, 1)
    result["fills_per_step"] = counters.read_through_fills / (warmup + steps)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=5120)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()
    result = run(args.slots, args.steps, args.warmup)
    print(f"{args.slots} slots, {args.steps} steps after {args.warmup}: hit rate {result['hit_rate']:.1%}, "
          f"{result['fills_per_step']:.1f} read-through fills a step")
    print("  ".join(f"{name} {result[f'{name}_ms']:.3f}" for name in PARTS) + f"  total {result['total_ms']:.3f} ms/step")


if __name__ == "__main__":
    main()
