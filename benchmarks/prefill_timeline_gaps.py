"""Where a streamed prompt chunk's layers spend their time, from ``freetoken bench --json`` files
(the timed run's per-layer timeline, ``expert_cache_phases.timelines``; CUDA events, issue 11):

    python benchmarks/prefill_timeline_gaps.py RUN.json [RUN.json ...]

Per chunk, summed over its layers (ms): routing -> experts (from the layer's routing to its experts'
start: the host's bookkeeping after the routing sync, the GPU running only what was queued before
it), experts (their start to their end), experts -> next routing (the next layer's attention or
GDN and its router), and the compute stream's waits for copies.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

from freetoken.experts.timeline import layer_phases


def timelines(result: Any) -> Iterator[dict[str, Any]]:
    """Every chunk timeline in a bench result (any nesting)."""
    if isinstance(result, dict):
        if "layers" in result and "span_ms" in result:
            yield result
        for value in result.values():
            yield from timelines(value)
    elif isinstance(result, list):
        for value in result:
            yield from timelines(value)


def phases(timeline: dict[str, Any]) -> dict[str, float]:
    """The chunk's sums, from its layers (``experts.timeline.layer_phases``: files from before the
    summary carried them too)."""
    return {"span": timeline["span_ms"], "experts": timeline["experts_ms"], "compute_wait": timeline["compute_wait_ms"],
            **layer_phases(timeline["layers"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    print(f"{'file':<24} {'span':>7} {'routing->experts':>17} {'experts':>8} {'experts->routing':>17} {'waits':>6}")
    for path in args.files:
        with open(path) as f:
            result = json.load(f)
        for timeline in timelines(result):
            p = phases(timeline)
            print(f"{path[-24:]:<24} {p['span']:7.1f} {p['routing_to_experts_ms']:17.1f} {p['experts']:8.1f} "
                  f"{p['experts_to_next_routing_ms']:17.1f} {p['compute_wait']:6.1f}")


if __name__ == "__main__":
    main()
