"""The dense projections of a Qwen3.6-35B-A3B decode step at 64 and 128 rows: cuBLAS (``F.linear``)
against the tensor-core GEMV (``kernels/triton/gemv.py``'s ``_gemv_dot_kernel`` through
``gemv_tiled``: 8 rows a program, the row blocks as a second grid axis, so a weight tile is read
from HBM once and from L2 by the other row blocks), replayed from CUDA graphs.

    python benchmarks/dense_rows_sweep.py [--rows 64 128] [--shapes in_proj ...] [--json FILE]

This measures before any switch: the layers take the GEMV only up to ``GEMV_MAX_ROWS`` (8) rows
(``kernels/gemv_configs.py``); a shape where a candidate here beats cuBLAS at 64 rows is the case
for a table entry past it. Each timing replays one graph of calls on distinct weight copies,
together over ``TARGET_BYTES`` (more than the 60 MB L2); us per call, median of 20 replays, and the
weight's bytes over that time (TB/s; ~4.3 reachable on the H200). Each candidate's output is
checked against ``F.linear`` first (relative L2 error printed). bf16. Under 120 s on an H200.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from graph_timing import graph_us

from freetoken.kernels.gemv_configs import GemvConfig
from freetoken.kernels.triton import gemv

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
SHAPES = {  # name: (out features N, in features K, calls a decode step)
    "gdn_in_proj": (12352, 2048, 30),
    "gdn_out_proj": (2048, 4096, 30),
    "attn_qkv": (9216, 2048, 10),
    "attn_o_proj": (2048, 4096, 10),
    "router": (264, 2048, 40),
    "shared_gate_up": (1024, 2048, 40),
    "shared_down": (2048, 512, 40),
    "lm_head": (248320, 2048, 1),
}
TARGET_BYTES = 512 << 20
CANDIDATES = [
    GemvConfig(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, pdl=False, dot=True)
    for block_n, warps in ((64, 4), (128, 4), (128, 8)) for block_k in (64, 128) for stages in (3, 4)
]


def weights_for(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    copies = max(1, min(64, TARGET_BYTES // (2 * n * k)))
    return [torch.randn(n, k, dtype=BF16, device=CUDA, generator=gen) * k**-0.5 for _ in range(copies)]


def shape_rows(name: str, rows: int, gen: torch.Generator) -> list[dict]:
    n, k, calls = SHAPES[name]
    ws = weights_for(n, k, gen)
    x = torch.randn(rows, k, dtype=BF16, device=CUDA, generator=gen)
    want = F.linear(x, ws[0]).float()
    tb = lambda us: 2 * n * k / us / 1e6  # noqa: E731
    cublas = graph_us(lambda: [F.linear(x, w) for w in ws], len(ws))
    results = [{"shape": name, "rows": rows, "variant": "cuBLAS", "us": cublas, "tb_s": tb(cublas), "rel_err": 0.0}]
    for config in CANDIDATES:
        try:
            got = gemv.gemv_tiled(x, ws[0], config).float()
        except Exception as exc:  # a tile the GPU cannot hold (shared memory, registers)
            print(f"  {config.label()}: failed ({type(exc).__name__})", flush=True)
            continue
        err = ((got - want).norm() / want.norm()).item()
        us = graph_us(lambda config=config: [gemv.gemv_tiled(x, w, config) for w in ws], len(ws))
        results.append({"shape": name, "rows": rows, "variant": config.label(), "config": config.__dict__, "us": us,
                        "tb_s": tb(us), "rel_err": err})
    best = min(results[1:], key=lambda r: r["us"], default=None)
    line = f"{name} {n}x{k} at {rows} rows: cuBLAS {cublas:.2f} us ({tb(cublas):.2f} TB/s)"
    if best:
        line += (f"; best GEMV {best['variant']} {best['us']:.2f} us ({best['tb_s']:.2f} TB/s, rel err "
                 f"{best['rel_err']:.1e}): {'GEMV' if best['us'] < cublas else 'cuBLAS'} wins, "
                 f"{(cublas - best['us']) * calls:+.1f} us a step over its {calls} calls")
    print(line, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    rows = []
    for name in args.shapes:
        for count in args.rows:
            rows += shape_rows(name, count, gen)
            torch.cuda.empty_cache()
    for count in args.rows:
        at = [r for r in rows if r["rows"] == count]
        cublas = sum(r["us"] * SHAPES[r["shape"]][2] for r in at if r["variant"] == "cuBLAS")
        best = sum(min(r["us"] for r in at if r["shape"] == s) * SHAPES[s][2] for s in args.shapes)
        print(f"{count} rows, the step's dense projections: cuBLAS {cublas:.1f} us, best of each {best:.1f} us",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
