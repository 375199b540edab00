"""Time decode attention (one query token a request) under CUDA graph replay: the one-launch split-KV
kernel (``kernels/triton/attention_decode.py``) against the two launches it replaced (a frozen copy,
``attention_decode_baseline.py``), at Qwen3.6-35B-A3B's full-attention shape (16 query / 2 KV heads of
256, gated output, pages of 16, bf16), for each batch size x context length.

    python benchmarks/attention_decode_sweep.py [--batches 1 8 64 128] [--contexts 1024 8192 32768]
        [--dtype bfloat16] [--tune] [--focus BATCH CONTEXT ...] [--json FILE]

Each timing replays one graph of ``layers`` launches, each over its own KV pages (together at least
256 MB, more than the 60 MB L2), so no launch finds its keys cached by the one before, as in a step
of a model; the figure is the replay time divided by ``layers``. ``floor`` is that layer's KV bytes
over 4.3 TB/s. Both kernels' outputs are compared before timing. ``--tune`` adds a sweep of the new
kernel's ``DecodeTiles`` at a few shapes (the best per shape, and the default's time), then the
default tiles under other split axes (``max_splits`` 8 to 64).

``--focus 64 1024 64 32768`` (pairs of batch and context; with ``--batches`` left out it times only
these) sweeps, at each pair, the grid's split axis (``FOCUS_SPLITS``) against the launch shapes
that matter there (``FOCUS_TILES``: 32- and 64-key blocks, 4 and 8 warps, ``prefetch_pages``: K/V
double-buffered at 3 stages, triple at 4), and prints the best with its ``DecodeTiles`` and the split policy
(``programs_per_sm``, ``round_splits_down``) that gives its split axis. At 64 x 1k the default
(4 splits: 512 programs of 4 blocks each, one K/V block in flight per program) reads 2.5 TB/s
against 4.1 at 64 x 32k, where the same programs stream 128 blocks each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_decode_baseline as old  # noqa: E402

from freetoken.kernels.triton import attention_decode as new  # noqa: E402

HQ, HKV, HEAD_DIM, PAGE_SIZE = 16, 2, 256, 16
HBM_BYTES_PER_S = 4.3e12
POOL_BYTES = 256 << 20
MAX_LAYERS = 128
TUNE_SHAPES = [(1, 1024), (1, 8192), (1, 32768), (8, 8192), (64, 1024), (64, 8192)]
FOCUS_SPLITS = [1, 2, 4, 8]
FOCUS_TILES = [  # (block_n, warps, prefetch_pages, stages); three 64-key K and V buffers would not fit
    new.DecodeTiles(block_n=block_n, num_warps=warps, num_stages=stages, prefetch_pages=prefetch)
    for block_n, warps, prefetch, stages in (
        (64, 4, False, 3), (64, 4, True, 3), (64, 8, True, 3), (32, 4, False, 3), (32, 4, True, 3), (32, 4, True, 4),
        (32, 8, True, 4),
    )
]
CUDA = torch.device("cuda")


@dataclass
class Shape:
    """One (batch, context) point: ``layers`` KV regions in one pool, one page table per layer."""

    batch: int
    context: int
    layers: int
    q: torch.Tensor
    gate: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # [layers, batch, pages per row]
    cu: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one layer's launch must read."""
        return 2 * self.batch * self.context * HKV * HEAD_DIM * self.k_cache.element_size()

    def args(self, layer: int) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.tables[layer], self.cu, self.seq_lens, HEAD_DIM**-0.5, 1)


def make_shape(batch: int, context: int, dtype: torch.dtype) -> Shape:
    kv_bytes = 2 * batch * context * HKV * HEAD_DIM * dtype.itemsize
    layers = max(1, min(MAX_LAYERS, math.ceil(POOL_BYTES / kv_bytes)))
    pages_per_row = -(-context // PAGE_SIZE)
    num_pages = layers * batch * pages_per_row + 1
    shape = (num_pages, PAGE_SIZE, HKV, HEAD_DIM)
    k_cache = torch.randn(shape, device=CUDA, dtype=dtype)
    v_cache = torch.randn(shape, device=CUDA, dtype=dtype)
    perm = torch.randperm(num_pages - 1, device=CUDA) + 1  # scattered pages, page 0 is the scratch page
    tables = perm.view(layers, batch, pages_per_row).int()
    q_gate = torch.randn(batch, HQ, 2 * HEAD_DIM, device=CUDA, dtype=dtype)
    return Shape(
        batch, context, layers, q_gate[..., :HEAD_DIM], q_gate[..., HEAD_DIM:], k_cache, v_cache, tables,
        torch.arange(batch + 1, dtype=torch.int32, device=CUDA),
        torch.full((batch,), context, dtype=torch.int32, device=CUDA),
    )


def graph_time_us(shape: Shape, fn: Callable[..., torch.Tensor]) -> float:
    """Microseconds per layer of a graph replaying ``fn`` over every layer's pages."""
    for layer in range(shape.layers):  # compiles, and sizes the new kernel's counters before capture
        fn(*shape.args(layer), gate=shape.gate)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(shape.layers):
            fn(*shape.args(layer), gate=shape.gate)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    replays = max(5, min(200, int(0.05 / max(time.perf_counter() - start, 1e-6))))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return begin.elapsed_time(end) * 1e3 / (replays * shape.layers)


def split_plan(shape: Shape, tiles: new.DecodeTiles) -> tuple[int, int]:
    """(grid split axis, splits a request of this context uses): the host's ``num_splits`` and the
    kernel's device-side plan, recomputed here for the report."""
    max_splits = new.num_splits(shape.q, shape.batch * HKV)
    block_n = tiles.block_n or (32 if shape.q.dtype == torch.float32 else 64)  # HEAD_DIM 256 > 128
    split_keys = triton.cdiv(tiles.split_keys or block_n, block_n) * block_n
    splits = min(max(triton.cdiv(shape.context, split_keys), 1), max_splits)
    split_len = triton.cdiv(triton.cdiv(shape.context, splits), block_n) * block_n
    return max_splits, triton.cdiv(shape.context, split_len)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def compare(shape: Shape) -> float:
    """Relative L2 difference of the new launch's output from the old one's (layer 0)."""
    args = shape.args(0)
    return rel_error(new.paged_decode_attention(*args, gate=shape.gate), old.paged_attention(*args, gate=shape.gate))


def sweep(batches: list[int], contexts: list[int], dtype: torch.dtype) -> list[dict]:
    rows = []
    print(f"{'batch':>5} {'context':>7} {'layers':>6} {'splits':>9} {'old us':>8} {'new us':>8} {'speedup':>7} "
          f"{'floor us':>8} {'new GB/s':>8} {'rel diff':>8}")
    for batch in batches:
        for context in contexts:
            shape = make_shape(batch, context, dtype)
            diff = compare(shape)
            old_us = graph_time_us(shape, old.paged_attention)
            new_us = graph_time_us(shape, new.paged_decode_attention)
            floor_us = shape.kv_bytes / HBM_BYTES_PER_S * 1e6
            grid_splits, splits = split_plan(shape, new.TILES)
            row = dict(batch=batch, context=context, layers=shape.layers, grid_splits=grid_splits, splits=splits,
                       old_us=old_us, new_us=new_us, floor_us=floor_us, rel_diff=diff)
            rows.append(row)
            print(f"{batch:>5} {context:>7} {shape.layers:>6} {f'{splits}/{grid_splits}':>9} {old_us:>8.2f} "
                  f"{new_us:>8.2f} {old_us / new_us:>6.2f}x {floor_us:>8.2f} {shape.kv_bytes / new_us / 1e3:>8.0f} "
                  f"{diff:>8.1e}", flush=True)
            del shape
            torch.cuda.empty_cache()
    return rows


def tune(dtype: torch.dtype) -> list[dict]:
    variants = [
        new.DecodeTiles(block_n=block_n, num_warps=warps, num_stages=stages, split_keys=keys)
        for block_n in (32, 64) for warps in (4, 8) for stages in (2, 3) for keys in (32, 64, 128, 256)
        if keys >= block_n  # fewer keys round up to one block
    ]
    rows = []
    for batch, context in TUNE_SHAPES:
        shape = make_shape(batch, context, dtype)
        times = []
        for tiles in variants:
            fn = lambda *a, tiles=tiles, **k: new.paged_decode_attention(*a, tiles=tiles, **k)  # noqa: E731
            times.append((graph_time_us(shape, fn), tiles))
            rows.append(dict(batch=batch, context=context, us=times[-1][0], **asdict(tiles)))
        best_us, best = min(times, key=lambda t: t[0])
        default_us = graph_time_us(shape, new.paged_decode_attention)
        rows.append(dict(batch=batch, context=context, us=default_us, default=True, **asdict(new.TILES)))
        print(f"tune batch {batch:>3} context {context:>6}: best {best_us:.2f} us {best}; "
              f"default {new.TILES}: {default_us:.2f} us", flush=True)
        by_axis = {}
        for splits in (8, 16, 32, 64):  # the grid's split axis (default: num_splits), default tiles
            fn = lambda *a, splits=splits, **k: new.paged_decode_attention(*a, max_splits=splits, **k)  # noqa: E731
            by_axis[splits] = graph_time_us(shape, fn)
            rows.append(dict(batch=batch, context=context, us=by_axis[splits], max_splits=splits))
        print(f"    split axis (default {new.num_splits(shape.q, batch * HKV)}) -> us: "
              + ", ".join(f"{splits}: {us:.2f}" for splits, us in by_axis.items()), flush=True)
        del shape
        torch.cuda.empty_cache()
    return rows


def split_policies(shape: Shape, splits: int) -> list[str]:
    """The ``DecodeTiles`` split settings whose ``num_splits`` at this launch size is ``splits``."""
    found = []
    for per_sm in (1, 2, 3, 4):
        for down in (False, True):
            tiles = new.DecodeTiles(programs_per_sm=per_sm, round_splits_down=down)
            if new.num_splits(shape.q, shape.batch * HKV, tiles) == splits:
                found.append(f"programs_per_sm={per_sm}, round_splits_down={down}")
    return found


def focus(pairs: list[tuple[int, int]], dtype: torch.dtype) -> list[dict]:
    rows = []
    for batch, context in pairs:
        shape = make_shape(batch, context, dtype)
        default_us = graph_time_us(shape, new.paged_decode_attention)
        default_splits = new.num_splits(shape.q, batch * HKV)
        print(f"focus batch {batch} context {context}: default {new.TILES}, split axis {default_splits}: "
              f"{default_us:.2f} us ({shape.kv_bytes / default_us / 1e3:.0f} GB/s)", flush=True)
        rows.append(dict(batch=batch, context=context, us=default_us, default=True, max_splits=default_splits,
                         **asdict(new.TILES)))
        times = []
        for tiles in FOCUS_TILES:
            for splits in FOCUS_SPLITS:
                fn = lambda *a, t=tiles, m=splits, **k: new.paged_decode_attention(  # noqa: E731
                    *a, tiles=t, max_splits=m, **k)
                try:
                    us = graph_time_us(shape, fn)
                except Exception as exc:  # a launch shape the GPU cannot hold (shared memory)
                    print(f"    {tiles} splits {splits}: failed ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
                    continue
                times.append((us, tiles, splits))
                rows.append(dict(batch=batch, context=context, us=us, max_splits=splits, **asdict(tiles)))
            line = ", ".join(f"{m}: {us:.2f}" for us, t, m in times if t == tiles)
            print(f"    block_n {tiles.block_n} warps {tiles.num_warps} stages {tiles.num_stages} "
                  f"prefetch {tiles.prefetch_pages} -> us by split axis: {line}", flush=True)
        best_us, best, splits = min(times, key=lambda t: t[0])
        print(f"  best {best_us:.2f} us ({shape.kv_bytes / best_us / 1e3:.0f} GB/s, default {default_us:.2f}): "
              f"DecodeTiles(block_n={best.block_n}, num_warps={best.num_warps}, num_stages={best.num_stages}, "
              f"prefetch_pages={best.prefetch_pages}) at split axis {splits}; split settings giving it: "
              f"{split_policies(shape, splits) or 'none (pass max_splits)'}", flush=True)
        del shape
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 64 128 (none with --focus)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tune", action="store_true", help="also sweep the new kernel's DecodeTiles")
    parser.add_argument("--focus", type=int, nargs="+", default=[], metavar="BATCH CONTEXT",
                        help="pairs of batch and context: split axis x launch shape at each")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}")
    if len(args.focus) % 2:
        parser.error("--focus takes pairs of batch and context")
    batches = args.batches if args.batches is not None else ([] if args.focus else [1, 8, 64, 128])
    result = dict(sweep=sweep(batches, args.contexts, dtype))
    if args.focus:
        result["focus"] = focus(list(zip(args.focus[::2], args.focus[1::2])), dtype)
    if args.tune:
        result["tune"] = tune(dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
