"""Time the NVFP4 MoE decode block's launch shapes (``NVFP4DecodeTiles``) on one GPU at a few tokens,
against the packed bytes and scales the block must read; prints one line per shape, the best at
each token count with the ``NVFP4DecodeTiles`` fields that make it the default, and the time per
kernel of the default and of the best (without PDL, so a launch's time is its own).

    python benchmarks/tune_nvfp4_decode.py [--tokens 1 8] [--only TEXT ...] [--old] [--dense] [--json FILE]

The candidates: the one-program-per-tile kernels (the default) and the stream kernels
(``nvfp4_decode_stream.py``: ``*_per_sm`` programs an SM looping over row tiles, the next tile's
loads issued before the current one's decode), varying rows a tile, warps, programs an SM (sized
to the registers each shape compiles to, so that all its programs are resident: ``nvfp4_sass.py``),
the shared expert's gate/up tiles first (loaded before the wait and the routing) or not, prefetch
and PDL off as controls (one persistent launch for both passes was measured 2.7-3.4x slower and
removed: docs/benchmarks.md). ``--old`` adds the frozen
two-launch kernels (``nvfp4_decode_baseline.py``), ``--dense`` the one-row dense GEMVs (attention
qkv and o) against the frozen tensor-core tile, and the attention input norm + qkv GEMV as two
launches against the fused one (``normed_nvfp4_gemv.py``). The default run (12 distinct shapes, two token counts)
takes under three minutes with a cold Triton cache, most of it compiling.

As ``tune_moe_decode.py`` (whose graph check and profiler breakdown this reuses): each timing runs
the block over ``LAYERS`` layers' distinct packed experts (about 1.8 GB, far more than the 60 MB
L2), replayed from a CUDA graph as the engine decodes; every variant is first checked against the
float32 torch reference (a variant that fails or does not compile is reported and skipped). TB/s
counts the touched experts' and the shared expert's packed bytes, e4m3 scales and float32 row
scales.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields, replace
from typing import Callable

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvfp4_decode_baseline as old  # noqa: E402
from kernels import BF16, CUDA, EXPERTS, HIDDEN, INTER, TOP_K  # noqa: E402
from nvfp4 import nvfp4_bytes, random_nvfp4  # noqa: E402
from tune_moe_decode import graph_error, per_kernel_us  # noqa: E402

from freetoken.kernels.nvfp4 import nvfp4_linear_reference, sparse_moe_decode_nvfp4_reference  # noqa: E402
from freetoken.kernels.triton import nvfp4, nvfp4_decode  # noqa: E402
from freetoken.kernels.triton.nvfp4_decode import NVFP4DecodeTiles, sparse_moe_decode_nvfp4_tiled  # noqa: E402

SHARED_INTER = INTER
LAYERS = 4
# Dense projections timed at one row, (out, in), and how many distinct weights each timing cycles
# through (more bytes than the 60 MB L2).
DENSE = {"attention qkv": (9216, HIDDEN), "attention o": (HIDDEN, 4096)}
DENSE_COPIES = 12
DEFAULT = nvfp4_decode.TILES


def stream(gate_up: tuple[int, int, int], down: tuple[int, int, int], **flags) -> NVFP4DecodeTiles:
    """Both passes as streams: (rows a tile, warps, programs an SM) each, plus other fields."""
    (gn, gw, gp), (dn, dw, dp) = gate_up, down
    return replace(DEFAULT, gate_up_block_n=gn, gate_up_warps=gw, gate_up_per_sm=gp, down_block_n=dn, down_warps=dw,
                   down_per_sm=dp, **flags)


# Registers by nvfp4_sass.py (sm_90, Triton 3.6): gate/up 8 rows 8 warps 124 (2 programs an SM),
# 4 rows 4 warps 96 (5), 8 rows 4 warps 166 (3); down 4 rows 8 warps 128 (2), 2 rows 4 warps 123 (4),
# 8 rows 4 warps 254 (2); gate/up 16 rows 8 warps 168 (1).
G8, G4, G2 = (8, 8, 2), (4, 4, 4), (2, 4, 4)
D4, D2, D8 = (4, 8, 2), (2, 4, 4), (8, 4, 2)
CANDIDATES = [
    DEFAULT,
    replace(DEFAULT, down_per_sm=D4[2], down_block_n=D4[0], down_warps=D4[1]),  # stream down only
    replace(DEFAULT, gate_up_per_sm=G8[2], gate_up_block_n=G8[0], gate_up_warps=G8[1]),  # stream gate/up only
    stream(G8, D4),
    stream(G8, D2),
    stream(G8, D8),
    stream(G4, D4),
    stream(G2, D2),
    stream((8, 4, 3), (8, 4, 3), down_regs=168),  # down capped from 254 registers: 3 programs an SM
    stream((8, 8, 1), (4, 8, 1)),  # fewer programs, more tiles each
    stream((16, 8, 1), D4),  # gate/up 168 registers: one program an SM, half the tiles
    # The shared expert's tiles first, loaded before the wait and the routing (nvfp4_decode_stream).
    replace(DEFAULT, shared_first=True),
    stream((4, 4, 5), D2, shared_first=True),
    stream(G8, D4, prefetch=False),  # controls
    stream(G8, D4, pdl=False),
]

Block = Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def layer_weights() -> tuple[torch.Tensor, ...]:
    return (*random_nvfp4(EXPERTS, 2 * INTER, HIDDEN), *random_nvfp4(EXPERTS, HIDDEN, INTER),
            *random_nvfp4(2 * SHARED_INTER, HIDDEN), *random_nvfp4(HIDDEN, SHARED_INTER))


def label(tiles: NVFP4DecodeTiles) -> str:
    t = tiles
    gate_up = (f"gate/up stream {t.gate_up_block_n} rows w{t.gate_up_warps} x{t.gate_up_per_sm}/SM"
               if t.gate_up_per_sm else f"gate/up {t.gate_up_block_n}x{t.gate_up_block_k} p{t.gate_up_pairs} w{t.gate_up_warps}")
    down = (f"down stream {t.down_block_n} rows w{t.down_warps} x{t.down_per_sm}/SM"
            if t.down_per_sm else f"down {t.down_block_n}x{t.down_block_k} w{t.down_warps}")
    flags = [name for name, on in (("pdl", t.pdl), ("shared first", t.shared_first),
                                   ("no prefetch", (t.gate_up_per_sm or t.down_per_sm) and not t.prefetch)) if on]
    regs = [f"{name} {getattr(t, name)}" for name in ("gate_up_regs", "down_regs") if getattr(t, name)]
    return ", ".join([gate_up, down, *flags, *regs])


def changed_fields(tiles: NVFP4DecodeTiles) -> str:
    """The fields that differ from the default: what to set in ``NVFP4DecodeTiles`` to apply ``tiles``."""
    diff = {f.name: getattr(tiles, f.name) for f in fields(tiles) if getattr(tiles, f.name) != getattr(DEFAULT, f.name)}
    return ", ".join(f"{name}={value}" for name, value in diff.items()) or "none (the default)"


def variants(with_old: bool, only: list[str] | None) -> list[tuple[str, NVFP4DecodeTiles | None, Block]]:
    """(label, tiles or None, the block on one layer's weights): the old kernels first where asked, then
    the candidates, the default first."""
    found: list[tuple[str, NVFP4DecodeTiles | None, Block]] = []
    if with_old:
        found.append(("old 2-launch kernels", None, lambda x, g, w: old.sparse_moe_decode_nvfp4(x, g, *w, TOP_K, True)))
    seen: list[NVFP4DecodeTiles] = []
    for tiles in CANDIDATES:
        name = label(tiles) + (" (default)" if tiles == DEFAULT else "")
        if tiles in seen or (only and tiles != DEFAULT and not any(text in name for text in only)):
            continue  # once each: some shapes written out are the default since it took the sweep's best
        seen.append(tiles)
        block = lambda x, g, w, tiles=tiles: sparse_moe_decode_nvfp4_tiled(x, g, *w, TOP_K, True, tiles)  # noqa: E731
        found.append((name, tiles, block))
    return found


def time_dense() -> list[dict]:
    """The dense NVFP4 linear at one row: us per call and TB/s of packed bytes + scales, the GEMV
    (``nvfp4_linear`` now) against the frozen tensor-core tile (old), both checked first."""
    rows = []
    for name, (n_out, k_in) in DENSE.items():
        weights = [random_nvfp4(n_out, k_in) for _ in range(DENSE_COPIES)]
        x = torch.randn(1, k_in, dtype=BF16, device=CUDA)
        wants = [nvfp4_linear_reference(x.float(), *w) for w in weights]
        line = []
        for path, linear in (("old", old.nvfp4_linear_one_row), ("new", nvfp4.nvfp4_linear)):
            def run(linear=linear) -> list[torch.Tensor]:
                return [linear(x, *w) for w in weights]

            run()  # compiles
            err = graph_error(run, wants)
            if not err <= 1e-2:
                raise AssertionError(f"{name} {path}: relative error {err:.3g} to the reference")
            us = do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3 / DENSE_COPIES
            tbs = nvfp4_bytes(n_out, k_in) / (us * 1e-6) / 1e12
            rows.append({"dense": name, "path": path, "us": us, "TB/s": tbs, "rel_err": err})
            line.append(f"{path} {us:.1f} us ({tbs:.2f} TB/s)")
        print(f"{name} {n_out}x{k_in} at 1 row: " + ", ".join(line), flush=True)
    return rows


def time_normed_dense() -> list[dict]:
    """The attention layer's input norm + packed q/k/v NVFP4 GEMV at one row: the two launches (the
    Triton add + RMSNorm, then ``nvfp4_linear``) against the fused launch (``normed_nvfp4_gemv``),
    with and without PDL, checked first; us per call over distinct weights and residual streams."""
    from freetoken.kernels.normed_nvfp4_gemv import add_rms_norm_nvfp4_gemv_reference
    from freetoken.kernels.triton import norm, normed_nvfp4_gemv

    n_out, k_in = DENSE["attention qkv"]
    weights = [random_nvfp4(n_out, k_in) for _ in range(DENSE_COPIES)]
    x = torch.randn(1, k_in, dtype=BF16, device=CUDA)
    res = torch.randn(1, k_in, dtype=BF16, device=CUDA)
    nw = (torch.randn(k_in, device=CUDA) * 0.2).to(BF16)
    wants = [add_rms_norm_nvfp4_gemv_reference(x.float(), res.float(), nw.float(), 1e-6, True, *w)[0] for w in weights]

    def two_launches(w):
        normed, _ = norm.add_rms_norm(x, res, nw, 1e-6, True)
        return nvfp4.nvfp4_linear(normed, *w)

    def fused(w):
        return normed_nvfp4_gemv.add_rms_norm_nvfp4_gemv(x, res, nw, 1e-6, True, *w)[0]

    rows, line = [], []
    for path, call, pdl in (("norm + GEMV", two_launches, True), ("fused", fused, True), ("fused, no PDL", fused, False)):
        normed_nvfp4_gemv.PDL = pdl

        def run(call=call) -> list[torch.Tensor]:
            return [call(w) for w in weights]

        run()  # compiles
        err = graph_error(run, wants)
        if not err <= 1e-2:
            raise AssertionError(f"normed qkv {path}: relative error {err:.3g} to the reference")
        us = do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3 / DENSE_COPIES
        rows.append({"dense": "attention qkv with its norm", "path": path, "us": us, "rel_err": err})
        line.append(f"{path} {us:.1f} us")
    normed_nvfp4_gemv.PDL = True
    print(f"attention input norm + qkv {n_out}x{k_in} at 1 row: " + ", ".join(line), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--only", nargs="+", help="time only the candidates whose label contains one of these (and the default)")
    parser.add_argument("--old", action="store_true", help="also time the frozen two-launch kernels")
    parser.add_argument("--dense", action="store_true", help="also time the one-row dense GEMVs")
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.manual_seed(0)
    layers = [layer_weights() for _ in range(LAYERS)]
    expert_bytes = nvfp4_bytes(2 * INTER, HIDDEN) + nvfp4_bytes(HIDDEN, INTER)
    shared_bytes = nvfp4_bytes(2 * SHARED_INTER, HIDDEN) + nvfp4_bytes(HIDDEN, SHARED_INTER)
    blocks = variants(args.old, args.only)
    results = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA)
        logits = [torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA) for _ in layers]
        touched = [int(torch.unique(g[:, :EXPERTS].topk(TOP_K, dim=1).indices).numel()) for g in logits]
        bytes_per_layer = sum(t * expert_bytes + shared_bytes for t in touched) / LAYERS
        wants = [sparse_moe_decode_nvfp4_reference(x.float(), g.float(), *w, TOP_K, True) for g, w in zip(logits, layers)]
        floor_us = bytes_per_layer / 4.27e12 * 1e6
        print(f"T={tokens}: {bytes_per_layer / 1e6:.1f} MB/layer packed + scales (floor {floor_us:.1f} us at 4.27 TB/s); "
              "graph us/layer (TB/s)", flush=True)
        rows = []
        for name, tiles, block in blocks:
            def run(block: Block = block) -> list[torch.Tensor]:
                return [block(x, g, weights) for g, weights in zip(logits, layers)]

            try:
                run()  # compiles
                err = graph_error(run, wants)
            except Exception as error:  # a shape that does not compile or launch: report, go on
                print(f"  FAILED  {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            if not err <= 1e-2:  # bf16 rounding in other places than the reference: a few 1e-3
                print(f"  WRONG   {name}: relative error {err:.3g} to the reference", flush=True)
                continue
            graph_us = do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3 / LAYERS
            row = {"tokens": tokens, "variant": name, "tiles": asdict(tiles) if tiles else None, "graph_us": graph_us,
                   "graph_TB/s": bytes_per_layer / (graph_us * 1e-6) / 1e12, "x_floor": graph_us / floor_us,
                   "rel_err": err}
            rows.append(row)
            print(f"  {graph_us:6.1f} ({row['graph_TB/s']:4.2f}, {row['x_floor']:.1f}x floor)  {name}", flush=True)
        ranked = [r for r in rows if r["tiles"] is not None]
        if ranked:
            best = min(ranked, key=lambda r: r["graph_us"])
            default = next((r for r in ranked if r["tiles"] == asdict(DEFAULT)), None)
            best_tiles = NVFP4DecodeTiles(**best["tiles"])
            print(f"  best: {best['graph_us']:.1f} us/layer ({best['graph_TB/s']:.2f} TB/s) {best['variant']}"
                  + (f"; default: {default['graph_us']:.1f}" if default else ""), flush=True)
            print(f"  apply: NVFP4DecodeTiles defaults {changed_fields(best_tiles)}", flush=True)
            # Without PDL: under it a launch's time includes its wait for the previous one.
            for name, tiles in (("default", DEFAULT), ("best", best_tiles)):
                quiet = replace(tiles, pdl=False)
                breakdown = per_kernel_us(
                    lambda: [sparse_moe_decode_nvfp4_tiled(x, g, *w, TOP_K, True, quiet) for g, w in zip(logits, layers)],
                    LAYERS)
                print(f"  per kernel (us, no PDL): {breakdown}  [{name}]", flush=True)
        results += rows
    if args.dense:
        results += time_dense() + time_normed_dense()
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
