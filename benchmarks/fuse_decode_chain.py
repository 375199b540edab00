"""The fused attention prologue against the chain it replaces, on one GPU, replayed from CUDA graphs.

    python benchmarks/fuse_decode_chain.py [--batch-sizes 1 8] [--json FILE]

Qwen3.6-35B-A3B's sizes in bf16: 10 full-attention layers (16 query / 2 KV heads of 256, rotary
64, pages of 16), each with its own weights and paged cache, and one graph holding every layer's
prologue back to back, as a decode step's graph does, so the time per layer includes the launch
gaps inside the graph. Per batch size it prints, per layer, the old prologue (two rms_norm,
apply_rotary's two launches, store_kv: five launches) and ``norm_rotary_store_kv`` (one), with the
largest relative error of the fused queries to the old chain's (bf16: below 1e-2).

(A fused Gated DeltaNet decode chain was measured here too and dropped: at batch 1 its 16
programs, one per key head, took 13.7-18.6 us per layer against the three-launch chain's 9.3.)
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from freetoken.kernels.rotary import build_rotary_cache
from freetoken.kernels.triton import attention, attention_prologue, norm, rotary

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HQ, HKV, HEAD_DIM, ROTARY_DIM, PAGE = 16, 2, 256, 64, 16
ATTENTION_LAYERS = 10
EPS = 1e-6


def randn(*shape, dtype=BF16, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=CUDA) * scale).to(dtype)


class AttentionLayer:
    """One attention layer's prologue inputs (views of its qkv_proj output), norm weights and
    paged cache; token ``i`` at a random position, stored in a random location past the scratch
    page 0 (so inside pages ``1 .. num_pages - 1``)."""

    def __init__(self, batch: int, rotary_cache: torch.Tensor) -> None:
        packed = randn(batch, HQ * 2 * HEAD_DIM + 2 * HKV * HEAD_DIM)
        self.q = packed[:, : HQ * 2 * HEAD_DIM].view(batch, HQ, 2 * HEAD_DIM)[..., :HEAD_DIM]
        self.k, self.v = packed[:, HQ * 2 * HEAD_DIM :].view(batch, 2, HKV, HEAD_DIM).unbind(1)
        self.q_w, self.k_w = randn(HEAD_DIM, scale=0.2), randn(HEAD_DIM, scale=0.2)
        self.rotary_cache = rotary_cache
        self.positions = torch.randint(0, rotary_cache.shape[0], (batch,), device=CUDA)
        num_pages = 64
        self.k_cache = randn(num_pages, PAGE, HKV, HEAD_DIM)
        self.v_cache = randn(num_pages, PAGE, HKV, HEAD_DIM)
        self.locations = torch.randperm((num_pages - 1) * PAGE, device=CUDA)[:batch] + PAGE

    def old(self) -> torch.Tensor:
        q = norm.rms_norm(self.q, self.q_w, EPS, True)
        k = norm.rms_norm(self.k, self.k_w, EPS, True)
        q, k = rotary.apply_rotary(q, k, self.positions, self.rotary_cache, ROTARY_DIM)
        attention.store_kv(k, self.v, self.k_cache, self.v_cache, self.locations)
        return q

    def fused(self) -> torch.Tensor:
        return attention_prologue.norm_rotary_store_kv(
            self.q, self.k, self.v, self.q_w, self.k_w, EPS, self.positions, self.rotary_cache, ROTARY_DIM,
            self.k_cache, self.v_cache, self.locations,
        )


def graph_us_per_layer(step: Callable[[], None], num_layers: int, replays: int = 50) -> float:
    """Mean microseconds per layer of ``step`` (every layer's chain) replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels, outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * num_layers)


def max_error(layers, snapshot: Callable, restore: Callable) -> float:
    """The largest relative error of a layer's fused output to its old chain's, from equal states."""
    worst = 0.0
    for layer in layers:
        saved = snapshot(layer)
        want = layer.old().float()
        restore(layer, saved)
        got = layer.fused().float()
        restore(layer, saved)
        worst = max(worst, ((got - want).norm() / want.norm()).item())
    return worst


def attention_rows(batch: int, rotary_cache: torch.Tensor) -> list[dict]:
    layers = [AttentionLayer(batch, rotary_cache) for _ in range(ATTENTION_LAYERS)]
    snapshot = lambda l: (l.k_cache.clone(), l.v_cache.clone())  # noqa: E731
    restore = lambda l, s: (l.k_cache.copy_(s[0]), l.v_cache.copy_(s[1]))  # noqa: E731
    error = max_error(layers, snapshot, restore)
    old_us = graph_us_per_layer(lambda: [layer.old() for layer in layers], ATTENTION_LAYERS)
    fused_us = graph_us_per_layer(lambda: [layer.fused() for layer in layers], ATTENTION_LAYERS)
    return [
        dict(op="attention prologue", batch=batch, variant="old (5 launches)", us_per_layer=old_us),
        dict(op="attention prologue", batch=batch, variant="fused (1 launch)", us_per_layer=fused_us, max_rel_error=error),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rotary_cache = build_rotary_cache(ROTARY_DIM, 32768, 1e7, CUDA)
    rows: list[dict] = []
    for batch in args.batch_sizes:
        for row in attention_rows(batch, rotary_cache):
            rows.append(row)
            extra = f"  max rel error {row['max_rel_error']:.2e}" if "max_rel_error" in row else ""
            print(f"batch {batch:3d}  {row['op']:18s} {row['variant']:42s} {row['us_per_layer']:7.2f} us/layer{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
