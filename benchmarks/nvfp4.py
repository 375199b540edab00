"""W4A16 (NVFP4 weights, bf16 activations) kernel timings against the hardware floor and against
the bf16 kernels, at Qwen3.6-35B-A3B's sizes, on one GPU:

    python benchmarks/nvfp4.py [--only "routed experts" ...] [--json FILE]

Random packed weights and scales are made on the device (no checkpoint needed). The floor of a
kernel is max(bytes it must move / copy bandwidth, FLOPs / bf16 matrix rate) with the ceilings of
``benchmarks/kernels.py``; an NVFP4 weight moves 0.5 byte a parameter plus one e4m3 byte per 16 and a
float32 per row. Every weight set is larger than the 60 MB L2, except the few experts one decode
token touches (which is what decode reads).
"""

from __future__ import annotations

import argparse
import json

import torch

from kernels import BF16, CUDA, EXPERTS, HIDDEN, INTER, TOP_K, ceilings, median_ms
from freetoken.kernels.triton import moe, moe_decode, nvfp4, nvfp4_decode

# Dense projections of one Qwen3.6-35B-A3B layer: attention q(+gate)/k/v and o, GDN in_proj (q, k, v, z) and out.
DENSE = {"attention qkv": (9216, HIDDEN), "attention o": (HIDDEN, 4096), "GDN in_proj": (12288, HIDDEN), "GDN out": (HIDDEN, 4096)}


def nvfp4_bytes(rows: int, cols: int) -> int:
    return rows * cols // 2 + rows * cols // 16 + rows * 4


def random_nvfp4(*shape: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    *lead, rows, cols = shape
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), dtype=torch.uint8, device=CUDA)
    scales = torch.randint(0x30, 0x40, (*lead, rows, cols // 16), dtype=torch.uint8, device=CUDA).view(torch.float8_e4m3fn)
    row_scales = torch.full((*lead, rows), cols**-0.5, device=CUDA)
    return packed, scales, row_scales


def dense_linear(name: str, tokens: int, quantized: bool):
    rows, cols = DENSE[name]
    x = torch.randn(tokens, cols, dtype=BF16, device=CUDA)
    if quantized:
        w = random_nvfp4(rows, cols)
        fn = lambda: nvfp4.nvfp4_linear(x, *w)  # noqa: E731
        weight_bytes = nvfp4_bytes(rows, cols)
    else:
        w = torch.randn(rows, cols, dtype=BF16, device=CUDA)
        fn = lambda: x @ w.T  # noqa: E731
        weight_bytes = rows * cols * 2
    return fn, weight_bytes + tokens * (rows + cols) * 2, 2 * tokens * rows * cols


def routed_experts(tokens: int, quantized: bool):
    x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA)
    logits = torch.randn(tokens, EXPERTS, dtype=BF16, device=CUDA)
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    touched = int(torch.unique(ids).numel())
    if quantized:
        w13, w2 = random_nvfp4(EXPERTS, 2 * INTER, HIDDEN), random_nvfp4(EXPERTS, HIDDEN, INTER)
        fn = lambda: nvfp4.fused_experts_nvfp4(x, *w13, *w2, weights, ids)  # noqa: E731
        expert_bytes = nvfp4_bytes(2 * INTER, HIDDEN) + nvfp4_bytes(HIDDEN, INTER)
    else:
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA) * HIDDEN**-0.5
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA) * INTER**-0.5
        fn = lambda: moe.fused_experts(x, w13, w2, weights, ids)  # noqa: E731
        expert_bytes = 3 * INTER * HIDDEN * 2
    return fn, touched * expert_bytes + 2 * tokens * HIDDEN * 2, 2 * tokens * TOP_K * 3 * INTER * HIDDEN


def moe_block_decode(tokens: int, quantized: bool):
    """The whole MoE block after the router GEMM for a few tokens (routed experts + the shared one,
    of intermediate ``INTER``): the engine's decode path (``layers.moe.DECODE_MAX_TOKENS``)."""
    x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA)
    logits = torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA)
    touched = int(torch.unique(logits[:, :EXPERTS].topk(TOP_K, dim=1).indices).numel())
    if quantized:
        weights = (*random_nvfp4(EXPERTS, 2 * INTER, HIDDEN), *random_nvfp4(EXPERTS, HIDDEN, INTER),
                   *random_nvfp4(2 * INTER, HIDDEN), *random_nvfp4(HIDDEN, INTER))
        fn = lambda: nvfp4_decode.sparse_moe_decode_nvfp4(x, logits, *weights, TOP_K, True)  # noqa: E731
        expert_bytes = nvfp4_bytes(2 * INTER, HIDDEN) + nvfp4_bytes(HIDDEN, INTER)
    else:
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA) * HIDDEN**-0.5
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA) * INTER**-0.5
        sgu, sd = w13[0].clone(), w2[0].clone()
        fn = lambda: moe_decode.sparse_moe_decode(x, logits, w13, w2, sgu, sd, TOP_K, True)  # noqa: E731
        expert_bytes = 3 * INTER * HIDDEN * 2
    return fn, (touched + 1) * expert_bytes + 2 * tokens * HIDDEN * 2, 2 * tokens * (TOP_K + 1) * 3 * INTER * HIDDEN


def cases():
    for tokens in (1, 8):
        for quantized in (True, False):
            kind = "NVFP4" if quantized else "bf16"
            yield f"MoE block decode B={tokens} {kind}", lambda t=tokens, q=quantized: moe_block_decode(t, q)
    for tokens, label in ((1, "decode B=1"), (64, "decode B=64"), (8192, "prefill 8k")):
        for quantized in (True, False):
            kind = "NVFP4" if quantized else "bf16"
            yield f"routed experts {label} {kind}", lambda t=tokens, q=quantized: routed_experts(t, q)
        for name in DENSE:
            for quantized in (True, False):
                kind = "NVFP4" if quantized else "bf16 (torch)"
                yield f"{name} {label} {kind}", lambda n=name, t=tokens, q=quantized: dense_linear(n, t, q)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", nargs="+", default=None, help="time only the cases whose name contains one of these")
    args = parser.parse_args()
    bandwidth, rate = ceilings()
    print(f"measured ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    rows = []
    for name, make in cases():
        if args.only and not any(part in name for part in args.only):
            continue
        fn, bytes_, flops = make()
        ms = median_ms(fn)
        floor_ms = max(bytes_ / bandwidth, flops / rate) * 1e3
        rows.append(dict(kernel=name, ms=ms, floor_ms=floor_ms, gb=bytes_ / 1e9, gflop=flops / 1e9))
        del fn
        torch.cuda.empty_cache()
    print("| kernel | time (us) | floor (us) | time/floor | GB moved | GFLOP |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['ms'] * 1e3:.1f} | {r['floor_ms'] * 1e3:.1f} | {r['ms'] / r['floor_ms']:.1f}x | "
              f"{r['gb']:.4f} | {r['gflop']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bytes_per_s=bandwidth, bf16_flops_per_s=rate, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
