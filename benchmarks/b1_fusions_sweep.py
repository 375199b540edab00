"""Time the batch-1 decode fusions of issue 9 against the launches they replace, on one GPU, at the
Qwen3.6-35B-A3B shape, and print ``GATED_NORMED_TUNED`` entries:

1. ``router``: the router's fused norm + GEMV, then the routing launch (``_route_kernel``), against
   the fused launch that routes in its last program (``add_rms_norm_gemv_route``; ``layers.moe.FUSED_ROUTE``);
2. ``gated``: the Gated DeltaNet output norm, then the out_proj GEMV, against the GEMV with the norm
   in its prologue (``gated_rms_norm_gemv``; ``layers.gated_deltanet.FUSED_OUTPUT_NORM``), over
   launch shapes;
3. ``conv``: the GDN input norm + in_proj GEMV, then ``causal_conv1d_decode``, against the launch
   with the conv step in its epilogue (``add_rms_norm_gemv_conv``; ``layers.gated_deltanet.FUSED_CONV``);
4. ``decode_norm``: the Gated DeltaNet decode step (``_decode_gated_kernel``), then the gated output
   norm (``_rms_norm_kernel``), against the step with the norm in its epilogue, run by the last of a
   head's programs (``gated_delta_rule_decode_gated_norm``; ``layers.gated_deltanet.FUSED_DECODE_NORM``);
5. ``greedy``: the sampler's general path at temperature 0 (parameter gathers, ``sample_tokens``,
   the slot scatters) against the one greedy launch (``greedy_sample_into_slots``;
   ``engine.sample.FUSED_GREEDY``), eager as the engine runs it (after the graph).

    python benchmarks/b1_fusions_sweep.py [--parts router gated conv decode_norm greedy] [--rows 1] [--json FILE]

1-4 replay one CUDA graph of back-to-back calls over distinct weight copies (``decode_norm``:
distinct recurrent states; more than the L2 together, as ``normed_gemv_sweep.py``), with
programmatic dependent launch as the step has it; us per call (the median replay). Each fused
output is checked against the unfused chain's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from graph_timing import graph_us
from freetoken.kernels.gemv_configs import GemvConfig, gemv_config, normed_gemv_config

C = GemvConfig
BF16 = torch.bfloat16
EPS = 1e-6
TARGET_BYTES = 256 << 20
MIN_CALLS = 20
HIDDEN, GATE_ROWS, EXPERTS, TOP_K = 2048, 264, 256, 8
HEADS, HEAD_DIM, VOCAB = 32, 128, 248320
# Gated norm + GEMV shapes: weight rows a program, 2-byte columns a step (whole 128-column heads), warps.
GATED_CANDIDATES = [C(4, 1024, 2), C(8, 1024, 4), C(8, 2048, 4), C(16, 1024, 4), C(16, 2048, 4), C(16, 512, 4),
                    C(32, 1024, 8), C(8, 512, 2)]


def _weights(n_out: int, k_in: int) -> list[torch.Tensor]:
    copies = max(1, math.ceil(TARGET_BYTES / (n_out * k_in * 2)))
    return [(torch.randn(n_out, k_in, device="cuda") * k_in**-0.5).to(BF16) for _ in range(copies)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def router(rows: int) -> dict:
    from freetoken.kernels.triton import moe_decode, normed_gemv

    weights = _weights(GATE_ROWS, HIDDEN)
    calls = max(MIN_CALLS, len(weights))
    x, res = (torch.randn(rows, HIDDEN, device="cuda").to(BF16) for _ in range(2))
    nw = (torch.randn(HIDDEN, device="cuda") * 0.2).to(BF16)
    config = normed_gemv_config(rows, GATE_ROWS, HIDDEN)

    def unfused(w):
        logits = normed_gemv.add_rms_norm_gemv_tiled(x, res, nw, EPS, True, w, True, config)[0]
        return moe_decode.route(logits, EXPERTS, TOP_K, True, config.pdl)[1]

    def fused(w):
        return normed_gemv.add_rms_norm_gemv_route_tiled(x, res, nw, EPS, True, w, EXPERTS, TOP_K, True, config)[4]

    assert torch.equal(unfused(weights[0]), fused(weights[0])), "the fused launch routes differently"
    row = dict(part="router", rows=rows, config=config.label(), calls_per_step=40,
               unfused_us=graph_us(lambda: [unfused(weights[i % len(weights)]) for i in range(calls)], calls),
               fused_us=graph_us(lambda: [fused(weights[i % len(weights)]) for i in range(calls)], calls))
    row["saving_us_per_step"] = (row["unfused_us"] - row["fused_us"]) * 40
    print(f"router rows={rows} ({config.label()}): norm + GEMV, route {row['unfused_us']:6.2f} us | routed in the "
          f"GEMV {row['fused_us']:6.2f} us | x40 a step: {row['saving_us_per_step']:+.1f} us", flush=True)
    return row


def gated(rows: int) -> dict:
    from freetoken.kernels.triton import gated_norm_gemv, gemv, norm

    k_in = HEADS * HEAD_DIM
    weights = _weights(HIDDEN, k_in)
    calls = max(MIN_CALLS, len(weights))
    core = torch.randn(rows, HEADS, HEAD_DIM, device="cuda").to(BF16)
    z = torch.randn(rows, HEADS, HEAD_DIM, device="cuda").to(BF16)
    nw = (torch.randn(HEAD_DIM, device="cuda") * 0.2 + 1).to(BF16)
    plain = gemv_config(rows, HIDDEN, k_in)

    def unfused(w):
        return gemv.gemv_tiled(norm.gated_rms_norm(core, z, nw, EPS, "silu").reshape(rows, -1), w, plain)

    want = unfused(weights[0])
    row = dict(part="gated", rows=rows, gemv_config=plain.label(), calls_per_step=30,
               unfused_us=graph_us(lambda: [unfused(weights[i % len(weights)]) for i in range(calls)], calls))
    timed = []
    for cand in GATED_CANDIDATES:
        for pdl in (True, False):
            c = GemvConfig(cand.block_n, cand.block_k, cand.num_warps, pdl=pdl)

            def fused(w, c=c):
                return gated_norm_gemv.gated_rms_norm_gemv_tiled(core, z, nw, EPS, "silu", w, c)

            try:
                err = _rel(fused(weights[0]), want)
                us = graph_us(lambda: [fused(weights[i % len(weights)]) for i in range(calls)], calls)
            except Exception as exc:  # a shape that does not compile or fit: reported, skipped
                print(f"  gated rows={rows} {c.label()}: {exc!r}", flush=True)
                continue
            timed.append(dict(config=c.label(), us=us, rel_error=err, cfg=c))
    timed.sort(key=lambda t: t["us"])
    best = timed[0]
    row.update(fused=[{k: v for k, v in t.items() if k != "cfg"} for t in timed[:6]], best=best["config"],
               best_us=best["us"], saving_us_per_step=(row["unfused_us"] - best["us"]) * 30)
    cfg = best["cfg"]
    row["entry"] = (f"C({cfg.block_n}, {cfg.block_k}, {cfg.num_warps}, {cfg.num_stages}, {cfg.pdl})"
                    if best["us"] < row["unfused_us"] else "None")
    print(f"gated  rows={rows}: gated norm + GEMV ({plain.label()}) {row['unfused_us']:6.2f} us | fused best "
          f"{best['config']} {best['us']:6.2f} us | x30 a step: {row['saving_us_per_step']:+.1f} us", flush=True)
    for t in row["fused"]:
        print(f"    {t['config']:22s} {t['us']:7.2f} us  rel err {t['rel_error']:.2e}", flush=True)
    return row


def conv(rows: int) -> dict:
    from freetoken.kernels.triton import conv1d, normed_gemv

    n_out, channels = 12352, 8192
    weights = _weights(n_out, HIDDEN)
    calls = max(MIN_CALLS, len(weights))
    x, res = (torch.randn(rows, HIDDEN, device="cuda").to(BF16) for _ in range(2))
    nw = (torch.randn(HIDDEN, device="cuda") * 0.2).to(BF16)
    conv_w = (torch.randn(channels, 4, device="cuda") * 0.5).to(BF16)
    state = torch.randn(rows + 1, channels, 3, device="cuda").to(BF16)
    slots = torch.arange(1, rows + 1, dtype=torch.int32, device="cuda")
    config = normed_gemv_config(rows, n_out, HIDDEN)

    def unfused(w):
        out = normed_gemv.add_rms_norm_gemv_tiled(x, res, nw, EPS, True, w, False, config)[0]
        return conv1d.causal_conv1d_decode(out[:, :channels], conv_w, state, slots)

    def fused(w):
        return normed_gemv.add_rms_norm_gemv_conv_tiled(x, res, nw, EPS, True, w, conv_w, state, slots, config)[1]

    start = state.clone()
    want = unfused(weights[0])
    state.copy_(start)
    assert torch.equal(fused(weights[0]), want), "the fused conv step differs"
    row = dict(part="conv", rows=rows, config=config.label(), calls_per_step=30,
               unfused_us=graph_us(lambda: [unfused(weights[i % len(weights)]) for i in range(calls)], calls),
               fused_us=graph_us(lambda: [fused(weights[i % len(weights)]) for i in range(calls)], calls))
    row["saving_us_per_step"] = (row["unfused_us"] - row["fused_us"]) * 30
    print(f"conv   rows={rows} ({config.label()}): norm + in_proj, conv1d {row['unfused_us']:6.2f} us | conv in the "
          f"GEMV {row['fused_us']:6.2f} us | x30 a step: {row['saving_us_per_step']:+.1f} us", flush=True)
    return row


def decode_norm(rows: int) -> dict:
    from freetoken.kernels.triton import gdn_decode, norm

    hk, dk = 16, 128
    conv_out = torch.randn(rows, 2 * hk * dk + HEADS * HEAD_DIM, device="cuda").to(BF16)
    q = conv_out[:, : hk * dk].reshape(rows, hk, dk)
    k = conv_out[:, hk * dk : 2 * hk * dk].reshape(rows, hk, dk)
    v = conv_out[:, 2 * hk * dk :].reshape(rows, HEADS, HEAD_DIM)
    projected = torch.randn(rows, HEADS * HEAD_DIM + 2 * HEADS, device="cuda").to(BF16)
    z = projected[:, : HEADS * HEAD_DIM].reshape(rows, HEADS, HEAD_DIM)
    b, a = projected[:, HEADS * HEAD_DIM : -HEADS], projected[:, -HEADS:]
    A_log = torch.rand(HEADS, device="cuda").log()
    dt_bias = torch.randn(HEADS, device="cuda").to(BF16)
    nw = (torch.randn(HEAD_DIM, device="cuda") * 0.2 + 1).to(BF16)
    slots = torch.arange(1, rows + 1, dtype=torch.int32, device="cuda")
    state_bytes = (rows + 1) * HEADS * dk * HEAD_DIM * 4
    states = [torch.randn(rows + 1, HEADS, dk, HEAD_DIM, device="cuda") * 0.1
              for _ in range(max(1, math.ceil(TARGET_BYTES / state_bytes)))]
    calls = max(MIN_CALLS, len(states))
    gating = (q, k, v, a, b, A_log, dt_bias)

    def unfused(state):
        core = gdn_decode.gated_delta_rule_decode_gated(*gating, state, slots)
        return norm.gated_rms_norm(core, z, nw, EPS, "silu")

    def fused(state):
        return gdn_decode.gated_delta_rule_decode_gated_norm(*gating, state, slots, z, nw, EPS, "silu")

    start = states[0].clone()
    want, want_state = unfused(states[0]), states[0].clone()
    states[0].copy_(start)
    got = fused(states[0])
    row = dict(part="decode_norm", rows=rows, calls_per_step=30, rel_error=_rel(got, want),
               state_rel_error=_rel(states[0], want_state), differing=int((got != want).sum()),
               unfused_us=graph_us(lambda: [unfused(states[i % len(states)]) for i in range(calls)], calls),
               fused_us=graph_us(lambda: [fused(states[i % len(states)]) for i in range(calls)], calls))
    row["saving_us_per_step"] = (row["unfused_us"] - row["fused_us"]) * 30
    print(f"decode_norm rows={rows}: GDN decode, gated norm {row['unfused_us']:6.2f} us | norm in the decode "
          f"epilogue {row['fused_us']:6.2f} us | x30 a step: {row['saving_us_per_step']:+.1f} us | rel err "
          f"{row['rel_error']:.2e} ({row['differing']} of {want.numel()} differ), state rel err "
          f"{row['state_rel_error']:.2e}", flush=True)
    return row


def greedy(rows: int, iters: int = 200) -> dict:
    from freetoken.engine import sample

    sampler = sample.SlotSampler(max(rows, 1) + 1, VOCAB, torch.device("cuda"))
    logits = torch.randn(rows, VOCAB, device="cuda")
    slots = torch.arange(1, rows + 1, dtype=torch.int32, device="cuda")
    sampler.temperature[1 : rows + 1] = 0.0  # greedy on the general path too
    for s in range(1, rows + 1):
        sampler._host[s] = sample._HostSlot(greedy=True)

    def timed(on: bool) -> float:
        sample.FUSED_GREEDY = on
        for _ in range(5):
            sampler.sample(logits, slots, list(range(1, rows + 1)))
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sampler.sample(logits, slots, list(range(1, rows + 1)))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    tokens = sampler.sample(logits, slots, list(range(1, rows + 1)))[0]
    assert torch.equal(tokens, logits.argmax(-1)), "the fused greedy launch picked another token"
    row = dict(part="greedy", rows=rows, unfused_us=timed(False), fused_us=timed(True))
    sample.FUSED_GREEDY = True
    print(f"greedy rows={rows}: general sampling path {row['unfused_us']:6.2f} us | one greedy launch "
          f"{row['fused_us']:6.2f} us (eager, host launch time included)", flush=True)
    return row


PARTS = {"router": router, "gated": gated, "conv": conv, "decode_norm": decode_norm, "greedy": greedy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    out = [PARTS[part](rows) for part in args.parts for rows in args.rows]
    gated_rows = [r for r in out if r["part"] == "gated"]
    if gated_rows:
        buckets = ", ".join(f"({r['rows']}, {r['entry']})" for r in gated_rows)
        print(f"\nGATED_NORMED_TUNED entry (kernels/gemv_configs.py):\n    ({HIDDEN}, {HEADS * HEAD_DIM}): ({buckets},),")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
