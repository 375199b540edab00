"""Gated DeltaNet's causal conv1d prefill on one GPU at the Qwen3.6-35B-A3B shape (8192 channels,
width 4, bf16, ``x`` a slice of the packed in_proj output as the layer passes it): the kernel
against the previous one (benchmarks/prefill_baseline_conv1d.py) and its floor, and with
``--sweep`` the tile variants of the convolution launch.

    python benchmarks/bench_conv1d_prefill.py [--sweep] [--json FILE]

Times are medians of ``triton.testing.do_bench`` (CUDA events, after warm-up) of the whole op
(convolution and state update). The floor is the bytes that must move (the input read once, the
output written once) over the measured copy bandwidth (a 2 GiB device copy, read + write). Each
new result is compared with the old kernel's (relative L2 difference; the new windows exactly).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefill_baseline_conv1d as old_conv1d  # noqa: E402

from freetoken.kernels.triton import conv1d  # noqa: E402

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
CHANNELS, WIDTH = 2 * 16 * 128 + 32 * 128, 4  # q|k|v of 16 key heads and 32 value heads of 128
PACKED = CHANNELS + 32 * 128 + 2 * 32  # the in_proj row: q|k|v, z, b, a
SLOTS = 16


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=BF16, device=CUDA).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 31) / (ms * 1e-3)


def inputs(lens: list[int]):
    """(x, weight, state, slots, cu) for requests of ``lens`` tokens, every slot holding a window."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    packed = torch.randn(sum(lens), PACKED, generator=g, device=CUDA).to(BF16)
    weight = (torch.randn(CHANNELS, WIDTH, generator=g, device=CUDA) * 0.5).to(BF16)
    state = torch.randn(SLOTS, CHANNELS, WIDTH - 1, generator=g, device=CUDA).to(BF16)
    slots = torch.arange(len(lens), dtype=torch.int32, device=CUDA) % SLOTS
    cu = torch.tensor([0] + lens, device=CUDA).cumsum(0).int()
    return packed[:, :CHANNELS], weight, state, slots, cu


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def compare(name: str, lens: list[int], bandwidth: float) -> dict:
    x, weight, state, slots, cu = inputs(lens)
    old_state, new_state = state.clone(), state.clone()
    want = old_conv1d.causal_conv1d_prefill(x, weight, old_state, slots, cu)
    got = conv1d.causal_conv1d_prefill(x, weight, new_state, slots, cu)
    row = dict(case=name, tokens=sum(lens), requests=len(lens), rel_l2_vs_old=rel_l2(got, want),
               windows_equal=bool(torch.equal(old_state, new_state)))
    floor_us = 2 * x.numel() * x.element_size() / bandwidth * 1e6
    # The state moves on each call; timing does not depend on its values.
    old_us = median_ms(lambda: old_conv1d.causal_conv1d_prefill(x, weight, state, slots, cu)) * 1e3
    new_us = median_ms(lambda: conv1d.causal_conv1d_prefill(x, weight, state, slots, cu)) * 1e3
    row.update(old_us=old_us, new_us=new_us, floor_us=floor_us, new_x_floor=new_us / floor_us,
               new_TB_s=2 * x.numel() * x.element_size() / (new_us * 1e-6) / 1e12)
    print(f"{name:>22}: old {old_us:8.1f} us  new {new_us:8.1f} us  floor {floor_us:7.1f} us "
          f"({row['new_x_floor']:.2f}x, {row['new_TB_s']:.2f} TB/s)  rel L2 vs old {row['rel_l2_vs_old']:.2e}  "
          f"windows equal {row['windows_equal']}")
    return row


def sweep(bandwidth: float, tokens: int = 8192) -> list[dict]:
    """The convolution launch alone over tile variants, one request of ``tokens``."""
    x, weight, state, slots, cu = inputs([tokens])
    out = torch.empty(tokens, CHANNELS, dtype=BF16, device=CUDA)
    floor_us = 2 * x.numel() * x.element_size() / bandwidth * 1e6
    want = torch.empty_like(out)
    conv1d.launch_prefill(x, weight, state, slots, cu, want, conv1d.prefill_tiles(CHANNELS))
    rows = []
    # (channels, warps): 4 or 8 channels a thread; the register cap only where 8 channels and 8
    # rows in flight need more than 128 registers.
    shapes = [(128, 1), (256, 1), (512, 2), (1024, 4)]
    variants = [conv1d.PrefillTiles(r, c, w, u) for r, (c, w), u in itertools.product([16, 32, 64], shapes, [4, 8])]
    variants += [conv1d.PrefillTiles(r, c, w, 8, 128) for r, (c, w) in itertools.product([16, 32, 64], shapes[1:])]
    for tiles in variants:
        out.fill_(float("nan"))
        conv1d.launch_prefill(x, weight, state, slots, cu, out, tiles)
        ok = torch.equal(out, want)
        us = median_ms(lambda: conv1d.launch_prefill(x, weight, state, slots, cu, out, tiles)) * 1e3  # noqa: B023
        rows.append(dict(tiles=str(tiles), us=us, x_floor=us / floor_us, equal_to_default=ok))
    rows.sort(key=lambda r: r["us"])
    print(f"\nconvolution launch alone, {tokens} tokens (floor {floor_us:.1f} us), fastest first:")
    for r in rows:
        print(f"  {r['us']:8.1f} us  {r['x_floor']:.2f}x  {'ok ' if r['equal_to_default'] else 'DIFF'}  {r['tiles']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time the tile variants (about a minute)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); default tiles "
          f"{conv1d.prefill_tiles(CHANNELS)}")
    results = dict(copy_TB_s=bandwidth / 1e12, cases=[
        compare("8k, one request", [8192], bandwidth),
        compare("32k, one request", [32768], bandwidth),
        compare("8k, 64 x 128", [128] * 64, bandwidth),
        compare("8k, 37 mixed", [1, 2, 3, 500, 77] * 7 + [3000, 1111], bandwidth),
    ])
    if args.sweep:
        results["sweep"] = sweep(bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
