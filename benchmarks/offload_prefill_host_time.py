"""Host time of an offloaded prompt chunk's per-layer expert bookkeeping (``OffloadedExperts.prepare``),
on the CPU:

    python benchmarks/offload_prefill_host_time.py [--tokens 8192] [--slots 5120] [--chunks 3] [--depth 1]

The sizes the host work scales with are the H200 bench's (``freetoken bench --preset
qwen3.6-35b-a3b --input-len 8192 --moe-offload --expert-cache-slots 5120 --routing trace``): 40
layers of 256 experts, top-8, 5,120 slots, an 8,192-token chunk routed along the fitted trace
(``bench.routing_trace.generate_trace``: corpus and request skew, token persistence); the experts'
widths are shrunk to a few numbers, so the copies cost next to nothing and what is timed is the
host's decisions. The next layer's router is stood in for by its trace ids one token behind (the
stream's prediction is close, not exact). Each chunk after the first is a new request (the trace's
experts permuted per chunk) into the cache the previous one left full, as the bench's measured
runs follow its warm-up.

Prints ms per layer, mean over the chunks after the first: all of it; ``prepare`` alone, which
the layer's experts launch waits for after the sync (the layer's misses and the next layer's
stream queued first, so the copy stream never waits for the launch; the rest, ``after_launch``:
``passed``, runs once they are queued), and the host work of it on a GPU (less the bincounts and the router's stand-in, device
work there); and by part: ``ids`` (the routed and predicted ids' counts to the host, the one sync,
and ranked), ``count`` (of it, the bincounts: device work on a GPU, where the host only waits for them;
slow single-threaded ops on the CPU), ``begin`` (the map read, the passes, the misses
admitted and their copies queued), ``stream_ahead`` (the next layer's predicted experts admitted
and queued), ``passed`` (the evict-behind pool), and of those, ``policy`` (time inside the
eviction policy's calls) and ``fill`` (queuing copies and map writes, ``DeviceSlots.fill``).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from freetoken.bench.routing_trace import generate_trace
from freetoken.experts import offload as offload_module
from freetoken.experts.offload import ExpertOffload
from freetoken.experts import store as store_module
from freetoken.experts.store import OffloadedExperts

LAYERS, EXPERTS, TOP_K = 40, 256, 8
INTERMEDIATE, HIDDEN = 2, 4  # shrunk: the copies are not what is measured

PARTS = ("ids", "count", "begin", "stream_ahead", "passed", "policy", "fill")


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, part: str) -> None:
        """Time ``owner.name`` (an instance or class attribute) under ``part``."""
        inner: Callable = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)


def build(slots: int, timer: Timer, depth: int = 1) -> tuple[ExpertOffload, list[OffloadedExperts]]:
    offload = ExpertOffload("lrfu", pin=False, stream_depth=depth)
    layers = [OffloadedExperts(EXPERTS, INTERMEDIATE, HIDDEN, TOP_K, offload) for _ in range(LAYERS)]
    for layer in layers:
        torch.nn.init.normal_(layer.w13)
        torch.nn.init.normal_(layer.w2)
    offload.allocate(slots, torch.device("cpu"))
    assert offload.table is not None
    policy = offload.table.policy
    for name in ("access", "insert", "evict", "discard"):
        timer.wrap(policy, name, "policy")
    timer.wrap(offload.slots, "fill", "fill")
    timer.wrap(offload, "begin", "begin")
    timer.wrap(offload, "stream_ahead", "stream_ahead")
    timer.wrap(offload, "passed", "passed")
    timer.wrap(offload_module, "distinct_experts", "ids")
    timer.wrap(store_module, "distinct_experts", "ids")
    timer.wrap(torch, "bincount", "count")
    return offload, layers


def chunk_ids(trace: np.ndarray, chunk: int) -> list[torch.Tensor]:
    """Per layer, the chunk's routed ids ``[T, k]``: the trace's, experts permuted per chunk (a new request)."""
    rng = np.random.default_rng(chunk)
    out = []
    for layer in range(LAYERS):
        perm = np.arange(EXPERTS) if chunk == 0 else rng.permutation(EXPERTS)
        out.append(torch.from_numpy(perm[trace[:, 0, layer, :]].astype(np.int64)))
    return out


def _predicted(ids: list[torch.Tensor], layer: int, x: torch.Tensor) -> torch.Tensor:
    """The stand-in for ``layer``'s router on ``x``: its routed ids one token behind (device work on a GPU)."""
    start = time.perf_counter()
    out = torch.roll(ids[layer], 1, 0)
    ROUTE_SECONDS[0] += time.perf_counter() - start
    return out


ROUTE_SECONDS = [0.0]


def run_chunk(offload: ExpertOffload, layers: list[OffloadedExperts], ids: list[torch.Tensor],
              launch: list[float], timer: Timer) -> float:
    """One streamed chunk's prepares (and ``after_launch``); returns their wall seconds, and adds
    to ``launch`` the seconds of ``prepare`` alone (what the layer's launch waits for after the
    sync) and of its host work (less the bincounts and the router's stand-in)."""
    tokens = ids[0].shape[0]
    x = torch.zeros(tokens, 1)
    for index, layer in enumerate(layers):
        layer.router = functools.partial(_predicted, ids, index)
    assert offload.streams(tokens)
    start = time.perf_counter()
    offload.start_forward(x)
    for index, layer in enumerate(layers):
        before, device = time.perf_counter(), ROUTE_SECONDS[0] + timer.seconds["count"]
        routing = layer.prepare(x, ids[index])
        elapsed = time.perf_counter() - before
        launch[0] += elapsed
        launch[1] += elapsed - (ROUTE_SECONDS[0] + timer.seconds["count"] - device)
        assert len(routing.groups) == 1
        if hasattr(layer, "after_launch"):  # ``compute`` runs it once the layer's experts are queued
            layer.after_launch(routing)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--slots", type=int, default=5120)
    parser.add_argument("--chunks", type=int, default=3, help="chunks run; the first (cold cache) is not counted")
    parser.add_argument("--depth", type=int, default=1, help="the stream's depth (prefill_stream_depth)")
    args = parser.parse_args()
    trace = generate_trace(LAYERS, EXPERTS, TOP_K, args.tokens, seed=0)
    timer = Timer()
    offload, layers = build(args.slots, timer, args.depth)
    total, launch = 0.0, [0.0, 0.0]
    for chunk in range(args.chunks):
        ids = chunk_ids(trace, chunk)
        if chunk == 1:
            timer.seconds.clear()
            launch[:] = [0.0, 0.0]
        wall = run_chunk(offload, layers, ids, launch, timer)
        if chunk:
            total += wall
    counters = offload.counters
    measured = (args.chunks - 1) * LAYERS
    print(f"{args.tokens} tokens, {LAYERS} layers x {EXPERTS} experts, top-{TOP_K}, {args.slots} slots; "
          f"ms per layer over {args.chunks - 1} chunks after the first:")
    print(f"  all (wall, start_forward included) {1e3 * total / measured:.3f}")
    print(f"  prepare, the launch waits for it   {1e3 * launch[0] / measured:.3f}"
          f"  (host work on a GPU, without the counts and the router: {1e3 * launch[1] / measured:.3f})")
    for part in PARTS:
        print(f"  {part:<13} {1e3 * timer.seconds[part] / measured:.3f}")
    print(f"counters: hits {counters.hits} misses {counters.misses} prefetched {counters.prefetched} "
          f"prefetch_hits {counters.prefetch_hits} bytes_copied {counters.bytes_copied}")


if __name__ == "__main__":
    main()
