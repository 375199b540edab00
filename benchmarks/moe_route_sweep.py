"""The grouped MoE path's routing prologue: the top-k kernel then the one-program sort
(``moe_sort_tokens`` up to ``SORT_ONE_PROGRAM_PAIRS``) against the top-k kernel then the
three-launch sort, at decode batch sizes, replayed from CUDA graphs.

    python benchmarks/moe_route_sweep.py [--tokens 16 64 128 256] [--no-block] [--json FILE]

Qwen3.6-35B-A3B's MoE shape: 256 experts, top-8, hidden 2048, moe intermediate 512 (shared 512).

1. ``prologue``: per layer, the router logits (bf16, the router columns of the router + shared-gate
   GEMM's ``[T, 257]`` output) to the ids, weights, sorted pairs and expert offsets the grouped
   GEMMs read. Each variant is checked equal to the old path, then timed as ``LAYERS_PROLOGUE``
   calls captured in one CUDA graph: the graph's replay time per call, median of 20
   replays. The one-program sort runs at each of ``SORT_WARPS``; the default
   (``SORT_ONE_PROGRAM_WARPS``) is marked. Set ``SORT_ONE_PROGRAM_PAIRS`` (kernels/triton/moe.py)
   to the largest batch where it wins.
2. ``router_gemm``: the router + shared-gate GEMM before it, with 257 output rows of weight
   (cuBLAS's unaligned kernels) and padded to 264 rows, as the layer allocates it.
3. ``block``: the whole MoE block after the router GEMM (top-k, sort, grouped GEMMs, sum over the
   choices, shared expert, combine), old sort against new, over ``LAYERS_BLOCK`` layers of
   distinct expert weights (6.4 GB, far more than the 60 MB L2) in one graph, as the engine's
   decode step runs it.

Under 120 s on an H200 (most of it compiling the tile shapes).
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us
import torch.nn.functional as F

from freetoken.kernels.triton import moe

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HIDDEN, EXPERTS, TOP_K, INTER, SHARED_INTER = 2048, 256, 8, 512, 512
LAYERS_PROLOGUE, LAYERS_BLOCK = 40, 4
ROUTER_WEIGHTS = 128  # 135 MB of router weights in turn: none found in the 60 MB L2, as in a step
SORT_WARPS = [4, 8]


def prologue(logits: torch.Tensor, pairs: int, warps: int) -> tuple[torch.Tensor, ...]:
    """The top-k kernel and ``moe_sort_tokens`` with its one-program bound and warps set."""
    default = moe.SORT_ONE_PROGRAM_PAIRS, moe.SORT_ONE_PROGRAM_WARPS
    moe.SORT_ONE_PROGRAM_PAIRS, moe.SORT_ONE_PROGRAM_WARPS = pairs, warps
    try:
        weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
        return (weights, ids, *moe.moe_sort_tokens(ids, EXPERTS))
    finally:
        moe.SORT_ONE_PROGRAM_PAIRS, moe.SORT_ONE_PROGRAM_WARPS = default


def old_prologue(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return prologue(logits, 0, moe.SORT_ONE_PROGRAM_WARPS)


def prologue_rows(tokens: int, gen: torch.Generator) -> list[dict]:
    packed = torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA, generator=gen)
    logits = packed[:, :EXPERTS]
    want = old_prologue(logits)
    pairs = tokens * TOP_K
    variants = [("four launches (old): top-k kernel, 3-launch sort", old_prologue)]
    variants += [
        (f"two launches: top-k kernel, sort program of {w} warps"
         + ("  (default)" if w == moe.SORT_ONE_PROGRAM_WARPS else ""),
         lambda logits, w=w: prologue(logits, pairs, w))
        for w in SORT_WARPS
    ]
    rows = []
    for name, fn in variants:
        got = fn(logits)
        torch.cuda.synchronize()
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        us = graph_us(lambda fn=fn: [fn(logits) for _ in range(LAYERS_PROLOGUE)], LAYERS_PROLOGUE)
        rows.append({"part": "prologue", "tokens": tokens, "variant": name, "us": us, "equal_to_old": same})
    old = rows[0]["us"]
    best = min(rows[1:], key=lambda r: r["us"])
    print(f"T={tokens} prologue, us per layer (graph replay):", flush=True)
    for r in rows:
        print(f"  {r['us']:7.2f}  {r['variant']}{'' if r['equal_to_old'] else '  MISMATCH vs old'}", flush=True)
    print(f"  best {best['us']:.2f} us ({best['variant']}), old {old:.2f} us: {old / best['us']:.1f}x", flush=True)
    return rows


def layer(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA, generator=gen) * INTER**-0.5
    sgu = torch.randn(2 * SHARED_INTER, HIDDEN, dtype=BF16, device=CUDA, generator=gen) * HIDDEN**-0.5
    sd = torch.randn(HIDDEN, SHARED_INTER, dtype=BF16, device=CUDA, generator=gen) * SHARED_INTER**-0.5
    return w13, w2, sgu, sd


def block(x: torch.Tensor, gate_logits: torch.Tensor, w: tuple[torch.Tensor, ...], pairs: int) -> torch.Tensor:
    """The block as ``SparseMoE`` runs it past the fused decode sizes, the one-program sort up to ``pairs``."""
    w13, w2, sgu, sd = w
    default = moe.SORT_ONE_PROGRAM_PAIRS
    moe.SORT_ONE_PROGRAM_PAIRS = pairs
    try:
        weights, ids = moe.moe_topk_softmax(gate_logits[:, :EXPERTS], TOP_K, True)
        shared = F.linear(moe.silu_and_mul(F.linear(x, sgu)), sd)
        routed = moe.fused_experts(x, w13, w2, weights, ids)
        return moe.shared_expert_combine(routed, shared, gate_logits[:, EXPERTS:])
    finally:
        moe.SORT_ONE_PROGRAM_PAIRS = default


def old_block(x: torch.Tensor, gate_logits: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return block(x, gate_logits, w, 0)


def new_block(x: torch.Tensor, gate_logits: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return block(x, gate_logits, w, moe.SORT_ONE_PROGRAM_PAIRS)


def block_rows(tokens: int, layers: list[tuple[torch.Tensor, ...]], gen: torch.Generator) -> list[dict]:
    x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA, generator=gen)
    gates = [torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA, generator=gen) for _ in layers]
    rows = []
    outs = {}
    for name, run in (("old", old_block), ("new", new_block)):
        outs[name] = [run(x, g, w) for g, w in zip(gates, layers)]
        us = graph_us(lambda run=run: [run(x, g, w) for g, w in zip(gates, layers)], len(layers))
        rows.append({"part": "block", "tokens": tokens, "variant": name, "us": us})
    torch.cuda.synchronize()
    err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(outs["new"], outs["old"]))
    for r in rows:
        r["rel_err_to_old"] = err
    print(f"T={tokens} MoE block after the router GEMM, us per layer (graph replay): old {rows[0]['us']:.1f}, "
          f"new {rows[1]['us']:.1f} (saved {rows[0]['us'] - rows[1]['us']:.1f}); new vs old rel err {err:.1e}",
          flush=True)
    return rows


def router_gemm_rows(tokens: int, gen: torch.Generator) -> list[dict]:
    """The router + shared-gate GEMM that feeds the prologue: ``[T, 2048] x [2048, 257]`` as the
    layer runs it (257 output columns: rows of 514 bytes, so cuBLAS can only take its unaligned
    kernels, e.g. ``cutlass_75_..._align1``), against the weight padded to 264 rows (rows of a
    multiple of 16 bytes) with the first 257 columns used; ``ROUTER_WEIGHTS`` weights in turn."""
    x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA, generator=gen)
    weights = [torch.randn(EXPERTS + 8, HIDDEN, dtype=BF16, device=CUDA, generator=gen) * HIDDEN**-0.5
               for _ in range(ROUTER_WEIGHTS)]
    exact = [w[: EXPERTS + 1].contiguous() for w in weights]
    rows = []
    for name, ws in (("257 rows", exact), ("264 rows, 257 used (the layer's)", weights)):
        us = graph_us(lambda ws=ws: [F.linear(x, w)[:, : EXPERTS + 1] for w in ws], len(ws))
        rows.append({"part": "router_gemm", "tokens": tokens, "variant": name, "us": us})
    print(f"T={tokens} router GEMM, us per layer (graph replay): 257 rows {rows[0]['us']:.2f}, "
          f"padded to 264 {rows[1]['us']:.2f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--no-block", action="store_true", help="time the prologue only")
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    rows = []
    for tokens in args.tokens:
        rows += prologue_rows(tokens, gen)
    for tokens in args.tokens:
        rows += router_gemm_rows(tokens, gen)
    if not args.no_block:
        layers = [layer(gen) for _ in range(LAYERS_BLOCK)]
        for tokens in args.tokens:
            rows += block_rows(tokens, layers, gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
