"""Registers, spills and shared memory of the prefill kernels (and the fused attention prologue) at the real model sizes, compiled for
sm_90 on a machine without a GPU (the stand-in driver of tests/kernels/compile_only.py: every
launch compiles, none runs). Spills cost local-memory traffic on the GPU; this shows them per
cubin without a GPU run.

    PYTHONPATH=.venv/triton-3.6.0 .venv/bin/python benchmarks/kernel_resources.py [--only gdn attention moe prologue]

Prints one line per compiled variant: ``cuobjdump --dump-resource-usage`` (REG, STACK: the spill
and local frame, SHARED), the dynamic shared memory (the pipeline buffers; at most 232,448 bytes
on the H200, which only a launch checks), and the count of SASS spill stores (STL) and
tensor-core instructions (HGMMA: warpgroup, HMMA: warp-level).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
import compile_only  # noqa: E402

compile_only.install(90)

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from freetoken.kernels.triton import attention, attention_prologue, gated_delta_rule, moe  # noqa: E402

BF16 = torch.bfloat16
compiled: list[tuple[str, dict, object]] = []
_run = JITFunction.run


def _recording_run(self, *args, **kwargs):
    kernel = _run(self, *args, **kwargs)
    config = {n: v for n, v in kwargs.items() if n.isupper() or n.startswith("num_")}
    compiled.append((self.fn.__name__, config, kernel))
    return kernel


JITFunction.run = _recording_run


def gdn(tokens: int = 8192) -> None:
    gated_delta_rule._num_sms = lambda device: 132  # the H200's: the state pass's value block as there
    hk, hv, dk, dv = 16, 32, 128, 128
    for dtype in (BF16, torch.float32):  # float32: the parity runs
        conv = torch.randn(tokens, 2 * hk * dk + hv * dv).to(dtype)
        q = conv[:, : hk * dk].view(tokens, hk, dk)
        k = conv[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
        v = conv[:, 2 * hk * dk :].view(tokens, hv, dv)
        g, beta = torch.zeros(tokens, hv), torch.zeros(tokens, hv, dtype=dtype)
        state = torch.zeros(2, hv, dk, dv)
        cu, slots = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
        gated_delta_rule.gated_delta_rule_prefill(q, k, v, g, beta, state, slots, cu)


def attention_prefill(tokens: int = 8192) -> None:
    for head_dim in (256, 128):
        pages = tokens // 16 + 1
        cache = torch.zeros(pages, 16, 2, head_dim, dtype=BF16)
        q = torch.zeros(tokens, 16, head_dim, dtype=BF16)
        table = torch.arange(1, pages, dtype=torch.int32)[None]
        cu, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
        attention.paged_attention(q, cache, cache, table, cu, lens, head_dim**-0.5, tokens, gate=q)


def moe_prefill(tokens: int = 8192) -> None:
    """The table's tiles, then the same tiles as persistent launches (two programs an SM)."""
    x = torch.zeros(tokens, 2048, dtype=BF16)
    w13, w2 = torch.zeros(256, 1024, 2048, dtype=BF16), torch.zeros(256, 2048, 512, dtype=BF16)
    weights = torch.full((tokens, 8), 0.125, dtype=BF16)
    ids = torch.arange(tokens * 8, dtype=torch.int32).remainder(256).view(tokens, 8)
    moe.fused_experts(x, w13, w2, weights, ids)
    tuned = moe.moe_gemm_config
    moe.moe_gemm_config = lambda *args: replace(tuned(*args), persistent=2)
    try:
        moe.fused_experts(x, w13, w2, weights, ids)
    finally:
        moe.moe_gemm_config = tuned


def prologue(batch: int = 8) -> None:
    """The fused attention prologue (16 query / 2 KV heads of 256, rotary 64)."""
    for dtype in (BF16, torch.float32):
        q, kv = torch.zeros(batch, 16, 256, dtype=dtype), torch.zeros(batch, 2, 256, dtype=dtype)
        cache = torch.zeros(4, 16, 2, 256, dtype=dtype)
        positions = torch.zeros(batch, dtype=torch.int64)
        attention_prologue.norm_rotary_store_kv(
            q, kv, kv, q[0, 0], q[0, 0], 1e-6, positions, torch.zeros(16, 64), 64, cache, cache, positions
        )


def report() -> None:
    for name, config, kernel in compiled:
        line, sass = compile_only.resources_and_sass(kernel)
        ops = " ".join(f"{op}={sass.count(op)}" for op in ("STL", "HGMMA", "HMMA"))
        print(f"{name:22s} {line} dynamic shared {kernel.metadata.shared} {ops} {config}")
    compiled.clear()


CASES = {"gdn": gdn, "attention": attention_prefill, "moe": moe_prefill, "prologue": prologue}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    for name in parser.parse_args().only:
        CASES[name]()
        report()


if __name__ == "__main__":
    main()
