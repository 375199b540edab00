"""Time the batch-1 decode fusions of issue 9 against the launches they replace, on one GPU, at the
Qwen3.6-35B-A3B shape:

1. ``conv``: the GDN input norm + in_proj GEMV, then ``causal_conv1d_decode``, against the launch
   with the conv step in its epilogue (``add_rms_norm_gemv_conv``; ``layers.gated_deltanet.FUSED_CONV``);
2. ``decode_norm``: the Gated DeltaNet decode step (``_decode_gated_kernel``), then the gated output
   norm (``_rms_norm_kernel``), against the step with the norm in its epilogue, run by the last of a
   head's programs (``gated_delta_rule_decode_gated_norm``; ``layers.gated_deltanet.FUSED_DECODE_NORM``);
3. ``greedy``: the sampler's general path at temperature 0 (parameter gathers, ``sample_tokens``,
   the slot scatters) against the one greedy launch (``greedy_sample_into_slots``;
   ``engine.sample.FUSED_GREEDY``), eager as the engine runs it (after the graph).

    python benchmarks/b1_fusions_sweep.py [--parts conv decode_norm greedy] [--rows 1] [--json FILE]

Two folds this script timed were measured slower and deleted (session 36; docs/benchmarks.md): the
MoE routing in the router's norm + GEMV launch (``router``) and the GDN output norm in out_proj's
GEMV prologue (``gated``).

1-2 replay one CUDA graph of back-to-back calls over distinct weight copies (``decode_norm``:
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
from freetoken.kernels.gemv_configs import normed_gemv_config

BF16 = torch.bfloat16
EPS = 1e-6
TARGET_BYTES = 256 << 20
MIN_CALLS = 20
HIDDEN = 2048
HEADS, HEAD_DIM, VOCAB = 32, 128, 248320


def _weights(n_out: int, k_in: int) -> list[torch.Tensor]:
    copies = max(1, math.ceil(TARGET_BYTES / (n_out * k_in * 2)))
    return [(torch.randn(n_out, k_in, device="cuda") * k_in**-0.5).to(BF16) for _ in range(copies)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


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


PARTS = {"conv": conv, "decode_norm": decode_norm, "greedy": greedy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    out = [PARTS[part](rows) for part in args.parts for rows in args.rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
