"""Sweep the MoE grouped-GEMM tile configurations on one GPU and print the table for
``kernels/triton/moe_configs.py`` (``TUNED``), with each shape's best time and TFLOP/s.
The best tile and the table's are also tried as persistent launches (``GemmConfig.persistent``,
with TMA operands and the half-size tail tile or not).

    python benchmarks/tune_moe.py [--tokens 1024 2048 4096 8192 16384] [--experts 256 --top-k 8
                                  --hidden 2048 --inter 512] [--quick]

Each GEMM (gate/up with SiLU-and-mul, down) is timed alone (median of ``triton.testing.do_bench``)
over the same sorted pairs for every candidate; candidates whose tiles do not fit shared memory
are skipped. The bucket bounds printed are the geometric means of neighbouring sizes' pairs per
expert, so each tuned size is the middle of its bucket.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import replace

import torch
from triton.testing import do_bench

from freetoken.kernels.triton import moe
from freetoken.kernels.triton.moe_configs import DEFAULT, GemmConfig, config_source, moe_gemm_config

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
SHARED_BYTES = 220 * 1024  # what one H200 program may take, with some room for the epilogue


def candidates(gemm: str, mean_rows: float, quick: bool) -> list[GemmConfig]:
    """Tiles that fit shared memory, row tiles between a quarter and twice the mean rows per expert,
    row groups of 8 (``refine`` then varies the group of the best)."""
    rows = [m for m in (16, 32, 64, 128) if mean_rows / 4 <= m <= max(16, 2 * mean_rows)] or [16]
    cols = (64, 128) if gemm == "gate_up" else (64, 128, 256)
    out = []
    for m, n, k, s, w in itertools.product(rows, cols, (64, 128), (3,) if quick else (3, 4), (4, 8)):
        b_tiles = 2 if gemm == "gate_up" else 1
        if s * (m * k + b_tiles * n * k) * 2 > SHARED_BYTES:
            continue
        if (w == 8) != (m * n * b_tiles >= 128 * 128):  # 8 warps for large tiles, 4 for the others
            continue
        out.append(GemmConfig(m, n, k, 8, w, s))
    return out


def refine(best: GemmConfig) -> list[GemmConfig]:
    """Other row-group sizes and pipeline depths around the best tile."""
    return [replace(best, group_m=g) for g in (1, 4, 16, 32)] + [replace(best, num_stages=s) for s in (2, 5)]


def persistent(configs: list[GemmConfig]) -> list[GemmConfig]:
    """The persistent launches of these tiles (``GemmConfig.persistent``): two programs an SM
    capped at 128 registers (no spills at the table's 128-row tiles on sm_90), with and without TMA
    operands and the half-size tail tile (``half_tail``, from 32-row tiles)."""
    out = [
        replace(c, persistent=2, max_registers=128, tma=t, half_tail=half)
        for c in configs for t in (False, True) for half in (False, True) if c.block_m >= 32 or not half
    ]
    return [c for c in dict.fromkeys(out) if c not in configs]  # the table's may be persistent already


def median_us(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def tune(tokens: int, args) -> dict[str, tuple[GemmConfig, float, float]]:
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, args.hidden, dtype=BF16, device=CUDA, generator=gen)
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, dtype=BF16, device=CUDA, generator=gen)
    w2 = torch.randn(args.experts, args.hidden, args.inter, dtype=BF16, device=CUDA, generator=gen)
    logits = torch.randn(tokens, args.experts, dtype=BF16, device=CUDA, generator=gen)
    weights, ids = moe.moe_topk_softmax(logits, args.top_k, True)
    order, offsets = moe.moe_sort_tokens(ids, args.experts)
    pairs = tokens * args.top_k
    h = torch.randn(pairs, args.inter, dtype=BF16, device=CUDA, generator=gen)
    y = torch.empty(pairs, args.hidden, dtype=BF16, device=CUDA)
    run = {
        "gate_up": lambda c: moe.gate_up(x, w13, order, offsets, h, args.top_k, c),
        "down": lambda c: moe.down(h, w2, order, offsets, weights, y, c),
    }
    flops = {"gate_up": 2 * pairs * 2 * args.inter * args.hidden, "down": 2 * pairs * args.inter * args.hidden}
    best = {}
    for gemm, launch in run.items():
        current = moe_gemm_config(gemm, BF16, pairs, args.experts, args.hidden, args.inter)
        results = []

        def measure(configs):
            for config in configs:
                try:
                    results.append((median_us(lambda: launch(config)), config))
                except Exception as exc:  # out of shared memory / registers: not a candidate on this GPU
                    print(f"  skip {config}: {type(exc).__name__}")
            results.sort(key=lambda r: r[0])

        measure(candidates(gemm, pairs / args.experts, args.quick) + [current])
        if not args.quick:
            measure(refine(results[0][1]))
        measure(persistent(list(dict.fromkeys([results[0][1], current]))))
        us, config = results[0]
        now = next(t for t, c in results if c == current)
        print(f"T={tokens} {gemm}: best {us:.1f} us ({flops[gemm] / us / 1e6:.0f} TFLOP/s) {config}; "
              f"current table {now:.1f} us {current}")
        for t, c in results[1:4]:
            print(f"    next {t:.1f} us {c}")
        best[gemm] = (config, us, flops[gemm] / us / 1e6)
        torch.cuda.empty_cache()
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="a smaller sweep: 3 stages, no refinement")
    args = parser.parse_args()
    tokens = sorted(args.tokens)
    results = {t: tune(t, args) for t in tokens}
    rows = [t * args.top_k / args.experts for t in tokens]
    print("\n# paste into kernels/triton/moe_configs.py (TUNED):")
    for gemm in ("gate_up", "down"):
        smallest = rows[0]
        kept = [f"        ({bound}, {config_source(c)})," for bound, c in DEFAULT[gemm]
                if bound < smallest]  # buckets below the smallest tuned size stay as they are
        for i, t in enumerate(tokens):
            bound = "float(\"inf\")" if i == len(tokens) - 1 else f"{math.sqrt(rows[i] * rows[i + 1]):.0f}"
            c, us, tflops = results[t][gemm]
            kept.append(f"        ({bound}, {config_source(c)}),  # T={t}: {us:.0f} us, "
                        f"{tflops:.0f} TFLOP/s")
        print(f"    (\"{gemm}\", {args.hidden}, {args.inter}, {args.experts}): (\n" + "\n".join(kept) + "\n    ),")


if __name__ == "__main__":
    main()
