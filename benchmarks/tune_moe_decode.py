"""Time the fused MoE decode block's launch shapes (``DecodeTiles``) on one GPU at batch 1 and a few
tokens, against the bytes the block must read, beside the previous two-launch kernels (a frozen copy,
``moe_decode_baseline.py``); prints one line per shape, the best, and the default's time per kernel.

    python benchmarks/tune_moe_decode.py [--tokens 1 8] [--json FILE]

Each timing runs the block over ``LAYERS`` layers' weights in turn (about 200 MB of distinct experts,
more than the 60 MB L2), so no layer finds its experts cached by the previous call, as in a real step.
``graph`` is the time per layer replayed from a CUDA graph, as the engine decodes (the figure to tune
on); ``eager`` the same launches from Python, where at one token the host's launch cost can dominate.
Every variant's layers are first checked against the torch reference, replayed from a graph.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Callable

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_decode_baseline as old  # noqa: E402

from freetoken.kernels.moe_decode import sparse_moe_decode_reference  # noqa: E402
from freetoken.kernels.triton import moe_decode  # noqa: E402
from freetoken.kernels.triton.moe_decode import DecodeTiles, sparse_moe_decode_tiled  # noqa: E402

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HIDDEN, EXPERTS, TOP_K, INTER, SHARED_INTER = 2048, 256, 8, 512, 512
LAYERS = 4

# Gate/up: rows x reduction step (2048: the whole hidden in one load), pairs per program, warps;
# down: rows x step (512: the whole intermediate), warps; programmatic dependent launch. Each
# candidate changes the default (TILES, the H200 sweep's best at one token) in one or two fields.
CANDIDATES = [
    moe_decode.TILES,
    replace(moe_decode.TILES, pdl=False),
    replace(moe_decode.TILES, gate_up_block_n=8),
    replace(moe_decode.TILES, gate_up_block_n=8, gate_up_block_k=1024),
    replace(moe_decode.TILES, gate_up_block_n=16, gate_up_block_k=512),
    replace(moe_decode.TILES, gate_up_block_n=2, gate_up_pairs=2),
    replace(moe_decode.TILES, gate_up_warps=4),
    replace(moe_decode.TILES, down_block_n=4, down_block_k=512),
    replace(moe_decode.TILES, down_block_n=2, down_block_k=512, down_warps=4),
    replace(moe_decode.TILES, down_block_n=8, down_block_k=512),
    replace(moe_decode.TILES, down_block_n=16, down_block_k=128, down_warps=4),
    replace(moe_decode.TILES, gate_up_warps=4, down_block_n=16, down_block_k=128, down_warps=4),
    replace(moe_decode.TILES, shared_in_route=False),
    replace(moe_decode.TILES, shared_block_n=2),
]

Block = Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def layer_weights(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA, generator=gen) * INTER**-0.5
    shared_gate_up = torch.randn(2 * SHARED_INTER, HIDDEN, dtype=BF16, device=CUDA, generator=gen) * HIDDEN**-0.5
    shared_down = torch.randn(HIDDEN, SHARED_INTER, dtype=BF16, device=CUDA, generator=gen) * SHARED_INTER**-0.5
    return w13, w2, shared_gate_up, shared_down


def label(tiles: DecodeTiles) -> str:
    t = tiles
    return (f"gate/up {t.gate_up_block_n}x{t.gate_up_block_k} p{t.gate_up_pairs} w{t.gate_up_warps}, "
            f"down {t.down_block_n}x{t.down_block_k} w{t.down_warps}{', pdl' if t.pdl else ''}"
            f"{f', shared in route x{t.shared_block_n}' if t.shared_in_route else ''}")


def variants() -> list[tuple[str, dict | None, Block]]:
    """(label, tiles as a dict or None, the block on one layer's weights): the old kernels first, then
    the candidates, the default first."""
    found: list[tuple[str, dict | None, Block]] = [
        ("old 2-launch kernels, old default", None, lambda x, g, w: old.sparse_moe_decode(x, g, *w, TOP_K, True))
    ]
    for tiles in CANDIDATES:
        name = label(tiles) + (" (default)" if tiles == moe_decode.TILES else "")
        block = lambda x, g, w, tiles=tiles: sparse_moe_decode_tiled(x, g, *w, TOP_K, True, tiles)  # noqa: E731
        found.append((name, asdict(tiles), block))
    return found


def graph_error(run: Callable[[], list[torch.Tensor]], wants: list[torch.Tensor]) -> float:
    """The largest relative error to the reference over the layers of ``run`` replayed (twice) from a
    CUDA graph, as the engine runs them: each layer's buffers at the previous layer's addresses."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    errors = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        errors += [((out.float() - want).norm() / want.norm()).item() for out, want in zip(outs, wants)]
    return max(errors)


def per_kernel_us(fn: Callable[[], None], calls_per_fn: int, repeats: int = 5) -> str:
    """Device time per launch of each kernel ``fn`` runs (torch.profiler), averaged over its layers."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / (repeats * calls_per_fn)
    return ", ".join(f"{name} {us:.1f}" for name, us in totals.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    layers = [layer_weights(gen) for _ in range(LAYERS)]
    blocks = variants()
    results = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA, generator=gen)
        logits = [torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA, generator=gen) for _ in layers]
        touched = [int(torch.unique(g[:, :EXPERTS].topk(TOP_K, dim=1).indices).numel()) for g in logits]
        bytes_per_layer = sum((t + 1) * 3 * INTER * HIDDEN * 2 for t in touched) / LAYERS
        wants = [sparse_moe_decode_reference(x, g, *w, TOP_K, True).float() for g, w in zip(logits, layers)]
        print(f"T={tokens}: {bytes_per_layer / 1e6:.1f} MB/layer; us/layer (TB/s), graph | eager", flush=True)
        rows = []
        for name, tiles, block in blocks:
            def run(block: Block = block) -> list[torch.Tensor]:
                return [block(x, g, weights) for g, weights in zip(logits, layers)]

            run()  # compiles
            err = graph_error(run, wants)
            if not err <= 1e-2:  # bf16 rounding in other places than the reference: about 3e-3
                raise AssertionError(f"{name}: relative error {err:.3g} to the reference")
            graph_us = do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3 / LAYERS
            eager_us = do_bench(run, warmup=5, rep=25, return_mode="median") * 1e3 / LAYERS
            row = {"tokens": tokens, "variant": name, "tiles": tiles, "graph_us": graph_us, "eager_us": eager_us,
                   "graph_TB/s": bytes_per_layer / (graph_us * 1e-6) / 1e12, "rel_err": err}
            rows.append(row)
            print(f"  {graph_us:6.1f} ({row['graph_TB/s']:4.2f}) | {eager_us:6.1f}  {name}", flush=True)
        best = min(rows[1:], key=lambda r: r["graph_us"])
        print(f"  best: {best['graph_us']:.1f} us/layer ({best['graph_TB/s']:.2f} TB/s) {best['variant']}; "
              f"old: {rows[0]['graph_us']:.1f}", flush=True)
        # Without PDL: under it a launch's time includes its wait for the previous one.
        for name, _, block in (blocks[2], blocks[0]):
            breakdown = per_kernel_us(lambda block=block: [block(x, g, w) for g, w in zip(logits, layers)], LAYERS)
            print(f"  per kernel (us): {breakdown}  [{name}]", flush=True)
        results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
