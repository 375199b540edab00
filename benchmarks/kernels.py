"""Kernel timings against the hardware floor on one GPU (run by scripts/gpu_check.sh).

    python benchmarks/kernels.py [--json FILE]

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm-up first). The floor of a
kernel is max(bytes it must move / copy bandwidth, FLOPs / bf16 matrix rate), with both ceilings
measured here first (a 2 GiB device-to-device copy counted as read + write, an 8192^3 bf16 GEMM).
Inputs are bf16 at Qwen3.5-35B-A3B's sizes, every working set larger than the 60 MB L2.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from freetoken.kernels.triton import attention, gated_delta_rule, moe, moe_decode
from freetoken.kernels.triton import gdn_decode as gdn_decode_kernel

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HQ, HKV, HEAD_DIM, PAGE = 16, 2, 256, 16
HK, HV, DK, DV = 16, 32, 128, 128
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings() -> tuple[float, float]:
    """(bytes/s, FLOP/s) measured: device copy (read + write) and a bf16 GEMM."""
    src = torch.empty(1 << 30, dtype=BF16, device=CUDA).normal_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=BF16, device=CUDA)
    b = torch.randn(8192, 8192, dtype=BF16, device=CUDA)
    gemm_ms = median_ms(lambda: a @ b)
    del src, dst, a, b
    return 2 * (1 << 31) / (copy_ms * 1e-3), 2 * 8192**3 / (gemm_ms * 1e-3)


def decode_attention(batch: int, context: int):
    pages_per = -(-context // PAGE)
    num_pages = batch * pages_per + 1
    k_cache = torch.randn(num_pages, PAGE, HKV, HEAD_DIM, dtype=BF16, device=CUDA)
    v_cache = torch.randn_like(k_cache)
    table = (torch.randperm(num_pages - 1, device=CUDA)[: batch * pages_per] + 1).int().view(batch, pages_per)
    q_gate = torch.randn(batch, HQ, 2 * HEAD_DIM, dtype=BF16, device=CUDA)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=CUDA)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=CUDA)
    fn = lambda: attention.paged_attention(  # noqa: E731
        q_gate[..., :HEAD_DIM], k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, 1, gate=q_gate[..., HEAD_DIM:]
    )
    kv_bytes = 2 * batch * context * HKV * HEAD_DIM * 2
    flops = 4 * batch * context * HQ * HEAD_DIM
    return fn, kv_bytes, flops


def prefill_attention(length: int):
    num_pages = -(-length // PAGE) + 1
    k_cache = torch.randn(num_pages, PAGE, HKV, HEAD_DIM, dtype=BF16, device=CUDA)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(1, num_pages, dtype=torch.int32, device=CUDA)[None]
    q_gate = torch.randn(length, HQ, 2 * HEAD_DIM, dtype=BF16, device=CUDA)
    cu = torch.tensor([0, length], dtype=torch.int32, device=CUDA)
    seq_lens = torch.tensor([length], dtype=torch.int32, device=CUDA)
    fn = lambda: attention.paged_attention(  # noqa: E731
        q_gate[..., :HEAD_DIM], k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, length, gate=q_gate[..., HEAD_DIM:]
    )
    flops = 2 * 2 * HQ * HEAD_DIM * length * (length + 1) // 2
    bytes_ = (3 * length * HQ * HEAD_DIM + 2 * length * HKV * HEAD_DIM) * 2
    return fn, bytes_, flops


def fused_moe(tokens: int):
    x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA) * INTER**-0.5
    logits = torch.randn(tokens, EXPERTS, dtype=BF16, device=CUDA)
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    touched = int(torch.unique(ids).numel())
    fn = lambda: moe.fused_experts(x, w13, w2, weights, ids)  # noqa: E731
    bytes_ = touched * 3 * INTER * HIDDEN * 2 + 2 * tokens * HIDDEN * 2
    flops = 2 * tokens * TOP_K * 3 * INTER * HIDDEN
    return fn, bytes_, flops


def gdn_prefill(length: int):
    conv = torch.randn(length, 2 * HK * DK + HV * DV, dtype=BF16, device=CUDA)
    q = conv[:, : HK * DK].view(length, HK, DK)
    k = conv[:, HK * DK : 2 * HK * DK].view(length, HK, DK)
    v = conv[:, 2 * HK * DK :].view(length, HV, DV)
    g = -F.softplus(torch.randn(length, HV, device=CUDA)) * 0.3
    beta = torch.rand(length, HV, device=CUDA).to(BF16)
    state = torch.zeros(2, HV, DK, DV, device=CUDA)
    slots = torch.tensor([1], dtype=torch.int32, device=CUDA)
    cu = torch.tensor([0, length], dtype=torch.int32, device=CUDA)
    fn = lambda: gated_delta_rule.gated_delta_rule_prefill(q, k, v, g, beta, state, slots, cu)  # noqa: E731
    chunks = -(-length // 64)
    # Per chunk and head: L⁻¹ applied to k and v, W·S, q·S, q·kᵀ, (q·kᵀ)·v', kᵀ·v' (64-token chunks).
    flops = chunks * HV * 2 * 64 * (64 * DK + 64 * DV + 3 * DK * DV + 2 * 64 * DK)
    bytes_ = conv.numel() * 2 + length * HV * DV * 2 + 2 * HV * DK * DV * 4
    return fn, bytes_, flops


def gdn_decode(batch: int):
    q = torch.randn(batch, HK, DK, dtype=BF16, device=CUDA)
    k = torch.randn_like(q)
    v = torch.randn(batch, HV, DV, dtype=BF16, device=CUDA)
    g = -F.softplus(torch.randn(batch, HV, device=CUDA))
    beta = torch.rand(batch, HV, device=CUDA).to(BF16)
    state = torch.randn(batch + 1, HV, DK, DV, device=CUDA)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device=CUDA)
    fn = lambda: gated_delta_rule.gated_delta_rule_decode(q, k, v, g, beta, state, slots)  # noqa: E731
    return fn, 2 * batch * HV * DK * DV * 4, 4 * batch * HV * DK * DV


def moe_block(tokens: int, fused: bool):
    """The MoE block after its router GEMM (routing, routed and shared experts, combine): the fused
    decode op, or the general ops it replaces."""
    x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA) * INTER**-0.5
    shared_gate_up = torch.randn(2 * INTER, HIDDEN, dtype=BF16, device=CUDA) * HIDDEN**-0.5
    shared_down = torch.randn(HIDDEN, INTER, dtype=BF16, device=CUDA) * INTER**-0.5
    gate_logits = torch.randn(tokens, EXPERTS + 1, dtype=BF16, device=CUDA)
    touched = int(torch.unique(moe.moe_topk_softmax(gate_logits[:, :EXPERTS], TOP_K, True)[1]).numel())

    def unfused():
        weights, ids = moe.moe_topk_softmax(gate_logits[:, :EXPERTS], TOP_K, True)
        routed = moe.fused_experts(x, w13, w2, weights, ids)
        shared = F.linear(moe.silu_and_mul(F.linear(x, shared_gate_up)), shared_down)
        return moe.shared_expert_combine(routed, shared, gate_logits[:, EXPERTS:])

    fn = (
        (lambda: moe_decode.sparse_moe_decode(x, gate_logits, w13, w2, shared_gate_up, shared_down, TOP_K, True))
        if fused
        else unfused
    )
    bytes_ = (touched + 1) * 3 * INTER * HIDDEN * 2 + 2 * tokens * HIDDEN * 2
    flops = 2 * tokens * (TOP_K + 1) * 3 * INTER * HIDDEN
    return fn, bytes_, flops


def gdn_decode_gated(batch: int):
    q = torch.randn(batch, HK, DK, dtype=BF16, device=CUDA)
    k = torch.randn_like(q)
    v = torch.randn(batch, HV, DV, dtype=BF16, device=CUDA)
    a, b = torch.randn(batch, HV, dtype=BF16, device=CUDA), torch.randn(batch, HV, dtype=BF16, device=CUDA)
    A_log, dt_bias = torch.randn(HV, dtype=BF16, device=CUDA), torch.randn(HV, dtype=BF16, device=CUDA)
    state = torch.randn(batch + 1, HV, DK, DV, device=CUDA)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device=CUDA)
    fn = lambda: gdn_decode_kernel.gated_delta_rule_decode_gated(q, k, v, a, b, A_log, dt_bias, state, slots)  # noqa: E731
    return fn, 2 * batch * HV * DK * DV * 4, 4 * batch * HV * DK * DV


CASES = {
    "decode attention B=64 ctx=4096": lambda: decode_attention(64, 4096),
    "decode attention B=1 ctx=65536": lambda: decode_attention(1, 65536),
    "prefill attention 1x4096": lambda: prefill_attention(4096),
    "fused MoE T=64 (decode)": lambda: fused_moe(64),
    "fused MoE T=4096 (prefill)": lambda: fused_moe(4096),
    "GDN prefill 1x8192": lambda: gdn_prefill(8192),
    "GDN decode B=64": lambda: gdn_decode(64),
    "GDN decode B=1": lambda: gdn_decode(1),
    "GDN decode + gating fused B=1": lambda: gdn_decode_gated(1),
    "GDN decode + gating fused B=64": lambda: gdn_decode_gated(64),
    "MoE block T=1, general ops": lambda: moe_block(1, fused=False),
    "MoE block T=1, sparse_moe_decode": lambda: moe_block(1, fused=True),
    "MoE block T=8, general ops": lambda: moe_block(8, fused=False),
    "MoE block T=8, sparse_moe_decode": lambda: moe_block(8, fused=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bandwidth, rate = ceilings()
    print(f"measured ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    rows = []
    for name, make in CASES.items():
        fn, bytes_, flops = make()
        ms = median_ms(fn)
        floor_ms = max(bytes_ / bandwidth, flops / rate) * 1e3
        rows.append(dict(kernel=name, ms=ms, floor_ms=floor_ms, gb=bytes_ / 1e9, gflop=flops / 1e9,
                         achieved_tbs=bytes_ / (ms * 1e-3) / 1e12, achieved_tflops=flops / (ms * 1e-3) / 1e12))
        torch.cuda.empty_cache()
    print("| kernel | time (us) | floor (us) | time/floor | GB moved | GFLOP | TB/s | TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['ms'] * 1e3:.1f} | {r['floor_ms'] * 1e3:.1f} | {r['ms'] / r['floor_ms']:.1f}x | "
              f"{r['gb']:.3f} | {r['gflop']:.1f} | {r['achieved_tbs']:.2f} | {r['achieved_tflops']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bytes_per_s=bandwidth, bf16_flops_per_s=rate, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
