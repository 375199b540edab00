"""Time the fused residual add + RMSNorm + GEMV (``kernels.add_rms_norm_gemv``) against the two
launches it replaces (``add_rms_norm``, then the GEMV in its table's shape) at the decode
projections that follow a norm in a Qwen3.6-35B-A3B step, on one GPU, and print ``NORMED_TUNED``.

    python benchmarks/normed_gemv_sweep.py [--shapes in_proj qkv router lm_head] [--rows 1] [--json FILE]

Each timing replays one CUDA graph of back-to-back calls (as the decode graph runs them) over
distinct copies of the weight, together more than the 50 MB L2 (``TARGET_BYTES``), so no call
finds its weight cached. Times are us per call (median of the replays); the step's saving is the
difference times the calls a step. Every candidate's output is checked against the unfused chain's
(bf16: both round the same intermediates; the sums of squares may differ in order, so the
relative error is printed, not required to be 0). The router shape asks for the normalized rows
too (the MoE block reads them), as the layer does.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from graph_timing import graph_us
from freetoken.kernels.gemv_configs import GemvConfig, gemv_config, prefers_gemv

C = GemvConfig
BF16 = torch.bfloat16
EPS = 1e-6
# name: (out, in, calls in one decode step, whether the normalized rows are returned).
SHAPES = {
    "in_proj": (12352, 2048, 30, False),  # input_layernorm -> GDN in_proj
    "qkv": (9216, 2048, 10, False),  # input_layernorm -> attention qkv
    "router": (264, 2048, 40, True),  # post_attention_layernorm -> router + shared gate
    "lm_head": (248320, 2048, 1, False),  # final norm -> lm_head
}
TARGET_BYTES = 256 << 20
MIN_CALLS = 20
# FMA shapes: rows a program, 2-byte columns a step, warps. More weight rows a warp than one share
# each thread's normalized columns between rows (the norm's work per weight falls).
CANDIDATES = [
    C(1, 2048, 1), C(2, 2048, 1), C(4, 2048, 1), C(2, 2048, 2), C(4, 2048, 2), C(8, 2048, 2),
    C(4, 2048, 4), C(8, 2048, 4), C(16, 2048, 4), C(8, 2048, 8), C(16, 1024, 4), C(8, 1024, 2),
]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def sweep(name: str, rows: int) -> dict:
    from freetoken.kernels.triton import gemv, norm, normed_gemv

    n_out, k_in, per_step, return_normed = SHAPES[name]
    copies = max(1, math.ceil(TARGET_BYTES / (n_out * k_in * 2)))
    calls = max(MIN_CALLS, copies)
    weights = [(torch.randn(n_out, k_in, device="cuda") * k_in**-0.5).to(BF16) for _ in range(copies)]
    x, res = (torch.randn(rows, k_in, device="cuda").to(BF16) for _ in range(2))
    nw = (torch.randn(k_in, device="cuda") * 0.2).to(BF16)

    def unfused(w: torch.Tensor) -> torch.Tensor:
        normed, _ = norm.add_rms_norm(x, res, nw, EPS, True)
        return gemv.gemv(normed, w) if prefers_gemv(rows, n_out, k_in) else torch.nn.functional.linear(normed, w)

    def fused(config: GemvConfig):
        return lambda w: normed_gemv.add_rms_norm_gemv_tiled(x, res, nw, EPS, True, w, return_normed, config)[0]

    want = unfused(weights[0])
    row = dict(shape=name, rows=rows, n_out=n_out, k_in=k_in, calls_per_step=per_step,
               gemv_config=gemv_config(rows, n_out, k_in).label(),
               unfused_us=graph_us(lambda: [unfused(weights[i % copies]) for i in range(calls)], calls))
    timed = []
    for config in CANDIDATES:
        for pdl in (False, True):
            c = GemvConfig(config.block_n, config.block_k, config.num_warps, pdl=pdl)
            try:
                err = rel_error(fused(c)(weights[0]), want)
                us = graph_us(lambda: [fused(c)(weights[i % copies]) for i in range(calls)], calls)
            except Exception as exc:  # a shape that does not compile or fit: reported, skipped
                print(f"  {name} rows={rows} {c.label()}: {exc!r}", flush=True)
                continue
            timed.append(dict(config=c.label(), us=us, rel_error=err, cfg=c))
    timed.sort(key=lambda t: t["us"])
    best = timed[0]
    row.update(fused=[{k: v for k, v in t.items() if k != "cfg"} for t in timed[:6]], best=best["config"],
               best_us=best["us"], saving_us_per_step=(row["unfused_us"] - best["us"]) * per_step)
    row["entry"] = best["cfg"] if best["us"] < row["unfused_us"] else None
    return row


def table_entry(cfg: GemvConfig | None) -> str:
    if cfg is None:
        return "None"
    return f"C({cfg.block_n}, {cfg.block_k}, {cfg.num_warps}, {cfg.num_stages}, {cfg.pdl})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for name in args.shapes:
        for rows in args.rows:
            r = sweep(name, rows)
            rows_out.append(r)
            print(f"{name:8s} rows={rows}: norm + GEMV ({r['gemv_config']}) {r['unfused_us']:7.2f} us | fused best "
                  f"{r['best']} {r['best_us']:7.2f} us | x{r['calls_per_step']} a step: "
                  f"{r['saving_us_per_step']:+.1f} us saved", flush=True)
            for t in r["fused"]:
                print(f"    {t['config']:22s} {t['us']:7.2f} us  rel err {t['rel_error']:.2e}", flush=True)
    print("\nNORMED_TUNED entries (kernels/gemv_configs.py):")
    for name in args.shapes:
        n_out, k_in = SHAPES[name][:2]
        buckets = ", ".join(f"({r['rows']}, {table_entry(r['entry'])})" for r in rows_out if r["shape"] == name)
        print(f"    ({n_out}, {k_in}): ({buckets},),  # {name}")
    print(f"\ndecode step, fused at every listed shape: {sum(r['saving_us_per_step'] for r in rows_out):+.1f} us saved")
    if args.json:
        for r in rows_out:
            r["entry"] = table_entry(r["entry"])
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
