"""Time the few-row GEMV's launch shapes (``kernels/gemv_configs.GemvConfig``) against cuBLAS at the
dense projections of a Qwen3.6-35B-A3B decode step on one GPU, and print the ``TUNED`` table.

    python benchmarks/gemv_sweep.py [--rows 1 2 4 8] [--shapes in_proj out_proj ...] [--json FILE]

Each timing replays a CUDA graph of back-to-back calls (as the engine decodes) on distinct copies of
the weight, together over ``TARGET_BYTES`` (more than the 50 MB L2), so no call finds its weight
cached by an earlier one. Times are per call (us: the median of three rounds of replays queued back
to back, over the calls in them), with the weight's bytes over that time (TB/s; 4.3 is about the
H200's reachable HBM bandwidth).

Every candidate is timed without programmatic dependent launch (what a GEMV after an ordinary
kernel sees, most of them in a step); the ``PDL_TIMED`` fastest also with it (back to back, each
call's weight loads overlap the previous call's drain; in a step only a launch after a PDL kernel
gets that). The shape is chosen by the time without PDL; PDL is kept on where it is not slower.
Every candidate's output is first checked against float32 ``F.linear``.

Output: per shape and row count, cuBLAS and the five fastest candidates; then the decode step's
GEMV time per row count (cuBLAS vs the chosen shapes, each projection times its calls a step);
then ``TUNED`` entries to paste into ``kernels/gemv_configs.py`` (``None``: cuBLAS stays faster).
Compilation of all candidates runs first, in parallel worker processes (Triton's cache).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from typing import Callable

import torch
import torch.nn.functional as F

from freetoken.kernels.gemv_configs import GemvConfig

C = GemvConfig
BF16 = torch.bfloat16
# name: (out, in, calls in one decode step) at the Qwen3.6-35B-A3B shape (30 GDN, 10 attention layers).
SHAPES = {
    "in_proj": (12352, 2048, 30),  # GDN qkv + z + b + a
    "out_proj": (2048, 4096, 40),  # GDN out_proj (30) and attention o_proj (10)
    "router": (264, 2048, 40),  # router + shared-expert gate, its 257 rows padded as layers.moe keeps them
    "qkv": (9216, 2048, 10),  # attention q (gated) + k + v
    "lm_head": (248320, 2048, 1),
}
TARGET_BYTES = 256 << 20  # distinct weight bytes per timed graph: past the L2 several times
MIN_CALLS = 20
ROUNDS = 3  # timed rounds per candidate (the median is kept), each of up to MAX_REPLAYS replays
MAX_REPLAYS = 10
REPLAY_MS = 10.0  # the rounds together about this long
# Rows a program x 2-byte columns a step, warps, stages. FMA kernel: a warp's lanes span 256 columns
# (16 bytes each) of a row and the warps take the rows, so block_n / num_warps rows a warp (more
# reuse of each activation load: what matters at 8 rows), block_k / 256 loads of 16 bytes a row a
# thread (bytes in flight); fewer rows than warps split the step over warps (a shared-memory
# reduction). Tensor-core kernel (dot): block_n rows x block_k columns a stage through shared memory.
CANDIDATES = [
    C(1, 2048, 1), C(2, 2048, 2), C(4, 2048, 4), C(8, 2048, 8), C(4, 2048, 2), C(8, 2048, 4),
    C(8, 1024, 8), C(16, 1024, 8), C(16, 512, 4), C(32, 512, 8), C(1, 2048, 4), C(8, 4096, 8),
    C(16, 256, 4, 4, dot=True), C(32, 256, 4, 4, dot=True), C(64, 128, 4, 3, dot=True), C(64, 256, 4, 3, dot=True),
    C(128, 128, 4, 3, dot=True), C(128, 256, 8, 3, dot=True),
]
# Of the fastest this many without PDL, the PDL variants are timed too.
PDL_TIMED = 3


def effective(config: GemvConfig, k_in: int) -> GemvConfig:
    """The config as launched at ``k_in`` (a step is capped at the row)."""
    return replace(config, block_k=min(config.block_k, 1 << (k_in - 1).bit_length()))


def candidates(k_in: int) -> list[GemvConfig]:
    """The distinct launches at ``k_in``, each without and with PDL."""
    found: list[GemvConfig] = []
    for config in CANDIDATES:
        for pdl in (False, True):
            c = replace(effective(config, k_in), pdl=pdl)
            if c not in found:
                found.append(c)
    return found


def _compile(job: tuple[dict, int, int, int]) -> str:
    """Worker: launch one candidate once on small operands with the same specializations as the real
    shape (N divisible by 16 or not, the same K), filling Triton's on-disk cache."""
    from freetoken.kernels.triton.gemv import gemv_tiled

    config, rows, n_out, k_in = job
    x = torch.zeros(rows, k_in, dtype=BF16, device="cuda")
    w = torch.zeros(n_out, k_in, dtype=BF16, device="cuda")
    try:
        gemv_tiled(x, w, GemvConfig(**config))
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # reported, and the candidate skipped, by the timing pass
        return f"{GemvConfig(**config).label()} rows={rows}: {exc!r}"


def precompile(shapes: dict[str, tuple[int, int, int]], rows: list[int]) -> None:
    jobs = []
    for n_out, k_in, _ in shapes.values():
        small_n = 256 if n_out % 16 == 0 else 257
        for config in candidates(k_in):
            # The tensor-core kernel takes the row count at run time: one row or more.
            for r in sorted({min(r, 2) for r in rows}) if config.dot else rows:
                job = (asdict(config), r, small_n, k_in)
                if job not in jobs:
                    jobs.append(job)
    start = time.perf_counter()
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            errors = [e for e in pool.map(_compile, jobs, chunksize=4) if e]
    except Exception as exc:  # the timing pass then compiles each launch itself, serially
        print(f"parallel compilation failed ({exc!r}); compiling as the candidates are timed", flush=True)
        return
    print(f"compiled {len(jobs)} launches in {time.perf_counter() - start:.0f} s ({workers} processes)", flush=True)
    for e in errors:
        print(f"  compile failed: {e}", flush=True)


def time_per_call(fn: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor], calls: int,
                  check: Callable[[torch.Tensor, torch.Tensor], float]) -> tuple[float, float]:
    """(us per call, relative error): ``calls`` calls over ``weights`` in turn, captured in one graph."""
    fn(weights[0])  # compiles (from the cache) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(weights[i % len(weights)]) for i in range(calls)]
    graph.replay()
    torch.cuda.synchronize()
    err = max(check(outs[0], weights[0]), check(outs[-1], weights[(calls - 1) % len(weights)]))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1, min(MAX_REPLAYS, math.ceil(REPLAY_MS / ROUNDS / start.elapsed_time(end))))
    times = []
    for _ in range(ROUNDS):  # each round's replays queued back to back: one launch latency a round
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    del graph, outs
    return statistics.median(times), err


def config_source(config: GemvConfig | None) -> str:
    if config is None:
        return "None"
    dot = ", dot=True" if config.dot else ""
    return f"C({config.block_n}, {config.block_k}, {config.num_warps}, {config.num_stages}, {config.pdl}{dot})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args()
    from freetoken.kernels.triton.gemv import gemv_tiled

    shapes = {name: SHAPES[name] for name in args.shapes}
    rows_list = sorted(set(args.rows))
    started = time.perf_counter()
    precompile(shapes, rows_list)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, tuned, step = [], {}, {r: [0.0, 0.0] for r in rows_list}
    for name, (n_out, k_in, per_step) in shapes.items():
        nbytes = n_out * k_in * 2
        copies = max(1, math.ceil(TARGET_BYTES / nbytes))
        calls = max(MIN_CALLS, copies)
        weights = [torch.randn(n_out, k_in, dtype=BF16, device="cuda", generator=gen) * k_in**-0.5
                   for _ in range(copies)]
        print(f"\n[{time.perf_counter() - started:.0f} s] {name} {n_out}x{k_in} ({nbytes / 1e6:.1f} MB, "
              f"{copies} copies, {calls} calls a graph): us per call (TB/s); top 5 without / with pdl", flush=True)
        buckets = []
        for rows in rows_list:
            x = torch.randn(rows, k_in, dtype=BF16, device="cuda", generator=gen)

            def check(out: torch.Tensor, w: torch.Tensor, x: torch.Tensor = x) -> float:
                want = F.linear(x.float(), w.float())
                return ((out.float() - want).norm() / want.norm()).item()

            tbs = lambda us: nbytes / (us * 1e-6) / 1e12  # noqa: E731
            cublas_us, err = time_per_call(lambda w, x=x: F.linear(x, w), weights, calls, check)
            timed: dict[GemvConfig, float] = {}

            def measure(config: GemvConfig, x: torch.Tensor = x, check=check) -> None:
                try:
                    us, err = time_per_call(lambda w: gemv_tiled(x, w, config), weights, calls, check)
                except Exception as exc:
                    print(f"  M={x.shape[0]} {config.label()}: failed: {exc!r}", flush=True)
                    return
                if not err <= 1e-2:  # one bf16 rounding of float32 sums: ~2e-3
                    print(f"  M={x.shape[0]} {config.label()}: relative error {err:.3g}, skipped", flush=True)
                    return
                timed[config] = us
                results.append({"shape": name, "n": n_out, "k": k_in, "rows": x.shape[0], "config": asdict(config),
                                "us": us, "TB/s": tbs(us), "rel_err": err})

            for config in candidates(k_in):
                if not config.pdl:
                    measure(config)
            plain = {c: us for c, us in timed.items() if not c.pdl}
            for config in sorted(plain, key=plain.get)[:PDL_TIMED]:
                measure(replace(config, pdl=True))
            results.append({"shape": name, "n": n_out, "k": k_in, "rows": rows, "config": "cublas",
                            "us": cublas_us, "TB/s": tbs(cublas_us)})
            if not plain:
                buckets.append((rows, None))
                step[rows][0] += per_step * cublas_us
                step[rows][1] += per_step * cublas_us
                continue
            best = min(plain, key=plain.get)
            with_pdl = replace(best, pdl=True)
            best_pdl_us = timed.get(with_pdl, math.inf)
            chosen = with_pdl if best_pdl_us <= plain[best] else best
            wins = plain[best] < cublas_us
            buckets.append((rows, chosen if wins else None))
            step[rows][0] += per_step * cublas_us
            step[rows][1] += per_step * min(plain[best], cublas_us)
            print(f"  M={rows}: cuBLAS {cublas_us:7.2f} ({tbs(cublas_us):.2f}) | best {plain[best]:7.2f} "
                  f"({tbs(plain[best]):.2f}) {best.label()}, with pdl {best_pdl_us:7.2f} | "
                  f"{'GEMV' if wins else 'cuBLAS'} wins x{cublas_us / plain[best]:.2f}", flush=True)
            top = sorted(plain, key=plain.get)[:5]
            print("        " + ", ".join(f"{c.label()} {plain[c]:.2f}/{timed.get(replace(c, pdl=True), math.nan):.2f}"
                                        for c in top), flush=True)
        tuned[(n_out, k_in)] = (name, buckets)
        del weights
        torch.cuda.empty_cache()
    print("\ndecode step, the GEMVs above times their calls a step (us): cuBLAS -> chosen")
    for rows, (cublas_total, chosen_total) in step.items():
        print(f"  M={rows}: {cublas_total:7.1f} -> {chosen_total:7.1f}")
    print("\nTUNED entries for kernels/gemv_configs.py (bf16, this GPU):")
    for (n_out, k_in), (name, buckets) in tuned.items():
        entries = ", ".join(f"({rows}, {config_source(c)})" for rows, c in buckets)
        print(f"    ({n_out}, {k_in}): ({entries}),  # {name}")
    print(f"\nsweep took {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
