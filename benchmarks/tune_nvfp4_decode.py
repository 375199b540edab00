"""Time the NVFP4 MoE decode block's launch shapes (``NVFP4DecodeTiles``) on one GPU at a few tokens,
against the packed bytes and scales the block must read, beside the previous two-launch kernels (a
frozen copy, ``nvfp4_decode_baseline.py``); prints one line per shape, the best, and the time per
kernel of the old kernels and of the default without PDL. Then the dense NVFP4 linear at one row
(attention qkv and o): the GEMV (``nvfp4_rows.nvfp4_gemv``) against the frozen tensor-core tile it
replaced there. "old" is the kernels with their decode as of 3243eab.

    python benchmarks/tune_nvfp4_decode.py [--tokens 1 8] [--json FILE]

As ``tune_moe_decode.py`` (whose graph check and profiler breakdown this reuses): each timing runs the
block over ``LAYERS`` layers' distinct packed experts (about 1.8 GB, far more than the 60 MB L2),
replayed from a CUDA graph as the engine decodes; every variant is first checked against the float32
torch reference. TB/s counts the touched experts' and the shared expert's packed bytes, e4m3 scales
and float32 row scales.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
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

# Gate/up rows x step (2048: the whole hidden in one load), pairs per program, warps; down rows x
# step (512: the whole intermediate), warps; programmatic dependent launch.
CANDIDATES = [
    DEFAULT,
    replace(DEFAULT, pdl=False),
    replace(DEFAULT, gate_up_block_n=4),
    replace(DEFAULT, gate_up_block_n=16),
    replace(DEFAULT, gate_up_block_n=4, gate_up_pairs=2),
    replace(DEFAULT, down_block_n=4),
    replace(DEFAULT, down_block_n=16, down_block_k=256),
    replace(DEFAULT, down_warps=8),
]

Block = Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def layer_weights() -> tuple[torch.Tensor, ...]:
    return (*random_nvfp4(EXPERTS, 2 * INTER, HIDDEN), *random_nvfp4(EXPERTS, HIDDEN, INTER),
            *random_nvfp4(2 * SHARED_INTER, HIDDEN), *random_nvfp4(HIDDEN, SHARED_INTER))


def label(tiles: NVFP4DecodeTiles) -> str:
    t = tiles
    return (f"gate/up {t.gate_up_block_n}x{t.gate_up_block_k} p{t.gate_up_pairs} w{t.gate_up_warps}, "
            f"down {t.down_block_n}x{t.down_block_k} w{t.down_warps}{', pdl' if t.pdl else ''}")


def variants() -> list[tuple[str, dict | None, Block]]:
    """(label, tiles as a dict or None, the block on one layer's weights): the old kernels first, then
    the candidates, the default first."""
    found: list[tuple[str, dict | None, Block]] = [
        ("old 2-launch kernels", None, lambda x, g, w: old.sparse_moe_decode_nvfp4(x, g, *w, TOP_K, True))
    ]
    for tiles in CANDIDATES:
        name = label(tiles) + (" (default)" if tiles == DEFAULT else "")
        block = lambda x, g, w, tiles=tiles: sparse_moe_decode_nvfp4_tiled(x, g, *w, TOP_K, True, tiles)  # noqa: E731
        found.append((name, asdict(tiles), block))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [layer_weights() for _ in range(LAYERS)]
    expert_bytes = nvfp4_bytes(2 * INTER, HIDDEN) + nvfp4_bytes(HIDDEN, INTER)
    shared_bytes = nvfp4_bytes(2 * SHARED_INTER, HIDDEN) + nvfp4_bytes(HIDDEN, SHARED_INTER)
    blocks = variants()
    results = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA)
        logits = [torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA) for _ in layers]
        touched = [int(torch.unique(g[:, :EXPERTS].topk(TOP_K, dim=1).indices).numel()) for g in logits]
        bytes_per_layer = sum(t * expert_bytes + shared_bytes for t in touched) / LAYERS
        wants = [sparse_moe_decode_nvfp4_reference(x.float(), g.float(), *w, TOP_K, True) for g, w in zip(logits, layers)]
        print(f"T={tokens}: {bytes_per_layer / 1e6:.1f} MB/layer packed + scales; graph us/layer (TB/s)", flush=True)
        rows = []
        for name, tiles, block in blocks:
            def run(block: Block = block) -> list[torch.Tensor]:
                return [block(x, g, weights) for g, weights in zip(logits, layers)]

            run()  # compiles
            err = graph_error(run, wants)
            if not err <= 1e-2:  # bf16 rounding in other places than the reference: a few 1e-3
                raise AssertionError(f"{name}: relative error {err:.3g} to the reference")
            graph_us = do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3 / LAYERS
            row = {"tokens": tokens, "variant": name, "tiles": tiles, "graph_us": graph_us,
                   "graph_TB/s": bytes_per_layer / (graph_us * 1e-6) / 1e12, "rel_err": err}
            rows.append(row)
            print(f"  {graph_us:6.1f} ({row['graph_TB/s']:4.2f})  {name}", flush=True)
        best = min(rows[1:], key=lambda r: r["graph_us"])
        print(f"  best: {best['graph_us']:.1f} us/layer ({best['graph_TB/s']:.2f} TB/s) {best['variant']}; "
              f"old: {rows[0]['graph_us']:.1f}", flush=True)
        # Without PDL: under it a launch's time includes its wait for the previous one.
        for name, _, block in (blocks[2], blocks[0]):
            breakdown = per_kernel_us(lambda block=block: [block(x, g, w) for g, w in zip(logits, layers)], LAYERS)
            print(f"  per kernel (us): {breakdown}  [{name}]", flush=True)
        results += rows
    results += time_dense()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
