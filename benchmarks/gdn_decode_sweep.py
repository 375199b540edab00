"""Launch shapes of the Gated DeltaNet decode step (``_decode_gated_kernel``) against the bytes it
must move: the float32 state ``[B, 32, 128, 128]`` read and written, at decode batch sizes.

    python benchmarks/gdn_decode_sweep.py [--batch 1 16 64 128] [--json FILE]

The kernel runs one program per (request, value head, block of ``BLOCK_V`` value columns) with a
``[128, BLOCK_V]`` state tile and ``num_warps`` warps (``gdn_decode.decode_tiles``: 32, from 16
requests 64, over 4 warps). Each shape here is launched as the wrapper launches it, checked against
the wrapper's output and new state, then timed over ``LAYERS`` layers of distinct states (more than the 60 MB L2 at every
batch) captured in one CUDA graph: us per layer and TB/s of state traffic (read + write). The
best shape per batch is printed beside the default; set ``decode_tiles`` to it.
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us
import triton

from freetoken.kernels.triton import gdn_decode

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HK, HV, DK, DV = 16, 32, 128, 128
SHAPES = [(bv, w) for bv in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8) if 4 <= DK * bv // (32 * w) <= 128]


def launch(inputs: dict, state: torch.Tensor, block_v: int, num_warps: int) -> torch.Tensor:
    """``gated_delta_rule_decode_gated``'s launch with another tile: same arguments, same kernel."""
    q, k, v, a, b = inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"]
    batch = v.shape[0]
    out = torch.empty(batch, HV, DV, dtype=BF16, device=CUDA)
    gdn_decode._decode_gated_kernel[(batch, HV, triton.cdiv(DV, block_v))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        a, a.stride(0), b, b.stride(0), inputs["A_log"], inputs["dt_bias"],
        state, state.stride(0), state.stride(1), state.stride(2), inputs["slots"], out,
        HV, DK, DV, DK**-0.5,
        HEAD_RATIO=HV // HK, BLOCK_K=DK, BLOCK_V=block_v, num_warps=num_warps,
    )
    return out


def inputs_of(batch: int, gen: torch.Generator) -> dict:
    def randn(*shape, dtype=BF16):
        return torch.randn(*shape, generator=gen, device=CUDA).to(dtype)

    return {
        "q": randn(batch, HK, DK), "k": randn(batch, HK, DK), "v": randn(batch, HV, DV),
        "a": randn(batch, HV), "b": randn(batch, HV),
        "A_log": randn(HV, dtype=torch.float32), "dt_bias": randn(HV, dtype=torch.float32),
        # Slots in a shuffled order, as a running batch holds them.
        "slots": torch.randperm(batch, generator=gen, device=CUDA).int(),
    }


def sweep(batch: int, gen: torch.Generator) -> list[dict]:
    inputs = inputs_of(batch, gen)
    state_bytes = batch * HV * DK * DV * 4
    layers = max(2, min(30, -(-256_000_000 // state_bytes)))
    states = [torch.randn(batch, HV, DK, DV, generator=gen, device=CUDA) * 0.1 for _ in range(layers)]
    # The timing updates ``states`` in place: every shape is checked from this copy of the first.
    initial = states[0].clone()
    want_state = initial.clone()
    want = gdn_decode.gated_delta_rule_decode_gated(
        inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"],
        want_state, inputs["slots"],
    )
    rows = []
    for block_v, warps in SHAPES:
        state = initial.clone()
        out = launch(inputs, state, block_v, warps)
        err = max(((out.float() - want.float()).norm() / want.float().norm()).item(),
                  ((state - want_state).norm() / want_state.norm()).item())
        us = graph_us(lambda bv=block_v, w=warps: [launch(inputs, s, bv, w) for s in states], layers)
        rows.append({"batch": batch, "block_v": block_v, "num_warps": warps, "us": us,
                     "TB/s": 2 * state_bytes / (us * 1e-6) / 1e12, "rel_err": err})
    chosen = (gdn_decode.decode_tiles(batch, DV), gdn_decode.NUM_WARPS)
    default = next(r for r in rows if (r["block_v"], r["num_warps"]) == chosen)
    best = min(rows, key=lambda r: r["us"])
    print(f"B={batch}: state {state_bytes / 1e6:.0f} MB/layer read + written, {layers} layers; us/layer (TB/s)",
          flush=True)
    for r in sorted(rows, key=lambda r: r["us"]):
        mark = "  (default)" if r is default else ""
        print(f"  {r['us']:8.1f} ({r['TB/s']:4.2f})  BLOCK_V {r['block_v']:3d}, {r['num_warps']} warps, "
              f"rel err {r['rel_err']:.1e}{mark}", flush=True)
    print(f"  best: BLOCK_V {best['block_v']}, {best['num_warps']} warps: {best['us']:.1f} us "
          f"({best['TB/s']:.2f} TB/s), default {default['us']:.1f} us ({default['TB/s']:.2f} TB/s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    rows = []
    for batch in args.batch:
        rows += sweep(batch, gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
