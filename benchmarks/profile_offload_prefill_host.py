"""Where the host's time goes in ``freetoken bench``'s timed run with expert offload: cProfile over
the timed run alone (from ``ExpertOffload.record_timeline``, which the bench calls before it, to
``stop_timeline``, after it), and the garbage collector's pauses in it (issue 11).

An offloaded prompt chunk syncs at every layer's routing (the routed ids go to the host), so the
GPU's queue drains there and the host's work for the layer (the copies' bookkeeping and calls, the
launches up to the next routing) is on the critical path. This says how much of it is which:

    python benchmarks/profile_offload_prefill_host.py bench --preset qwen3.6-35b-a3b --batch-sizes 1 \\
        --max-running-requests 1 --input-len 8192 --output-len 2 --profile-steps 0 --moe-offload \\
        --expert-cache-slots 5120 --routing trace [--stats FILE]

Arguments other than ``--stats`` (where to dump the pstats file) go to ``freetoken.cli``. The
profiler slows the host: the run's own figures are above the unprofiled ones.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time

from freetoken.experts.offload import ExpertOffload

PAUSE_MS = 0.2  # GC pauses listed from this length


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--stats", metavar="FILE", help="dump the pstats file here")
    ours, argv = parser.parse_known_args(argv)
    profiler = cProfile.Profile()
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    record, stop = ExpertOffload.record_timeline, ExpertOffload.stop_timeline

    def profiled_record(self: ExpertOffload):
        timeline = record(self)
        gc.callbacks.append(on_gc)
        profiler.enable()
        return timeline

    def profiled_stop(self: ExpertOffload) -> None:
        profiler.disable()
        gc.callbacks.remove(on_gc)
        stop(self)

    ExpertOffload.record_timeline, ExpertOffload.stop_timeline = profiled_record, profiled_stop
    from freetoken.cli import main as cli_main

    rc = cli_main(argv)
    long_pauses = [(generation, round(ms, 2)) for generation, ms in pauses if ms > PAUSE_MS]
    print(f"GC: {len(pauses)} collections in the timed run; over {PAUSE_MS} ms (generation, ms): {long_pauses}")
    stats = pstats.Stats(profiler)
    if ours.stats:
        stats.dump_stats(ours.stats)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
