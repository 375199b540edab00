"""Prefill kernels on one GPU at the Qwen3.6-35B-A3B shape: time, TFLOP/s and the ratio to the
floor, the new kernels against the previous ones (frozen copies beside this file, kept for this
comparison only), and the tile variants worth choosing between.

    python benchmarks/bench_prefill.py [--only gdn attention moe] [--json FILE]

Times are medians of ``triton.testing.do_bench`` (CUDA events, after warm-up), bf16. The floor is
max(bytes that must move / measured copy bandwidth, FLOPs / measured bf16 GEMM rate). Each new
result is also compared with the old kernel's (relative L2 difference), a check that both compute
the same thing; the tests against the torch references are tests/gpu and tests/kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from unittest import mock

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefill_baseline_attention as old_attention  # noqa: E402
import prefill_baseline_gdn as old_gdn  # noqa: E402
import prefill_baseline_moe as old_moe  # noqa: E402

from freetoken.kernels.triton import attention, gated_delta_rule, moe  # noqa: E402

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HK, HV, DK, DV = 16, 32, 128, 128  # GDN key / value heads
HQ, HKV, PAGE = 16, 2, 16  # attention
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512  # MoE


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings() -> tuple[float, float]:
    """(bytes/s, FLOP/s) measured: a 2 GiB device copy (read + write) and an 8192^3 bf16 GEMM."""
    src = torch.empty(1 << 30, dtype=BF16, device=CUDA).normal_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=BF16, device=CUDA)
    b = torch.randn(8192, 8192, dtype=BF16, device=CUDA)
    gemm_ms = median_ms(lambda: a @ b)
    return 2 * (1 << 31) / (copy_ms * 1e-3), 2 * 8192**3 / (gemm_ms * 1e-3)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gdn_case(lengths: list[int]):
    """(variants {name: fn}, bytes, flops, outputs to compare) for one step of GDN prefills."""
    tokens = sum(lengths)
    conv = torch.randn(tokens, 2 * HK * DK + HV * DV, dtype=BF16, device=CUDA)
    q = conv[:, : HK * DK].view(tokens, HK, DK)
    k = conv[:, HK * DK : 2 * HK * DK].view(tokens, HK, DK)
    v = conv[:, 2 * HK * DK :].view(tokens, HV, DV)
    g = -F.softplus(torch.randn(tokens, HV, device=CUDA)) * 0.3
    beta = torch.rand(tokens, HV, device=CUDA).to(BF16)
    n = len(lengths)
    state0 = torch.randn(n + 1, HV, DK, DV, device=CUDA) * 0.1
    slots = torch.arange(1, n + 1, dtype=torch.int32, device=CUDA)
    cu = torch.tensor([0] + lengths, device=CUDA).cumsum(0).int()
    state = state0.clone()

    def run(impl, block_v: int | None = None):
        def call():
            if block_v is None:
                return impl.gated_delta_rule_prefill(q, k, v, g, beta, state, slots, cu)
            with mock.patch.object(impl, "state_pass_block_v", lambda *_: block_v):  # the state pass's value block
                return impl.gated_delta_rule_prefill(q, k, v, g, beta, state, slots, cu)

        return call

    variants = {"old": run(old_gdn), "new": run(gated_delta_rule)}
    for block_v in (16, 32, 64):
        variants[f"new state_block_v={block_v}"] = run(gated_delta_rule, block_v)

    def two_stages():
        with mock.patch.object(gated_delta_rule, "STATE_PASS_STAGES", 2):  # round 1's state pass pipeline
            return variants["new"]()

    variants["new state pass 2 stages"] = two_stages

    def outputs_64():
        with mock.patch.object(gated_delta_rule, "OUTPUT_BLOCK_V", 64):  # round 1's output value block
            return variants["new"]()

    variants["new outputs block_v=64"] = outputs_64

    def outputs(name):
        state.copy_(state0)
        out = variants[name]()
        return torch.cat([out.flatten().float(), state[1:].flatten()])

    chunks = sum(-(-n // 64) for n in lengths)
    flops = chunks * HV * 2 * 64 * (64 * DK + 64 * DV + 3 * DK * DV + 2 * 64 * DK)
    bytes_ = conv.numel() * 2 + tokens * HV * DV * 2 + 2 * n * HV * DK * DV * 4
    return variants, bytes_, flops, outputs


def attention_inputs(length: int, head_dim: int) -> tuple[tuple, torch.Tensor]:
    """One causal prompt of ``length`` tokens in paged caches: ``paged_attention``'s positional
    arguments and its gate."""
    num_pages = -(-length // PAGE) + 1
    k_cache = torch.randn(num_pages, PAGE, HKV, head_dim, dtype=BF16, device=CUDA)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(1, num_pages, dtype=torch.int32, device=CUDA)[None]
    q_gate = torch.randn(length, HQ, 2 * head_dim, dtype=BF16, device=CUDA)
    cu = torch.tensor([0, length], dtype=torch.int32, device=CUDA)
    seq_lens = torch.tensor([length], dtype=torch.int32, device=CUDA)
    return (q_gate[..., :head_dim], k_cache, v_cache, table, cu, seq_lens, head_dim**-0.5, length), q_gate[..., head_dim:]


def attention_flops(length: int, head_dim: int) -> int:
    """The two products of causal attention over ``length`` tokens."""
    return 2 * 2 * HQ * head_dim * length * (length + 1) // 2


def attention_case(length: int, head_dim: int):
    args, gate = attention_inputs(length, head_dim)

    def tiles(config):
        def fn():
            with mock.patch.object(attention, "_tile_sizes", lambda *a: config):
                return attention.paged_attention(*args, gate=gate)
        return fn

    variants = {"old": lambda: old_attention.paged_attention(*args, gate=gate),
                "new": lambda: attention.paged_attention(*args, gate=gate)}
    # Round 1's defaults (now (128, 64, 8, 2) for both), and for head_dim 128 the wider tiles that
    # still fit its registers (smaller ones lost in run 6: docs/benchmarks.md).
    configs = [(128, 32, 8, 2), (128, 64, 8, 3)]
    if head_dim <= 128:
        configs += [(128, 128, 8, 2), (128, 128, 8, 3), (256, 64, 8, 2)]
    for config in configs:
        variants[f"new tiles {config}"] = tiles(config)
    flops = attention_flops(length, head_dim)
    bytes_ = (3 * length * HQ * head_dim + 2 * length * HKV * head_dim) * 2
    return variants, bytes_, flops, lambda name: variants[name]().float()


def moe_case(tokens: int):
    x = torch.randn(tokens, HIDDEN, dtype=BF16, device=CUDA)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=BF16, device=CUDA) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=BF16, device=CUDA) * INTER**-0.5
    logits = torch.randn(tokens, EXPERTS, dtype=BF16, device=CUDA)
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    touched = int(torch.unique(ids).numel())
    variants = {"old": lambda: old_moe.fused_experts(x, w13, w2, weights, ids),
                "new": lambda: moe.fused_experts(x, w13, w2, weights, ids)}

    def configs(name, change):
        def fn():
            tuned = moe.moe_gemm_config
            with mock.patch.object(moe, "moe_gemm_config", lambda gemm, *a: change(gemm, tuned(gemm, *a))):
                return moe.fused_experts(x, w13, w2, weights, ids)
        variants[f"new {name}"] = fn

    configs("GEMMs 4 stages", lambda gemm, c: replace(c, num_stages=4))
    configs("gate/up BLOCK_K 128", lambda gemm, c: replace(c, block_k=128) if gemm == "gate_up" else c)
    bytes_ = touched * 3 * INTER * HIDDEN * 2 + 2 * tokens * HIDDEN * 2
    flops = 2 * tokens * TOP_K * 3 * INTER * HIDDEN
    return variants, bytes_, flops, lambda name: variants[name]().float()


CASES = {
    "gdn": {
        "GDN prefill 1x8192": lambda: gdn_case([8192]),
        "GDN prefill 1x32768": lambda: gdn_case([32768]),
        "GDN prefill 4x2048": lambda: gdn_case([2048] * 4),
    },
    "attention": {
        "attention prefill 1x4096 d256": lambda: attention_case(4096, 256),
        "attention prefill 1x8192 d256": lambda: attention_case(8192, 256),
        "attention prefill 1x8192 d128": lambda: attention_case(8192, 128),
    },
    "moe": {
        "fused MoE T=4096": lambda: moe_case(4096),
        "fused MoE T=8192": lambda: moe_case(8192),
    },
}


def kernel_breakdown(fn, repeats: int = 10) -> None:
    """Device time per kernel of ``fn`` (torch.profiler), to see which launch of a case dominates."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / repeats
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {us:9.1f} us  {name[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--breakdown", action="store_true", help="device time per kernel of each case's new variant")
    args = parser.parse_args()
    bandwidth, rate = ceilings()
    print(f"measured ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s", flush=True)
    print("| case | kernel | time (us) | TFLOP/s | time/floor | vs old | rel. diff to old |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for group in args.only:
        for case, make in CASES[group].items():
            variants, bytes_, flops, outputs = make()
            floor_ms = max(bytes_ / bandwidth, flops / rate) * 1e3
            reference = outputs("old")
            old_ms = None
            for name, fn in variants.items():
                try:
                    ms = median_ms(fn)
                    diff = 0.0 if name == "old" else rel_diff(outputs(name), reference)
                except Exception as exc:  # a tile variant that does not fit this GPU
                    print(f"| {case} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | | |", flush=True)
                    continue
                old_ms = ms if name == "old" else old_ms
                row = dict(case=case, kernel=name, ms=ms, tflops=flops / (ms * 1e-3) / 1e12, floor_ms=floor_ms,
                           speedup=old_ms / ms, rel_diff=diff)
                rows.append(row)
                print(f"| {case} | {name} | {ms * 1e3:.1f} | {row['tflops']:.1f} | {ms / floor_ms:.1f}x | "
                      f"{row['speedup']:.2f}x | {diff:.1e} |", flush=True)
            if args.breakdown:
                print(f"  per kernel, {case}, new:")
                try:
                    kernel_breakdown(variants["new"])
                except Exception as exc:  # no profiler (CUPTI) on this machine
                    print(f"    profiler failed: {type(exc).__name__}: {exc}")
            del variants, outputs, reference
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bytes_per_s=bandwidth, bf16_flops_per_s=rate, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
