"""Sweep the NVFP4 (W4A16) prefill GEMM configurations on one GPU, against the packed-bytes floor,
and write the table of ``kernels/triton/nvfp4_configs.py`` from the result.

    python benchmarks/tune_nvfp4_moe.py [--tokens 528 8192] [--full] [--json FILE]   # on the GPU
    python benchmarks/tune_nvfp4_moe.py --tail [--json FILE]                          # on the GPU, < 90 s
    python benchmarks/tune_nvfp4_moe.py --apply FILE                                  # anywhere

At each token count (528: the tail of an 8k prompt whose first 7,664 tokens are a prefix-cache
hit, ~16 pairs an expert; 8192: an 8k prefill, 256) it times each grouped GEMM (gate/up with
SiLU-and-mul, down) alone over the same sorted pairs, for every candidate tile (``Nvfp4GemmConfig``,
``swap_ab`` included) and for the dequantize-then-bf16 path (``DEQUANT``), and the dense
projections (attention qkv 9216 x 2048, o 2048 x 4096) through the W4A16 tiles and through
dequantize-then-cuBLAS. Each line prints the time, the packed bytes read per second and the time
over the floor: max(packed bytes + scales of the experts the pairs touch / HBM, FLOPs / bf16 peak).

``--tail`` times only the prefix hit's tail (528 tokens, no dense projections) over
``tail_candidates``: the table's tiles with and without ``fold_bias`` (the decode's bias folded
into the group scale), small-M tiles around them (16-row tiles, wider N, longer K steps) and
``split`` (the even and odd columns decoded elementwise and multiplied apart), and prints the
``TUNED`` entries the best would make.

``--apply`` rewrites ``TUNED`` (between its markers) with the best configuration of each GEMM in
the bucket holding each tuned size (the other buckets keep ``DEFAULT``'s), and
``LINEAR_DEQUANT_MIN_ROWS`` with the smallest tuned row count where dequantizing won: one GPU call,
then one command here, then commit. (The dense "w4a16 swap" line times one other ``LINEAR_TILES``
entry; patch that table by hand if it wins.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_PY = os.path.join(ROOT, "kernels", "triton", "nvfp4_configs.py")
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512
HBM_BYTES_S = 4.27e12  # the H200's measured device copy rate (docs/benchmarks.md)
BF16_FLOP_S = 686e12  # its measured 8k x 8k bf16 GEMM rate
DENSE = {"attention qkv": (9216, HIDDEN), "attention o": (HIDDEN, 4096)}


def candidates(mean_rows: float, full: bool, gemm: str = "gate_up"):
    """Tiles around the mean pairs an expert: one row tile an expert where it fits (the weights
    decoded once), wgmma's register operand (``swap_ab``) or not, wide and narrow K steps; for down
    (K = 512: four steps of 128) also 256 output columns a program, so fewer programs pay the
    prologue (finding the tile's expert, the pipeline's fill) for the same bytes."""
    from freetoken.kernels.triton.nvfp4_configs import C

    if mean_rows <= 64:
        rows = (16, 32) if mean_rows <= 24 else (32, 64)
    else:
        rows = (64, 128)
    shapes = [(64, 128, 4), (64, 64, 4), (128, 64, 8), (128, 128, 4)] if full else [(64, 128, 4), (128, 64, 8)]
    if gemm == "down":
        shapes.append((256, 64, 8))
    out = []
    for m in rows:
        for n, k, warps in shapes:
            out.append(C(m, n, k, 8, warps, 3, True))
        out.append(C(m, 64, 128, 8, 4, 3, False))
    if full:
        out += [C(rows[-1], 64, 128, 8, 4, s, True) for s in (2, 4)] + [C(rows[-1], 64, 128, g, 4, 3, True) for g in (1, 32)]
    return out


def tail_candidates(gemm: str):
    """The tail's (~16 pairs an expert) tiles for ``--tail``: the measured best (``TUNED``: gate/up
    32 x 64 x 128 4 warps, down 32 x 128 x 64 8 warps, both ``swap_ab``) without and with
    ``fold_bias``; folded variants with 16-row tiles (the pairs as wgmma's N side: no half-empty tile
    at 16 pairs, but experts past 16 pairs decode twice), wider N or longer K steps, a deeper
    pipeline; and ``split`` (no shared-memory round trip of the decoded weights, more instructions)
    at the best and the first two of those. 8 a GEMM: ~16 compiles."""
    from freetoken.kernels.triton.nvfp4_configs import C

    if gemm == "gate_up":
        best = (32, 64, 128, 8, 4, 3)
        others = [(16, 64, 128, 8, 4, 3), (32, 128, 128, 8, 8, 3), (32, 64, 128, 8, 4, 4)]
    else:
        best = (32, 128, 64, 8, 8, 3)
        others = [(16, 128, 64, 8, 8, 3), (32, 128, 128, 8, 8, 3), (32, 256, 64, 8, 8, 3)]
    folded = [C(*shape, True, True) for shape in others]
    split = [C(*shape, True, True, True) for shape in (best, *others[:2])]
    return [C(*best, True, False), C(*best, True, True), *folded, *split]


def _random_nvfp4(*shape: int):
    *lead, rows, cols = shape
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x30, 0x40, (*lead, rows, cols // 16), dtype=torch.uint8, device="cuda")
    return packed, scales, torch.full((*lead, rows), cols**-0.5, device="cuda")


def _packed_bytes(rows: int, cols: int) -> int:
    return rows * cols // 2 + rows * cols // 16 + rows * 4


def _median_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the largest magnitude (bf16 outputs of other tiles differ by ulps)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def _describe(config) -> dict | str:
    return "DEQUANT" if config is None else {k: v for k, v in vars(config).items()}


def _line(label: str, us: float, bytes_read: int, flops: int) -> str:
    floor_us = max(bytes_read / HBM_BYTES_S, flops / BF16_FLOP_S) * 1e6
    return f"{label}: {us:8.1f} us  {bytes_read / us / 1e3:7.0f} GB/s  {us / floor_us:5.2f}x floor ({floor_us:.1f} us)"


def tune_experts(tokens: int, full: bool, tail: bool = False) -> dict:
    from freetoken.kernels.triton import moe, nvfp4
    from freetoken.kernels.triton.nvfp4_configs import nvfp4_moe_config

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=gen)
    logits = torch.randn(tokens, EXPERTS, dtype=torch.bfloat16, device="cuda", generator=gen)
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    order, offsets = moe.moe_sort_tokens(ids, EXPERTS)
    touched = int(torch.unique(ids).numel())
    pairs = tokens * TOP_K
    w13, w2 = _random_nvfp4(EXPERTS, 2 * INTER, HIDDEN), _random_nvfp4(EXPERTS, HIDDEN, INTER)
    h = torch.randn(pairs, INTER, dtype=torch.bfloat16, device="cuda", generator=gen)
    y = torch.empty(pairs, HIDDEN, dtype=torch.bfloat16, device="cuda")
    runs = {  # launch, its output, bytes, FLOPs
        "gate_up": (lambda c: nvfp4.gate_up_nvfp4(x, w13, order, offsets, h, TOP_K, c), h,
                    touched * _packed_bytes(2 * INTER, HIDDEN), 2 * pairs * 2 * INTER * HIDDEN),
        "down": (lambda c: nvfp4.down_nvfp4(h, w2, order, offsets, weights, y, c), y,
                 touched * _packed_bytes(HIDDEN, INTER), 2 * pairs * INTER * HIDDEN),
    }
    out = {"tokens": tokens, "pairs_per_expert": pairs / EXPERTS, "touched_experts": touched}
    for gemm, (launch, output, bytes_read, flops) in runs.items():
        current = nvfp4_moe_config(gemm, torch.bfloat16, pairs, EXPERTS, HIDDEN, INTER)
        results = []
        tried = tail_candidates(gemm) if tail else [None, *candidates(pairs / EXPERTS, full, gemm)]
        want = None
        for config in dict.fromkeys([current, *tried]):
            try:
                output.fill_(float("nan"))  # what a launch leaves unwritten fails the check
                launch(config)
                want = output.clone() if want is None else want
                error = _relative_error(output, want)
                if not error <= 2e-2:  # the current table's output is the check (its tests hold it exact)
                    print(f"  T={tokens} {gemm} WRONG {_describe(config)}: {error:.3g} off the table's output")
                    continue
                us = _median_us(lambda: launch(config))
            except Exception as exc:  # out of shared memory / registers: not a candidate on this GPU
                print(f"  T={tokens} {gemm} skip {_describe(config)}: {type(exc).__name__}")
                continue
            results.append({"config": _describe(config), "us": us, "gb_s": bytes_read / us / 1e3,
                            "current": config == current})
            print(_line(f"T={tokens} {gemm} {'*' if config == current else ' '} {_describe(config)}", us, bytes_read, flops))
        results.sort(key=lambda r: r["us"])
        best = results[0]
        now = next((f"{r['us']:.1f} us" for r in results if r["current"]), "failed")
        print(_line(f"T={tokens} {gemm} BEST {best['config']}", best["us"], bytes_read, flops) + f"; table now {now}")
        out[gemm] = {"bytes": bytes_read, "flops": flops, "results": results}
        torch.cuda.empty_cache()
    return out


def tune_dense(tokens: int) -> dict:
    from freetoken.kernels.triton import nvfp4, nvfp4_configs

    out = {}
    for name, (rows, cols) in DENSE.items():
        x = torch.randn(tokens, cols, dtype=torch.bfloat16, device="cuda")
        w = _random_nvfp4(rows, cols)
        w = (w[0], w[1].view(torch.float8_e4m3fn), w[2])
        bytes_read, flops = _packed_bytes(rows, cols), 2 * tokens * rows * cols
        times = {}
        table = nvfp4_configs.LINEAR_TILES
        paths = [("w4a16", 1 << 62, table), ("dequant", 0, table)]
        if tokens > 16:  # wgmma's register operand with 256 rows a tile: fewer decodes a weight
            paths.append(("w4a16 swap 256x128x64", 1 << 62, ((float("inf"), (256, 128, 64, 8, 3, True)),)))
        for path, threshold, tiles in paths:
            saved = nvfp4_configs.LINEAR_DEQUANT_MIN_ROWS
            nvfp4_configs.LINEAR_DEQUANT_MIN_ROWS, nvfp4_configs.LINEAR_TILES = threshold, tiles
            try:
                times[path] = _median_us(lambda: nvfp4.nvfp4_linear(x, *w))
            finally:
                nvfp4_configs.LINEAR_DEQUANT_MIN_ROWS, nvfp4_configs.LINEAR_TILES = saved, table
            print(_line(f"T={tokens} {name} {path}", times[path], bytes_read, flops))
        out[name] = times
    return out


def table_entry(results: list[dict], buckets) -> tuple:
    """``buckets`` (``DEFAULT``'s for one GEMM) with the bucket of each tuned size replaced by its
    best configuration; ``results``: ``tune_experts`` outputs."""
    from freetoken.kernels.triton.nvfp4_configs import C

    entries = {bound: (config, None) for bound, config in buckets}
    for result in results:
        bound = next(b for b, _ in buckets if result["pairs_per_expert"] <= b)
        best = result["best"]
        config = None if best["config"] == "DEQUANT" else C(**best["config"])
        entries[bound] = (config, f"T={result['tokens']}: {best['us']:.0f} us, {best['gb_s']:.0f} GB/s")
    return tuple((b, c) for b, (c, _) in entries.items()), {b: note for b, (_, note) in entries.items() if note}


def dense_threshold(dense: dict) -> int | None:
    """The smallest tuned row count from which dequantize-then-cuBLAS won for every projection at
    it and every larger tuned count; ``None`` (keep the table's) where it never won."""
    sizes = sorted(dense, key=int)
    won = [all(times["dequant"] < times["w4a16"] for times in dense[t].values()) for t in sizes]
    threshold = None
    for size, ok in zip(reversed(sizes), reversed(won)):
        if not ok:
            break
        threshold = int(size)
    return threshold


def entry_lines(run: dict) -> list[str]:
    """``TUNED``'s entries (Python source lines) from a tuning run: each GEMM's best per bucket."""
    from freetoken.kernels.triton.nvfp4_configs import DEFAULT, format_buckets

    lines = []
    for gemm in ("gate_up", "down"):
        results = [{**r, "best": r[gemm]["results"][0]} for r in run["experts"]]
        buckets, notes = table_entry(results, DEFAULT[gemm])
        lines.append(f'    ("{gemm}", {run["hidden"]}, {run["inter"]}, {run["experts_count"]}): (')
        lines += format_buckets(buckets, notes).splitlines()
        lines.append("    ),")
    return lines


def apply(path: str, configs_py: str = CONFIGS_PY) -> None:
    """Write ``TUNED`` and ``LINEAR_DEQUANT_MIN_ROWS`` of ``nvfp4_configs.py`` from a tuning JSON."""
    with open(path) as f:
        run = json.load(f)
    lines = ["# BEGIN TUNED (written by benchmarks/tune_nvfp4_moe.py --apply)",
             f"# {run['device']}, {run['date']}, tokens {[r['tokens'] for r in run['experts']]}",
             "TUNED: dict[tuple[str, int, int, int], Buckets] = {", *entry_lines(run), "}"]
    with open(configs_py) as f:
        source = f.read()
    block = re.compile(r"# BEGIN TUNED.*?# END TUNED", re.S)
    source = block.sub(lambda _: "\n".join(lines) + "\n# END TUNED", source)
    threshold = dense_threshold(run["dense"])
    if threshold is not None:
        source = re.sub(r"LINEAR_DEQUANT_MIN_ROWS = \d+", f"LINEAR_DEQUANT_MIN_ROWS = {threshold}", source)
    with open(configs_py, "w") as f:
        f.write(source)
    print(f"wrote {configs_py}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[528, 8192])
    parser.add_argument("--full", action="store_true", help="more tiles, stages and row groups (minutes)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense projections")
    parser.add_argument("--tail", action="store_true", help="only the 528-token tail's tiles (tail_candidates), < 90 s")
    parser.add_argument("--json", default=None, help="write the results here (for --apply)")
    parser.add_argument("--apply", default=None, metavar="JSON", help="patch nvfp4_configs.py from a result file")
    args = parser.parse_args()
    if args.apply:
        apply(args.apply)
        return
    start = time.time()
    run = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "hidden": HIDDEN,
           "inter": INTER, "experts_count": EXPERTS, "top_k": TOP_K,
           "experts": [tune_experts(t, args.full, args.tail) for t in ([528] if args.tail else sorted(args.tokens))],
           "dense": {} if args.no_dense or args.tail else {str(t): tune_dense(t) for t in sorted(args.tokens)}}
    print(f"swept in {time.time() - start:.0f} s")
    print("TUNED entries (--apply writes them; or paste between the markers of nvfp4_configs.py):")
    print("\n".join("apply: " + line for line in entry_lines(run)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
        print(f"wrote {args.json}; patch the table with: python benchmarks/tune_nvfp4_moe.py --apply {args.json}")


if __name__ == "__main__":
    main()
