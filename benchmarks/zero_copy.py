"""Can a Triton kernel read pinned host memory directly (UVA zero-copy), inside a CUDA graph too,
and how fast does it read over PCIe against a cudaMemcpy? (The facts the graph-captured expert
offload rests on: a missed expert read by the kernel from host memory, issue 11.)

    python benchmarks/zero_copy.py
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

MIB = 2**20


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


@triton.jit
def _select(dev, host, use_host, dst, n, BLOCK: tl.constexpr):
    """Copy from ``host`` or ``dev``, as a device flag says: a pointer chosen on the device."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    base = tl.where(tl.load(use_host) != 0, host, dev)
    tl.store(dst + i, tl.load(base + i, mask=i < n), mask=i < n)


def _seconds(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    n = 64 * MIB  # 128 MB of bf16
    host = torch.randn(n, dtype=torch.bfloat16).pin_memory()
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    _copy[(triton.cdiv(n, 4096),)](host, dev, n, BLOCK=4096)
    torch.cuda.synchronize()
    print(f"pinned host tensor as a kernel argument: read equal {torch.equal(dev.cpu(), host)}")
    for block, warps in ((4096, 4), (8192, 8), (16384, 8)):
        dt = _seconds(lambda: _copy[(triton.cdiv(n, block),)](host, dev, n, BLOCK=block, num_warps=warps))
        print(f"zero-copy read, block {block}, {warps} warps: {2 * n / dt / 1e9:.1f} GB/s")
    print(f"cudaMemcpy host to device: {2 * n / _seconds(lambda: dev.copy_(host, non_blocking=True)) / 1e9:.1f} GB/s")

    flag, out = torch.ones(1, dtype=torch.int32, device="cuda"), torch.empty_like(dev)
    grid = (triton.cdiv(n, 4096),)
    _select[grid](dev, host, flag, out, n, BLOCK=4096)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _select[grid](dev, host, flag, out, n, BLOCK=4096)
    host.mul_(2)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    print(f"graph replay reads the host data of replay time: {torch.equal(out.cpu(), host)}")

    # Eight experts of the Qwen3.6-35B-A3B shape (3 x 2048 x 512 bf16, 6.3 MB each), as a decode miss.
    experts, size = 64, 3 * 2048 * 512
    host_experts = torch.randn(experts, size, dtype=torch.bfloat16).pin_memory()
    dev_experts = torch.empty(8, size, dtype=torch.bfloat16, device="cuda")
    ids = torch.randperm(experts)[:8].tolist()

    def read_eight() -> None:
        for i, e in enumerate(ids):
            _copy[(triton.cdiv(size, 8192),)](host_experts[e], dev_experts[i], size, BLOCK=8192, num_warps=8)

    print(f"8 experts read zero-copy, one launch each: {8 * size * 2 / _seconds(read_eight) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
