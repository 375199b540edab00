"""The grouped MoE path's routing: the one-warp top-k kernel (``_topk_softmax_warp_kernel``) at
each tile against the old multi-warp kernel, with and without programmatic dependent launch,
replayed from CUDA graphs at decode (and prefill) batch sizes.

    python benchmarks/moe_route_sweep.py [--tokens 16 64 128 256] [--topk-tokens ...] [--no-block] [--json FILE]

Qwen3.6-35B-A3B's MoE shape: 256 experts, top-8, hidden 2048, moe intermediate 512 (shared 512).
The router logits are bf16, the router columns of the router + shared-gate GEMM's ``[T, 264]``
output (row stride 264, as the layer allocates it).

1. ``topk``: ``moe_topk_softmax`` alone, ``LAYERS_PROLOGUE`` calls in one graph, us per call
   (median of 20 replays): the old kernel (``TOPK_WARP_MAX_TOKENS = 0``) and the one-warp kernel at
   ``TOPK_WARP_TOKENS`` in ``WARP_TOKENS``; ids checked equal to the old kernel's, weights within
   one rounding (the renormalising sum adds in another order).
2. ``prologue``: the top-k kernel then the one-program sort (``moe_sort_tokens``), old and new.
3. ``block``: the router GEMM and the whole MoE block after it (top-k, shared expert, sort, grouped
   GEMMs, sum over the choices, combine) over ``LAYERS_BLOCK`` layers of distinct expert weights
   (6.4 GB, far more than the 60 MB L2) in one graph, as the decode step runs it: old top-k, new,
   new with ``ROUTE_PDL`` (the top-k kernel and the sort start while the GEMM before each drains).

At the end it prints the settings of ``kernels/triton/moe.py`` the timings pick. Under 120 s on an
H200 (most of it compiling the grouped GEMMs' tile shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Iterator

import torch
import torch.nn.functional as F
from graph_timing import graph_us

from freetoken.kernels.triton import moe

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HIDDEN, EXPERTS, TOP_K, INTER, SHARED_INTER = 2048, 256, 8, 512, 512
ROUTER_ROWS = 264  # 256 experts + the shared expert's gate, padded to rows of 16 bytes
LAYERS_PROLOGUE, LAYERS_BLOCK = 40, 4
WARP_TOKENS = [1, 2, 4]
OLD = {"TOPK_WARP_MAX_TOKENS": 0, "ROUTE_PDL": False}


@contextlib.contextmanager
def knobs(**values: object) -> Iterator[None]:
    """``kernels/triton/moe.py``'s module settings set for the duration (the wrappers read them at
    each call, so also while a graph is captured)."""
    saved = {name: getattr(moe, name) for name in values}
    for name, value in values.items():
        setattr(moe, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(moe, name, value)


def router_logits(tokens: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(tokens, ROUTER_ROWS, dtype=BF16, device=CUDA, generator=gen)[:, :EXPERTS]


def topk_variants() -> list[tuple[str, dict]]:
    variants = [("old multi-warp kernel", OLD)]
    variants += [(f"one warp, {n} token(s) a program", {"TOPK_WARP_MAX_TOKENS": 1 << 31, "TOPK_WARP_TOKENS": n})
                 for n in WARP_TOKENS]
    return variants


def compare(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> tuple[bool, float]:
    """(ids equal, largest weight difference) of two ``(weights, ids, ...)`` results."""
    torch.cuda.synchronize()
    ids_equal = all(torch.equal(g, w) for g, w in zip(got[1:], want[1:]))
    return ids_equal, (got[0].float() - want[0].float()).abs().max().item()


def topk_rows(tokens: int, gen: torch.Generator) -> list[dict]:
    logits = router_logits(tokens, gen)
    with knobs(**OLD):
        want = moe.moe_topk_softmax(logits, TOP_K, True)
    rows = []
    print(f"T={tokens} top-k, us per layer (graph replay):", flush=True)
    for name, settings in topk_variants():
        with knobs(**settings):
            ids_equal, w_diff = compare(moe.moe_topk_softmax(logits, TOP_K, True), want)
            us = graph_us(lambda: [moe.moe_topk_softmax(logits, TOP_K, True) for _ in range(LAYERS_PROLOGUE)],
                          LAYERS_PROLOGUE)
        rows.append({"part": "topk", "tokens": tokens, "variant": name, "settings": settings, "us": us,
                     "ids_equal_to_old": ids_equal, "max_weight_diff": w_diff})
        flag = "" if ids_equal else "  IDS DIFFER FROM OLD"
        print(f"  {us:7.2f}  {name}  (max weight diff {w_diff:.1e}){flag}", flush=True)
    return rows


def prologue(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    return (weights, ids, *moe.moe_sort_tokens(ids, EXPERTS))


def prologue_rows(tokens: int, new: dict, gen: torch.Generator) -> list[dict]:
    logits = router_logits(tokens, gen)
    with knobs(**OLD):
        want = prologue(logits)
    rows = []
    for name, settings in (("old: multi-warp top-k, sort program", OLD), ("new: one-warp top-k, sort program", new)):
        with knobs(**settings):
            ids_equal, w_diff = compare(prologue(logits), want)
            us = graph_us(lambda: [prologue(logits) for _ in range(LAYERS_PROLOGUE)], LAYERS_PROLOGUE)
        rows.append({"part": "prologue", "tokens": tokens, "variant": name, "settings": settings, "us": us,
                     "ids_equal_to_old": ids_equal, "max_weight_diff": w_diff})
    print(f"T={tokens} top-k + sort, us per layer: old {rows[0]['us']:.2f}, new {rows[1]['us']:.2f}"
          + ("" if rows[1]["ids_equal_to_old"] else "  ORDER DIFFERS FROM OLD"), flush=True)
    return rows


def layer(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=BF16, device=CUDA, generator=gen) * shape[-1] ** -0.5

    return (weight(ROUTER_ROWS, HIDDEN), weight(EXPERTS, 2 * INTER, HIDDEN), weight(EXPERTS, HIDDEN, INTER),
            weight(2 * SHARED_INTER, HIDDEN), weight(HIDDEN, SHARED_INTER))


def block(x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The router GEMM and the block as ``SparseMoE.forward`` runs it past the fused decode sizes."""
    router, w13, w2, sgu, sd = w
    gate_logits = F.linear(x, router)[:, : EXPERTS + 1]
    weights, ids = moe.moe_topk_softmax(gate_logits[:, :EXPERTS], TOP_K, True)
    shared = F.linear(moe.silu_and_mul(F.linear(x, sgu)), sd)
    routed = moe.fused_experts(x, w13, w2, weights, ids)
    return moe.shared_expert_combine(routed, shared, gate_logits[:, EXPERTS:])


def block_rows(tokens: int, new: dict, layers: list[tuple[torch.Tensor, ...]], gen: torch.Generator) -> list[dict]:
    xs = [torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA, generator=gen) for _ in layers]
    variants = (("old", OLD), ("new", {**new, "ROUTE_PDL": False}), ("new + PDL", {**new, "ROUTE_PDL": True}))
    rows, outs = [], {}
    for name, settings in variants:
        with knobs(**settings):
            outs[name] = [block(x, w) for x, w in zip(xs, layers)]
            us = graph_us(lambda: [block(x, w) for x, w in zip(xs, layers)], len(layers))
        rows.append({"part": "block", "tokens": tokens, "variant": name, "settings": settings, "us": us})
    torch.cuda.synchronize()
    for row in rows:
        row["rel_err_to_old"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                    for a, b in zip(outs[row["variant"]], outs["old"]))
    print(f"T={tokens} router GEMM + MoE block, us per layer (graph replay): "
          + ", ".join(f"{r['variant']} {r['us']:.1f} (rel err to old {r['rel_err_to_old']:.1e})" for r in rows),
          flush=True)
    return rows


def best_warp_tokens(rows: list[dict], decode_tokens: list[int]) -> int:
    """The one-warp tile with the least time summed over the decode batch sizes."""
    def total(n: int) -> float:
        return sum(r["us"] for r in rows if r["part"] == "topk" and r["tokens"] in decode_tokens
                   and r["settings"].get("TOPK_WARP_TOKENS") == n and r["settings"]["TOPK_WARP_MAX_TOKENS"])

    return min(WARP_TOKENS, key=total)


def warp_bound(rows: list[dict], tokens: int) -> int:
    """The largest measured batch up to which the chosen one-warp tile beats the old kernel at
    every measured size (``1 << 31``: everywhere measured)."""
    sizes = sorted({r["tokens"] for r in rows if r["part"] == "topk"})
    bound = 0
    for size in sizes:
        at = [r for r in rows if r["part"] == "topk" and r["tokens"] == size]
        old = next(r["us"] for r in at if not r["settings"]["TOPK_WARP_MAX_TOKENS"])
        new = next(r["us"] for r in at if r["settings"].get("TOPK_WARP_TOKENS") == tokens
                   and r["settings"]["TOPK_WARP_MAX_TOKENS"])
        if new >= old:
            break
        bound = size
    return 1 << 31 if bound == sizes[-1] else bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 256], help="decode batch sizes")
    parser.add_argument("--topk-tokens", type=int, nargs="+", default=[1024, 8192],
                        help="prefill sizes the top-k alone is also timed at (the one-warp kernel's bound)")
    parser.add_argument("--no-block", action="store_true", help="skip the MoE block part")
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    rows = []
    for tokens in sorted(set(args.tokens + args.topk_tokens)):
        rows += topk_rows(tokens, gen)
    warp_tokens = best_warp_tokens(rows, args.tokens)
    max_tokens = warp_bound(rows, warp_tokens)
    new = {"TOPK_WARP_MAX_TOKENS": max_tokens, "TOPK_WARP_TOKENS": warp_tokens}
    for tokens in args.tokens:
        rows += prologue_rows(tokens, new, gen)
    pdl = False
    if not args.no_block:
        layers = [layer(gen) for _ in range(LAYERS_BLOCK)]
        block_at = [block_rows(tokens, new, layers, gen) for tokens in args.tokens]
        rows += [r for b in block_at for r in b]
        pdl = sum(b[2]["us"] for b in block_at) < sum(b[1]["us"] for b in block_at)
    print(f"kernels/triton/moe.py: TOPK_WARP_MAX_TOKENS = {max_tokens}, TOPK_WARP_TOKENS = {warp_tokens}"
          + ("" if args.no_block else f", ROUTE_PDL = {pdl}"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
