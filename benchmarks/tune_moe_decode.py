"""Time ``sparse_moe_decode``'s launch shapes (``DecodeTiles``) on one GPU, at batch 1 and a few
tokens, against the bytes the block must read; prints one line per shape and the best.

    python benchmarks/tune_moe_decode.py [--tokens 1 4 8] [--json FILE]

At one token the block reads its experts at under 1 TB/s on the H200 (docs/benchmarks.md). Each
timing runs the block over ``LAYERS`` layers' weights in turn (about 200 MB of distinct experts, more than the
60 MB L2), so no layer finds its experts cached by the previous call, as in a real step.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch
from triton.testing import do_bench

from freetoken.kernels.triton import moe_decode
from freetoken.kernels.triton.moe_decode import DecodeTiles, sparse_moe_decode_tiled

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HIDDEN, EXPERTS, TOP_K, INTER, SHARED_INTER = 2048, 256, 8, 512, 512
LAYERS = 4

CANDIDATES = [
    moe_decode.TILES,
    DecodeTiles(gate_up_block_n=8),
    DecodeTiles(gate_up_block_n=4, gate_up_block_k=512),
    DecodeTiles(gate_up_block_n=8, gate_up_block_k=512, gate_up_warps=8),
    DecodeTiles(gate_up_block_n=32, gate_up_warps=8),
    DecodeTiles(down_block_n=4),
    DecodeTiles(down_block_n=16, down_warps=8),
    DecodeTiles(down_block_k=512, down_warps=8),
]


def layer_weights(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA, generator=gen) * INTER**-0.5
    shared_gate_up = torch.randn(2 * SHARED_INTER, HIDDEN, dtype=BF16, device=CUDA, generator=gen) * HIDDEN**-0.5
    shared_down = torch.randn(HIDDEN, SHARED_INTER, dtype=BF16, device=CUDA, generator=gen) * SHARED_INTER**-0.5
    return w13, w2, shared_gate_up, shared_down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    layers = [layer_weights(gen) for _ in range(LAYERS)]
    results = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA, generator=gen)
        logits = [torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA, generator=gen) for _ in layers]
        touched = [int(torch.unique(g[:, :EXPERTS].topk(TOP_K, dim=1).indices).numel()) for g in logits]
        bytes_per_layer = sum((t + 1) * 3 * INTER * HIDDEN * 2 for t in touched) / LAYERS
        want = moe_decode.sparse_moe_decode(x, logits[0], *layers[0], TOP_K, True)
        for tiles in CANDIDATES:
            def run(tiles: DecodeTiles = tiles) -> None:
                for g, weights in zip(logits, layers):
                    sparse_moe_decode_tiled(x, g, *weights, TOP_K, True, tiles)

            out = sparse_moe_decode_tiled(x, logits[0], *layers[0], TOP_K, True, tiles)
            # Other reduction steps sum in another order: equal up to bf16 rounding, not bitwise.
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-3, msg=lambda m: f"{tiles}: {m}")
            us = do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3 / LAYERS
            tbs = bytes_per_layer / (us * 1e-6) / 1e12
            results.append({"tokens": tokens, "tiles": asdict(tiles), "us": us, "TB/s": tbs})
            print(f"T={tokens} {us:7.1f} us/layer {tbs:5.2f} TB/s  {tiles}", flush=True)
        best = min((r for r in results if r["tokens"] == tokens), key=lambda r: r["us"])
        print(f"T={tokens} best: {best['us']:.1f} us/layer ({best['TB/s']:.2f} TB/s) {best['tiles']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
